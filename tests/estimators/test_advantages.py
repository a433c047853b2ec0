"""Tests for basis_lite.estimators: the registry and its one interface, hand-computed estimators, the leave-one-out
rule, invariances, edge cases, a brute-force check of the bandwidth cross-validation, small value-MSE simulations,
and the option checks when a config loads.

Building blocks that only these tests use (BLUE pooling around given values, the general calibration fit) are in
tests/reference_estimators.py; the package's estimators are checked against them."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import pytest
import torch
from reference_estimators import blue_pool, calibrate

from basis_lite.config import load_config
from basis_lite.errors import ConfigError
from basis_lite.estimators import EstimatorContext, EstimatorSpec, estimator_names, get_estimator, register
from basis_lite.estimators.base import explained_variance, leave_one_out_mean, leave_one_out_sum
from basis_lite.estimators.basis import basis_baseline
from basis_lite.estimators.basis_blocks import (
    calibrate_shift,
    calibrated_values,
    cosine_similarity,
    similarity_pool,
    smooth_prior,
)
from basis_lite.estimators.basis_options import BASIS_DEFAULTS
from basis_lite.estimators.simple import (
    dr_grpo_advantages,
    group_mean_baseline,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_baseline,
)
from bench.basis_variants import BASIS_VARIANTS

D = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # These tensors are tiny: on a shared 2-core machine, intra-op threads only add synchronisation stalls
    # (measured 40x slower with 2 threads under load). Restore the setting for other test modules.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def reference_table(B: int, k: int = 4) -> dict:
    """A reference-sample table (rl/priors.py's layout) for prompts p0..p{B-1}: K reward totals each, varied."""
    rewards = {f"p{i}": [float((i * 7 + j * 3) % 5 == 0) + 0.25 * (j == i % k) for j in range(k)] for i in range(B)}
    return {"k": k, "rewards": rewards, "counts": {i: int(sum(x >= 1 for x in r)) for i, r in rewards.items()}}


def compute(name, rewards, prior=None, features=None, normalize=False, **options):
    """The registered estimator ``name`` through its one interface: (advantages [B, G], baselines [B, G]). An
    estimator that reads reference samples gets its state with `reference_table(B)`."""
    B = rewards.shape[0] if rewards.dim() else 0
    spec = get_estimator(name)
    state = spec.make_state(options)
    if spec.uses_reference:
        state.set_reference(reference_table(B))
    ctx = EstimatorContext(prompt_ids=[f"p{i}" for i in range(B)], prior=prior, features=features, options=options,
                           normalize=normalize, state=state)
    return spec.compute(rewards, ctx)


def _batch(B: int, seed: int = 0, binary: bool = True):
    g = torch.Generator().manual_seed(seed)
    if binary:
        r = torch.bernoulli(torch.full((B,), 0.45, dtype=D), generator=g)
    else:
        r = torch.rand(B, dtype=D, generator=g)
    p = torch.rand(B, dtype=D, generator=g)
    if B >= 3:
        p[0], p[1] = 0.0, 1.0  # exact 0 and 1 must be handled
    f = torch.randn(B, 6, dtype=D, generator=g)
    if B >= 4:
        f[3] = f[2]  # duplicate prompts (cosine 1)
    return r, p, f


# ------------------------------------------------------------------------------------------------------------
# standard estimators, hand-computed
# ------------------------------------------------------------------------------------------------------------


def test_reinforce_pp_hand_computed():
    a = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=D))
    # mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    s = math.sqrt(1.0 / 3.0)
    torch.testing.assert_close(a, torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=D) / (s + 1e-6))
    assert reinforce_pp_advantages(torch.tensor([0.7])).item() == 0.0  # a batch of one
    assert torch.isfinite(reinforce_pp_advantages(torch.ones(5))).all()


def test_group_estimators_hand_computed():
    r = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]], dtype=D)
    torch.testing.assert_close(group_mean_baseline(r), torch.tensor([[0.75] * 4, [0.25] * 4], dtype=D))
    torch.testing.assert_close(rloo_baseline(r), torch.tensor([[2 / 3, 1.0, 2 / 3, 2 / 3], [1 / 3, 1 / 3, 1 / 3, 0.0]],
                                                              dtype=D))
    torch.testing.assert_close(dr_grpo_advantages(r), torch.tensor([[0.25, -0.75, 0.25, 0.25],
                                                                    [-0.25, -0.25, -0.25, 0.75]], dtype=D))
    # group std (unbiased) = sqrt(0.75 / 3) = 0.5 for both rows
    torch.testing.assert_close(grpo_advantages(r), torch.tensor([[0.5, -1.5, 0.5, 0.5], [-0.5, -0.5, -0.5, 1.5]],
                                                                dtype=D) / (1 + 2e-6), rtol=1e-5, atol=1e-5)
    # RLOO = k/(k-1) (r - group mean)
    torch.testing.assert_close(r - rloo_baseline(r), 4 / 3 * dr_grpo_advantages(r))
    # all-equal group: zero advantages, no nan
    assert torch.equal(grpo_advantages(torch.ones(2, 3)), torch.zeros(2, 3))


def test_group_of_one_conventions():
    r = torch.tensor([[1.0], [0.0]])
    assert torch.equal(rloo_baseline(r), torch.zeros(2, 1))
    assert torch.equal(group_mean_baseline(r), torch.zeros(2, 1))
    torch.testing.assert_close(grpo_advantages(r), r / (1 + 1e-6))
    assert torch.equal(dr_grpo_advantages(r), r)


def test_leave_one_out_sum_is_exact():
    x = torch.randn(3, 17, dtype=D)
    brute = torch.stack([x.sum(1) - x[:, i] for i in range(17)], dim=1)
    torch.testing.assert_close(leave_one_out_sum(x, 1), brute)
    torch.testing.assert_close(leave_one_out_mean(x, 1), brute / 16)
    # entry i is bitwise unaffected by x[i]
    y = x.clone()
    y[:, 5] = 1e6
    assert torch.equal(leave_one_out_sum(x, 1)[:, 5], leave_one_out_sum(y, 1)[:, 5])
    assert leave_one_out_mean(torch.tensor([3.0]), empty=0.5).item() == 0.5


# ------------------------------------------------------------------------------------------------------------
# BLUE pooling and calibration: the reference implementations by hand, the package against them
# ------------------------------------------------------------------------------------------------------------


