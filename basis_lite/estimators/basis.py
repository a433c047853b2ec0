"""BASIS: one rollout per prompt, each prompt's baseline built from the OTHER prompts of the batch.

``basis(rewards [B, G], ctx) -> (advantages, baselines)`` is what the estimator registered as "basis"
(basis_mix.basis_estimator) and the poise estimators call; ``basis_baseline`` is the baseline over one row per
rollout, with the equations and options in its docstring, and runs them as one function per step: the inputs
checked (``_checked_inputs``), the calibration views (``calibration_views``, a ``CalibrationViews``), the pooled
residual (``pooled_residual``), similarity pooling (``_kernel_toward_prior``, or ``_similarity_residual`` with its
cross-validation in ``_cv_errors`` and ``_best_pair``), the fallback and clip (``_fallback_and_clip``). The pieces
those are made of (prior smoothing, calibration fit, BLUE terms, kernels) are in basis_blocks.py, the options in
basis_options.py.

The leave-one-out rule: b_i never depends on r_i, for every option. Every quantity fitted on the batch (the
calibration shift, the bandwidth and shrinkage picked by cross-validation) is fitted separately for each row i on
the rewards of the other rows only, and sums "over j != i" are computed so that reward i never enters them (masked
sums and exclusive prefix/suffix sums, never "total minus own term"): the independence is exact in floating point.
``tests/estimators/test_advantages.py`` checks it for every option combination.

The BASIS paper published no code or equations (see ``docs/papers.md``); this is our own reconstruction. The
defaults (fixed bandwidth and shrinkage, calibration by a logit shift, no BLUE pooling, the kernel mean shrunk
toward the calibrated prior) were chosen with bench/value_mse.py; the measurements are in
bench/results/value_mse.md, and docs/results.md says where single-rollout baselines fall short.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from .base import as_float_tensor, check_finite, leave_one_out_mean, leave_one_out_range, leave_one_out_sum, rewards_1d
from .basis_blocks import (
    blue_terms,
    calibrate_index,
    calibration_candidates,
    combine,
    cosine_similarity,
    grid_tensor,
    kernel_matrix,
    residual_target,
    smooth_prior,
)
from .basis_options import parse_options


def basis(rewards: Tensor, ctx) -> tuple[Tensor, Tensor]:
    """A = r - b, b = ``basis_baseline`` over all B*G rollouts as rows.

    Every rollout is its own row, with its prompt's prior ``ctx.prior`` [B] and features ``ctx.features`` [B, D]
    repeated G times; the baseline of a rollout never depends on its own reward (the other rollouts of the same
    prompt may be used, and with features they are its nearest neighbours). ``ctx.options`` are the BASIS options.
    ``ctx.history`` is not read here: the trainer folds a prompt's earlier rewards into ``ctx.prior``
    (``rl.priors.prior_values``). The registered ``basis`` estimator (basis_mix.basis_estimator) calls this, or with
    the option ``mix: true`` the mix of basis_mix.py, whose parts call this.
    """
    B, G = rewards.shape
    p = f = None
    if ctx.prior is not None:
        p = as_float_tensor(ctx.prior, "prior")
        if p.dim() == 2 and p.shape[1] == 1:
            p = p[:, 0]
        if p.shape != (B,):
            raise ValueError(f"prior must have shape [B] = [{B}] (one value per prompt), got {tuple(p.shape)}")
        p = p.to(rewards.device).repeat_interleave(G)
    if ctx.features is not None:
        f = as_float_tensor(ctx.features, "features")
        if f.dim() != 2 or f.shape[0] != B:
            raise ValueError(f"features must have shape [B, D] = [{B}, D], got {tuple(f.shape)}")
        f = f.to(rewards.device).repeat_interleave(G, dim=0)
    base = basis_baseline(rewards.reshape(-1), p, f, **(ctx.options or {})).reshape(B, G)
    return rewards - base, base


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
    2. BLUE pooling (needs prior) of the residuals r_j - mu_j over active rows j != i, with Bernoulli variances
       sigma_j^2 = mu_j (1 - mu_j): the pooled residual t_i is  "additive": the 1/sigma_j^2-weighted mean residual;
       "ratio": mu_i (c_{-i} - 1), c_{-i} = [sum (mu_j / sigma_j^2) r_j] / [sum mu_j^2 / sigma_j^2]; "none": 0.
       With no other active row t_i = 0. Without features b_i = mu_i + t_i. With all priors equal (and active),
       "additive" and "ratio" both give exactly the leave-one-out batch mean.
    3. Similarity pooling (needs features): cos_ij from ``cosine_similarity`` and k_ij = exp((cos_ij - 1) / h),
       j != i. With a prior and combine="toward_prior" (the default) it is the kernel mean of the other prompts'
       rewards shrunk toward the calibrated prior:  b_i = (sum_{j != i} k_ij r_j + lambda * mu_i) / (S_i + lambda)
       (pooling is then unused; bandwidth and shrink must be fixed numbers). With combine="residual" it smooths the
       calibrated residuals e_j = r_j - mu_j; without a prior, the rewards themselves (mu = 0, and t_i = the
       leave-one-out batch mean):
           b_i = mu_i + (sum_{j != i} k_ij e_j + lambda * t_i) / (S_i + lambda),   S_i = sum_{j != i} k_ij
       i.e. the kernel mean of the neighbours' residuals, shrunk toward the pooled residual t_i with the weight of
       lambda pseudo-prompts ("softmax" kernel: S_i is Kish's effective count of the normalised weights instead).
       Far-away prompts get k ~ 0 and b_i falls back to mu_i + t_i; a very large h gives nearly the batch mean.
    4. Bandwidth h and shrinkage lambda: fixed numbers, or "cv": for each row i, every (h, lambda) on the grids is
       scored by the leave-one-out squared error over the OTHER rows, sum_{j != i} (r_j - b_j^(-i,-j))^2, where
       b_j^(-i,-j) is row j's baseline computed without r_i and r_j (in row i's calibration view). The best pair
       is then used for b_i. Cost O(|grid| * B^2 * V) time and O(B^2) memory, V the number of distinct
       calibrations among the rows (1 to 3 in practice).
    5. Rows outside the active set (mu_i < tau or mu_i > 1 - tau): fallback "prior" keeps mu_i (plus the
       similarity-pooled residual when features are given, shrunk toward 0 instead of t_i); "zero" sets b_i = 0.
       Finally clip=True clamps b_i to [0, 1] -- the range of a success probability -- widened to
       [min(0, min_{j != i} r_j), max(1, max_{j != i} r_j)] when rewards outside [0, 1] occur (e.g. a format bonus).

    Options (defaults in ``BASIS_DEFAULTS``, basis_options.py; chosen with bench/value_mse.py)
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
    mix=False, mix_parts, mix_rate, mix_memory, tracker_decay, tracker_prior_count, probe_min_rows
                                        read by ``basis`` only (basis_mix.py); ignored here
    """
    o = parse_options(options)
    r_in = rewards_1d(rewards)
    if r_in.numel() == 0:
        return r_in.clone()
    r, p, cos = _checked_inputs(r_in, prior, features, o)
    if p is None and cos is None:  # step 0
        return leave_one_out_mean(r, empty=o.empty_baseline).to(r_in.dtype)
    views = calibration_views(r, p, o)  # step 1, and the BLUE terms of step 2
    target = pooled_residual(views, o)  # step 2
    clip_range = _clip_range(r)
    if cos is None:
        b = views.mu_self + target
    elif views.has_prior and o.combine == "toward_prior":
        b = _kernel_toward_prior(r, cos, views, o)  # step 3 with a prior
    else:
        b = views.mu_self + _similarity_residual(r, cos, views, target, o, clip_range)  # steps 3 and 4
    return _fallback_and_clip(b, views, o, clip_range).to(r_in.dtype)  # step 5


