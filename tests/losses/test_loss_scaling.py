"""fp16 loss scaling in the policy update (the T4 path), checked on the CPU with torch's CPU GradScaler.

A scaled backward, unscaled before clipping, must move the LoRA weights exactly as the unscaled update does;
an overflow must be skipped by the scaler without counting as a bad (NaN) step.
"""
from __future__ import annotations

import copy

import torch

from basis_lite.config import load_config
from basis_lite.engines.base import Rollout
from basis_lite.model.loading import load_policy
from basis_lite.rl.update import make_optimizer, policy_update


def _setup():
    torch.manual_seed(0)
    cfg = load_config("smoke", ["train.micro_batch_size=2", "train.lr=1e-2"])
    model, tok = load_policy(cfg, torch.device("cpu"), torch.float32)
    for n, p in model.named_parameters():  # make lora_B non-zero so every LoRA weight gets a gradient
        if "lora_B" in n:
            p.data.normal_(0, 0.1)
    g = torch.Generator().manual_seed(1)
    rolls = [Rollout(prompt="", prompt_ids=torch.randint(0, 250, (5,), generator=g).tolist(),
                     completion_ids=torch.randint(0, 250, (4 + i,), generator=g).tolist(), text="", finished=True)
             for i in range(4)]
    return cfg, model, tok, rolls


def _lora(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_scaled_update_equals_unscaled_update():
    cfg, model, tok, rolls = _setup()
    model2 = copy.deepcopy(model)
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])
    opt1, opt2 = make_optimizer(cfg, model, torch.device("cpu")), make_optimizer(cfg, model2, torch.device("cpu"))
    before = _lora(model)
    s1, ok1 = policy_update(cfg, model, opt1, rolls, adv, tok.pad_token_id, torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    s2, ok2 = policy_update(cfg, model2, opt2, rolls, adv, tok.pad_token_id, torch.device("cpu"), scaler=scaler)
    assert ok1 and ok2
    assert abs(s1["grad_norm"] - s2["grad_norm"]) < 1e-4 * max(1.0, s1["grad_norm"])
    a, b = _lora(model), _lora(model2)
    assert any(not torch.equal(before[n], a[n]) for n in a)  # the update did something
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=1e-6, rtol=1e-5)


def test_overflow_is_skipped_by_the_scaler_not_counted_as_a_bad_step():
    cfg, model, tok, rolls = _setup()
    opt = make_optimizer(cfg, model, torch.device("cpu"))
    before = _lora(model)
    # a finite loss (~1e30) whose scaled gradients overflow (x 2^100 > float32's 3.4e38)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)
    stats, ok = policy_update(cfg, model, opt, rolls, torch.tensor([1e30, -1e30, 1e30, -1e30]), tok.pad_token_id,
                              torch.device("cpu"), scaler=scaler)
    assert ok  # not a NaN loss: the scaler handles it
    assert scaler.get_scale() < 2.0**100  # it backed off
    after = _lora(model)
    assert all(torch.equal(before[n], after[n]) for n in after)  # and the step was skipped