def test_blue_pool_hand_computed():
    mu = torch.tensor([0.5, 0.2, 0.8, 0.5], dtype=D)
    r = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=D)
    # additive, i = 0: weights 1/var = [4, 6.25, 6.25, 4], residuals [.5, -.2, .2, -.5]
    # b_0 = 0.5 + (6.25*-.2 + 6.25*.2 + 4*-.5) / (6.25 + 6.25 + 4) = 0.5 - 2/16.5
    b = blue_pool(r, mu, form="additive", tau=0.1)
    assert b[0].item() == pytest.approx(0.5 - 2 / 16.5, abs=1e-12)
    # i = 1: others 0, 2, 3: (4*.5 + 6.25*.2 + 4*-.5) / 14.25
    assert b[1].item() == pytest.approx(0.2 + 1.25 / 14.25, abs=1e-12)
    # ratio, i = 0: c = sum r_j/(1-mu_j) / sum mu_j/(1-mu_j) over j = 1..3 = (1/0.2) / (0.25 + 4 + 1)
    b = blue_pool(r, mu, form="ratio", tau=0.1)
    assert b[0].item() == pytest.approx(0.5 * 5 / 5.25, abs=1e-12)
    # i = 2: others 0, 1, 3: c = (1/0.5) / (1 + 0.25 + 1) ; b = 0.8 c
    assert b[2].item() == pytest.approx(0.8 * 2 / 2.25, abs=1e-12)
    torch.testing.assert_close(blue_pool(r, mu, form="none"), mu)


def test_blue_active_set_and_fallback():
    mu = torch.tensor([0.5, 0.01, 0.99, 0.5], dtype=D)
    r = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=D)
    b = blue_pool(r, mu, form="additive", tau=0.05, fallback="prior")
    # only rows 0 and 3 are active: b_0 = 0.5 + (0 - 0.5) = 0.0, b_3 = 0.5 + 0.5 = 1.0
    torch.testing.assert_close(b, torch.tensor([0.0, 0.01, 0.99, 1.0], dtype=D))
    b = blue_pool(r, mu, form="additive", tau=0.05, fallback="zero")
    torch.testing.assert_close(b, torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=D))
    # no other active row: drift 0 (additive), c = 1 (ratio)
    mu2 = torch.tensor([0.5, 0.001, 0.999], dtype=D)
    r2 = torch.tensor([1.0, 1.0, 0.0], dtype=D)
    assert blue_pool(r2, mu2, form="additive")[0].item() == pytest.approx(0.5)
    assert blue_pool(r2, mu2, form="ratio")[0].item() == pytest.approx(0.5)


@pytest.mark.parametrize("form", ["additive", "ratio", "none"])
def test_basis_prior_pooling_matches_reference_blue_pool(form):
    """basis_baseline with a prior, no features and no calibration is BLUE pooling around the smoothed prior."""
    g = torch.Generator().manual_seed(14)
    for B, tau, fallback, clip in ((9, 0.02, "prior", True), (12, 0.2, "zero", True), (7, 0.3, "prior", False),
                                   (2, 0.02, "prior", True), (1, 0.02, "zero", True)):
        r = torch.bernoulli(torch.full((B,), 0.5, dtype=D), generator=g) * 1.5  # rewards above 1: a wider clip
        p = torch.rand(B, dtype=D, generator=g) * 0.9 + 0.05
        b = basis_baseline(r, p, use_features=False, calibration="none", pooling=form, tau=tau, fallback=fallback,
                           clip=clip)
        want = blue_pool(r, smooth_prior(p), form=form, tau=tau, fallback=fallback, clip=clip)
        torch.testing.assert_close(b, want, rtol=0, atol=1e-12)


def test_calibration_recovers_shift_and_is_leave_one_out():
    g = torch.Generator().manual_seed(1)
    p = torch.rand(4000, dtype=D, generator=g) * 0.8 + 0.1
    r = torch.bernoulli(torch.sigmoid(torch.logit(p) + 1.0), generator=g)
    shift = calibrate_shift(r, p, prior_clip=0.01)
    assert shift.shape == (4000,)
    assert abs(shift.mean().item() - 1.0) < 0.25
    assert torch.equal(shift, calibrate(r, p, prior_clip=0.01)[0])  # the package's fit is the reference's
    whole, _ = calibrate(r, p, prior_clip=0.01, leave_one_out=False)
    assert torch.all(whole == whole[0])
    # row i's shift ignores r_i
    for i in (0, 7):
        r2 = r.clone()
        r2[i] = 1 - r2[i]
        assert calibrate_shift(r2, p, prior_clip=0.01)[i] == shift[i]
    s, a = calibrate(r, p, method="affine", prior_clip=0.01)
    assert abs(s.mean().item() - 1.0) < 0.4 and set(a.unique().tolist()) <= {0.5, 0.75, 1.0, 1.25, 1.5}
    s, a = calibrate(r, p, method="none")
    assert torch.all(s == 0) and torch.all(a == 1)
    mu = calibrated_values(torch.tensor([0.5, 0.0, 1.0]), shift=1.0)
    assert torch.isfinite(mu).all() and mu[0].item() == pytest.approx(torch.sigmoid(torch.tensor(1.0)).item())


@pytest.mark.parametrize("method", ["shift", "affine", "none"])
def test_basis_calibration_matches_reference(method):
    """basis_baseline with a prior only and no pooling is the calibrated prior, fitted leave-one-out per row."""
    g = torch.Generator().manual_seed(15)
    p = torch.rand(40, dtype=D, generator=g) * 0.8 + 0.1
    r = torch.bernoulli(torch.sigmoid(torch.logit(p) + 0.7), generator=g)
    for opts in (dict(), dict(calib_reg=2.0, prior_k=4, shift_grid=(-1.0, 0.0, 0.5, 1.0), scale_grid=(0.5, 2.0))):
        b = basis_baseline(r, p, use_features=False, calibration=method, pooling="none", **opts)
        s, a = calibrate(r, p, method=method, reg=opts.get("calib_reg", 0.0), prior_k=opts.get("prior_k"),
                         shift_grid=opts.get("shift_grid"), scale_grid=opts.get("scale_grid", (0.5, 0.75, 1.0, 1.25, 1.5)))
        torch.testing.assert_close(b, calibrated_values(p, s, a, prior_k=opts.get("prior_k")), rtol=0, atol=1e-12)


def test_smooth_prior():
    p = torch.tensor([0.0, 0.5, 1.0], dtype=D)
    torch.testing.assert_close(smooth_prior(p, clip=0.02), torch.tensor([0.02, 0.5, 0.98], dtype=D))
    torch.testing.assert_close(smooth_prior(p, clip=0.001, k=8), torch.tensor([0.5 / 9, 0.5, 8.5 / 9], dtype=D))
    with pytest.raises(ValueError, match="prior_clip"):
        smooth_prior(p, clip=0.0)


# ------------------------------------------------------------------------------------------------------------
# BASIS: the leave-one-out rule
# ------------------------------------------------------------------------------------------------------------

