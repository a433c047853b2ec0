"""The online value probe (estimators/probe.py) and the estimators built on it (estimators/poise.py): ``poise``
(cross-rollout baselines) and ``basis_probe`` (BASIS with the probe as its prior).

The property that keeps the policy gradient unbiased is checked directly: a rollout's baseline does not move when
its own reward and its own trajectory features change, for every option; for ``basis_probe`` a prompt's baseline
does not move with its own reward. The probe is checked against brute force (ridge normal equations, refits with a
group left out), the buffer against its capacity and a weights-only round trip, and a simulation shows the probe
recovering values that RLOO's single sibling reward only sees through noise.
"""
from __future__ import annotations

import io
import itertools
import json

import pytest
import torch

from basis_lite.config import load_config
from basis_lite.engines.trajectory import N_STATS
from basis_lite.errors import ConfigError
from basis_lite.estimators import EstimatorContext, get_estimator
from basis_lite.estimators.base import leave_one_out_mean
from basis_lite.estimators.basis import basis_baseline
from basis_lite.estimators.poise import fit_poise_probe, fit_prompt_probe, probe_prior
from basis_lite.estimators.probe import ReplayBuffer, blocks_of, fit_probe
from basis_lite.estimators.probe_options import PoiseOptions, poise_options, split_basis_probe

