"""bench/lora_fused.py: its rows and micro-batches are shaped as it says, its arms switch every adapted linear, and
its bit-for-bit check sees a difference when one is there (tiny random model, preset smoke; nothing is timed)."""
from __future__ import annotations

import pytest
import torch
from conftest import bench_module
from peft.tuners.lora.layer import Linear as PeftLoraLinear

from basis_lite.config import load_config
from basis_lite.model.lora import FusedLoraLinear


@pytest.fixture(scope="module")
def lf():
    return bench_module("lora_fused.py")


def test_rows_and_micro_batches(lf):
    rows = lf.synthetic_rows(10, seed=3)
    assert rows == sorted(rows, key=sum) and all(12 <= s < 24 and 15 <= c < 48 for s, c in rows)
    prefix, batches = lf.micro_batch_tensors(rows, 4, vocab=500)
    assert [b[0].shape[0] for b in batches] == [4, 4, 2]
    for (ids, attn, comp), chunk in zip(batches, (rows[:4], rows[4:8], rows[8:])):
        assert torch.equal(ids[:, :lf.PREFIX], prefix.expand(len(chunk), -1))
        assert attn.sum(1).tolist() == [lf.PREFIX + s + c for s, c in chunk]
        assert comp.sum(1).tolist() == [c for _, c in chunk]
        assert not (comp.bool() & ~attn.bool()).any()


def test_arms_switch_and_the_check_can_fail(lf):
    from basis_lite.model.loading import load_policy

    cfg = load_config("smoke", ["model.gradient_checkpointing=false"])
    torch.manual_seed(0)
    model, _ = load_policy(cfg, torch.device("cpu"), torch.bfloat16)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    n = sum(type(m) is FusedLoraLinear for m in model.modules())
    assert n > 0
    lf.set_arm(model, "peft")
    assert sum(type(m) is PeftLoraLinear for m in model.modules()) == n
    lf.set_arm(model, "fused")
    assert sum(type(m) is FusedLoraLinear for m in model.modules()) == n
    _, batches = lf.micro_batch_tensors(lf.synthetic_rows(4), 4, vocab=model.get_input_embeddings().weight.shape[0])
    assert lf.same_numbers(model, batches[0], 64)
    real = FusedLoraLinear.forward
    FusedLoraLinear.forward = lambda self, x, *a, **k: real(self, x, *a, **k) * 1.01  # a different number
    try:
        assert not lf.same_numbers(model, batches[0], 64)
    finally:
        FusedLoraLinear.forward = real