# Option combinations: every BASIS variant plus a covering list that hits every value of every option.
_COMBOS = [dict(v) for v in BASIS_VARIANTS.values()] + [
    dict(calibration=c, pooling=pl, fallback=fb, kernel=k, bandwidth=bw, shrink=sh, feature_norm=fn, clip=cl, tau=tau,
         combine=cb)
    for (c, pl, fb, k, bw, sh, fn, cl, tau, cb) in [
        ("shift", "additive", "prior", "exp", "cv", "cv", "center", True, 0.02, "residual"),
        ("affine", "ratio", "zero", "softmax", "cv", 2.0, "standardize", False, 0.1, "residual"),
        ("none", "none", "zero", "exp", 0.1, "cv", "none", True, 0.0, "residual"),
        ("shift", "ratio", "prior", "softmax", 0.3, 0.0, "center", False, 0.3, "toward_prior"),
        ("affine", "additive", "zero", "exp", "cv", 0.5, "none", False, 0.05, "residual"),
        ("none", "additive", "prior", "softmax", "cv", "cv", "standardize", True, 0.2, "residual"),
        ("affine", "none", "zero", "exp", 1.0, 8.0, "standardize", True, 0.05, "toward_prior"),
    ]
] + [dict(calib_reg=5.0, prior_k=8, prior_clip=0.01, empty_baseline=0.5, shift_grid=(-1.0, 0.0, 2.0),
          bandwidth_grid=(0.05, 2.0), shrink_grid=(0.0, 1.0))]

_INPUTS = list(itertools.product((False, True), (False, True)))  # (with prior, with features)


@pytest.mark.parametrize("opts", _COMBOS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults")
def test_baseline_ignores_own_reward(opts):
    for B, seed, binary in ((9, 0, True), (2, 1, True), (7, 2, False)):
        r, p, f = _batch(B, seed, binary)
        rows = sorted({0, 1, B // 2, B - 1})
        for use_p, use_f in _INPUTS:
            args = (p if use_p else None, f if use_f else None)
            b = basis_baseline(r, *args, **opts)
            assert b.shape == (B,) and torch.isfinite(b).all()
            for i in rows:
                r2 = r.clone()
                r2[i] = 1.0 - r2[i] if binary else r2[i] * 0.1 + 0.9
                b2 = basis_baseline(r2, *args, **opts)
                assert abs(b2[i].item() - b[i].item()) <= 1e-6, (use_p, use_f, B, i)


def test_baseline_ignores_own_reward_larger_batch():
    r, p, f = _batch(48, 5)
    b = basis_baseline(r, p, f)
    for i in range(0, 48, 5):
        r2 = r.clone()
        r2[i] = 1.0 - r2[i]
        assert basis_baseline(r2, p, f)[i].item() == b[i].item()  # bitwise, not just close


def test_compute_basis_groups_leave_one_out():
    g = torch.Generator().manual_seed(3)
    r = torch.bernoulli(torch.full((5, 3), 0.5, dtype=D), generator=g)
    p = torch.tensor([0.0, 0.3, 0.5, 1.0, 0.8], dtype=D)
    f = torch.randn(5, 4, dtype=D, generator=g)
    for prior, feats in ((None, None), (p, None), (None, f), (p, f)):
        adv, base = compute("basis", r, prior, feats)
        assert adv.shape == base.shape == (5, 3)
        torch.testing.assert_close(adv, r - base)
        for i, j in ((0, 0), (2, 1), (4, 2)):
            r2 = r.clone()
            r2[i, j] = 1 - r2[i, j]
            assert abs(compute("basis", r2, prior, feats)[1][i, j].item() - base[i, j].item()) <= 1e-6
    # with no prior and no features, basis over [B, G] is the leave-one-out mean over all B*G rollouts
    _, base = compute("basis", r)
    torch.testing.assert_close(base.reshape(-1), leave_one_out_mean(r.reshape(-1)))


# ------------------------------------------------------------------------------------------------------------
# BASIS: invariances, reductions, edge cases
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["default", "paper", "prior_shift_ratio", "features_cv", "features_softmax_cv",
                                  "prior_features_affine_cv", "prior_features_additive_cv"])
def test_permutation_equivariance(name):
    r, p, f = _batch(13, 4)
    perm = torch.randperm(13, generator=torch.Generator().manual_seed(0))
    b = basis_baseline(r, p, f, **BASIS_VARIANTS[name])
    bp = basis_baseline(r[perm], p[perm], f[perm], **BASIS_VARIANTS[name])
    torch.testing.assert_close(bp, b[perm], atol=1e-9, rtol=0)


@pytest.mark.parametrize("opts", [dict(v) for v in BASIS_VARIANTS.values()])
def test_finite_on_edge_cases(opts):
    cases = [
        (torch.tensor([1.0]), torch.tensor([1.0]), torch.randn(1, 3)),  # B == 1
        (torch.tensor([0.0]), torch.tensor([0.0]), torch.zeros(1, 3)),
        (torch.ones(6), torch.ones(6), torch.randn(6, 3)),  # all rewards and priors 1
        (torch.zeros(6), torch.zeros(6), torch.ones(6, 3)),  # all 0, identical features
        (torch.zeros(6), torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0]), torch.randn(6, 2)),
        (torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.randn(2, 5)),  # B == 2
    ]
    for r, p, f in cases:
        for args in ((None, None), (p, None), (None, f), (p, f)):
            b = basis_baseline(r, *args, **opts)
            assert b.shape == r.shape and b.dtype == r.dtype and torch.isfinite(b).all(), (r, args)


def test_batch_of_one_values():
    r = torch.tensor([1.0])
    assert basis_baseline(r).item() == 0.0  # no other prompt: empty_baseline (0.0, plain REINFORCE)
    assert basis_baseline(r, empty_baseline=0.5).item() == 0.5
    assert basis_baseline(r, features=torch.randn(1, 4)).item() == 0.0
    # with a prior, a batch of one keeps shift 0: the smoothed prior itself
    assert basis_baseline(r, torch.tensor([0.3])).item() == pytest.approx(0.3)
    assert basis_baseline(r, torch.tensor([1.0])).item() == pytest.approx(0.95)  # prior_clip default 0.05


def test_reduces_to_loo_batch_mean():
    r, p, f = _batch(11, 6)
    loo = (r.sum() - r) / 10
    torch.testing.assert_close(basis_baseline(r), loo)
    torch.testing.assert_close(basis_baseline(r, p, f, use_prior=False, use_features=False), loo)
    # all priors equal: every calibrated mu is equal, and the additive BLUE (and the ratio form) give the LOO mean
    peq = torch.full((11,), 0.3, dtype=D)
    for cal in ("shift", "affine", "none"):
        for form in ("additive", "ratio"):
            torch.testing.assert_close(basis_baseline(r, peq, pooling=form, calibration=cal), loo)
    # a huge bandwidth with no shrinkage: uniform kernel weights, i.e. the LOO mean again
    torch.testing.assert_close(basis_baseline(r, None, f, bandwidth=1e9, shrink=0.0), loo)