@dataclasses.dataclass
class CalibrationViews:
    """The calibrated prior as each row sees it (step 1), with the BLUE terms over it (step 2).

    Row i sees the calibrated values ``mu[view[i]]``: one view per distinct calibration fitted among the rows (1 to
    3 in practice), each fitted without that row's reward. Without a prior there is one view of zeros, every row
    active, and the BLUE form "mean" (the terms are then the rewards and ones).
    """

    mu: Tensor  # [V, N] calibrated values mu_j in each view
    active: Tensor  # [V, N] tau <= mu_j <= 1 - tau (all True without a prior)
    view: Tensor  # [N] the view of each row
    form: str  # the BLUE form: the pooling option with a prior, "mean" without
    num: Tensor  # [V, N] BLUE numerator and denominator terms of each row j (``blue_terms``)
    den: Tensor
    lnum: Tensor  # [V, N] their sums over j != i (r_i never enters column i)
    lden: Tensor
    has_prior: bool

    @property
    def rows(self) -> Tensor:
        return torch.arange(self.view.numel(), device=self.view.device)

    @property
    def mu_self(self) -> Tensor:
        """[N] mu_i in row i's own view."""
        return self.mu[self.view, self.rows]

    @property
    def active_self(self) -> Tensor:
        return self.active[self.view, self.rows]


