"""The building blocks of the BASIS baseline (basis.py): prior smoothing, calibration, BLUE pooling terms, and
similarity pooling over prompt features.

Every function takes float tensors of one value per prompt ([B], or [B, D] features) and returns tensors on the
same device. What a block fits on the batch (the calibration shift) is fitted for each row i on the other rows
only, so the leave-one-out rule of ``basis_baseline`` holds for every piece.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .base import as_float_tensor, leave_one_out_mean, leave_one_out_sum, rewards_1d
from .basis_options import CHOICES, DEFAULT_SHIFT_GRID, PRIOR_CLIP, check_choice

# ----------------------------------------------------------------------------------------------------------------
# the prior and its calibration


def smooth_prior(prior: Tensor, clip: float = PRIOR_CLIP, k: int | None = None) -> Tensor:
    """Map raw prior success rates p0 in [0, 1] into the open interval (0, 1), so that logit(p) is finite.

    With ``k`` (the number of reference rollouts behind each p0): Jeffreys smoothing p = (k * p0 + 1/2) / (k + 1).
    Then (always) clamp to [clip, 1 - clip]. ``clip`` must lie in (0, 0.5).
    """
    p = as_float_tensor(prior, "prior")
    if not 0.0 < clip < 0.5:
        raise ValueError(f"prior_clip must be in (0, 0.5), got {clip!r}")
    if k is not None:
        if int(k) < 1:
            raise ValueError(f"prior_k must be a positive number of reference rollouts, got {k!r}")
        p = (int(k) * p + 0.5) / (int(k) + 1)
    return p.clamp(clip, 1.0 - clip)


def grid_tensor(values: Any, name: str, dtype: torch.dtype, device: torch.device, positive: bool = False) -> Tensor:
    g = torch.as_tensor(values, dtype=dtype, device=device).reshape(-1)
    if g.numel() == 0:
        raise ValueError(f"{name} must contain at least one value")
    if not bool(torch.isfinite(g).all()):
        raise ValueError(f"{name} must be finite, got {values!r}")
    if positive and not bool((g > 0).all()):
        raise ValueError(f"{name} values must be > 0, got {values!r}")
    return g


def calibration_candidates(method: str, shift_grid: Any, scale_grid: Any, dtype, device) -> tuple[Tensor, Tensor]:
    """All (shift, scale) pairs the calibration may pick, shift-major: [P] and [P]."""
    if method == "none":
        return torch.zeros(1, dtype=dtype, device=device), torch.ones(1, dtype=dtype, device=device)
    shifts = grid_tensor(shift_grid if shift_grid is not None else DEFAULT_SHIFT_GRID, "shift_grid", dtype, device)
    if method == "shift":
        scales = torch.ones(1, dtype=dtype, device=device)
    elif method == "affine":
        scales = grid_tensor(scale_grid, "scale_grid", dtype, device, positive=True)
    else:
        raise ValueError(f"calibration={method!r} is not one of {CHOICES['calibration']}")
    s = shifts[:, None].expand(-1, scales.numel()).reshape(-1)
    a = scales[None, :].expand(shifts.numel(), -1).reshape(-1)
    return s, a


def calibrate_index(r: Tensor, z: Tensor, cand_shift: Tensor, cand_scale: Tensor, reg: float) -> Tensor:
    """Index into the candidates chosen for each row i, fitted on the other rows (leave-one-out): [N] long.

    Row i minimises  sum_{j != i} (r_j - sigmoid(a * z_j + delta))^2 + reg * delta^2  over the (delta, a) pairs.
    """
    mu = torch.sigmoid(cand_scale[:, None] * z[None, :] + cand_shift[:, None])  # [P, N]
    loss = leave_one_out_sum((r[None, :] - mu) ** 2, dim=1)
    # Ridge penalty on the shift (a Gaussian prior on the drift), plus a tiny tie-break towards (0, 1) that decides
    # exact ties, e.g. a batch of one where every candidate has zero leave-one-out loss.
    log_a = torch.log(cand_scale)
    pen = reg * cand_shift**2 + 1e-9 * (cand_shift**2 + log_a**2)
    return torch.argmin(loss + pen[:, None], dim=0)


def calibrate_shift(rewards: Tensor, prior: Tensor, *, grid: Any = None, reg: float = 0.0,
                    prior_clip: float = PRIOR_CLIP, prior_k: int | None = None) -> Tensor:
    """The common logit shift delta of the priors, fitted by least squares over ``grid`` (default linspace(-4,4,81)).

    delta_i = argmin over the grid of  sum_{j != i} (r_j - sigmoid(logit(p_j) + delta))^2 + reg * delta^2,
    p = smooth_prior(prior): leave-one-out, row i's shift ignores r_i. Returns a tensor [B] of shifts.
    """
    r = rewards_1d(rewards)
    p = smooth_prior(prior, prior_clip, prior_k).to(r.dtype)
    if p.shape != r.shape:
        raise ValueError(f"prior must have shape {tuple(r.shape)} like rewards, got {tuple(p.shape)}")
    cs, ca = calibration_candidates("shift", grid, None, r.dtype, r.device)
    if r.numel() == 0:
        return r.clone()
    return cs[calibrate_index(r, torch.logit(p), cs, ca, float(reg))]


def calibrated_values(prior: Tensor, shift: Any = 0.0, scale: Any = 1.0, *, prior_clip: float = PRIOR_CLIP,
                      prior_k: int | None = None) -> Tensor:
    """mu = sigmoid(scale * logit(smooth_prior(prior)) + shift), elementwise (shift/scale scalars or [B])."""
    p = smooth_prior(prior, prior_clip, prior_k)
    return torch.sigmoid(torch.as_tensor(scale, dtype=p.dtype, device=p.device) * torch.logit(p)
                         + torch.as_tensor(shift, dtype=p.dtype, device=p.device))


# ----------------------------------------------------------------------------------------------------------------
# BLUE pooling of the residuals r_j - mu_j


def blue_terms(r: Tensor, mu: Tensor, active: Tensor, form: str) -> tuple[Tensor, Tensor]:
    """Per-row numerator and denominator terms of the pooled estimate (summed over j != i by the caller).

    "additive": (r_j - mu_j) / sigma_j^2 and 1 / sigma_j^2; "ratio": (mu_j / sigma_j^2) r_j and mu_j^2 / sigma_j^2,
    sigma_j^2 = mu_j (1 - mu_j), on active rows only; "none": zeros; "mean" (no prior): r_j and 1.
    """
    a = active.to(mu.dtype)
    if form == "additive":
        w = a / (mu * (1.0 - mu)).clamp_min(1e-12)  # weight 1 / sigma_j^2 on active rows
        return w * (r - mu), w
    if form == "ratio":
        one_minus = (1.0 - mu).clamp_min(1e-12)
        return a * r / one_minus, a * mu / one_minus  # (mu/sigma^2) r and mu^2/sigma^2
    if form == "none":
        return torch.zeros_like(mu), torch.zeros_like(mu)
    if form == "mean":  # no prior: plain mean of the other rewards
        return r.expand_as(mu).clone(), torch.ones_like(mu)
    raise ValueError(f"pooling={form!r} is not one of {CHOICES['pooling']}")


def residual_target(num: Tensor, den: Tensor, mu: Tensor, form: str, empty: float,
                    scale: Tensor | None = None) -> Tensor:
    """Pooled residual (baseline minus mu) from leave-out sums ``num`` and ``den``.

    "additive": num / den (0 with no other active row); "ratio": mu (c - 1), c = num / den (1 with none); "none": 0;
    "mean": num / den, or ``empty`` when no row is left. ``scale`` (same shape, or broadcastable) is the denominator
    before a further row was taken out; a denominator below 1e-9 * scale is rounding residue of an empty set and
    counts as empty. The test is elementwise, so one row's result never depends on another row's numbers.
    """
    ok = den > (1e-9 * scale if scale is not None else 0.0)
    safe = torch.where(ok, den, torch.ones_like(den))
    if form == "additive":
        return torch.where(ok, num / safe, torch.zeros_like(num))
    if form == "ratio":
        c = torch.where(ok, num / safe, torch.ones_like(num))
        return mu * (c - 1.0)
    if form == "none":
        return torch.zeros_like(num)
    # "mean" (no prior; mu == 0): the mean of the rewards left in, or `empty` when none are left.
    return torch.where(den > 0.5, num / safe, torch.full_like(num, float(empty)))


# ----------------------------------------------------------------------------------------------------------------
# similarity pooling over prompt features


def cosine_similarity(features: Tensor, norm: str = "center") -> Tensor:
    """Cosine similarity of feature rows: [B, D] -> [B, B].

    norm: "center" subtracts the batch mean of each feature column first (so the similarity measures how prompts
    DIFFER, not the direction all hidden states share); "standardize" also divides each column by its std (tames
    a few huge-activation dimensions); "none" uses the raw rows. Rows are then scaled to unit length (a zero row
    has similarity 0 with everything). Features never carry rewards, so using all rows here is leave-one-out safe.
    """
    f = as_float_tensor(features, "features")
    if f.dim() != 2:
        raise ValueError(f"features must be a 2-D tensor [B, D], got shape {tuple(f.shape)}")
    if norm not in CHOICES["feature_norm"]:
        raise ValueError(f"feature_norm={norm!r} is not one of {CHOICES['feature_norm']}")
    if norm in ("center", "standardize") and f.shape[0] > 1:
        f = f - f.mean(dim=0, keepdim=True)
        if norm == "standardize":
            f = f / f.std(dim=0, keepdim=True).clamp_min(1e-6)
    n = f.norm(dim=1, keepdim=True)
    f = f / n.clamp_min(1e-12) * (n > 1e-12 * n.amax().clamp_min(1e-30))
    return (f @ f.T).clamp(-1.0, 1.0)


def kernel_matrix(cos: Tensor, h: float) -> Tensor:
    """k_ij = exp((cos_ij - 1) / h) for j != i, 0 on the diagonal (a row is never its own neighbour)."""
    k = torch.exp((cos - 1.0) / h)
    k.fill_diagonal_(0.0)
    return k


def combine(num: Tensor, ksum: Tensor, ksq: Tensor, target: Tensor, lam: float, kernel: str) -> Tensor:
    """Kernel-weighted mean shrunk toward ``target``: (S m + lam t) / (S + lam), S the effective count.

    kernel "exp": S = sum of the weights (``ksum``), S m = ``num``; "softmax": normalised weights, S = Kish's effective
    sample size ksum^2 / ksq.
    """
    if kernel == "exp":  # S = sum of weights, S m = sum of weighted values
        den = ksum + lam
        ok = den > 1e-12
        return torch.where(ok, (num + lam * target) / torch.where(ok, den, torch.ones_like(den)), target)
    # softmax: normalised weights, S = Kish effective sample size (sum w)^2 / sum w^2
    okk = ksum > 1e-12
    m = torch.where(okk, num / torch.where(okk, ksum, torch.ones_like(ksum)), torch.zeros_like(num))
    ess = torch.where(okk & (ksq > 0), ksum**2 / torch.where(ksq > 0, ksq, torch.ones_like(ksq)),
                      torch.zeros_like(ksum))
    den = ess + lam
    ok = den > 1e-12
    return torch.where(ok, (ess * m + lam * target) / torch.where(ok, den, torch.ones_like(den)), target)


def similarity_pool(
    values: Tensor,
    features: Tensor,
    *,
    target: Tensor | None = None,
    bandwidth: float = 0.3,
    shrink: float = 2.0,
    kernel: str = "exp",
    feature_norm: str = "center",
    empty: float = 0.0,
) -> Tensor:
    """Leave-one-out kernel smoother over prompt similarity, with a fixed bandwidth.

    cos_ij = cosine_similarity(features, feature_norm); k_ij = exp((cos_ij - 1) / bandwidth) for j != i.
    kernel "exp":     S_i = sum_{j != i} k_ij (an effective count of similar prompts), m_i = sum_{j != i} k_ij v_j / S_i.
    kernel "softmax": weights w_ij = k_ij / sum_j k_ij (a softmax of cos / bandwidth), m_i = sum_j w_ij v_j, and
                      S_i = 1 / sum_j w_ij^2 (Kish's effective sample size).
    Result: b_i = (S_i m_i + shrink * t_i) / (S_i + shrink), where t_i = target[i], by default the leave-one-out
    mean of ``values`` (``empty`` for a batch of one). ``values[i]`` never enters b_i (unless ``target`` uses it).
    """
    v = rewards_1d(values)
    cos = cosine_similarity(features, feature_norm).to(v.dtype)
    if cos.shape[0] != v.numel():
        raise ValueError(f"features must have {v.numel()} rows like values, got {cos.shape[0]}")
    check_choice("kernel", kernel)
    if not float(bandwidth) > 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth!r}")
    if not float(shrink) >= 0:
        raise ValueError(f"shrink must be >= 0, got {shrink!r}")
    t = leave_one_out_mean(v, empty=empty) if target is None else as_float_tensor(target, "target").to(v.dtype)
    k = kernel_matrix(cos, float(bandwidth))
    eye = torch.eye(v.numel(), dtype=torch.bool, device=v.device)
    num = torch.where(eye, torch.zeros_like(k), k * v[None, :]).sum(dim=1)
    return combine(num, k.sum(dim=1), (k * k).sum(dim=1), t, float(shrink), kernel)