def test_cv_matches_brute_force():
    """Per-row bandwidth/shrinkage CV against a literal implementation (calibration off, raw cosine)."""
    hs, lams = (0.05, 0.3, 2.0), (0.5, 4.0)
    for kernel, pooling, use_prior in (("exp", "none", False), ("softmax", "none", True), ("exp", "additive", True),
                                       ("exp", "ratio", True)):
        r, p, f = _batch(8, 7)
        p = p.clamp(0.2, 0.8)
        opts = dict(calibration="none", feature_norm="none", kernel=kernel, pooling=pooling, tau=0.0,
                    combine="residual")
        prior = p if use_prior else None
        fast = basis_baseline(r, prior, f, bandwidth="cv", bandwidth_grid=hs, shrink="cv", shrink_grid=lams, **opts)
        for i in range(8):
            keep = torch.arange(8) != i
            best, best_err = None, math.inf
            for h, lam in itertools.product(hs, lams):
                # predictions for every j != i computed without r_i (and, leave-one-out inside, without r_j)
                pred = basis_baseline(r[keep], None if prior is None else prior[keep], f[keep], bandwidth=h,
                                      shrink=lam, **opts)
                err = ((r[keep] - pred) ** 2).sum().item()
                if err < best_err - 1e-12:
                    best, best_err = (h, lam), err
            full = basis_baseline(r, prior, f, bandwidth=best[0], shrink=best[1], **opts)
            assert fast[i].item() == pytest.approx(full[i].item(), abs=1e-9), (kernel, pooling, i)


def test_cosine_similarity_normalisation():
    g = torch.Generator().manual_seed(10)
    f = torch.randn(9, 5, dtype=D, generator=g)
    # "center": a direction shared by every row (common offset) does not count as similarity
    torch.testing.assert_close(cosine_similarity(f + 50.0), cosine_similarity(f))
    assert cosine_similarity(f + 50.0, "none").min() > 0.99
    # "standardize": per-column scale does not matter either
    scaled = f * torch.tensor([1.0, 100.0, 0.01, 1.0, 3.0], dtype=D)
    torch.testing.assert_close(cosine_similarity(scaled, "standardize"), cosine_similarity(f, "standardize"))
    c = cosine_similarity(f)
    torch.testing.assert_close(c.diagonal(), torch.ones(9, dtype=D))
    torch.testing.assert_close(c, c.T)


def test_similarity_pool_formula():
    r, _, f = _batch(6, 8)
    cos = cosine_similarity(f)
    k = torch.exp((cos - 1) / 0.3)
    k.fill_diagonal_(0)
    loo = (r.sum() - r) / 5
    expect = (k @ r + 2.0 * loo) / (k.sum(1) + 2.0)
    torch.testing.assert_close(similarity_pool(r, f, bandwidth=0.3, shrink=2.0), expect)
    torch.testing.assert_close(basis_baseline(r, None, f, bandwidth=0.3, shrink=2.0), expect)
    # softmax kernel: weighted mean with the Kish effective count
    w = k / k.sum(1, keepdim=True)
    ess = 1 / (w**2).sum(1)
    expect = (ess * (w @ r) + 2.0 * loo) / (ess + 2.0)
    torch.testing.assert_close(similarity_pool(r, f, bandwidth=0.3, shrink=2.0, kernel="softmax"), expect)


def test_prior_and_features_pool_calibrated_residuals():
    r, p, f = _batch(7, 9)
    opts = dict(calibration="none", bandwidth=0.5, shrink=1.0, pooling="none", tau=0.0, combine="residual")
    mu = smooth_prior(p)
    e = r - mu
    k = torch.exp((cosine_similarity(f) - 1) / 0.5)
    k.fill_diagonal_(0)
    expect = (mu + (k @ e) / (k.sum(1) + 1.0)).clamp(0, 1)
    torch.testing.assert_close(basis_baseline(r, p, f, **opts), expect)


def test_clip_range_and_rewards_outside_unit_interval():
    r, p, f = _batch(10, 13)
    b = basis_baseline(r, p, f)
    assert (b >= 0).all() and (b <= 1).all()
    # a format bonus pushes rewards above 1: the clip range widens to the OTHER rewards' range, leave-one-out
    r2 = r * 1.5
    b2 = basis_baseline(r2, None, None)
    torch.testing.assert_close(b2, (r2.sum() - r2) / 9)
    for opts in ({}, dict(pooling="additive"), dict(bandwidth=0.1, shrink=0.5)):
        b2 = basis_baseline(r2, p, f, **opts)
        assert (b2 <= 1.5).all() and (b2 >= 0).all()
        for i in (0, 4):
            r3 = r2.clone()
            r3[i] = 7.0  # a huge own reward must neither move nor widen its own clip range
            assert basis_baseline(r3, p, f, **opts)[i].item() == b2[i].item()
    # a binding clip: row 0's neighbours beat their priors by 1.45, so mu_0 + 1.45 = 2.4 is clipped to max_{j != 0} r_j
    r4 = torch.tensor([0.0, 1.5, 1.5, 1.5], dtype=D)
    p4 = torch.tensor([0.95, 0.05, 0.05, 0.05], dtype=D)
    f4 = torch.ones(4, 3, dtype=D)
    opts = dict(calibration="none", tau=0.0, bandwidth=1.0, shrink=0.0, combine="residual")
    assert basis_baseline(r4, p4, f4, **opts)[0].item() == pytest.approx(1.5)
    r4[0] = 7.0
    assert basis_baseline(r4, p4, f4, **opts)[0].item() == pytest.approx(1.5)
    assert basis_baseline(r4, p4, f4, **opts, clip=False)[0].item() == pytest.approx(2.4)


def test_features_make_similar_prompts_share():
    # two clusters of identical prompts; within a cluster all rewards equal: the baseline follows the cluster
    r = torch.tensor([1.0] * 5 + [0.0] * 5, dtype=D)
    f = torch.cat([torch.tensor([[1.0, 0.0]]).repeat(5, 1), torch.tensor([[0.0, 1.0]]).repeat(5, 1)])
    b = basis_baseline(r, None, f)
    assert (b[:5] > 0.8).all() and (b[5:] < 0.2).all()


# ------------------------------------------------------------------------------------------------------------
# simulations: value MSE against the batch mean
# ------------------------------------------------------------------------------------------------------------


