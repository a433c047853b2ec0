"""LoRA over a 16-bit base: the adapter's input kept once, in the base's dtype, for the backward.

peft runs an adapted linear as `base(x) + lora_B(lora_A(dropout(x.to(fp32)))) * scaling` when the adapter is fp32
and the base bf16/fp16 (`load_policy` keeps LoRA weights in fp32). Autograd then keeps each layer's fp32 copy of x
for lora_A's weight gradient: q, k and v each keep their own copy of the same input, and so do gate and up. Per
token and decoder layer that is 3 x 4 + 2 x 4 bytes per hidden unit where one 2-byte tensor would do.

`keep_lora_inputs_16bit` turns peft's input cast off for such layers (`cast_input_dtype_enabled`, peft's own switch)
and lets lora_A do the cast inside `_CastLinear`, which saves the 16-bit input it was given (one tensor, shared by
every projection that reads it) and casts it again in the backward. The forward computes the same products in the
same dtypes, and the backward the same gradients with the same matrix products as linear + cast, so every number
stays what it was (tests/model/test_lora_inputs.py checks outputs and gradients bit for bit).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _CastLinear(torch.autograd.Function):
    """F.linear(x.to(weight.dtype), weight) that saves x in its own dtype, not the cast copy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x.to(weight.dtype), weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad2d = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            # linear's input gradient (grad @ W) in the weight's dtype, then the cast's backward to x's dtype
            grad_x = grad2d.mm(weight).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = grad2d.t().mm(x.reshape(-1, x.shape[-1]).to(weight.dtype))
        return grad_x, grad_w


class CastInputLinear(nn.Linear):
    """An adapter's lora_A that takes its input in the base's dtype and casts it itself (`_CastLinear`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype or self.bias is not None:
            return super().forward(x.to(self.weight.dtype))
        return _CastLinear.apply(x, self.weight)


def keep_lora_inputs_16bit(model) -> int:
    """Switch every plain LoRA layer of `model` whose adapter is fp32 and whose input is 16-bit to
    `CastInputLinear`; returns how many layers were switched.

    Left as peft runs them: layers with dropout (dropout would then act on the 16-bit input, a different rounding),
    DoRA or other variants, and layers whose base is already in the adapter's dtype (no cast to save).
    """
    switched = 0
    for module in model.modules():
        lora_a = getattr(module, "lora_A", None)
        base = getattr(module, "base_layer", None)
        if not isinstance(lora_a, nn.ModuleDict) or base is None or not hasattr(module, "cast_input_dtype_enabled"):
            continue
        base_dtype = _compute_dtype(base)
        names = list(lora_a.keys())
        if (base_dtype not in (torch.bfloat16, torch.float16) or getattr(module, "lora_variant", {})
                or any(not isinstance(module.lora_dropout[n], nn.Identity) for n in names)
                or any(type(lora_a[n]) not in (nn.Linear, CastInputLinear) for n in names)
                or any(lora_a[n].weight.dtype == base_dtype for n in names)):
            continue
        for n in names:
            lora_a[n].__class__ = CastInputLinear
        module.cast_input_dtype_enabled = False
        switched += 1
    return switched


def _compute_dtype(base: nn.Module) -> torch.dtype | None:
    """The dtype a base linear computes in: its weight's, or a 4-bit layer's compute dtype."""
    weight = getattr(base, "weight", None)
    if weight is None:
        return None
    if weight.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return weight.dtype
    return getattr(base, "compute_dtype", None)
