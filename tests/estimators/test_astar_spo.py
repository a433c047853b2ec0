"""A*-PO (``astar``) and SPO (``spo``): their baselines by hand, the leave-one-out rule, SPO's tracker (initial
counts, KL-adaptive decay, prompt weights, an exact state round trip), A*-PO's prompt filter, the drift measurement
on the tiny model, and both estimators through a short training run."""
from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import VARIED, step_records, train_smoke, trainer_logprobs

from basis_lite.config import load_config
from basis_lite.data.example import Example
from basis_lite.data.sampler import PromptSampler
from basis_lite.errors import ConfigError
from basis_lite.estimators import EstimatorContext, get_estimator
from basis_lite.estimators.astar import AStarState, optimal_value
from basis_lite.estimators.spo import SPOState

D = torch.float64


def _ctx(name, ids, state, **options):
    return EstimatorContext(prompt_ids=ids, options=options, state=state)


def _table(rewards: dict) -> dict:
    k = len(next(iter(rewards.values())))
    return {"k": k, "rewards": rewards, "counts": {i: int(sum(x >= 1 for x in r)) for i, r in rewards.items()}}


# ------------------------------------------------------------------------------------------------------------
# astar


def test_astar_optimal_value_by_hand():
    assert optimal_value(torch.tensor([1.0, 0.0, 0.0, 0.0]), 0.5).item() == pytest.approx(
        0.5 * math.log((math.exp(2.0) + 3) / 4), rel=1e-12)
    r = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    v = optimal_value(r, 1e-3)  # beta -> 0: the best sample (a soft max); beta -> inf: the mean
    assert v[0].item() == pytest.approx(1.0 - 1e-3 * math.log(3 / 2), rel=1e-9) and v[1].item() == 0.0
    assert optimal_value(r, 1e6)[0].item() == pytest.approx(2 / 3, rel=1e-5)


def test_astar_baseline_is_v_star_and_never_uses_the_own_reward():
    state = AStarState({"beta": 0.5})
    state.set_reference(_table({"a": [1.0, 0.0], "b": [0.0, 0.0], "c": [1.0, 1.0]}))
    r = torch.tensor([[1.0], [0.0], [1.0]], dtype=D)
    spec = get_estimator("astar")
    adv, base = spec.compute(r, _ctx("astar", ["a", "b", "c"], state))
    want = [0.5 * math.log((math.exp(2) + 1) / 2), 0.0, 1.0]
    torch.testing.assert_close(base[:, 0], torch.tensor(want, dtype=D))
    torch.testing.assert_close(adv, r - base)
    for i in range(3):  # flipping a prompt's own reward leaves its baseline where it was
        flipped = r.clone()
        flipped[i] = 1 - flipped[i]
        assert torch.equal(spec.compute(flipped, _ctx("astar", ["a", "b", "c"], state))[1], base)
    with pytest.raises(ValueError, match="no reference samples for prompt 'z'"):
        spec.compute(r, _ctx("astar", ["a", "b", "z"], state))
    with pytest.raises(ValueError, match="astar needs its state"):
        spec.compute(r, _ctx("astar", ["a", "b", "c"], None))


def test_astar_filters_prompts_whose_reference_samples_all_failed():
    state = AStarState({})
    state.set_reference(_table({"a": [1.0, 0.0], "b": [0.0, 0.0], "c": [0.0, 0.5]}))
    assert [state.accept(Example(id=i, question="q", answer="1")) for i in "abc"] == [1.0, 0.0, 1.0]
    examples = [Example(id=i, question="q", answer="1") for i in "abc"]
    sampler = PromptSampler(examples, 2, seed=0, accept=state.accept)
    drawn = [ex.id for _ in range(5) for ex in next(sampler)]
    assert "b" not in drawn and set(drawn) == {"a", "c"}
    off = AStarState({"filter_all_incorrect": False})
    off.set_reference(_table({"a": [0.0, 0.0]}))
    assert off.accept is None
    with pytest.raises(ConfigError, match="filter_all_incorrect: none of the 2 reference samples of any of the 1"):
        AStarState({}).set_reference(_table({"a": [0.0, 0.0]}))


# ------------------------------------------------------------------------------------------------------------
# spo


