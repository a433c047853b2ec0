"""LoRA inputs kept once in 16 bits (basis_lite.model.lora): the same log-probs and gradients as peft's own path,
bit for bit, with fewer bytes saved for the backward; layers where the switch would change a number are left alone.
Tiny random model (preset smoke), CPU."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from basis_lite.model.lora import CastInputLinear


def _policy(dtype, *overrides):
    from basis_lite.config import load_config
    from basis_lite.model.loading import load_policy

    # without checkpointing, so that autograd saves the activations the switch is about
    cfg = load_config("smoke", ["model.gradient_checkpointing=false", *overrides])
    torch.manual_seed(0)
    model, _ = load_policy(cfg, torch.device("cpu"), dtype)
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():  # lora_B starts at 0; random values make every gradient path live
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _as_peft_runs_it(model) -> None:
    """Undo the switch: peft's own forward (cast the input to fp32, lora_A as a plain nn.Linear)."""
    for m in model.modules():
        if hasattr(m, "cast_input_dtype_enabled") and hasattr(m, "lora_A"):
            m.cast_input_dtype_enabled = True
            for a in m.lora_A.values():
                if type(a) is CastInputLinear:
                    a.__class__ = nn.Linear


def _switched(model) -> int:
    return sum(type(m) is CastInputLinear for m in model.modules())


def _logprobs_grads_saved(model):
    """Token log-probs of a padded batch, every LoRA gradient of their masked mean, and the bytes autograd saved
    (unique storages, parameters excluded)."""
    gen = torch.Generator().manual_seed(2)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (3, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    params = {p.data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.data_ptr() not in params:
            saved[t.data_ptr()] = max(saved.get(t.data_ptr(), 0), t.numel() * t.element_size())
        return t

    model.train()
    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    ((lp * mask[:, 1:]).sum() / mask.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return lp.detach(), grads, sum(saved.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_same_numbers_bit_for_bit_with_less_saved(dtype):
    model = _policy(dtype)
    n_lora = sum(hasattr(m, "lora_A") and hasattr(m, "base_layer") for m in model.modules())
    assert n_lora > 0 and _switched(model) == n_lora  # every adapted linear of the 16-bit base is switched
    lp, grads, saved = _logprobs_grads_saved(model)
    _as_peft_runs_it(model)
    assert _switched(model) == 0
    ref_lp, ref_grads, ref_saved = _logprobs_grads_saved(model)
    assert torch.equal(lp, ref_lp)
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * n_lora
    unequal = [n for n in grads if not torch.equal(grads[n], ref_grads[n])]
    assert not unequal, unequal[:3]
    assert all(g.abs().sum() > 0 for g in grads.values())  # every path carried a gradient
    assert saved < 0.9 * ref_saved, (saved, ref_saved)


def test_generation_unchanged_without_grad():
    """Inference (no autograd) goes through the same products: greedy generate gives the same tokens."""
    model = _policy(torch.bfloat16)
    model.eval()
    ids = torch.randint(0, model.get_input_embeddings().weight.shape[0], (2, 8),
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        _as_peft_runs_it(model)
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref)


def test_left_as_peft_runs_them_where_a_number_would_change():
    assert _switched(_policy(torch.float32)) == 0  # fp32 base: peft does not cast, nothing to save
    assert _switched(_policy(torch.bfloat16, "lora.dropout=0.1")) == 0  # dropout on 16 bits would round otherwise


def test_4bit_base_computing_in_bf16_is_switched_and_unchanged():
    bnb = pytest.importorskip("bitsandbytes")
    model = _policy(torch.bfloat16, "model.load_in_4bit=true")
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    assert _switched(model) > 0
    lp, grads, _ = _logprobs_grads_saved(model)
    _as_peft_runs_it(model)
    ref_lp, ref_grads, _ = _logprobs_grads_saved(model)
    assert torch.equal(lp, ref_lp)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)
