"""Baselines and advantages for RL from verifiable rewards, as pure functions over torch tensors.

Every function here takes float tensors (CPU or GPU) of scalar rewards, one per rollout, and returns tensors on the
same device. There is no model code: the trainer hands in rewards, and for BASIS a per-prompt prior and per-prompt
feature vectors (the policy's hidden state of the prompt).

Estimators
----------
- ``reinforce_pp_advantages``: REINFORCE++ global whitening. Its implicit baseline is the batch mean.
- ``group_mean_baseline`` / ``grpo_advantages`` / ``dr_grpo_advantages``: the group of G rollouts of a prompt.
- ``rloo_baseline``: the mean of the OTHER G-1 rollouts of the same prompt.
- ``basis_baseline``: one rollout per prompt; each prompt's baseline is built from the OTHER prompts of the batch
  (leave-one-out), optionally helped by an offline prior (reference-model success rate) and by the similarity of the
  prompts' hidden states. See its docstring for the equations and options.
- ``compute_advantages``: one entry point for all of them, on a ``[B, G]`` reward tensor.
- ``explained_variance``: how much of the reward variance a baseline removes.

The leave-one-out rule
----------------------
A baseline that depends on its own reward biases the policy gradient. Every BASIS quantity that is fitted on the
batch (the calibration shift, the bandwidth and shrinkage picked by cross-validation) is fitted separately for each
prompt i on the rewards of the other prompts only. Sums "over j != i" are computed so that reward i never enters them
(masked sums and exclusive prefix/suffix sums, never "total minus own term"), so the independence is exact in floating
point, not just up to rounding; ``tests/test_advantages.py`` checks it for every option combination.

Defaults
--------
The BASIS paper published no code or equations (see ``docs/papers.md``); this is our own
principled reconstruction. ``bench/value_mse.py`` loops over ``BASIS_VARIANTS`` on recorded SmolLM2 rollouts
(arithmetic, 512 prompts, and word problems, 256; the reference, a T=0.7 policy and a policy mid-training; batches
of 32-256): the fixed kernel (bandwidth 0.3, shrinkage 2 pseudo-prompts) beat per-batch cross-validation in 19 of
20 cells, and the default combination ranked first at K = 0, 2 and 4 over the drifted scenarios, so they are the
defaults. Calibration by a logit shift, no BLUE pooling on top of it. See bench/results/value_mse.md and the README
for where single-rollout baselines fall short (a trained policy whose values split by a per-problem property).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "ESTIMATORS",
    "BASIS_DEFAULTS",
    "BASIS_VARIANTS",
    "BASIS_OPTION_CHOICES",
    "reinforce_pp_advantages",
    "group_mean_baseline",
    "rloo_baseline",
    "grpo_advantages",
    "dr_grpo_advantages",
    "basis_baseline",
    "smooth_prior",
    "calibrate",
    "calibrate_shift",
    "calibrated_values",
    "blue_pool",
    "cosine_similarity",
    "similarity_pool",
    "leave_one_out_sum",
    "leave_one_out_mean",
    "compute_advantages",
    "explained_variance",
]

ESTIMATORS = ("basis", "reinforce_pp", "grpo", "dr_grpo", "rloo")
EPS = 1e-6
_PRIOR_CLIP = 0.05  # provisional default: clamp priors to [0.05, 0.95] before the logit


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------


def _float_tensor(x: Any, name: str) -> Tensor:
    t = x if isinstance(x, Tensor) else torch.as_tensor(x)
    if t.is_complex():
        raise ValueError(f"{name} must be real, got dtype {t.dtype}")
    if not t.is_floating_point():
        t = t.to(torch.get_default_dtype())
    return t


def _check_finite(t: Tensor, name: str) -> None:
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains non-finite values (nan or inf)")


def _rewards_1d(rewards: Any) -> Tensor:
    r = _float_tensor(rewards, "rewards")
    if r.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [B] (one reward per rollout), got shape {tuple(r.shape)}")
    _check_finite(r, "rewards")
    return r


def _rewards_2d(rewards: Any, what: str) -> Tensor:
    r = _float_tensor(rewards, "rewards")
    if r.dim() != 2:
        raise ValueError(
            f"{what} needs rewards of shape [B, G] (B prompts x G rollouts), got shape {tuple(r.shape)}; "
            "for one rollout per prompt pass rewards[:, None]"
        )
    _check_finite(r, "rewards")
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


def _leave_one_out_range(x: Tensor) -> tuple[Tensor, Tensor]:
    """(min, max) over the OTHER entries of a 1-D tensor, exactly (prefix/suffix running extremes); +-inf if none."""
    n = x.numel()
    inf = x.new_full((1,), math.inf)
    lo_pre = torch.cat([inf, torch.cummin(x, 0).values[:-1]])
    lo_suf = torch.cat([torch.cummin(x.flip(0), 0).values.flip(0)[1:], inf])
    hi_pre = torch.cat([-inf, torch.cummax(x, 0).values[:-1]])
    hi_suf = torch.cat([torch.cummax(x.flip(0), 0).values.flip(0)[1:], -inf])
    if n == 0:
        return x.clone(), x.clone()
    return torch.minimum(lo_pre, lo_suf), torch.maximum(hi_pre, hi_suf)


def leave_one_out_mean(x: Tensor, dim: int = -1, empty: float = 0.0) -> Tensor:
    """Mean of the OTHER entries along ``dim``: out[i] = (sum over j != i of x[j]) / (n - 1).

    With a single entry there are no others and the result is ``empty`` (default 0.0).
    """
    n = x.shape[dim]
    if n <= 1:
        return torch.full_like(x, float(empty))
    return leave_one_out_sum(x, dim) / (n - 1)


# ----------------------------------------------------------------------------------------------------------------
# standard estimators
# ----------------------------------------------------------------------------------------------------------------


def reinforce_pp_advantages(rewards: Tensor, eps: float = EPS) -> Tensor:
    """REINFORCE++ advantages: global batch whitening.

    A_i = (r_i - mean(r)) / (std(r) + eps), mean and (unbiased, N-1) std over the whole batch. The implicit baseline
    is the batch mean, which includes r_i itself (not leave-one-out; the bias is O(1/N)). One reward gives 0.
    """
    r = _rewards_1d(rewards)
    if r.numel() == 0:
        return r.clone()
    mean = r.mean()
    std = r.std() if r.numel() > 1 else r.new_zeros(())
    return (r - mean) / (std + eps)


def group_mean_baseline(rewards: Tensor) -> Tensor:
    """Group-mean baseline of GRPO / Dr. GRPO: b_ig = mean over the G rollouts of prompt i of r_ig.

    Includes the rollout's own reward. A group of one (G == 1) has no baseline: b = 0 (veRL's convention, which
    turns GRPO with G = 1 into plain REINFORCE instead of a zero advantage).
    """
    r = _rewards_2d(rewards, "group_mean_baseline")
    if r.shape[1] == 1:
        return torch.zeros_like(r)
    return r.mean(dim=1, keepdim=True).expand_as(r).clone()


def rloo_baseline(rewards: Tensor) -> Tensor:
    """RLOO baseline: b_ig = mean of the OTHER G-1 rollouts of prompt i = (sum_{h != g} r_ih) / (G - 1).

    Leave-one-out, so r_ig never enters b_ig. For G == 1 there are no other rollouts and b = 0.
    """
    r = _rewards_2d(rewards, "rloo_baseline")
    return leave_one_out_mean(r, dim=1, empty=0.0)


def grpo_advantages(rewards: Tensor, eps: float = EPS) -> Tensor:
    """GRPO advantages: A_ig = (r_ig - group mean_i) / (group std_i + eps).

    The group std is the unbiased (G-1) std over the G rollouts of prompt i, as in TRL and veRL. For G == 1 the
    group mean is taken as 0 and the std as 1 (veRL's convention), so A = r / (1 + eps).
    """
    r = _rewards_2d(rewards, "grpo_advantages")
    if r.shape[1] == 1:
        return r / (1.0 + eps)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True)
    return (r - mean) / (std + eps)


def dr_grpo_advantages(rewards: Tensor) -> Tensor:
    """Dr. GRPO advantages: A_ig = r_ig - group mean_i (no division by the group std). G == 1 gives A = r."""
    r = _rewards_2d(rewards, "dr_grpo_advantages")
    return r - group_mean_baseline(r)


# ----------------------------------------------------------------------------------------------------------------
# BASIS pieces
# ----------------------------------------------------------------------------------------------------------------


def smooth_prior(prior: Tensor, clip: float = _PRIOR_CLIP, k: int | None = None) -> Tensor:
    """Map raw prior success rates p0 in [0, 1] into the open interval (0, 1), so that logit(p) is finite.

    With ``k`` (the number of reference rollouts behind each p0): Jeffreys smoothing p = (k * p0 + 1/2) / (k + 1).
    Then (always) clamp to [clip, 1 - clip]. ``clip`` must lie in (0, 0.5).
    """
    p = _float_tensor(prior, "prior")
    if not 0.0 < clip < 0.5:
        raise ValueError(f"prior_clip must be in (0, 0.5), got {clip!r}")
    if k is not None:
        if int(k) < 1:
            raise ValueError(f"prior_k must be a positive number of reference rollouts, got {k!r}")
        p = (int(k) * p + 0.5) / (int(k) + 1)
    return p.clamp(clip, 1.0 - clip)


def _grid(values: Any, name: str, dtype: torch.dtype, device: torch.device, positive: bool = False) -> Tensor:
    g = torch.as_tensor(values, dtype=dtype, device=device).reshape(-1)
    if g.numel() == 0:
        raise ValueError(f"{name} must contain at least one value")
    if not bool(torch.isfinite(g).all()):
        raise ValueError(f"{name} must be finite, got {values!r}")
    if positive and not bool((g > 0).all()):
        raise ValueError(f"{name} values must be > 0, got {values!r}")
    return g


def _calibration_candidates(method: str, shift_grid: Any, scale_grid: Any, dtype, device) -> tuple[Tensor, Tensor]:
    """All (shift, scale) pairs the calibration may pick: [P] and [P]."""
    if method == "none":
        return torch.zeros(1, dtype=dtype, device=device), torch.ones(1, dtype=dtype, device=device)
    shifts = _grid(shift_grid if shift_grid is not None else _DEFAULT_SHIFT_GRID, "shift_grid", dtype, device)
    if method == "shift":
        scales = torch.ones(1, dtype=dtype, device=device)
    elif method == "affine":
        scales = _grid(scale_grid, "scale_grid", dtype, device, positive=True)
    else:
        raise ValueError(f"calibration={method!r} is not one of {_CHOICES['calibration']}")
    s = shifts[:, None].expand(-1, scales.numel()).reshape(-1)
    a = scales[None, :].expand(shifts.numel(), -1).reshape(-1)
    return s, a


def _calibrate_index(r: Tensor, z: Tensor, cand_shift: Tensor, cand_scale: Tensor, reg: float, loo: bool) -> Tensor:
    """Index into the candidates chosen for each row i (leave-one-out) or for the whole batch: [N] long."""
    n = r.numel()
    mu = torch.sigmoid(cand_scale[:, None] * z[None, :] + cand_shift[:, None])  # [P, N]
    sq = (r[None, :] - mu) ** 2
    loss = leave_one_out_sum(sq, dim=1) if loo else sq.sum(dim=1, keepdim=True).expand(-1, n)
    # Ridge penalty on the shift (a Gaussian prior on the drift), plus a tiny tie-break towards (0, 1) that decides
    # exact ties, e.g. a batch of one where every candidate has zero leave-one-out loss.
    log_a = torch.log(cand_scale)
    pen = reg * cand_shift**2 + 1e-9 * (cand_shift**2 + log_a**2)
    return torch.argmin(loss + pen[:, None], dim=0)


def calibrate(
    rewards: Tensor,
    prior: Tensor,
    *,
    method: str = "shift",
    shift_grid: Any = None,
    scale_grid: Any = (0.5, 0.75, 1.0, 1.25, 1.5),
    reg: float = 0.0,
    leave_one_out: bool = True,
    prior_clip: float = _PRIOR_CLIP,
    prior_k: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Online calibration of the prior: fit a logit shift (and optionally a logit scale) by least squares.

    Calibrated value: mu_j(delta, a) = sigmoid(a * logit(p_j) + delta), p = smooth_prior(prior).
    The fit picks, from the grid, the (delta, a) minimising  sum_j (r_j - mu_j(delta, a))^2 + reg * delta^2.
    method: "shift" (a = 1, delta from ``shift_grid``, default linspace(-4, 4, 81)), "affine" (also a from
    ``scale_grid``) or "none" (delta = 0, a = 1).
    leave_one_out=True (what BASIS uses): the fit for row i sums over j != i only, so it never sees r_i.
    Returns (shift [B], scale [B]); with leave_one_out=False every row gets the same whole-batch fit.
    """
    r = _rewards_1d(rewards)
    p = smooth_prior(prior, prior_clip, prior_k).to(r.dtype)
    if p.shape != r.shape:
        raise ValueError(f"prior must have shape {tuple(r.shape)} like rewards, got {tuple(p.shape)}")
    z = torch.logit(p)
    cs, ca = _calibration_candidates(method, shift_grid, scale_grid, r.dtype, r.device)
    if r.numel() == 0:
        return r.clone(), r.clone()
    idx = _calibrate_index(r, z, cs, ca, float(reg), leave_one_out)
    return cs[idx], ca[idx]


def calibrate_shift(
    rewards: Tensor,
    prior: Tensor,
    *,
    grid: Any = None,
    reg: float = 0.0,
    leave_one_out: bool = True,
    prior_clip: float = _PRIOR_CLIP,
    prior_k: int | None = None,
) -> Tensor:
    """The common logit shift delta of the priors, fitted by least squares over ``grid`` (default linspace(-4,4,81)).

    delta_i = argmin over the grid of  sum_{j != i} (r_j - sigmoid(logit(p_j) + delta))^2 + reg * delta^2
    (leave-one-out: row i's shift ignores r_i). Returns a tensor [B] of shifts. See ``calibrate``.
    """
    shift, _ = calibrate(
        rewards, prior, method="shift", shift_grid=grid, reg=reg, leave_one_out=leave_one_out,
        prior_clip=prior_clip, prior_k=prior_k,
    )
    return shift


def calibrated_values(prior: Tensor, shift: Any = 0.0, scale: Any = 1.0, *, prior_clip: float = _PRIOR_CLIP,
                      prior_k: int | None = None) -> Tensor:
    """mu = sigmoid(scale * logit(smooth_prior(prior)) + shift), elementwise (shift/scale scalars or [B])."""
    p = smooth_prior(prior, prior_clip, prior_k)
    return torch.sigmoid(torch.as_tensor(scale, dtype=p.dtype, device=p.device) * torch.logit(p)
                         + torch.as_tensor(shift, dtype=p.dtype, device=p.device))


def _blue_terms(r: Tensor, mu: Tensor, active: Tensor, form: str) -> tuple[Tensor, Tensor]:
    """Per-row numerator and denominator terms of the pooled estimate (for the leave-one-out sums)."""
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
    raise ValueError(f"pooling={form!r} is not one of {_CHOICES['pooling']}")


def _residual_target(num: Tensor, den: Tensor, mu: Tensor, form: str, empty: float,
                     scale: Tensor | None = None) -> Tensor:
    """Pooled residual (baseline minus mu) from leave-out sums ``num`` and ``den``.

    ``scale`` (same shape, or broadcastable) is the denominator before a further row was taken out; a denominator
    below 1e-9 * scale is rounding residue of an empty set and counts as empty. The test is elementwise, so one
    row's result never depends on another row's numbers.
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


def blue_pool(
    rewards: Tensor,
    mu: Tensor,
    *,
    form: str = "additive",
    tau: float = 0.02,
    fallback: str = "prior",
    clip: bool = True,
) -> Tensor:
    """Leave-one-out BLUE pooling of the other prompts' rewards around calibrated values ``mu`` [B].

    Bernoulli variances sigma_j^2 = mu_j (1 - mu_j); active set A = {j : tau <= mu_j <= 1 - tau} (rows outside it have
    a near-zero variance and would get exploding weights, so they are left out of the sums).
    - form "additive" (model r_j = mu_j + common drift + noise):
      b_i = mu_i + [sum_{j in A, j != i} (r_j - mu_j) / sigma_j^2] / [sum_{j in A, j != i} 1 / sigma_j^2]
    - form "ratio" (model E r_j = c * mu_j):
      b_i = mu_i * c_{-i},  c_{-i} = [sum_{j in A, j != i} (mu_j / sigma_j^2) r_j] / [sum_{j in A, j != i} mu_j^2 / sigma_j^2]
    - form "none": b_i = mu_i.
    With no other active row the drift is 0 (c = 1). A row i outside A gets the fallback: "prior" -> b_i = mu_i,
    "zero" -> b_i = 0 (the paper's choice). clip=True clamps b_i to [0, 1], widened to the range of the other
    rewards when some lie outside [0, 1].
    If all mu are equal (and active), the additive form is exactly the leave-one-out batch mean of the rewards.
    """
    r = _rewards_1d(rewards)
    m = _float_tensor(mu, "mu").to(r.dtype)
    if m.shape != r.shape:
        raise ValueError(f"mu must have shape {tuple(r.shape)} like rewards, got {tuple(m.shape)}")
    _check_choice("pooling", form)
    _check_choice("fallback", fallback)
    active = (m >= tau) & (m <= 1.0 - tau)
    num, den = _blue_terms(r, m, active, form)
    b = m + _residual_target(leave_one_out_sum(num), leave_one_out_sum(den), m, form, 0.0)
    b = torch.where(active, b, m if fallback == "prior" else torch.zeros_like(m))
    if clip:
        lo, hi = _leave_one_out_range(r)
        b = torch.minimum(torch.maximum(b, lo.clamp(max=0.0)), hi.clamp(min=1.0))
    return b


def cosine_similarity(features: Tensor, norm: str = "center") -> Tensor:
    """Cosine similarity of feature rows: [B, D] -> [B, B].

    norm: "center" subtracts the batch mean of each feature column first (so the similarity measures how prompts
    DIFFER, not the direction all hidden states share); "standardize" also divides each column by its std (tames
    a few huge-activation dimensions); "none" uses the raw rows. Rows are then scaled to unit length (a zero row
    has similarity 0 with everything). Features never carry rewards, so using all rows here is leave-one-out safe.
    """
    f = _float_tensor(features, "features")
    if f.dim() != 2:
        raise ValueError(f"features must be a 2-D tensor [B, D], got shape {tuple(f.shape)}")
    if norm not in _CHOICES["feature_norm"]:
        raise ValueError(f"feature_norm={norm!r} is not one of {_CHOICES['feature_norm']}")
    if norm in ("center", "standardize") and f.shape[0] > 1:
        f = f - f.mean(dim=0, keepdim=True)
        if norm == "standardize":
            f = f / f.std(dim=0, keepdim=True).clamp_min(1e-6)
    n = f.norm(dim=1, keepdim=True)
    f = f / n.clamp_min(1e-12) * (n > 1e-12 * n.amax().clamp_min(1e-30))
    return (f @ f.T).clamp(-1.0, 1.0)


def _kernel(cos: Tensor, h: float) -> Tensor:
    """k_ij = exp((cos_ij - 1) / h) for j != i, 0 on the diagonal (a row is never its own neighbour)."""
    k = torch.exp((cos - 1.0) / h)
    k.fill_diagonal_(0.0)
    return k


def _combine(num: Tensor, ksum: Tensor, ksq: Tensor, target: Tensor, lam: float, kernel: str) -> Tensor:
    """Kernel-weighted mean shrunk toward ``target``: (S m + lam t) / (S + lam), S the effective count."""
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
    v = _rewards_1d(values)
    cos = cosine_similarity(features, feature_norm).to(v.dtype)
    if cos.shape[0] != v.numel():
        raise ValueError(f"features must have {v.numel()} rows like values, got {cos.shape[0]}")
    _check_choice("kernel", kernel)
    if not float(bandwidth) > 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth!r}")
    if not float(shrink) >= 0:
        raise ValueError(f"shrink must be >= 0, got {shrink!r}")
    t = leave_one_out_mean(v, empty=empty) if target is None else _float_tensor(target, "target").to(v.dtype)
    k = _kernel(cos, float(bandwidth))
    eye = torch.eye(v.numel(), dtype=torch.bool, device=v.device)
    num = torch.where(eye, torch.zeros_like(k), k * v[None, :]).sum(dim=1)
    return _combine(num, k.sum(dim=1), (k * k).sum(dim=1), t, float(shrink), kernel)


# ----------------------------------------------------------------------------------------------------------------
# BASIS options
# ----------------------------------------------------------------------------------------------------------------

_DEFAULT_SHIFT_GRID = tuple(round(-4.0 + 0.1 * k, 10) for k in range(81))  # linspace(-4, 4, 81)

_CHOICES = {
    "calibration": ("shift", "affine", "none"),
    "pooling": ("none", "additive", "ratio"),
    "fallback": ("prior", "zero"),
    "kernel": ("exp", "softmax"),
    "feature_norm": ("center", "standardize", "none"),
    "combine": ("toward_prior", "residual"),
}
BASIS_OPTION_CHOICES = dict(_CHOICES)


def _check_choice(name: str, value: Any) -> None:
    allowed = _CHOICES[name]
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {allowed}")


@dataclass(frozen=True)
class _BasisOptions:
    use_prior: bool = True
    use_features: bool = True
    prior_clip: float = _PRIOR_CLIP
    prior_k: int | None = None
    calibration: str = "shift"
    shift_grid: Any = None
    scale_grid: Any = (0.5, 0.75, 1.0, 1.25, 1.5)
    calib_reg: float = 0.0
    pooling: str = "none"
    tau: float = 0.02
    fallback: str = "prior"
    kernel: str = "exp"
    bandwidth: Any = 0.3  # bench/value_mse.py on real SmolLM2 rollouts: fixed 0.3 / 2.0 beat "cv" in 19 of 20 cells
    bandwidth_grid: Any = (0.03, 0.1, 0.3, 1.0, 3.0)
    shrink: Any = 2.0
    shrink_grid: Any = (0.5, 2.0, 8.0, 32.0)
    feature_norm: str = "center"
    combine: str = "toward_prior"  # prior AND features: see basis_baseline, step 3
    clip: bool = True
    empty_baseline: float = 0.0


BASIS_DEFAULTS: dict[str, Any] = asdict(_BasisOptions())


def _parse_options(options: dict) -> _BasisOptions:
    known = {f.name for f in fields(_BasisOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown basis_baseline option(s) {unknown}; accepted options: {sorted(known)}")
    o = _BasisOptions(**options)
    for name in _CHOICES:
        _check_choice(name, getattr(o, name))
    if not 0.0 <= float(o.tau) < 0.5:
        raise ValueError(f"tau must be in [0, 0.5), got {o.tau!r}")
    if not float(o.calib_reg) >= 0:
        raise ValueError(f"calib_reg must be >= 0, got {o.calib_reg!r}")
    if isinstance(o.bandwidth, str):
        if o.bandwidth != "cv":
            raise ValueError(f"bandwidth={o.bandwidth!r} must be a positive number or 'cv'")
    elif not float(o.bandwidth) > 0:
        raise ValueError(f"bandwidth={o.bandwidth!r} must be a positive number or 'cv'")
    if isinstance(o.shrink, str):
        if o.shrink != "cv":
            raise ValueError(f"shrink={o.shrink!r} must be a number >= 0 or 'cv'")
    elif not float(o.shrink) >= 0:
        raise ValueError(f"shrink={o.shrink!r} must be a number >= 0 or 'cv'")
    if not math.isfinite(float(o.empty_baseline)):
        raise ValueError(f"empty_baseline must be finite, got {o.empty_baseline!r}")
    return o


# Named option sets for benchmarks: basis_baseline(r, prior, features, **BASIS_VARIANTS[name]).
# "use_prior"/"use_features" = False makes a variant ignore an input it was given.
BASIS_VARIANTS: dict[str, dict[str, Any]] = {
    # no side information: leave-one-out batch mean (REINFORCE++'s baseline, made leave-one-out)
    "loo_mean": dict(use_prior=False, use_features=False),
    # prior only
    "prior_raw": dict(use_features=False, calibration="none", pooling="none"),
    "prior_shift": dict(use_features=False, calibration="shift", pooling="none"),
    "prior_affine": dict(use_features=False, calibration="affine", pooling="none"),
    "prior_shift_additive": dict(use_features=False, calibration="shift", pooling="additive"),
    "prior_shift_ratio": dict(use_features=False, calibration="shift", pooling="ratio"),
    # closest to the paper as described: shift calibration, BLUE pooling, active set with a zero fallback
    "paper": dict(use_features=False, calibration="shift", pooling="additive", tau=0.05, fallback="zero"),
    "paper_ratio": dict(use_features=False, calibration="shift", pooling="ratio", tau=0.05, fallback="zero"),
    # features only
    "features_fixed": dict(use_prior=False, bandwidth=0.3, shrink=2.0),
    "features_cv": dict(use_prior=False, bandwidth="cv", shrink="cv"),
    "features_softmax_cv": dict(use_prior=False, kernel="softmax", bandwidth="cv", shrink="cv"),
    "features_standardize_cv": dict(use_prior=False, feature_norm="standardize", bandwidth="cv", shrink="cv"),
    # prior and features: kernel smoother on calibrated residuals
    "prior_features_fixed": dict(calibration="shift", pooling="none", bandwidth=0.3, shrink=2.0, combine="residual"),
    "prior_features_cv": dict(calibration="shift", pooling="none", bandwidth="cv", shrink="cv", combine="residual"),
    "prior_features_additive_cv": dict(calibration="shift", pooling="additive", bandwidth="cv", shrink="cv",
                                       combine="residual"),
    "prior_features_affine_cv": dict(calibration="affine", pooling="none", bandwidth="cv", shrink="cv",
                                     combine="residual"),
    # the kernel mean of the other prompts' rewards, shrunk toward the calibrated prior (the default combination)
    "prior_features_toward_prior": dict(calibration="shift", combine="toward_prior", bandwidth=0.3, shrink=2.0),
    # the current defaults (whatever BASIS_DEFAULTS says)
    "default": dict(),
}


# ----------------------------------------------------------------------------------------------------------------
# BASIS
# ----------------------------------------------------------------------------------------------------------------


def _row_chunk(n: int, per_row: int) -> int:
    return max(1, min(n, (1 << 21) // max(1, per_row)))


def basis_baseline(rewards: Tensor, prior: Tensor | None = None, features: Tensor | None = None, **options) -> Tensor:
    """BASIS baseline for one rollout per prompt: b_i from the OTHER prompts of the batch (leave-one-out).

    Inputs: ``rewards`` [B] in [0, 1] (usually 0/1); ``prior`` [B] the success rate of each prompt under the
    reference model (K reference rollouts; exact 0 and 1 are fine, see prior_clip/prior_k); ``features`` [B, D] any
    D (the policy's hidden state of each prompt). The advantage is rewards - baseline. Returns a tensor [B].

    Guarantee: b_i does not depend on rewards[i], for every option, including every per-batch fitted quantity
    (calibration shift, bandwidth, shrinkage): those are fitted for row i on the other rows only.

    How b_i is built
    ----------------
    0. Neither prior nor features (or both switched off): b_i = mean of the other rewards,
       (sum_{j != i} r_j) / (B - 1). A batch of one has no other prompt: b = ``empty_baseline`` (default 0.0,
       i.e. plain REINFORCE for that prompt).
    1. Calibration (needs prior): p = prior smoothed into (0, 1); mu_j = sigmoid(a * logit(p_j) + delta) where
       (delta, a) minimise sum_{j != i} (r_j - mu_j)^2 + calib_reg * delta^2 over a grid -- separately for each i.
       (So each row i has its own view mu^(i) of all the calibrated values; they rarely differ by more than one grid
       step.) A batch of one keeps delta = 0, a = 1.
    2. BLUE pooling (needs prior) of the residuals r_j - mu_j over active rows j != i (see ``blue_pool``):
       the pooled residual t_i is  "additive": the 1/sigma_j^2-weighted mean residual; "ratio": mu_i (c_{-i} - 1);
       "none": 0. Without features b_i = mu_i + t_i. With all priors equal (and active), "additive" and "ratio"
       both give exactly the leave-one-out batch mean.
    3. Similarity pooling (needs features): cos_ij from ``cosine_similarity`` and k_ij = exp((cos_ij - 1) / h),
       j != i. With a prior and combine="toward_prior" (the default; bench/value_mse.py: the best variant at K = 2
       and 4; with K = 8, on arithmetic, "residual" was a little better) it is the kernel mean of the other prompts'
       rewards shrunk toward the calibrated prior:  b_i = (sum_{j != i} k_ij r_j + lambda * mu_i) / (S_i + lambda)  (pooling is
       then unused; bandwidth and shrink must be fixed numbers). With combine="residual" it smooths the calibrated
       residuals e_j = r_j - mu_j; without a prior, the rewards themselves (mu = 0, and t_i = the leave-one-out batch
       mean):
           b_i = mu_i + (sum_{j != i} k_ij e_j + lambda * t_i) / (S_i + lambda),   S_i = sum_{j != i} k_ij
       i.e. the kernel mean of the neighbours' residuals, shrunk toward the pooled residual t_i with the weight of
       lambda pseudo-prompts ("softmax" kernel: S_i is Kish's effective count of the normalised weights instead).
       Far-away prompts get k ~ 0 and b_i falls back to mu_i + t_i; a very large h gives nearly the batch mean.
    4. Bandwidth h and shrinkage lambda: fixed numbers, or "cv": for each row i, every (h, lambda) on the grids is
       scored by the leave-one-out squared error over the OTHER rows, sum_{j != i} (r_j - b_j^(-i,-j))^2, where
       b_j^(-i,-j) is row j's baseline computed without r_i and r_j (in row i's calibration view). The best pair
       is then used for b_i. Cost O(|grid| * B^2 * V) time and O(B^2) memory, V the number of distinct
       calibrations among the rows (1 to 3 in practice); at B = 512 it takes about 0.15 s on one CPU core.
    5. Rows outside the active set (mu_i < tau or mu_i > 1 - tau): fallback "prior" keeps mu_i (plus the
       similarity-pooled residual when features are given, shrunk toward 0 instead of t_i); "zero" sets b_i = 0.
       Finally clip=True clamps b_i to [0, 1] -- the range of a success probability -- widened to
       [min(0, min_{j != i} r_j), max(1, max_{j != i} r_j)] when rewards outside [0, 1] occur (e.g. a format bonus).

    Options (defaults in ``BASIS_DEFAULTS``, chosen with bench/value_mse.py; see bench/results/value_mse.md)
    ------------------------------------------------------------------------------------------
    use_prior=True, use_features=True   use the prior / features when given (False ignores them: for benchmarks)
    prior_clip=0.05                     clamp the prior to [prior_clip, 1 - prior_clip] before the logit
    prior_k=None                        number of reference rollouts: Jeffreys-smooth (k p0 + 1/2) / (k + 1) first
    calibration="shift"                 "shift" (logit shift delta) | "affine" (delta and logit scale a) | "none"
    shift_grid=None                     grid for delta; None = linspace(-4, 4, 81)
    scale_grid=(0.5, 0.75, 1, 1.25, 1.5)  grid for a ("affine" only)
    calib_reg=0.0                       ridge penalty calib_reg * delta^2 added to the calibration loss
    pooling="none"                      BLUE pooled residual: "none" | "additive" | "ratio"
    tau=0.02                            active set: tau <= mu_j <= 1 - tau
    fallback="prior"                    baseline of an inactive row: "prior" (mu_i) | "zero" (0, the paper's choice)
    kernel="exp"                        "exp" (S = sum of weights) | "softmax" (S = Kish effective count)
    bandwidth=0.3                       h > 0, or "cv" to choose it per row from bandwidth_grid
    bandwidth_grid=(0.03, 0.1, 0.3, 1, 3)
    shrink=2.0                          lambda >= 0, or "cv" to choose it per row from shrink_grid
    shrink_grid=(0.5, 2, 8, 32)
    feature_norm="center"               "center" | "standardize" | "none" (see ``cosine_similarity``)
    combine="toward_prior"              prior and features together: "toward_prior" | "residual" (see 3.)
    clip=True                           clamp b_i to [0, 1] (widened to the other rewards' range, see 5.)
    empty_baseline=0.0                  baseline when no other prompt is available (batch of one, no prior)
    """
    o = _parse_options(options)
    r_in = _rewards_1d(rewards)
    n = r_in.numel()
    device = r_in.device
    dtype = torch.float64 if (device.type == "cpu" or r_in.dtype == torch.float64) else torch.float32
    r = r_in.to(dtype)
    out_dtype = r_in.dtype
    if n == 0:
        return r_in.clone()

    p = None
    if prior is not None and o.use_prior:
        p = _float_tensor(prior, "prior").to(device=device, dtype=dtype)
        if p.shape != r.shape:
            raise ValueError(f"prior must have shape {tuple(r.shape)} like rewards, got {tuple(p.shape)}")
        _check_finite(p, "prior")
        if bool(((p < 0) | (p > 1)).any()):
            raise ValueError("prior values must lie in [0, 1] (success probabilities)")
    cos = None
    if features is not None and o.use_features:
        f = _float_tensor(features, "features")
        if f.dim() != 2 or f.shape[0] != n or f.shape[1] == 0:
            raise ValueError(f"features must have shape [{n}, D] with D >= 1, got {tuple(f.shape)}")
        f = f.to(device=device, dtype=dtype)
        _check_finite(f, "features")
        cos = cosine_similarity(f, o.feature_norm)

    if p is None and cos is None:
        return leave_one_out_mean(r, empty=o.empty_baseline).to(out_dtype)

    ar = torch.arange(n, device=device)
    lo_c, hi_c = _leave_one_out_range(r)  # clip range of b_i: [0, 1], widened by the other rewards
    lo_c, hi_c = lo_c.clamp(max=0.0), hi_c.clamp(min=1.0)
    # ---- views: row i sees calibrated values MuV[view[i]] (one view per distinct calibration) ----
    if p is not None:
        z = torch.logit(smooth_prior(p, o.prior_clip, o.prior_k))
        cs, ca = _calibration_candidates(o.calibration, o.shift_grid, o.scale_grid, dtype, device)
        idx = _calibrate_index(r, z, cs, ca, float(o.calib_reg), loo=True)
        uniq, view = torch.unique(idx, return_inverse=True)
        mu_v = torch.sigmoid(ca[uniq, None] * z[None, :] + cs[uniq, None])  # [V, N]
        act_v = (mu_v >= o.tau) & (mu_v <= 1.0 - o.tau)
        form = o.pooling
    else:
        mu_v = torch.zeros(1, n, dtype=dtype, device=device)
        act_v = torch.ones(1, n, dtype=torch.bool, device=device)
        view = torch.zeros(n, dtype=torch.long, device=device)
        form = "mean"
    num_v, den_v = _blue_terms(r[None, :], mu_v, act_v, form)  # [V, N]
    lnum_v, lden_v = leave_one_out_sum(num_v, 1), leave_one_out_sum(den_v, 1)  # sums over j != i
    mu_self = mu_v[view, ar]
    act_self = act_v[view, ar]
    target = _residual_target(lnum_v[view, ar], lden_v[view, ar], mu_self, form, o.empty_baseline)
    if p is not None:
        target = torch.where(act_self, target, torch.zeros_like(target))

    if cos is not None and p is not None and o.combine == "toward_prior":
        # kernel mean of the OTHER prompts' rewards (k_ii = 0), shrunk toward row i's calibrated prior mu_i, which
        # was itself fitted without r_i
        if isinstance(o.bandwidth, str) or isinstance(o.shrink, str):
            raise ValueError("combine='toward_prior' takes a fixed bandwidth and shrink, not 'cv'; use "
                             "combine='residual' for cross-validated ones")
        k = _kernel(cos, float(o.bandwidth))
        b = _combine((k * r[None, :]).sum(dim=1), k.sum(dim=1), (k * k).sum(dim=1), mu_self, float(o.shrink),
                     o.kernel)
    else:
        if cos is None:
            pooled = target
        else:
            pooled = _similarity_residual(r, cos, o, mu_v, act_v, view, num_v, den_v, lnum_v, lden_v, form, target,
                                          has_prior=p is not None, clip_range=(lo_c, hi_c))
        b = mu_self + pooled
    if p is not None and o.fallback == "zero":
        b = torch.where(act_self, b, torch.zeros_like(b))
    if o.clip:
        b = torch.minimum(torch.maximum(b, lo_c), hi_c)
    return b.to(out_dtype)


def _similarity_residual(r, cos, o, mu_v, act_v, view, num_v, den_v, lnum_v, lden_v, form, target, has_prior,
                         clip_range):
    """Kernel-pooled residual for every row, with bandwidth/shrinkage fixed or chosen per row by leave-one-out CV."""
    n = r.numel()
    dtype, device = r.dtype, r.device
    ar = torch.arange(n, device=device)
    hs = [float(o.bandwidth)] if not isinstance(o.bandwidth, str) else \
        _grid(o.bandwidth_grid, "bandwidth_grid", dtype, device, positive=True).tolist()
    lams = [float(o.shrink)] if not isinstance(o.shrink, str) else \
        _grid(o.shrink_grid, "shrink_grid", dtype, device).tolist()
    if any(x < 0 for x in lams):
        raise ValueError(f"shrink_grid values must be >= 0, got {o.shrink_grid!r}")
    do_cv = len(hs) * len(lams) > 1
    H, L = len(hs), len(lams)
    num_f = torch.empty(n, H, dtype=dtype, device=device)  # sum_{j != i} k_ij e_j in row i's view
    ksum_f = torch.empty(n, H, dtype=dtype, device=device)
    ksq_f = torch.empty(n, H, dtype=dtype, device=device)
    cv = torch.zeros(n, H, L, dtype=dtype, device=device) if do_cv else None
    chunk = _row_chunk(n, n)
    for hi, h in enumerate(hs):
        k = _kernel(cos, h)  # symmetric, zero diagonal; holds no reward
        ksum, ksq = k.sum(1), (k * k).sum(1)
        km = k @ mu_v.T  # [N, V]: sum_l k_jl mu_l in each view (no reward)
        # lx[j, i] = sum_{l != i} k_jl r_l  (exclusive prefix/suffix sums: r_i never enters column i)
        lx = leave_one_out_sum(k * r[None, :], dim=1)
        num_f[:, hi] = lx[ar, ar] - km[ar, view]
        ksum_f[:, hi], ksq_f[:, hi] = ksum, ksq
        if not do_cv:
            continue
        for s in range(0, n, chunk):
            rows = ar[s:s + chunk]
            vw = view[rows]
            mu_rows = mu_v[vw]  # [c, N] mu_j in row i's view
            k_rows = k[rows]  # k_ij == k_ji
            # row j's prediction without r_i and r_j, for each j, in row i's view
            num2 = lx[:, rows].T - (km[:, vw].T - k_rows * mu_v[vw, rows][:, None])
            ksum2 = (ksum[None, :] - k_rows).clamp_min(0.0)
            ksq2 = (ksq[None, :] - k_rows * k_rows).clamp_min(0.0)
            lden_rows = lden_v[vw, rows][:, None]
            t2 = _residual_target(lnum_v[vw, rows][:, None] - num_v[vw], lden_rows - den_v[vw],
                                  mu_rows, form, o.empty_baseline, scale=lden_rows)
            act_rows = act_v[vw]
            if has_prior:
                t2 = torch.where(act_rows, t2, torch.zeros_like(t2))
            self_mask = rows[:, None] == ar[None, :]
            for li, lam in enumerate(lams):
                pred = mu_rows + _combine(num2, ksum2, ksq2, t2, lam, o.kernel)
                if has_prior and o.fallback == "zero":
                    pred = torch.where(act_rows, pred, torch.zeros_like(pred))
                if o.clip:  # row i's clip range (from the rewards other than r_i)
                    pred = torch.minimum(torch.maximum(pred, clip_range[0][rows, None]), clip_range[1][rows, None])
                err = torch.where(self_mask, torch.zeros_like(pred), (r[None, :] - pred) ** 2)
                cv[rows, hi, li] = err.sum(1)
    if do_cv:
        # exact ties (e.g. B <= 2, where nothing is left to validate on) go to the pair nearest h = 1, lambda = 2
        hpen = torch.tensor([abs(math.log(h)) for h in hs], dtype=dtype, device=device)
        lpen = torch.tensor([abs(math.log((lam + 1.0) / 3.0)) for lam in lams], dtype=dtype, device=device)
        score = cv + 1e-12 * (hpen[None, :, None] + lpen[None, None, :])
        best = torch.argmin(score.reshape(n, H * L), dim=1)
        hi_sel, li_sel = best // L, best % L
    else:
        hi_sel = torch.zeros(n, dtype=torch.long, device=device)
        li_sel = torch.zeros(n, dtype=torch.long, device=device)
    pooled = torch.empty(n, dtype=dtype, device=device)
    for li, lam in enumerate(lams):
        sel = li_sel == li
        if bool(sel.any()):
            pooled[sel] = _combine(num_f[ar, hi_sel][sel], ksum_f[ar, hi_sel][sel], ksq_f[ar, hi_sel][sel],
                                   target[sel], lam, o.kernel)
    return pooled


# ----------------------------------------------------------------------------------------------------------------
# one entry point
# ----------------------------------------------------------------------------------------------------------------


def compute_advantages(
    name: str,
    rewards: Tensor,
    prior: Tensor | None = None,
    features: Tensor | None = None,
    normalize: bool = False,
    **options,
) -> tuple[Tensor, Tensor]:
    """Advantages and baselines for rewards [B, G] (B prompts x G rollouts): returns (advantages, baselines), both [B, G].

    name: "basis" | "reinforce_pp" | "grpo" | "dr_grpo" | "rloo".
    - basis: every rollout is its own row, with its prompt's prior [B] and features [B, D] repeated G times; the
      baseline of a rollout never depends on its own reward (the other rollouts of the same prompt may be used,
      and with features they are its nearest neighbours). ``options`` go to ``basis_baseline``. A = r - b.
    - reinforce_pp: A = global whitening of all B*G rewards; the returned baseline is the batch mean.
    - grpo: b = group mean, A = (r - b) / (group std + eps). dr_grpo: b = group mean, A = r - b.
    - rloo: b = mean of the other G - 1 rollouts of the prompt, A = r - b.
    normalize=True divides the advantages by their batch std (+eps) for every estimator except reinforce_pp (which
    is already whitened); the baselines are returned unscaled. That std uses every reward, as REINFORCE++'s
    whitening does: it rescales the batch, it does not shift any advantage. prior and features are ignored except by
    basis.
    """
    if name not in ESTIMATORS:
        raise ValueError(f"unknown estimator name={name!r}; accepted names: {', '.join(ESTIMATORS)}")
    r = _rewards_2d(rewards, f"compute_advantages(name={name!r})")
    B, G = r.shape
    if options and name != "basis":
        raise ValueError(f"options {sorted(options)} only apply to name='basis', not name={name!r}")
    if name == "reinforce_pp":
        adv = reinforce_pp_advantages(r.reshape(-1)).reshape(B, G)
        base = r.mean().expand(B, G).clone() if r.numel() else r.clone()
        return adv, base
    if name == "grpo":
        base, adv = group_mean_baseline(r), grpo_advantages(r)
    elif name == "dr_grpo":
        base = group_mean_baseline(r)
        adv = r - base
    elif name == "rloo":
        base = rloo_baseline(r)
        adv = r - base
    else:
        p = f = None
        if prior is not None:
            p = _float_tensor(prior, "prior")
            if p.dim() == 2 and p.shape[1] == 1:
                p = p[:, 0]
            if p.shape != (B,):
                raise ValueError(f"prior must have shape [B] = [{B}] (one value per prompt), got {tuple(p.shape)}")
            p = p.to(r.device).repeat_interleave(G)
        if features is not None:
            f = _float_tensor(features, "features")
            if f.dim() != 2 or f.shape[0] != B:
                raise ValueError(f"features must have shape [B, D] = [{B}, D], got {tuple(f.shape)}")
            f = f.to(r.device).repeat_interleave(G, dim=0)
        base = basis_baseline(r.reshape(-1), p, f, **options).reshape(B, G)
        adv = r - base
    if normalize and adv.numel() > 1:
        adv = adv / (adv.std() + EPS)
    return adv, base


def explained_variance(rewards: Tensor, baselines: Tensor) -> float:
    """1 - Var(r - b) / Var(r) over all entries (population variances); nan when Var(r) == 0.

    1 means the baseline removes all reward variance, 0 means it removes none (e.g. a constant), < 0 means it adds
    variance. Like any explained variance it ignores a constant offset between r and b.
    """
    r = _float_tensor(rewards, "rewards").reshape(-1).to(torch.float64)
    b = _float_tensor(baselines, "baselines").reshape(-1).to(device=r.device, dtype=torch.float64)
    if r.shape != b.shape:
        raise ValueError(f"rewards and baselines must have the same number of entries, got {r.numel()} and {b.numel()}")
    if r.numel() == 0:
        return float("nan")
    var_r = r.var(unbiased=False)
    if float(var_r) == 0.0:
        return float("nan")
    return float(1.0 - (r - b).var(unbiased=False) / var_r)