def _checked_inputs(r_in: Tensor, prior, features, o) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(rewards, prior or None, cosine similarities of the features or None), in float64 on a CPU (float32 on a
    GPU unless the rewards are float64); a prior or features switched off by the options is None."""
    n, device = r_in.numel(), r_in.device
    dtype = torch.float64 if (device.type == "cpu" or r_in.dtype == torch.float64) else torch.float32
    r = r_in.to(dtype)
    p = cos = None
    if prior is not None and o.use_prior:
        p = as_float_tensor(prior, "prior").to(device=device, dtype=dtype)
        if p.shape != r.shape:
            raise ValueError(f"prior must have shape {tuple(r.shape)} like rewards, got {tuple(p.shape)}")
        check_finite(p, "prior")
        if bool(((p < 0) | (p > 1)).any()):
            raise ValueError("prior values must lie in [0, 1] (success probabilities)")
    if features is not None and o.use_features:
        f = as_float_tensor(features, "features")
        if f.dim() != 2 or f.shape[0] != n or f.shape[1] == 0:
            raise ValueError(f"features must have shape [{n}, D] with D >= 1, got {tuple(f.shape)}")
        f = f.to(device=device, dtype=dtype)
        check_finite(f, "features")
        cos = cosine_similarity(f, o.feature_norm)
    return r, p, cos


def calibration_views(r: Tensor, p: Tensor | None, o) -> CalibrationViews:
    """Step 1: each row's calibration (delta, a) fitted on the other rows' rewards, the distinct ones as views;
    and step 2's BLUE terms in each view with their sums over j != i."""
    n, dtype, device = r.numel(), r.dtype, r.device
    if p is not None:
        z = torch.logit(smooth_prior(p, o.prior_clip, o.prior_k))
        cs, ca = calibration_candidates(o.calibration, o.shift_grid, o.scale_grid, dtype, device)
        idx = calibrate_index(r, z, cs, ca, float(o.calib_reg))
        uniq, view = torch.unique(idx, return_inverse=True)
        mu = torch.sigmoid(ca[uniq, None] * z[None, :] + cs[uniq, None])  # [V, N]
        active = (mu >= o.tau) & (mu <= 1.0 - o.tau)
        form = o.pooling
    else:
        mu = torch.zeros(1, n, dtype=dtype, device=device)
        active = torch.ones(1, n, dtype=torch.bool, device=device)
        view = torch.zeros(n, dtype=torch.long, device=device)
        form = "mean"
    num, den = blue_terms(r[None, :], mu, active, form)  # [V, N]
    return CalibrationViews(mu, active, view, form, num, den, leave_one_out_sum(num, 1), leave_one_out_sum(den, 1),
                            has_prior=p is not None)