def test_simulation_prior_beats_batch_mean():
    g = torch.Generator().manual_seed(11)
    mse_basis = mse_mean = 0.0
    for _ in range(25):
        v0 = torch.distributions.Beta(torch.tensor(0.7, dtype=D), torch.tensor(1.0, dtype=D)).sample((64,))
        prior = torch.binomial(torch.full((64,), 8.0, dtype=D), v0, generator=g) / 8  # K = 8 reference samples
        v = torch.sigmoid(torch.logit(v0.clamp(1e-4, 1 - 1e-4)) + 0.8)  # the policy drifted from the reference
        r = torch.bernoulli(v, generator=g)
        mse_basis += ((basis_baseline(r, prior) - v) ** 2).mean().item()
        mse_mean += ((r.mean() - v) ** 2).mean().item()
    assert mse_basis < 0.6 * mse_mean, (mse_basis, mse_mean)


def test_simulation_features_beat_batch_mean():
    g = torch.Generator().manual_seed(12)
    mse_sim = mse_mean = 0.0
    for _ in range(25):
        cluster = torch.randint(0, 8, (64,), generator=g)
        values = torch.rand(8, dtype=D, generator=g)  # prompts of a cluster share one value
        centers = torch.randn(8, 16, dtype=D, generator=g)
        f = centers[cluster] + 0.5 * torch.randn(64, 16, dtype=D, generator=g) + 2.0
        v = values[cluster]
        r = torch.bernoulli(v, generator=g)
        mse_sim += ((basis_baseline(r, None, f) - v) ** 2).mean().item()
        mse_mean += ((r.mean() - v) ** 2).mean().item()
    assert mse_sim < 0.7 * mse_mean, (mse_sim, mse_mean)


# ------------------------------------------------------------------------------------------------------------
# the registry's one interface, explained_variance, option errors
# ------------------------------------------------------------------------------------------------------------


def test_compute_names_and_values():
    r = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]], dtype=D)
    adv, base = compute("reinforce_pp", r)
    torch.testing.assert_close(base, torch.full_like(r, 0.5))
    torch.testing.assert_close(adv, reinforce_pp_advantages(r.reshape(-1)).reshape(2, 4))
    adv, base = compute("grpo", r)
    torch.testing.assert_close(adv, grpo_advantages(r))
    torch.testing.assert_close(base, group_mean_baseline(r))
    adv, base = compute("dr_grpo", r)
    torch.testing.assert_close(adv, r - base)
    adv, base = compute("rloo", r)
    torch.testing.assert_close(base, rloo_baseline(r))
    adv, _ = compute("rloo", r, normalize=True)
    assert adv.std().item() == pytest.approx(1.0, abs=1e-4)
    for name in estimator_names():
        adv, base = compute(name, r, torch.tensor([0.5, 0.2]), torch.randn(2, 3))
        assert adv.shape == base.shape == (2, 4) and torch.isfinite(adv).all()


def test_compute_errors():
    r = torch.zeros(4, 2)
    with pytest.raises(ValueError, match=r"'ppo'.*basis, reinforce_pp, grpo, dr_grpo, rloo"):
        compute("ppo", r)
    with pytest.raises(ValueError, match=r"\[B, G\].*\(4,\)"):
        compute("basis", torch.zeros(4))
    with pytest.raises(ValueError, match=r"\(2, 2, 2\)"):
        compute("grpo", torch.zeros(2, 2, 2))
    with pytest.raises(ValueError, match=r"prior must have shape \[B\] = \[4\].*\(3,\)"):
        compute("basis", r, prior=torch.zeros(3))
    with pytest.raises(ValueError, match=r"features must have shape \[B, D\] = \[4, D\].*\(5, 3\)"):
        compute("basis", r, features=torch.zeros(5, 3))
    with pytest.raises(ConfigError, match=r"estimator\.options: rloo takes no options; got \['bandwidth'\]"):
        compute("rloo", r, bandwidth=0.3)
    with pytest.raises(ValueError, match=r"3 prompt ids for rewards of shape \(4, 2\)"):
        get_estimator("rloo").compute(r, EstimatorContext(prompt_ids=["a", "b", "c"]))


def test_basis_option_errors():
    r = torch.zeros(4)
    with pytest.raises(ConfigError, match=r"estimator\.options\.bandwith: .*accepted options: bandwidth, "):
        basis_baseline(r, bandwith=0.3)
    with pytest.raises(ConfigError, match=r"estimator\.options\.pooling: 'blue' .*none, additive, ratio"):
        basis_baseline(r, pooling="blue")
    with pytest.raises(ConfigError, match=r"estimator\.options\.calibration: 'temp'"):
        basis_baseline(r, calibration="temp")
    with pytest.raises(ConfigError, match=r"estimator\.options\.bandwidth: -1 .*positive number or 'cv'"):
        basis_baseline(r, bandwidth=-1)
    with pytest.raises(ValueError, match=r"prior must have shape \(4,\)"):
        basis_baseline(r, torch.zeros(3))
    with pytest.raises(ValueError, match=r"prior values must lie in \[0, 1\]"):
        basis_baseline(r, torch.full((4,), 1.5))
    with pytest.raises(ValueError, match=r"features must have shape \[4, D\]"):
        basis_baseline(r, None, torch.zeros(4))
    with pytest.raises(ValueError, match=r"rewards must be a 1-D"):
        basis_baseline(torch.zeros(2, 2))
    assert set(BASIS_DEFAULTS) >= {"calibration", "pooling", "tau", "fallback", "bandwidth", "shrink", "kernel"}


def test_explained_variance():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0])
    assert explained_variance(r, r) == pytest.approx(1.0)
    assert explained_variance(r, torch.full_like(r, 0.3)) == pytest.approx(0.0)
    assert explained_variance(r, 1 - r) == pytest.approx(-3.0)  # Var(2r - 1) = 4 Var(r)
    assert math.isnan(explained_variance(torch.ones(4), torch.zeros(4)))


def test_toward_prior_is_the_kernel_mean_of_the_others_shrunk_to_the_prior():
    """combine='toward_prior' by hand: b_i = (sum_{j != i} k_ij r_j + lambda mu_i) / (S_i + lambda)."""
    r, p, f = _batch(9, 11)
    p = p.clamp(0.2, 0.8)
    b = basis_baseline(r, p, f, calibration="none", feature_norm="none", bandwidth=0.5, shrink=3.0, clip=False,
                       combine="toward_prior")
    rd, pd, fd = r.double(), p.double(), f.double()
    fn = fd / fd.norm(dim=1, keepdim=True)
    cos = fn @ fn.T
    for i in range(9):
        k = torch.exp((cos[i] - 1.0) / 0.5)
        k[i] = 0.0
        want = ((k * rd).sum() + 3.0 * pd[i]) / (k.sum() + 3.0)
        assert b[i].item() == pytest.approx(want.item(), rel=1e-9, abs=1e-12)
    with pytest.raises(ValueError, match="toward_prior"):
        basis_baseline(r, p, f, bandwidth="cv")