def test_spo_tracker_by_hand():
    """Initial counts N0 (s + 1/2) / (K + 1) and N0 (K - s + 1/2) / (K + 1), then per visit
    alpha <- rho alpha + r, beta <- rho beta + (1 - r), rho = 2^(-D / kl_half) clipped (rho_max without a drift)."""
    state = SPOState({})
    state.set_reference({"k": 4, "counts": {"a": 1, "b": 4}})
    n0 = 1 / (1 - 0.875)
    a0, b0 = n0 * 1.5 / 5, n0 * 3.5 / 5
    torch.testing.assert_close(state.values(["a", "b", "new"]), torch.tensor([1.5 / 5, 4.5 / 5, 0.5], dtype=D))
    state.observe(1, ["a", "new"], torch.tensor([[1.0], [0.0]]), drift={0: 0.005})
    rho = 2 ** (-0.005 / 0.06)  # 0.944, inside [0.875, 0.96]
    assert state.counts["a"] == pytest.approx([rho * a0 + 1, rho * b0])
    assert state.counts["new"] == pytest.approx([0.96 * 0.5, 0.96 * 0.5 + 1])  # no drift known: rho_max
    assert state.metrics() == pytest.approx({"spo_rho_mean": (rho + 0.96) / 2, "spo_drift_mean": 0.005})
    assert state.decay(1.0) == 0.875 and state.decay(0.0) == 0.96  # clipped both ways
    constant = SPOState({"rho": 0.5})
    assert not constant.tracks_drift and constant.decay(0.3) == 0.5


def test_spo_advantages_are_whitened_and_the_baseline_never_uses_the_own_reward():
    state = SPOState({})
    state.set_reference({"k": 2, "counts": {"a": 0, "b": 1, "c": 2, "d": 1}})
    ids = ["a", "b", "c", "d"]
    r = torch.tensor([[1.0], [0.0], [1.0], [1.0]], dtype=D)
    spec = get_estimator("spo")
    adv, base = spec.compute(r, _ctx("spo", ids, state))
    v = torch.tensor([0.5 / 3, 1.5 / 3, 2.5 / 3, 1.5 / 3], dtype=D)
    torch.testing.assert_close(base[:, 0], v)
    a = r[:, 0] - v
    torch.testing.assert_close(adv[:, 0], (a - a.mean()) / (a.std() + 1e-6))
    for i in range(4):
        flipped = r.clone()
        flipped[i] = 1 - flipped[i]
        assert torch.equal(spec.compute(flipped, _ctx("spo", ids, state))[1], base)
    # normalize: always changes nothing (whitened already)
    norm = spec.compute(r, EstimatorContext(prompt_ids=ids, state=state, normalize=True))[0]
    assert torch.equal(norm, adv)


def test_spo_prioritized_sampling_draws_prompts_in_proportion_to_their_weight():
    state = SPOState({})
    state.set_reference({"k": 8, "counts": {"even": 4, "easy": 8}})  # v = 1/2 and 8.5/9
    w_even, w_easy = (0.5 + 0.05), (math.sqrt(8.5 / 9 * 0.5 / 9) + 0.05)
    assert state.sampling_weight(Example(id="even", question="q", answer="1")) == pytest.approx(1.0)
    assert state.sampling_weight(Example(id="easy", question="q", answer="1")) == pytest.approx(w_easy / w_even)
    examples = [Example(id="even", question="q", answer="1"), Example(id="easy", question="q", answer="1")]
    sampler = PromptSampler(examples, 1, seed=3, accept=state.accept)
    drawn = [next(sampler)[0].id for _ in range(3000)]
    ratio = drawn.count("easy") / drawn.count("even")
    assert ratio == pytest.approx(w_easy / w_even, rel=0.15)
    assert SPOState({"prioritize": False}).accept is None