D = torch.float64
HP, HT = 6, 5  # prompt / trajectory hidden sizes of the synthetic data


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _world(B, G, seed):
    """A synthetic step: prompts with a value v_i, prompt features that carry part of it, trajectories whose hidden
    state carries v_i plus noise, and rewards ~ Bernoulli(v_i)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.rand(B, generator=g, dtype=D) * 0.8 + 0.1
    pf = torch.randn(B, HP, generator=g, dtype=D)
    pf[:, 0] = 2 * v
    hid = torch.randn(B, G, HT, generator=g, dtype=D)
    hid[..., 0] = 3 * v[:, None] + 0.3 * torch.randn(B, G, generator=g, dtype=D)
    stats = torch.randn(B, G, N_STATS, generator=g, dtype=D)
    r = torch.bernoulli(v[:, None].expand(B, G), generator=g)
    return v, pf.float(), torch.cat([hid, stats], -1).float(), r.float()


def _buffer(steps=6, B=12, G=2, capacity=4096, seed=0):
    buf = ReplayBuffer(capacity)
    for s in range(steps):
        _, pf, tr, r = _world(B, G, seed * 100 + s)
        buf.add(s + 1, [f"s{s}p{i}" for i in range(B)], r, pf, tr)
    return buf


def _ctx(B, pf, tr, buf, options, history=None, ids=None):
    return EstimatorContext(prompt_ids=ids or [f"q{i}" for i in range(B)], features=pf, trajectory_features=tr,
                            replay=buf, options=options, history=history)


POISE_OPTIONS = [
    {},
    {"features": ["hidden", "stats"]},
    {"features": ["prompt", "hidden", "stats", "reward"]},
    {"target": "own"},
    {"ridge": "cv"},
    {"probe": "logistic", "ridge": 1.0},
    {"pca_prompt": 0, "pca_hidden": 0},
    {"pca_prompt": 2, "pca_hidden": 3, "recenter": True},
    {"recenter": True, "features": ["prompt", "hidden", "stats", "reward"], "ridge": "cv"},
    {"clip": False},
]


@pytest.mark.parametrize("opts", POISE_OPTIONS)
@pytest.mark.parametrize("G", [2, 3])
def test_poise_baseline_ignores_its_own_reward_and_trajectory(opts, G):
    opts = {"min_rows": 16, **opts}
    spec = get_estimator("poise")
    buf = _buffer(G=G)
    B = 7
    _, pf, tr, r = _world(B, G, 99)
    _, base = spec.compute(r, _ctx(B, pf, tr, buf, opts))
    assert not torch.allclose(base, leave_one_out_mean(r, 1))  # the probe is in use, not the RLOO fallback
    for i, g in itertools.product(range(B), range(G)):
        r2, tr2 = r.clone(), tr.clone()
        r2[i, g] = 1.0 - r2[i, g]
        tr2[i, g] = torch.randn(tr.shape[-1], generator=torch.Generator().manual_seed(i * 10 + g)) * 5
        adv2, base2 = spec.compute(r2, _ctx(B, pf, tr2, buf, opts))
        assert torch.equal(base2[i, g], base[i, g]), (opts, i, g)
        assert torch.equal(adv2[i, g], r2[i, g] - base[i, g])  # A = r - b
        others = [h for h in range(G) if h != g]
        assert not torch.equal(base2[i, others], base[i, others])  # the siblings' baselines do read it


def test_poise_is_rloo_until_the_buffer_is_warm():
    spec = get_estimator("poise")
    B, G = 5, 2
    _, pf, tr, r = _world(B, G, 3)
    rloo = leave_one_out_mean(r, 1)
    for buf in (None, ReplayBuffer(64), _buffer(steps=1, B=4)):  # no buffer, empty, 8 rows < min_rows
        adv, base = spec.compute(r, _ctx(B, pf, tr, buf, {"min_rows": 16}))
        assert torch.equal(base, rloo) and torch.equal(adv, r - rloo)
    _, base = spec.compute(r, _ctx(B, pf, tr, _buffer(steps=2, B=4), {"min_rows": 16}))
    assert not torch.equal(base, rloo)


def test_poise_baseline_is_the_siblings_mean_prediction():
    B, G = 4, 3
    buf = _buffer(G=G)
    o = poise_options({"min_rows": 16})
    probe = fit_poise_probe(buf, o)
    _, pf, tr, r = _world(B, G, 5)
    _, base = get_estimator("poise").compute(r, _ctx(B, pf, tr, buf, {"min_rows": 16}))
    blocks = blocks_of(pf.repeat_interleave(G, 0), tr.reshape(B * G, -1), r.reshape(-1), o.features, N_STATS)
    pred = probe.predict(blocks).reshape(B, G).clamp(0, 1)
    want = torch.stack([(pred.sum(1) - pred[:, g]) / (G - 1) for g in range(G)], 1)
    torch.testing.assert_close(base.double(), want, rtol=1e-6, atol=1e-6)


def test_poise_probe_recovers_values_better_than_one_sibling_reward():
    """On data where the trajectory's hidden state carries the prompt's value, the probe's baseline is closer to
    the true value than RLOO's (the sibling's 0/1 reward); with features that carry nothing it is not."""
    buf = _buffer(steps=20, B=16)
    B, G = 64, 2
    v, pf, tr, r = _world(B, G, 77)
    _, base = get_estimator("poise").compute(r, _ctx(B, pf, tr, buf, {}))
    mse_probe = float(((base.double() - v[:, None]) ** 2).mean())
    mse_rloo = float(((leave_one_out_mean(r, 1).double() - v[:, None]) ** 2).mean())
    assert mse_probe < 0.5 * mse_rloo, (mse_probe, mse_rloo)
    # shuffle the features across prompts: the probe learns nothing useful and predicts about the mean
    noise = ReplayBuffer(4096)
    g = torch.Generator().manual_seed(1)
    for s in range(20):
        _, pf_s, tr_s, r_s = _world(16, 2, s)
        noise.add(s, [f"n{s}-{i}" for i in range(16)], r_s, pf_s[torch.randperm(16, generator=g)],
                  tr_s[torch.randperm(16, generator=g)])
    _, base_n = get_estimator("poise").compute(r, _ctx(B, pf, tr, noise, {}))
    mse_noise = float(((base_n.double() - v[:, None]) ** 2).mean())
    assert mse_noise > 1.5 * mse_probe


def test_basis_probe_ignores_own_reward_and_uses_the_probe_as_its_prior():
    spec = get_estimator("basis_probe")
    buf = ReplayBuffer(4096)
    for s in range(6):
        _, pf, _, r = _world(16, 1, s)
        buf.add(s, [f"s{s}p{i}" for i in range(16)], r, pf)
    B = 9
    _, pf, tr, r = _world(B, 1, 41)
    hist = {"q2": [3, 4], "q5": [0, 2]}
    for opts in ({}, {"use_features": False}, {"ridge": 10.0, "pca_prompt": 0}, {"combine": "residual"},
                 {"probe": "logistic", "ridge": 1.0}):
        opts = {"min_rows": 16, **opts}
        ctx = _ctx(B, pf, tr, buf, opts, history=hist)
        adv, base = spec.compute(r, ctx)
        # the hand formula: the probe's prediction, folded with the history, is the prior of basis_baseline
        po, bo = split_basis_probe(opts)
        prior = probe_prior(fit_prompt_probe(buf, po), pf, ctx.prompt_ids, hist, po)
        want = basis_baseline(r[:, 0], prior, pf, **bo)
        torch.testing.assert_close(base[:, 0], want, rtol=1e-6, atol=1e-7)
        for i in range(B):
            r2 = r.clone()
            r2[i, 0] = 1.0 - r2[i, 0]
            tr2 = torch.randn_like(tr)  # trajectory features are not read at all
            _, base2 = spec.compute(r2, _ctx(B, pf, tr2, buf, opts, history=hist))
            assert torch.equal(base2[i], base[i]), (opts, i)
    # history: (h + c q) / (n + c)
    po, _ = split_basis_probe({"min_rows": 16})
    q = probe_prior(fit_prompt_probe(buf, po), pf, [f"q{i}" for i in range(B)], None, po)
    qh = probe_prior(fit_prompt_probe(buf, po), pf, [f"q{i}" for i in range(B)], hist, po)
    assert qh[2] == pytest.approx((3 + 4 * q[2]) / (4 + 4)) and qh[5] == pytest.approx((0 + 4 * q[5]) / (2 + 4))
    assert qh[0] == pytest.approx(q[0])
    # cold: plain BASIS
    _, base_cold = spec.compute(r, _ctx(B, pf, tr, ReplayBuffer(8), {}))
    torch.testing.assert_close(base_cold[:, 0], basis_baseline(r[:, 0], None, pf))


# ------------------------------------------------------------------------------------------------------------
# the probe against brute force


def test_ridge_matches_the_normal_equations():
    g = torch.Generator().manual_seed(0)
    for n, d in ((40, 6), (8, 20)):  # primal and dual side
        x = torch.randn(n, d, generator=g, dtype=D)
        y = torch.randn(n, generator=g, dtype=D)
        p = fit_probe({"prompt": x}, y, ridge=3.0)
        z = (x - x.mean(0)) / x.std(0, unbiased=False)
        w = torch.linalg.solve(z.T @ z + 3.0 * torch.eye(d, dtype=D), z.T @ (y - y.mean()))
        xn = torch.randn(5, d, generator=g, dtype=D)
        want = ((xn - x.mean(0)) / x.std(0, unbiased=False)) @ w + y.mean()
        torch.testing.assert_close(p.predict({"prompt": xn}), want)


def test_grouped_cross_validation_matches_refitting_without_each_group():
    g = torch.Generator().manual_seed(1)
    for n, d in ((18, 4), (10, 14)):
        x = torch.randn(n, d, generator=g, dtype=D)
        y = x[:, 0] + torch.randn(n, generator=g, dtype=D)
        groups = torch.arange(n) // 2  # pairs, as two rollouts of one prompt
        grid = [0.1, 1.0, 10.0, 100.0]
        p = fit_probe({"prompt": x}, y, groups, ridge="cv", ridge_grid=grid)
        # brute force on the design the probe standardised once: the closed form is exact for a fixed transform
        z = (x - x.mean(0)) / x.std(0, unbiased=False)
        for lam in grid:
            err = []
            for grp in groups.unique():
                out = groups == grp
                zt, yt = z[~out], y[~out]
                zm = zt.mean(0)  # the intercept is refit; the penalised weights see centred columns
                w = torch.linalg.solve((zt - zm).T @ (zt - zm) + lam * torch.eye(d, dtype=D),
                                       (zt - zm).T @ (yt - yt.mean()))
                pred = (z[out] - zm) @ w + yt.mean()
                err.append((y[out] - pred) ** 2)
            brute = float(torch.cat(err).mean())
            assert p.cv_error[lam] == pytest.approx(brute, rel=1e-5), (n, d, lam)
        assert p.ridge == min(grid, key=lambda lam: p.cv_error[lam])


def test_logistic_probe_is_at_its_optimum_and_pca_keeps_the_top_directions():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(60, 5, generator=g, dtype=D)
    y = torch.bernoulli(torch.sigmoid(2 * x[:, 0]), generator=g)
    p = fit_probe({"prompt": x}, y, kind="logistic", ridge=0.5)
    z = p.design({"prompt": x})
    pr = torch.sigmoid(z @ p.w + p.b)
    torch.testing.assert_close(z.T @ (pr - y) + 0.5 * p.w, torch.zeros(5, dtype=D), atol=1e-8, rtol=0)
    assert abs(float((pr - y).sum())) < 1e-6  # the free intercept matches the mean
    assert ((p.predict({"prompt": x}) >= 0) & (p.predict({"prompt": x}) <= 1)).all()
    # PCA: data in a 2-dimensional subspace of 8 dims; 2 components predict as well as all 8
    basis = torch.randn(2, 8, generator=g, dtype=D)
    c = torch.randn(50, 2, generator=g, dtype=D)
    x8 = c @ basis
    y8 = c[:, 0] * 2 + 0.5
    full = fit_probe({"hidden": x8}, y8, ridge=1e-6, pca={"hidden": 0})
    two = fit_probe({"hidden": x8}, y8, ridge=1e-6, pca={"hidden": 2})
    assert two.proj["hidden"].shape == (8, 2) and full.proj["hidden"] is None
    torch.testing.assert_close(two.predict({"hidden": x8}), y8, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------------------------
# the buffer


def test_replay_buffer_keeps_the_newest_rows_with_sibling_targets():
    buf = ReplayBuffer(5)
    buf.add(1, ["a", "b"], torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.ones(2, 3), torch.zeros(2, 2, 4))
    assert buf.rows == 4 and buf.sibling.tolist() == [0.0, 1.0, 1.0, 1.0]
    assert buf.prompt_ids == ["a", "a", "b", "b"] and buf.step.tolist() == [1, 1, 1, 1]
    buf.add(2, ["c"], torch.tensor([[0.0, 1.0]]), torch.full((1, 3), 2.0), torch.ones(1, 2, 4))
    assert buf.rows == 5 and buf.prompt_ids == ["a", "b", "b", "c", "c"] and buf.added == 6
    assert buf.reward.tolist() == [0.0, 1.0, 1.0, 0.0, 1.0]
    assert buf.prompt_features[:, 0].tolist() == [1.0, 1.0, 1.0, 2.0, 2.0]
    assert buf.groups().tolist() == [0, 1, 1, 2, 2]
    one = ReplayBuffer(8)
    one.add(1, ["x", "y"], torch.tensor([[1.0], [0.0]]))
    assert torch.isnan(one.sibling).all() and one.prompt_features is None
    with pytest.raises(ValueError, match="missing in others"):
        one.add(2, ["z"], torch.tensor([[1.0]]), torch.ones(1, 3))


def test_replay_buffer_state_is_plain_data_and_round_trips_exactly():
    buf = _buffer(steps=3, B=5)
    state = buf.state_dict()
    blob = io.BytesIO()
    torch.save(state, blob)
    blob.seek(0)
    loaded = torch.load(blob, weights_only=True)  # no pickled objects
    json.dumps({k: v for k, v in loaded.items() if not isinstance(v, torch.Tensor)})  # the rest is JSON-able
    again = ReplayBuffer.from_state_dict(loaded)
    for k, v in state.items():
        w = again.state_dict()[k]
        assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, k
    o = PoiseOptions(min_rows=8)
    a, b = fit_poise_probe(buf, o), fit_poise_probe(again, o)
    x = blocks_of(buf.prompt_features, buf.trajectory, buf.reward, o.features, N_STATS)
    assert torch.equal(a.predict(x), b.predict(x))  # the same buffer refits bit for bit the same probe


# ------------------------------------------------------------------------------------------------------------
# registry and config


def test_specs_and_replay_capacity():
    p, b = get_estimator("poise"), get_estimator("basis_probe")
    assert (p.min_rollouts, p.uses_trajectory, p.uses_features) == (2, True, True)
    assert (b.min_rollouts, b.uses_trajectory, b.uses_features, b.uses_history) == (1, False, True, True)
    assert p.replay_capacity({}) == 4096 and p.replay_capacity({"buffer_size": 100}) == 100
    assert b.replay_capacity({"buffer_size": 7, "bandwidth": 0.5}) == 7
    for name in ("reinforce_pp", "grpo", "dr_grpo", "rloo"):
        assert get_estimator(name).replay_capacity is None and not get_estimator(name).uses_trajectory
    # basis keeps a buffer only for its mix's probe (estimator.options.mix)
    basis = get_estimator("basis")
    assert basis.replay_capacity({}) is None and basis.replay_capacity({"mix": True}) == 4096
    assert not basis.uses_trajectory
    assert "never uses r_i" in p.description and "never uses r_i" in b.description


@pytest.mark.parametrize("overrides,match", [
    (["estimator.name=poise"], r"rollouts_per_prompt >= 2 \(got 1\)"),
    (["estimator.name=poise", "estimator.rollouts_per_prompt=2", "estimator.options={ridge: -1}"],
     r"estimator\.options\.ridge: -1 .*positive number or 'cv'"),
    (["estimator.name=poise", "estimator.rollouts_per_prompt=2", "estimator.options={features: [hidden, logits]}"],
     r"estimator\.options\.features: .*prompt, hidden, stats, reward"),
    (["estimator.name=poise", "estimator.rollouts_per_prompt=2", "estimator.options={target: own, "
      "features: [hidden, reward]}"], r"'reward' needs target: sibling"),
    (["estimator.name=poise", "estimator.rollouts_per_prompt=2", "estimator.options={bandwidth: 0.3}"],
     r"estimator\.options\.bandwidth: not an option of poise"),
    (["estimator.name=basis_probe", "estimator.options={min_rows: 1}"], r"estimator\.options\.min_rows: 1 "),
    (["estimator.name=basis_probe", "estimator.options={bandwidth: cv}"], r"'cv' cannot be combined"),
    (["estimator.name=basis_probe", "estimator.options={pooling: blue}"], r"estimator\.options\.pooling: 'blue'"),
])
def test_config_rejects_bad_probe_options(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("smoke", overrides)


def test_config_accepts_probe_options():
    cfg = load_config("smoke", ["estimator.name=poise", "estimator.rollouts_per_prompt=2",
                                "estimator.options={ridge: cv, ridge_grid: [1, 1e2], features: [hidden, reward]}"])
    assert cfg.estimator.options == {"ridge": "cv", "ridge_grid": [1, 100.0], "features": ["hidden", "reward"]}
    cfg = load_config("smoke", ["estimator.name=basis_probe", "estimator.options={ridge: 10, shrink: 8}"])
    po, bo = split_basis_probe(cfg.estimator.options)
    assert po.ridge == 10 and bo == {"shrink": 8}


def test_eapo_injection_with_a_trajectory_estimator_is_refused():
    """EAPO's injected rollouts come from its own sampling loop, which captures no trajectory features: the config
    is refused before anything runs, naming both settings."""
    from basis_lite.config import load_config
    from basis_lite.errors import ConfigError

    with pytest.raises(ConfigError, match=r"eapo.prior_adapter: .*estimator.name=poise"):
        load_config("smoke", ["estimator.name=poise", "estimator.rollouts_per_prompt=2",
                              "eapo.prior_adapter=runs/earlier/adapter"])
    load_config("smoke", ["estimator.name=basis", "eapo.prior_adapter=runs/earlier/adapter"])  # others are fine