# ------------------------------------------------------------------------------------------------------------
# the registry: every name against its formula, the specs, options checked when a config loads
# ------------------------------------------------------------------------------------------------------------


def _formula(name, r, prior, feats):
    """(advantages, baselines) of each estimator written out from its definition."""
    B, G = r.shape
    if name == "reinforce_pp":  # whitening over all B*G rewards; baseline = batch mean
        m, sd = r.mean(), r.reshape(-1).std() if r.numel() > 1 else torch.tensor(0.0, dtype=r.dtype)
        return (r - m) / (sd + 1e-6), m.expand(B, G)
    if name in ("grpo", "dr_grpo"):  # group mean (0 for a group of one); grpo divides by the group std (1 for G = 1)
        m = r.mean(1, keepdim=True) if G > 1 else torch.zeros(B, 1, dtype=r.dtype)
        sd = r.std(1, keepdim=True) if G > 1 else torch.ones(B, 1, dtype=r.dtype)
        return ((r - m) / (sd + 1e-6) if name == "grpo" else r - m), m.expand(B, G)
    if name in ("rloo", "poise"):  # mean of the other G - 1 rollouts (0 for G = 1); poise without a warm probe
        base = (r.sum(1, keepdim=True) - r) / (G - 1) if G > 1 else torch.zeros_like(r)
        return r - base, base
    if name == "basis_probe":  # without a replay buffer: no probe, no prior (the offline prior is not read)
        prior = None
    if name in ("basis", "basis_probe"):  # every rollout a row, its prompt's prior and features repeated
        rows = basis_baseline(r.reshape(-1), None if prior is None else prior.repeat_interleave(G),
                              None if feats is None else feats.repeat_interleave(G, dim=0))
        base = rows.reshape(B, G)
        return r - base, base
    if name == "astar":  # V* = 0.5 log mean_k exp(r_k / 0.5) of the prompt's reference rewards
        table = reference_table(B)
        v = torch.tensor([0.5 * math.log(sum(math.exp(x / 0.5) for x in table["rewards"][f"p{i}"]) / table["k"])
                          for i in range(B)], dtype=r.dtype)
        base = v[:, None].expand(B, G)
        return r - base, base
    if name == "spo":  # the Beta tracker at its start: N0 (s + 1/2) / (K + 1) over N0, whitened r - v
        table = reference_table(B)
        v = torch.tensor([(table["counts"][f"p{i}"] + 0.5) / (table["k"] + 1) for i in range(B)], dtype=r.dtype)
        base = v[:, None].expand(B, G)
        a = r - base
        return ((a - a.mean()) / (a.std() + 1e-6) if a.numel() > 1 else a), base
    raise AssertionError(f"no reference formula for the registered estimator {name!r}: add one here")


@pytest.mark.parametrize("name", estimator_names())
def test_registry_compute_matches_the_formulas(name):
    spec = get_estimator(name)
    g = torch.Generator().manual_seed(16)
    for B, G in ((6, 1), (5, 3), (1, 2)):
        if G < spec.min_rollouts:
            continue
        r = torch.bernoulli(torch.full((B, G), 0.5, dtype=D), generator=g)
        prior, feats = torch.rand(B, dtype=D, generator=g), torch.randn(B, 4, dtype=D, generator=g)
        for side in ((None, None), (prior, None), (None, feats), (prior, feats)):
            for normalize in (False, True):
                adv, base = compute(name, r, *side, normalize=normalize)
                want_adv, want_base = _formula(name, r, *side)
                if normalize and not spec.whitened and want_adv.numel() > 1:  # reinforce_pp, spo: whitened already
                    want_adv = want_adv / (want_adv.std() + 1e-6)
                torch.testing.assert_close(base, want_base, rtol=1e-9, atol=1e-12)
                torch.testing.assert_close(adv, want_adv, rtol=1e-9, atol=1e-9)
                assert adv.shape == base.shape == (B, G)


def test_registry_specs():
    assert estimator_names() == ("basis", "reinforce_pp", "grpo", "dr_grpo", "rloo", "basis_probe", "poise",
                                 "astar", "spo")
    want = {"basis": (1, True, True, True), "reinforce_pp": (1, False, False, False),
            "grpo": (2, False, False, False), "dr_grpo": (2, False, False, False), "rloo": (2, False, False, False),
            "basis_probe": (1, True, False, True), "poise": (2, True, False, False),
            "astar": (1, False, False, False), "spo": (1, False, False, False)}
    for name, (g, feats, prior, hist) in want.items():
        spec = get_estimator(name)
        assert (spec.name, spec.min_rollouts, spec.uses_features, spec.uses_prior, spec.uses_history) == \
            (name, g, feats, prior, hist)
        assert spec.description
    # the docs say which baselines include the rollout's own reward
    for name in ("reinforce_pp", "grpo", "dr_grpo", "spo"):
        assert "includes r_i" in get_estimator(name).description
    for name in ("basis", "rloo", "basis_probe", "poise", "astar"):
        assert "never uses r_i" in get_estimator(name).description
    with pytest.raises(ConfigError, match=r"estimator\.name: 'ppo' .*basis, reinforce_pp, grpo, dr_grpo, rloo, "
                                          r"basis_probe, poise"):
        get_estimator("ppo")
    with pytest.raises(ValueError, match="already registered"):
        register(EstimatorSpec("rloo", min_rollouts=2, fn=lambda r, ctx: (r, r)))
    assert get_estimator("basis").validate_options({"bandwidth": "1e-1"}) == {"bandwidth": 0.1}
    assert get_estimator("grpo").validate_options({}) == {}


def test_a_registered_estimator_is_usable_by_name():
    """A new estimator needs no change anywhere else: the config accepts its name, compute runs its function."""
    from basis_lite.estimators import _REGISTRY

    def half(rewards, ctx):
        base = torch.full_like(rewards, 0.5)
        return rewards - base, base

    register(EstimatorSpec("test_half", min_rollouts=3, fn=half, description="b = 1/2"))
    try:
        cfg = load_config("smoke", ["estimator.name=test_half", "estimator.rollouts_per_prompt=3"])
        assert cfg.estimator.name == "test_half"
        with pytest.raises(ConfigError, match=r"rollouts_per_prompt >= 3 \(got 2\); use basis or reinforce_pp or "
                                              r"grpo or dr_grpo or rloo or basis_probe or poise or astar or spo for 2 "
                                              r"rollouts"):
            load_config("smoke", ["estimator.name=test_half", "estimator.rollouts_per_prompt=2"])
        r = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]], dtype=D)
        adv, base = compute("test_half", r)
        assert torch.equal(base, torch.full((2, 3), 0.5, dtype=D)) and torch.equal(adv, r - 0.5)
        adv, _ = compute("test_half", r, normalize=True)  # normalize applies to every estimator the same way
        torch.testing.assert_close(adv, (r - 0.5) / ((r - 0.5).std() + 1e-6))
    finally:
        _REGISTRY.pop("test_half")