def test_spo_state_round_trips_exactly():
    state = SPOState({})
    state.set_reference({"k": 2, "counts": {"a": 1, "b": 0}})
    state.observe(1, ["a", "b"], torch.tensor([[1.0], [0.0]]), drift={0: 0.0123456789})
    rng = random.Random(0)
    state.keep_responses(["a", "b"], [([1, 2, 3, 4, 5], 3, torch.tensor([-0.123456789, -2.5])), None])
    state.keep_responses(["b"], [([7, 8, 9], 1, torch.tensor([rng.random() for _ in range(2)]))])
    saved = state.state_dict()
    other = SPOState({})
    other.set_reference({"k": 2, "counts": {"a": 1, "b": 0}})
    other.load_state_dict(saved)
    assert other.counts == state.counts
    assert other.responses.keys() == state.responses.keys()
    for k, (ids, n, lps) in state.responses.items():
        ids2, n2, lps2 = other.responses[k]
        assert (ids2, n2) == (ids, n) and torch.equal(lps2, lps)
    assert [r[0] for r in other.drift_responses(["x", "b", "a"])] == [1, 2]
    state.keep_responses(["a"], [None])  # a response that did not train: the next visit gets rho_max
    assert "a" not in state.responses


def test_response_drift_is_zero_for_the_same_policy_and_grows_when_it_moves():
    from basis_lite.engines.base import Rollout
    from basis_lite.model.loading import load_policy
    from basis_lite.rl.update import make_optimizer, policy_update, response_drift

    torch.manual_seed(0)
    cfg = load_config("smoke", ["model.dtype=float32", "train.micro_batch_size=2", "train.lr=5e-2"])
    model, tok = load_policy(cfg, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(1)
    rolls = [Rollout(prompt="", prompt_ids=torch.randint(0, 250, (5,), generator=g).tolist(),
                     completion_ids=torch.randint(0, 250, (3 + i,), generator=g).tolist(), text="", finished=True)
             for i in range(3)]
    kept: dict = {}
    opt = make_optimizer(cfg, model, torch.device("cpu"))
    policy_update(cfg, model, opt, rolls, torch.tensor([1.0, -1.0, 0.5]), tok.pad_token_id, torch.device("cpu"),
                  logprobs_out=kept)
    assert sorted(kept) == [0, 1, 2] and [len(kept[i]) for i in range(3)] == [3, 4, 5]
    responses = [(r.prompt_ids + r.completion_ids, len(r.prompt_ids), kept[i]) for i, r in enumerate(rolls)]
    moved, tokens = response_drift(cfg, model, responses, tok.pad_token_id, torch.device("cpu"))
    assert tokens == sum(len(x[0]) for x in responses) and all(d > 1e-4 for d in moved)  # one step moved it
    now = trainer_logprobs(model, tok, rolls, cfg.generation.temperature)  # the current policy, as trained
    same, _ = response_drift(cfg, model, [(ids, n, lp) for (ids, n, _), lp in zip(responses, now)],
                             tok.pad_token_id, torch.device("cpu"))
    assert max(same) < 1e-6 < min(moved)


# ------------------------------------------------------------------------------------------------------------
# through the trainer


@pytest.mark.parametrize("name,extra", [
    ("astar", ["estimator.prior_samples=2", "estimator.options={filter_all_incorrect: false}"]),
    ("spo", ["estimator.prior_samples=2", "data.train_size=4"]),
])
def test_astar_and_spo_train(tmp_path, name, extra):
    run = train_smoke(tmp_path / name, *VARIED, "train.steps=3", "train.batch_size=4", "train.save_every=100",
                      f"estimator.name={name}", *extra, one_thread=True)
    recs = step_records(run)
    assert all(not r["skipped"] and math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in recs)
    assert all(r["cum_reference_tokens"] > 0 for r in recs)  # the K reference samples count in the cost
    if name == "astar":  # the reference forward of every trained sequence
        assert all(r["forward_only_tokens"] == r["trained_tokens"] > 0 for r in recs)
        assert all(r["baseline_mean"] != r["reward_mean"] for r in recs)
    else:  # 4 prompts, 4 per step: from step 2 on every prompt comes back and its drift is measured
        assert recs[0]["spo_rho_mean"] == 0.96 and math.isnan(recs[0]["spo_drift_mean"])
        assert all(r["forward_only_tokens"] > 0 and 0.875 <= r["spo_rho_mean"] <= 0.96 for r in recs[1:])
        assert all(r["advantage_std"] == pytest.approx(1.0, abs=1e-3) for r in recs)
