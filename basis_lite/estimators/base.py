"""Torch helpers shared by the estimators: the ``@estimator`` decorator, input checks, exact leave-one-out sums,
explained variance.

Leave-one-out sums are computed so that entry i never enters out[i] (exclusive prefix plus suffix sums, never
"total minus own term"), so an estimator built on them is independent of its own reward exactly in floating point,
not just up to rounding.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

EPS = 1e-6  # added to standard deviations before dividing

_FUNCTIONS: dict = {}  # estimator name -> its function, filled by @estimator


def estimator(name: str):
    """``@estimator("name")`` above ``fn(rewards, ctx) -> (advantages, baselines)`` binds it to the spec registered
    under that name in ``basis_lite.estimators`` (the torch-free table the config reads)."""
    def bind(fn):
        if name in _FUNCTIONS and _FUNCTIONS[name] is not fn:
            raise ValueError(f"estimator {name!r} already has a function ({_FUNCTIONS[name].__qualname__})")
        _FUNCTIONS[name] = fn
        return fn
    return bind


def bound_function(name: str):
    """The function bound to ``name`` by ``@estimator``, or None."""
    return _FUNCTIONS.get(name)


def as_float_tensor(x: Any, name: str) -> Tensor:
    """``x`` as a real floating-point tensor (integers become the default float dtype)."""
    t = x if isinstance(x, Tensor) else torch.as_tensor(x)
    if t.is_complex():
        raise ValueError(f"{name} must be real, got dtype {t.dtype}")
    if not t.is_floating_point():
        t = t.to(torch.get_default_dtype())
    return t


def check_finite(t: Tensor, name: str) -> None:
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains non-finite values (nan or inf)")


def rewards_1d(rewards: Any) -> Tensor:
    r = as_float_tensor(rewards, "rewards")
    if r.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [B] (one reward per rollout), got shape {tuple(r.shape)}")
    check_finite(r, "rewards")
    return r


def rewards_2d(rewards: Any, what: str) -> Tensor:
    r = as_float_tensor(rewards, "rewards")
    if r.dim() != 2:
        raise ValueError(
            f"{what} needs rewards of shape [B, G] (B prompts x G rollouts), got shape {tuple(r.shape)}; "
            "for one rollout per prompt pass rewards[:, None]"
        )
    check_finite(r, "rewards")
    return r


def leave_one_out_sum(x: Tensor, dim: int = -1) -> Tensor:
    """Sum of all OTHER entries along ``dim``: out[..., i] = sum over j != i of x[..., j].

    Computed as an exclusive prefix sum plus an exclusive suffix sum (in float64), so x[..., i] never enters
    out[..., i] -- not even as "total minus own term", which would leave a rounding-level dependence.
    """
    x64 = x.to(torch.float64)
    n = x64.shape[dim]
    if n == 0:
        return x.clone()
    c = torch.cumsum(x64, dim=dim)
    prefix = c.narrow(dim, 0, n - 1)  # sum of x[0..k], k = 0..n-2
    rc = torch.cumsum(x64.flip(dim), dim=dim).flip(dim)  # rc[k] = sum of x[k..n-1]
    suffix = rc.narrow(dim, 1, n - 1)  # sum of x[k+1..n-1], k = 0..n-2
    zeros_shape = list(x64.shape)
    zeros_shape[dim] = 1
    z = x64.new_zeros(zeros_shape)
    out = torch.cat([z, prefix], dim=dim) + torch.cat([suffix, z], dim=dim)
    return out.to(x.dtype)


def leave_one_out_mean(x: Tensor, dim: int = -1, empty: float = 0.0) -> Tensor:
    """Mean of the OTHER entries along ``dim``: out[i] = (sum over j != i of x[j]) / (n - 1).

    With a single entry there are no others and the result is ``empty`` (default 0.0).
    """
    n = x.shape[dim]
    if n <= 1:
        return torch.full_like(x, float(empty))
    return leave_one_out_sum(x, dim) / (n - 1)


def leave_one_out_range(x: Tensor) -> tuple[Tensor, Tensor]:
    """(min, max) over the OTHER entries of a 1-D tensor, exactly (prefix/suffix running extremes); +-inf if none."""
    if x.numel() == 0:
        return x.clone(), x.clone()
    inf = x.new_full((1,), math.inf)
    lo_pre = torch.cat([inf, torch.cummin(x, 0).values[:-1]])
    lo_suf = torch.cat([torch.cummin(x.flip(0), 0).values.flip(0)[1:], inf])
    hi_pre = torch.cat([-inf, torch.cummax(x, 0).values[:-1]])
    hi_suf = torch.cat([torch.cummax(x.flip(0), 0).values.flip(0)[1:], -inf])
    return torch.minimum(lo_pre, lo_suf), torch.maximum(hi_pre, hi_suf)


def normalize_advantages(adv: Tensor) -> Tensor:
    """Divide by the batch std (+EPS). The std uses every entry: it rescales the batch, it shifts no advantage."""
    if adv.numel() > 1:
        return adv / (adv.std() + EPS)
    return adv


def explained_variance(rewards: Tensor, baselines: Tensor) -> float:
    """1 - Var(r - b) / Var(r) over all entries (population variances); nan when Var(r) == 0.

    1 means the baseline removes all reward variance, 0 means it removes none (e.g. a constant), < 0 means it adds
    variance. Like any explained variance it ignores a constant offset between r and b.
    """
    r = as_float_tensor(rewards, "rewards").reshape(-1).to(torch.float64)
    b = as_float_tensor(baselines, "baselines").reshape(-1).to(device=r.device, dtype=torch.float64)
    if r.shape != b.shape:
        raise ValueError(f"rewards and baselines must have the same number of entries, got {r.numel()} and {b.numel()}")
    if r.numel() == 0:
        return float("nan")
    var_r = r.var(unbiased=False)
    if float(var_r) == 0.0:
        return float("nan")
    return float(1.0 - (r - b).var(unbiased=False) / var_r)
