"""CONTRIBUTING.md, "Add an estimator", followed with a throwaway estimator: its function under @estimator, its spec
in the torch-free table, then the config (choices, help, G's minimum) and EstimatorSpec.compute reading them."""
from __future__ import annotations

import pytest
import torch

from basis_lite.config import FIELDS, ConfigError, load_config
from basis_lite.config.fields import choices_of, help_text
from basis_lite.estimators import EstimatorContext, EstimatorSpec, get_estimator, register, unregister
from basis_lite.estimators.base import bound_function, estimator


@estimator("batch_loo_test")
def batch_loo_test(rewards: torch.Tensor, ctx: EstimatorContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt's baseline: the mean reward of the OTHER prompts of the batch (all their rollouts)."""
    per_prompt = rewards.sum(1)
    n = rewards.numel() - rewards.shape[1]
    base = ((per_prompt.sum() - per_prompt) / n)[:, None].expand_as(rewards)
    return rewards - base, base


@pytest.fixture
def batch_loo():
    register(EstimatorSpec("batch_loo_test", min_rollouts=2, description="leave-one-prompt-out batch mean"))
    yield get_estimator("batch_loo_test")
    unregister("batch_loo_test")


def test_recipe_add_an_estimator(batch_loo):
    f = FIELDS["estimator.name"]
    assert "batch_loo_test" in choices_of(f) and "batch_loo_test" in help_text(f)
    assert "batch_loo_test" in help_text(FIELDS["estimator.rollouts_per_prompt"])  # it needs G >= 2
    cfg = load_config("smoke", ["estimator.name=batch_loo_test", "estimator.rollouts_per_prompt=2"])
    with pytest.raises(ConfigError, match=r"batch_loo_test needs estimator.rollouts_per_prompt >= 2 \(got 1\)"):
        load_config("smoke", ["estimator.name=batch_loo_test", "estimator.rollouts_per_prompt=1"])
    with pytest.raises(ConfigError, match="batch_loo_test takes no options"):
        load_config("smoke", ["estimator.name=batch_loo_test", "estimator.rollouts_per_prompt=2",
                              "estimator.options={k: 1}"])
    assert batch_loo.function() is bound_function("batch_loo_test") is batch_loo_test

    r = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    ctx = EstimatorContext(prompt_ids=[0, 1, 2], options=cfg.estimator.options)
    adv, base = batch_loo.compute(r, ctx)
    want = torch.tensor([1.0 / 2, 3.0 / 4, 1.0 / 4])[:, None].expand(3, 2)  # others' mean, by hand
    torch.testing.assert_close(base, want)
    torch.testing.assert_close(adv, r - want)
    r2 = r.clone()
    r2[1] = torch.tensor([1.0, 1.0])  # a prompt's own rewards never move its baseline
    assert torch.equal(batch_loo.compute(r2, ctx)[1][1], base[1])


def test_the_throwaway_estimator_is_gone_after_the_recipe_test():
    with pytest.raises(ConfigError, match="'batch_loo_test' is not a registered estimator"):
        get_estimator("batch_loo_test")
