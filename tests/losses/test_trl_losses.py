"""Every TRL `loss_type` (and GSPO: importance_sampling_level sequence) as basis-lite reads it, against TRL's own
loss code on the same tensors: the loss value and its gradient with respect to the current log-probs.

TRL's code is `GRPOTrainer._compute_loss` of the installed trl (pinned in the `test` extra), called on a trainer
object built without its __init__ (no model, no data): the attributes that method reads are set by hand, its model
forward (`_get_per_token_logps_and_entropies`) returns the test's log-probs, and a one-process `accelerate`
Accelerator gathers the metrics. One micro-batch, one process, one gradient-accumulation step: then every TRL
normalizer equals basis-lite's whole-step one (`Normalizer`).
"""
from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from basis_lite.config import load_config
from basis_lite.losses import trl_loss_types
from basis_lite.losses.policy import LossOptions, Normalizer, PolicyBatch, compute_policy_loss

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

TRL_NAMES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


def test_every_trl_loss_type_is_accepted():
    assert sorted(trl_loss_types()) == sorted(TRL_NAMES)
    assert trl_grpo.GRPOConfig.__dataclass_fields__["loss_type"].default == "dapo"  # basis-lite's default too
    t = load_config("smoke").train
    assert (t.loss, t.loss_aggregation) == trl_loss_types()["dapo"]


def _tensors(seed: int, B: int = 4, T: int = 6):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T)
    mask[1, 4:] = 0
    mask[2, 2:] = 0
    mask[3, 5:] = 0
    old = -torch.rand(B, T, generator=g) * 3 - 0.05  # log-probs of the sampling policy
    lp = old + torch.randn(B, T, generator=g) * 0.3  # the current policy: ratios around 1, some clipped
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5])
    return lp, old, adv, mask


def _trl_loss(loss_type: str, level: str, t, lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
              mask: torch.Tensor) -> tuple[float, torch.Tensor]:
    """TRL's loss and d loss / d lp, from GRPOTrainer._compute_loss with the settings of basis-lite's train section `t`."""
    from accelerate import Accelerator

    B, T = lp.shape
    x = lp.clone().requires_grad_(True)
    trainer = object.__new__(trl_grpo.GRPOTrainer)
    trainer.__dict__.update(
        loss_type=loss_type, importance_sampling_level=level, epsilon_low=t.clip_low,
        # TRL's cispo caps the ratio at epsilon_high itself, basis-lite's at 1 + clip_high
        epsilon_high=1 + t.clip_high if loss_type == "cispo" else t.clip_high,
        beta=0.0, top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False,
        vllm_importance_sampling_correction=False, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        max_completion_length=T, current_gradient_accumulation_steps=1, accelerator=Accelerator(cpu=True),
        model=SimpleNamespace(training=True), _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1,
                             sapo_temperature_pos=t.sapo_temperature_pos, sapo_temperature_neg=t.sapo_temperature_neg,
                             vespo_k_pos=t.vespo_k_pos, vespo_lambda_pos=t.vespo_lambda_pos,
                             vespo_k_neg=t.vespo_k_neg, vespo_lambda_neg=t.vespo_lambda_neg),
        _get_per_token_logps_and_entropies=lambda *a, **k: (x, torch.ones(B, T), None))
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    loss = trainer._compute_loss(None, inputs)
    loss.backward()
    return loss.item(), x.grad


def _ours(overrides: list[str], lp, old, adv, mask) -> tuple[float, torch.Tensor, object]:
    t = load_config("smoke", overrides).train
    x = lp.clone().requires_grad_(True)
    norm = Normalizer(num_tokens=float(mask.sum()), num_sequences=lp.shape[0], local_tokens=float(mask.sum()),
                      max_completion_length=lp.shape[1])
    loss, _ = compute_policy_loss(t.loss, t.loss_aggregation, PolicyBatch(x, old, adv, mask), LossOptions.from_train(t),
                                  norm)
    loss.backward()
    return loss.item(), x.grad, t


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", TRL_NAMES)
def test_loss_and_gradient_equal_trls(loss_type, level):
    """basis-lite with TRL's names (`loss_type`, `importance_sampling_level`; sequence = GSPO) computes TRL's loss
    and gradient; vespo builds its own sequence weight and is accepted at the token level only, as TRL advises."""
    overrides = [f"loss_type={loss_type}", f"importance_sampling_level={level}"]
    if loss_type == "vespo" and level == "sequence":
        with pytest.raises(Exception, match="importance_sampling_level: 'sequence' is not accepted with "
                                            "train.loss=vespo"):
            load_config("smoke", overrides)
        return
    for seed in range(3):
        lp, old, adv, mask = _tensors(seed)
        ours, g_ours, t = _ours(overrides, lp, old, adv, mask)
        theirs, g_theirs = _trl_loss(loss_type, level, t, lp, old, adv, mask)
        assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7), (loss_type, level, seed)
        torch.testing.assert_close(g_ours * mask, g_theirs * mask, rtol=1e-5, atol=1e-7)
        assert g_theirs.abs().sum() > 0  # the comparison has something to compare


def test_the_comparison_fails_for_a_different_loss():
    """The TRL harness tells losses apart: dapo's numbers are not grpo's, sapo's not cispo's."""
    lp, old, adv, mask = _tensors(0)
    ours, _, t = _ours(["loss_type=dapo"], lp, old, adv, mask)
    assert ours != pytest.approx(_trl_loss("grpo", "token", t, lp, old, adv, mask)[0], rel=1e-3)
    ours, _, t = _ours(["loss_type=sapo"], lp, old, adv, mask)
    assert ours != pytest.approx(_trl_loss("cispo", "token", t, lp, old, adv, mask)[0], rel=1e-3)


@pytest.mark.parametrize("key,value", [("sapo_temperature_neg", 2.0), ("vespo_k_neg", 1.5),
                                       ("vespo_lambda_pos", 0.5)])
def test_loss_options_under_trls_names(key, value):
    """TRL's names for the sapo / vespo options are read as their train.* keys and change the loss as in TRL."""
    loss_type = key.split("_")[0]
    lp, old, adv, mask = _tensors(1)
    ours, g_ours, t = _ours([f"loss_type={loss_type}", f"{key}={value}"], lp, old, adv, mask)
    assert getattr(t, key) == value
    theirs, g_theirs = _trl_loss(loss_type, "token", t, lp, old, adv, mask)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7)
    default, _, _ = _ours([f"loss_type={loss_type}"], lp, old, adv, mask)
    assert default != pytest.approx(ours, rel=1e-4)
