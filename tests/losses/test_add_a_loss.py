"""CONTRIBUTING.md, "Add a loss", followed with a throwaway policy loss: its row in the torch-free table, its
function under @policy_loss, then the config (choices, help, levels) and one policy_update on the tiny model reading
them."""
from __future__ import annotations

import math

import pytest
import torch

from basis_lite.config import FIELDS, ConfigError, load_config
from basis_lite.config.fields import choices_of, help_text
from basis_lite.engines.base import Rollout
from basis_lite.losses import LOSSES, LossSpec
from basis_lite.losses import policy as policy_losses
from basis_lite.losses.policy import LossOptions, Normalizer, PolicyBatch, compute_policy_loss, policy_loss
from basis_lite.model.loading import load_policy
from basis_lite.rl.update import make_optimizer, policy_update


def reinforce_test(b: PolicyBatch, o: LossOptions) -> tuple[torch.Tensor, dict]:
    """Plain REINFORCE, -A lp per token (no ratio, no clip)."""
    m = b.mask.bool()
    adv = b.advantages if b.advantages.dim() == 2 else b.advantages[:, None].expand_as(b.logprobs)
    per_token = torch.where(m, -adv * b.logprobs, torch.zeros_like(b.logprobs))
    return per_token, {"clip_fraction": torch.zeros(())}


@pytest.fixture
def reinforce_loss():
    LOSSES["reinforce_test"] = LossSpec("reinforce_test", "", "-A lp", levels=("token",),
                                        summary="plain REINFORCE, for a test")
    policy_loss("reinforce_test")(reinforce_test)
    yield
    del LOSSES["reinforce_test"]
    del policy_losses._LOSS_FNS["reinforce_test"]  # the binding the decorator made (a test-only undo)


def test_recipe_add_a_loss(reinforce_loss):
    f = FIELDS["train.loss"]
    assert "reinforce_test" in choices_of(f) and "reinforce_test (plain REINFORCE, for a test)" in help_text(f)
    with pytest.raises(ConfigError, match="importance_sampling_level: 'sequence' is not accepted with "
                                          "train.loss=reinforce_test"):
        load_config("smoke", ["train.loss=reinforce_test", "train.importance_sampling_level=sequence"])

    lp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([1.0, -2.0])
    loss, stats = compute_policy_loss("reinforce_test", "token-mean", PolicyBatch(lp, lp.detach(), adv, mask),
                                      LossOptions(), Normalizer())
    assert loss.item() == pytest.approx(-(1.0 * (-1.0 - 2.0) - 2.0 * -0.5) / 3)  # by hand, over 3 tokens
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1 / 3, -1 / 3, 0.0], [2 / 3, 0.0, 0.0]]))
    assert stats["clip_fraction"].item() == 0

    cfg = load_config("smoke", ["train.loss=reinforce_test", "train.micro_batch_size=2", "train.lr=1e-2"])
    torch.manual_seed(0)
    model, tok = load_policy(cfg, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(1)
    rolls = [Rollout(prompt="", prompt_ids=torch.randint(0, 250, (5,), generator=g).tolist(),
                     completion_ids=torch.randint(0, 250, (3 + i,), generator=g).tolist(), text="", finished=True)
             for i in range(4)]
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    stats, ok = policy_update(cfg, model, make_optimizer(cfg, model, torch.device("cpu")), rolls,
                              torch.tensor([1.0, -0.5, 0.5, -1.0]), tok.pad_token_id, torch.device("cpu"))
    assert ok and math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    assert any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters() if p.requires_grad)


def test_the_throwaway_loss_is_gone_after_the_recipe_test():
    assert "reinforce_test" not in LOSSES and "reinforce_test" not in policy_losses._LOSS_FNS