def pooled_residual(views: CalibrationViews, o) -> Tensor:
    """Step 2: t_i, the BLUE-pooled residual of the active rows j != i in row i's view (0 for an inactive row i
    with a prior; without one, the leave-one-out batch mean)."""
    ar, v = views.rows, views.view
    target = residual_target(views.lnum[v, ar], views.lden[v, ar], views.mu_self, views.form, o.empty_baseline)
    if views.has_prior:
        target = torch.where(views.active_self, target, torch.zeros_like(target))
    return target


def _clip_range(r: Tensor) -> tuple[Tensor, Tensor]:
    """Row i's clip range for step 5: [0, 1], widened by the rewards other than r_i."""
    lo, hi = leave_one_out_range(r)
    return lo.clamp(max=0.0), hi.clamp(min=1.0)


def _kernel_toward_prior(r: Tensor, cos: Tensor, views: CalibrationViews, o) -> Tensor:
    """Step 3 with combine="toward_prior": the kernel mean of the OTHER prompts' rewards (k_ii = 0), shrunk toward
    row i's calibrated prior mu_i, which was itself fitted without r_i."""
    if isinstance(o.bandwidth, str) or isinstance(o.shrink, str):
        raise ValueError("combine='toward_prior' takes a fixed bandwidth and shrink, not 'cv'; use "
                         "combine='residual' for cross-validated ones")
    k = kernel_matrix(cos, float(o.bandwidth))
    return combine((k * r[None, :]).sum(dim=1), k.sum(dim=1), (k * k).sum(dim=1), views.mu_self, float(o.shrink),
                   o.kernel)


def _fallback_and_clip(b: Tensor, views: CalibrationViews, o, clip_range: tuple[Tensor, Tensor]) -> Tensor:
    """Step 5: fallback "zero" sets an inactive row's baseline to 0; clip clamps b_i to row i's clip range."""
    if views.has_prior and o.fallback == "zero":
        b = torch.where(views.active_self, b, torch.zeros_like(b))
    if o.clip:
        b = torch.minimum(torch.maximum(b, clip_range[0]), clip_range[1])
    return b