def test_normalize_setting_resolves_per_estimator():
    """estimator.normalize: auto (the default) divides basis's advantages by the batch std and leaves the other
    estimators' as they are; true / false are read as always / never; anything else names the accepted values."""
    assert load_config("smoke", []).estimator.normalize == "auto"
    assert load_config("smoke", ["estimator.normalize=true"]).estimator.normalize == "always"
    assert load_config("smoke", ["estimator.normalize=false"]).estimator.normalize == "never"
    with pytest.raises(ConfigError, match=r"estimator\.normalize.*'sometimes'.*auto, always, never"):
        load_config("smoke", ["estimator.normalize=sometimes"])
    auto_on = {n for n in estimator_names() if get_estimator(n).normalizes("auto")}
    assert auto_on == {"basis"}
    for name in estimator_names():
        spec = get_estimator(name)
        assert spec.normalizes("always") and spec.normalizes(True)
        assert not spec.normalizes("never") and not spec.normalizes(False)


def test_trainer_applies_the_resolved_normalize_setting(tmp_path):
    """The trainer passes estimator.normalize resolved for the run's estimator: basis under auto logs advantages of
    unit std (rewards vary on the smoke preset's character-sum reward); with never they keep the rewards' scale."""
    from conftest import VARIED, step_records, train_smoke

    stds = {}
    for setting in ("auto", "never"):
        run = train_smoke(tmp_path / setting, *VARIED, "train.steps=2", f"estimator.normalize={setting}",
                          one_thread=True)
        stds[setting] = [r["advantage_std"] for r in step_records(run)]
    assert all(s == pytest.approx(1.0, abs=1e-3) for s in stds["auto"]), stds
    assert all(0.0 < s < 0.9 for s in stds["never"]), stds


