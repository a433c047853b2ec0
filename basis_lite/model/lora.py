"""LoRA layers run with fewer passes and fewer saved bytes than peft's own forward, with the same numbers.

peft runs an adapted linear as `(base(x) + lora_B(lora_A(dropout(x.to(fp32)))) * scaling).to(base dtype)`
(`load_policy` keeps LoRA weights in fp32). Two things here change how, not what, it computes:

* `FusedLoraLinear` (a plain nn.Linear base, 16-bit or fp32, one active adapter, no dropout, no variant): the
  LoRA branch runs inside one autograd function, `_LoraAdd`, that adds `(x A^T) B^T * scaling` (fp32) into the
  base's output in place, where peft allocates the scaled product, an fp32 sum and its cast back. Its backward
  makes the same matrix products as autograd makes for peft's graph and saves the input in its own dtype (one
  tensor shared by every projection that reads it) plus the small [tokens, r] product. Outputs and gradients are
  bit for bit peft's (tests/model/test_lora_inputs.py); anything else (adapter disabled, merged, several adapters,
  mixed-batch kwargs) goes through peft's forward.
* `keep_lora_inputs_16bit`, for the other bases (a 4-bit bitsandbytes layer computing in bf16): peft's input cast
  is turned off (`cast_input_dtype_enabled`, peft's own switch) and lora_A casts inside `_CastLinear`, which saves
  the 16-bit input, not its fp32 copy. Same products in the same dtypes.

`adapt_lora_layers(model)` (called by `load_policy`) applies both.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch import nn


class _LoraAdd(torch.autograd.Function):
    """y + (x.to(a.dtype) @ a.T @ b.T) * scaling, written into y (the base layer's output), rounded to y's dtype
    once, as peft's `(y + lora * scaling).to(y.dtype)` rounds it. Saves x in its own dtype and t = x @ a.T."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float):
        x2 = x.reshape(-1, x.shape[-1])
        t = x2.to(a.dtype).mm(a.t())
        u = t.mm(b.t())
        u.mul_(scaling)
        y.view(-1, y.shape[-1]).add_(u)
        ctx.mark_dirty(y)
        ctx.save_for_backward(x, a, b, t)
        ctx.scaling = scaling
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, a, b, t = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        gu = g2.to(a.dtype)  # the cast's backward, then the scaling's
        gu = gu.mul_(ctx.scaling) if gu is not g2 else gu * ctx.scaling
        gt = gu.mm(b)
        grad_x = gt.mm(a).to(x.dtype).view(x.shape) if ctx.needs_input_grad[1] else None
        grad_a = gt.t().mm(x.reshape(-1, x.shape[-1]).to(a.dtype)) if ctx.needs_input_grad[2] else None
        grad_b = gu.t().mm(t) if ctx.needs_input_grad[3] else None
        return grad, grad_x, grad_a, grad_b, None


class FusedLoraLinear(PeftLoraLinear):
    """peft's lora.Linear whose LoRA branch runs in `_LoraAdd` when it is plain LoRA on one active adapter."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        name = self._fusable_adapter(x, args, kwargs)
        if name is None:
            return super().forward(x, *args, **kwargs)
        y = self.base_layer(x)
        return _LoraAdd.apply(y, x, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name])

    def _fusable_adapter(self, x, args, kwargs) -> str | None:
        if self.disable_adapters or self.merged or args or kwargs or len(self.active_adapters) != 1:
            return None
        name = self.active_adapters[0]
        if (name not in self.lora_A or name in self.lora_variant
                or not isinstance(self.lora_dropout[name], nn.Identity) or self.lora_B[name].bias is not None
                or x.dtype != self.base_layer.weight.dtype or not self.cast_input_dtype_enabled):
            return None
        return name


def fuse_plain_lora(model) -> int:
    """Switch every peft lora.Linear over a plain nn.Linear base to `FusedLoraLinear`; returns how many."""
    switched = 0
    for module in model.modules():
        if type(module) is PeftLoraLinear and type(module.base_layer) is nn.Linear:
            module.__class__ = FusedLoraLinear
            switched += 1
    return switched


def adapt_lora_layers(model) -> tuple[int, int]:
    """`fuse_plain_lora`, then `keep_lora_inputs_16bit` on the layers left; returns (fused, cast) counts."""
    fused = fuse_plain_lora(model)
    return fused, keep_lora_inputs_16bit(model)


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
    """Switch the lora_A of every LoRA layer of `model` (other than a `FusedLoraLinear`) whose adapter is fp32 and
    whose input is 16-bit to `CastInputLinear`; returns how many layers were switched.

    Left as peft runs them: layers with dropout (dropout would then act on the 16-bit input, a different rounding),
    DoRA or other variants, and layers whose base is already in the adapter's dtype (no cast to save).
    """
    switched = 0
    for module in model.modules():
        lora_a = getattr(module, "lora_A", None)
        base = getattr(module, "base_layer", None)
        if (not isinstance(lora_a, nn.ModuleDict) or base is None or isinstance(module, FusedLoraLinear)
                or not hasattr(module, "cast_input_dtype_enabled")):
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