def _row_chunk(n: int, per_row: int) -> int:
    return max(1, min(n, (1 << 21) // max(1, per_row)))


def _similarity_residual(r: Tensor, cos: Tensor, views: CalibrationViews, target: Tensor, o,
                         clip_range: tuple[Tensor, Tensor]) -> Tensor:
    """Steps 3 and 4 with combine="residual" or no prior: the kernel-pooled residual of every row, shrunk toward
    ``target`` (t_i), with the bandwidth and shrinkage fixed or chosen per row by leave-one-out CV."""
    n = r.numel()
    dtype, device = r.dtype, r.device
    ar, view = views.rows, views.view
    hs = [float(o.bandwidth)] if not isinstance(o.bandwidth, str) else \
        grid_tensor(o.bandwidth_grid, "bandwidth_grid", dtype, device, positive=True).tolist()
    lams = [float(o.shrink)] if not isinstance(o.shrink, str) else \
        grid_tensor(o.shrink_grid, "shrink_grid", dtype, device).tolist()
    do_cv = len(hs) * len(lams) > 1
    H, L = len(hs), len(lams)
    num_f = torch.empty(n, H, dtype=dtype, device=device)  # sum_{j != i} k_ij e_j in row i's view
    ksum_f = torch.empty(n, H, dtype=dtype, device=device)
    ksq_f = torch.empty(n, H, dtype=dtype, device=device)
    cv = torch.zeros(n, H, L, dtype=dtype, device=device) if do_cv else None
    for hi, h in enumerate(hs):
        k = kernel_matrix(cos, h)  # symmetric, zero diagonal; holds no reward
        ksum, ksq = k.sum(1), (k * k).sum(1)
        km = k @ views.mu.T  # [N, V]: sum_l k_jl mu_l in each view (no reward)
        # lx[j, i] = sum_{l != i} k_jl r_l  (exclusive prefix/suffix sums: r_i never enters column i)
        lx = leave_one_out_sum(k * r[None, :], dim=1)
        num_f[:, hi] = lx[ar, ar] - km[ar, view]
        ksum_f[:, hi], ksq_f[:, hi] = ksum, ksq
        if do_cv:
            cv[:, hi] = _cv_errors(r, views, k, km, lx, lams, o, clip_range)
    if do_cv:
        hi_sel, li_sel = _best_pair(cv, hs, lams)
    else:
        hi_sel = torch.zeros(n, dtype=torch.long, device=device)
        li_sel = torch.zeros(n, dtype=torch.long, device=device)
    pooled = torch.empty(n, dtype=dtype, device=device)
    for li, lam in enumerate(lams):
        sel = li_sel == li
        if bool(sel.any()):
            pooled[sel] = combine(num_f[ar, hi_sel][sel], ksum_f[ar, hi_sel][sel], ksq_f[ar, hi_sel][sel],
                                  target[sel], lam, o.kernel)
    return pooled


def _cv_errors(r: Tensor, views: CalibrationViews, k: Tensor, km: Tensor, lx: Tensor, lams: list, o,
               clip_range: tuple[Tensor, Tensor]) -> Tensor:
    """Step 4 for one bandwidth (kernel ``k``): [N, L], row i's leave-one-out squared error over the other rows j
    for each shrinkage, each b_j computed without r_i and r_j in row i's calibration view (in chunks of rows)."""
    n = r.numel()
    ar, view, mu_v = views.rows, views.view, views.mu
    ksum, ksq = k.sum(1), (k * k).sum(1)
    out = torch.empty(n, len(lams), dtype=r.dtype, device=r.device)
    chunk = _row_chunk(n, n)
    for s in range(0, n, chunk):
        rows = ar[s:s + chunk]
        vw = view[rows]
        mu_rows = mu_v[vw]  # [c, N] mu_j in row i's view
        k_rows = k[rows]  # k_ij == k_ji
        # row j's prediction without r_i and r_j, for each j, in row i's view
        num2 = lx[:, rows].T - (km[:, vw].T - k_rows * mu_v[vw, rows][:, None])
        ksum2 = (ksum[None, :] - k_rows).clamp_min(0.0)
        ksq2 = (ksq[None, :] - k_rows * k_rows).clamp_min(0.0)
        lden_rows = views.lden[vw, rows][:, None]
        t2 = residual_target(views.lnum[vw, rows][:, None] - views.num[vw], lden_rows - views.den[vw],
                             mu_rows, views.form, o.empty_baseline, scale=lden_rows)
        act_rows = views.active[vw]
        if views.has_prior:
            t2 = torch.where(act_rows, t2, torch.zeros_like(t2))
        self_mask = rows[:, None] == ar[None, :]
        for li, lam in enumerate(lams):
            pred = mu_rows + combine(num2, ksum2, ksq2, t2, lam, o.kernel)
            if views.has_prior and o.fallback == "zero":
                pred = torch.where(act_rows, pred, torch.zeros_like(pred))
            if o.clip:  # row i's clip range (from the rewards other than r_i)
                pred = torch.minimum(torch.maximum(pred, clip_range[0][rows, None]), clip_range[1][rows, None])
            err = torch.where(self_mask, torch.zeros_like(pred), (r[None, :] - pred) ** 2)
            out[rows, li] = err.sum(1)
    return out


def _best_pair(cv: Tensor, hs: list, lams: list) -> tuple[Tensor, Tensor]:
    """Step 4's choice: each row's (bandwidth index, shrinkage index) with the least CV error; exact ties (e.g.
    B <= 2, where nothing is left to validate on) go to the pair nearest h = 1, lambda = 2."""
    n, H, L = cv.shape
    hpen = torch.tensor([abs(math.log(h)) for h in hs], dtype=cv.dtype, device=cv.device)
    lpen = torch.tensor([abs(math.log((lam + 1.0) / 3.0)) for lam in lams], dtype=cv.dtype, device=cv.device)
    score = cv + 1e-12 * (hpen[None, :, None] + lpen[None, None, :])
    best = torch.argmin(score.reshape(n, H * L), dim=1)
    return best // L, best % L