@pytest.mark.parametrize("overrides,match", [
    (["estimator.options={bandwith: 0.3}"], r"estimator\.options\.bandwith: .*accepted options: bandwidth, "),
    (["estimator.options={bandwidth: -1}"], r"estimator\.options\.bandwidth: -1 is not accepted; expected a positive "
                                            r"number or 'cv'"),
    (["estimator.options={pooling: blue}"], r"estimator\.options\.pooling: 'blue' .*none, additive, ratio"),
    (["estimator.options={tau: 0.7}"], r"estimator\.options\.tau: 0\.7 .*\[0, 0\.5\)"),
    (["estimator.options={use_prior: maybe}"], r"estimator\.options\.use_prior: 'maybe' .*true or false"),
    (["estimator.options={shrink_grid: [1, -2]}"], r"estimator\.options\.shrink_grid: -2 .*numbers >= 0"),
    (["estimator.options={bandwidth: abc}"], r"estimator\.options\.bandwidth: 'abc' .*positive number or 'cv'"),
    (["estimator.name=reinforce_pp", "estimator.options={bandwidth: 0.3}"],
     r"estimator\.options: reinforce_pp takes no options; got \['bandwidth'\]"),
    (["estimator.name=grpo", "estimator.rollouts_per_prompt=4", "estimator.options={shrink: 2}"],
     r"estimator\.options: grpo takes no options; got \['shrink'\]"),
])
def test_config_rejects_bad_estimator_options_at_load(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("smoke", overrides)


def test_config_accepts_and_normalises_good_estimator_options():
    cfg = load_config("smoke", ["estimator.options={bandwidth: cv, shrink: 1e-1, pooling: ratio, combine: residual}"])
    assert cfg.estimator.options == {"bandwidth": "cv", "shrink": 0.1, "pooling": "ratio", "combine": "residual"}
    r = torch.bernoulli(torch.full((6, 1), 0.5, dtype=D), generator=torch.Generator().manual_seed(17))
    compute("basis", r, torch.rand(6, dtype=D), torch.randn(6, 3, dtype=D), **cfg.estimator.options)


def test_registry_and_config_load_without_torch():
    code = ("import sys; from basis_lite.config import load_config; "
            "from basis_lite.estimators import get_estimator, estimator_names; "
            "load_config('smoke', ['estimator.options={bandwidth: 0.5}']); "
            "[get_estimator(n).validate_options({}) for n in estimator_names()]; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------------------------------------------------
# BASIS mix (basis_mix.py): parts that leave r_i out, weighted by earlier batches
# ------------------------------------------------------------------------------------------------------------


def _mix_history(options, steps=6, B=8, seed=0):
    """A BasisState and replay buffer after `steps` earlier batches over a pool of 12 prompts whose success rate
    follows their first feature, and the next batch: (state, replay, ids, rewards [B], features [B, D])."""
    from basis_lite.estimators.basis_mix import make_state
    from basis_lite.estimators.probe import ReplayBuffer

    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(12, 5, dtype=D, generator=g)
    rate = torch.sigmoid(2 * feats[:, 0])
    state, buf = make_state({"mix": True, **options}), ReplayBuffer(4096)
    ctx_opts = {"mix": True, **options}

    def batch():
        idx = torch.randint(0, 12, (B,), generator=g)
        idx[1] = idx[0]  # the same prompt twice in a batch
        return [f"p{int(i)}" for i in idx], torch.bernoulli(rate[idx], generator=g), feats[idx]

    for step in range(steps):
        ids, r, f = batch()
        ctx = EstimatorContext(prompt_ids=ids, features=f, replay=buf, options=ctx_opts, state=state)
        get_estimator("basis").compute(r[:, None], ctx)
        state.observe(step, ids, r[:, None])
        buf.add(step, ids, r[:, None], f)
    ids, r, f = batch()
    return state, buf, ids, r, f


_MIX_COMBOS = [{}, {"mix_parts": ["tracker"]}, {"mix_parts": ["probe", "pool"], "mix_memory": 1.0},
               {"mix_rate": 0.05, "tracker_decay": 0.5, "tracker_prior_count": 8, "probe_min_rows": 2},
               {"combine": "residual", "bandwidth": "cv", "shrink": "cv"}]


@pytest.mark.parametrize("opts", _MIX_COMBOS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults")
def test_mix_baseline_ignores_own_reward(opts):
    """Every part and the weights of the mix leave r_i out: flipping r_i moves no b_i, with or without an offline
    prior, with a warm probe and a tracker that has seen the batch's prompts (one of them twice in the batch)."""
    state, buf, ids, r, f = _mix_history({**opts, "probe_min_rows": opts.get("probe_min_rows", 8)})
    assert len(state.tracker.table) > 0 and buf.rows >= 8
    assert len({round(v, 9) for v in state.loss.values()}) > 1  # the weights are no longer equal
    prior = torch.rand(len(ids), dtype=D, generator=torch.Generator().manual_seed(1))
    for p in (None, prior):
        def run(rr):
            ctx = EstimatorContext(prompt_ids=ids, prior=p, features=f, replay=buf, state=state,
                                   options={"mix": True, **opts, "probe_min_rows": opts.get("probe_min_rows", 8)})
            return get_estimator("basis").compute(rr[:, None], ctx)[1][:, 0]

        b = run(r)
        assert torch.isfinite(b).all() and ((b >= 0) & (b <= 1)).all()
        for i in range(len(ids)):
            r2 = r.clone()
            r2[i] = 1.0 - r2[i]
            assert abs(run(r2)[i].item() - b[i].item()) <= 1e-9, (p is None, i)


def test_mix_parts_are_used_and_weights_follow_earlier_errors():
    from basis_lite.estimators.basis_mix import basis_mix

    state, buf, ids, r, f = _mix_history({"probe_min_rows": 8})
    ctx = EstimatorContext(prompt_ids=ids, features=f, replay=buf, options={"mix": True, "probe_min_rows": 8},
                           state=state)
    _, base = basis_mix(r[:, None], ctx, state)
    parts = state.pending
    assert set(parts) == {"loo", "pool", "probe", "tracker"}
    w = state.mix_weights()
    lo = min(state.loss.values())
    for p in parts:  # w_k proportional to exp(-rate * L_k)
        assert w[p] == pytest.approx(math.exp(-0.5 * (state.loss[p] - lo)) / sum(
            math.exp(-0.5 * (v - lo)) for v in state.loss.values()))
    torch.testing.assert_close(base, sum(w[p] * parts[p] for p in parts))
    torch.testing.assert_close(parts["loo"][:, 0], leave_one_out_mean(r))
    # the tracker part's prior: decayed own successes plus the probe's guess worth tracker_prior_count rollouts
    s, n = state.tracker.counts(ids)
    assert n.max() > 0
    assert not torch.allclose(parts["tracker"], parts["pool"])
    assert state.metrics() == {f"mix_weight_{p}": w[p] for p in parts}


def test_mix_stays_within_the_regret_bound_of_the_leave_one_out_mean():
    """Exponential weights on squared error (rate <= 1/2, memory 1): whatever the parts do, the mix's total squared
    error is at most the leave-one-out mean's plus log(parts) / rate. Here the features point the wrong way
    (prompts that look alike have opposite success rates), so pooling by them hurts."""
    from basis_lite.estimators.basis_mix import make_state

    g = torch.Generator().manual_seed(7)
    opts = {"mix": True, "mix_memory": 1.0, "mix_parts": ["pool"], "bandwidth": 0.05, "shrink": 0.0}
    state = make_state(opts)
    err_mix = err_loo = err_pool = 0.0
    for step in range(40):
        x = torch.randn(16, 3, dtype=D, generator=g)
        r = torch.bernoulli(torch.sigmoid(4 * x[:, 0]), generator=g)
        f = x.clone()
        f[:, 0] = -x[:, 0] + 3 * torch.sign(x[:, 0]) * (step % 2)  # misleading on alternate steps
        ids = [f"s{step}-{i}" for i in range(16)]
        ctx = EstimatorContext(prompt_ids=ids, features=f, options=opts, state=state)
        _, base = get_estimator("basis").compute(r[:, None], ctx)
        err_mix += float(((r - base[:, 0]) ** 2).sum())
        err_loo += float(((r - state.pending["loo"][:, 0]) ** 2).sum())
        err_pool += float(((r - state.pending["pool"][:, 0]) ** 2).sum())
        state.observe(step, ids, r[:, None])
    assert err_mix <= min(err_loo, err_pool) + math.log(2) / 0.5 + 1e-9


def test_value_tracker_counts_by_hand_and_state_round_trips_exactly():
    import json

    from basis_lite.estimators.basis_mix import ValueTracker, make_state

    t = ValueTracker(decay=0.5, prior_count=2.0)
    t.observe(["a", "b"], torch.tensor([[1.0], [0.0]]))
    t.observe(["a"], torch.tensor([[1.0]]))
    t.observe(["c"], torch.tensor([[0.0]]))
    # a: 1 * 0.5 + 1 = 1.5 successes at t=1, read at t=3: * 0.25; b: 1 failure at t=0, read at t=3: * 0.125
    s, n = t.counts(["a", "b", "c", "new"])
    torch.testing.assert_close(s, torch.tensor([0.375, 0.0, 0.0, 0.0], dtype=D))
    torch.testing.assert_close(n, torch.tensor([0.375, 0.125, 0.5, 0.0], dtype=D))
    v = t.value(["a", "new"], torch.tensor([0.2, 0.2], dtype=D))
    torch.testing.assert_close(v, torch.tensor([(0.375 + 0.4) / 2.375, 0.2], dtype=D))
    state, buf, ids, r, f = _mix_history({"probe_min_rows": 8})
    again = make_state({"mix": True, "probe_min_rows": 8})
    again.load_state_dict(json.loads(json.dumps(state.state_dict())))  # the checkpoint stores it as JSON
    assert again.state_dict() == state.state_dict()
    outs = []
    for st in (state, again):
        ctx = EstimatorContext(prompt_ids=ids, features=f, replay=buf, options={"mix": True, "probe_min_rows": 8},
                               state=st)
        outs.append(get_estimator("basis").compute(r[:, None], ctx)[1])
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="mix_parts"):
        make_state({"mix": True, "mix_parts": ["pool"]}).load_state_dict(state.state_dict())


@pytest.mark.parametrize("options,match", [
    ({"mix": "yes"}, r"estimator\.options\.mix: 'yes'.*true or false"),
    ({"mix": True, "mix_parts": ["pool", "oracle"]}, r"mix_parts.*loo, pool, probe, tracker"),
    ({"mix": True, "mix_rate": 0}, r"mix_rate: 0 .*> 0"),
    ({"mix": True, "mix_memory": 1.5}, r"mix_memory.*\[0, 1\]"),
    ({"mix": True, "tracker_decay": 0}, r"tracker_decay.*\(0, 1\]"),
    ({"mix": True, "probe_min_rows": 1}, r"probe_min_rows.*>= 2"),
    ({"mix": True, "bandwidth": "cv"}, r"cannot be combined with mix"),
])
def test_mix_option_errors(options, match):
    with pytest.raises(ConfigError, match=match):
        get_estimator("basis").validate_options(options)
    assert get_estimator("basis").replay_capacity({"mix": True}) == 4096
    assert get_estimator("basis").replay_capacity({"mix": True, "mix_parts": ["pool"]}) is None
    assert get_estimator("basis").replay_capacity({}) is None and get_estimator("basis").make_state({}) is None
