"""Reference implementations for the estimator tests: building blocks that only the tests use, written plainly.

- ``blue_pool``: leave-one-out BLUE pooling around given calibrated values mu, one row at a time in Python loops.
  The package computes the same thing inside ``basis_baseline`` (calibration="none", no features); the tests check
  the formulas here by hand and the package against them.
- ``calibrate``: the grid fit of the prior's logit shift (and scale), leave-one-out or on the whole batch. The
  package's ``calibrate_shift`` is its "shift", leave-one-out case; ``basis_baseline``'s "affine" and "none"
  calibrations are checked against the other cases.
"""
from __future__ import annotations

import torch
from torch import Tensor

from basis_lite.estimators.base import leave_one_out_sum
from basis_lite.estimators.basis_blocks import smooth_prior
from basis_lite.estimators.basis_options import CHOICES, DEFAULT_SHIFT_GRID, PRIOR_CLIP


def blue_pool(rewards: Tensor, mu: Tensor, *, form: str = "additive", tau: float = 0.02, fallback: str = "prior",
              clip: bool = True) -> Tensor:
    """Leave-one-out BLUE pooling of the other prompts' rewards around calibrated values ``mu`` [B].

    Bernoulli variances sigma_j^2 = mu_j (1 - mu_j); active set A = {j : tau <= mu_j <= 1 - tau} (rows outside it
    have a near-zero variance and would get exploding weights, so they are left out of the sums).
    - form "additive" (model r_j = mu_j + common drift + noise):
      b_i = mu_i + [sum_{j in A, j != i} (r_j - mu_j) / sigma_j^2] / [sum_{j in A, j != i} 1 / sigma_j^2]
    - form "ratio" (model E r_j = c * mu_j):
      b_i = mu_i * c_{-i},  c_{-i} = [sum_{j in A, j != i} (mu_j / sigma_j^2) r_j] / [sum_{j in A, j != i} mu_j^2 / sigma_j^2]
    - form "none": b_i = mu_i.
    With no other active row the drift is 0 (c = 1). A row i outside A gets the fallback: "prior" -> b_i = mu_i,
    "zero" -> b_i = 0. clip=True clamps b_i to [0, 1], widened to the range of the other rewards when some lie
    outside [0, 1].
    """
    r = torch.as_tensor(rewards).to(torch.float64)
    m = torch.as_tensor(mu).to(torch.float64)
    assert r.dim() == 1 and m.shape == r.shape, (r.shape, m.shape)
    assert form in CHOICES["pooling"] and fallback in CHOICES["fallback"], (form, fallback)
    n = r.numel()
    rl, ml = r.tolist(), m.tolist()
    active = [tau <= x <= 1.0 - tau for x in ml]
    out = []
    for i in range(n):
        others = [j for j in range(n) if j != i and active[j]]
        if not active[i]:
            b = ml[i] if fallback == "prior" else 0.0
        elif form == "additive":
            w = {j: 1.0 / max(ml[j] * (1.0 - ml[j]), 1e-12) for j in others}
            den = sum(w.values())
            b = ml[i] + (sum(w[j] * (rl[j] - ml[j]) for j in others) / den if den > 0 else 0.0)
        elif form == "ratio":
            num = sum(rl[j] / max(1.0 - ml[j], 1e-12) for j in others)  # (mu_j / sigma_j^2) r_j
            den = sum(ml[j] / max(1.0 - ml[j], 1e-12) for j in others)  # mu_j^2 / sigma_j^2
            b = ml[i] * (num / den if den > 0 else 1.0)
        else:
            b = ml[i]
        if clip:
            rest = [rl[j] for j in range(n) if j != i]
            b = min(max(b, min([0.0] + rest)), max([1.0] + rest))
        out.append(b)
    return torch.tensor(out, dtype=torch.float64).to(torch.as_tensor(rewards).dtype)


def calibrate(rewards: Tensor, prior: Tensor, *, method: str = "shift", shift_grid=None,
              scale_grid=(0.5, 0.75, 1.0, 1.25, 1.5), reg: float = 0.0, leave_one_out: bool = True,
              prior_clip: float = PRIOR_CLIP, prior_k: int | None = None) -> tuple[Tensor, Tensor]:
    """Fit mu_j(delta, a) = sigmoid(a * logit(p_j) + delta), p = smooth_prior(prior), by least squares on a grid.

    Picks the (delta, a) minimising  sum_j (r_j - mu_j(delta, a))^2 + reg * delta^2 (plus a 1e-9 tie-break toward
    (0, 1)); method "shift" (a = 1), "affine" (a from ``scale_grid`` too) or "none" (delta = 0, a = 1).
    leave_one_out=True: row i's fit sums over j != i only; False: every row gets the whole-batch fit.
    Returns (shift [B], scale [B]).
    """
    r = torch.as_tensor(rewards).to(torch.float64)
    z = torch.logit(smooth_prior(prior, prior_clip, prior_k).to(torch.float64))
    shifts = [0.0] if method == "none" else list(shift_grid if shift_grid is not None else DEFAULT_SHIFT_GRID)
    scales = list(scale_grid) if method == "affine" else [1.0]
    pairs = [(s, a) for s in shifts for a in scales]  # shift-major, as the package enumerates them
    S = torch.tensor([s for s, _ in pairs], dtype=torch.float64)
    A = torch.tensor([a for _, a in pairs], dtype=torch.float64)
    sq = (r[None, :] - torch.sigmoid(A[:, None] * z[None, :] + S[:, None])) ** 2  # [P, B]
    loss = leave_one_out_sum(sq, dim=1) if leave_one_out else sq.sum(dim=1, keepdim=True).expand(-1, r.numel())
    pen = reg * S**2 + 1e-9 * (S**2 + torch.log(A) ** 2)
    idx = torch.argmin(loss + pen[:, None], dim=0)
    return S[idx], A[idx]
