"""Exact resume with an online probe: the replay buffer travels in the checkpoint, so a run of ``poise`` or
``basis_probe`` SIGKILLed anywhere and resumed refits the same probe at every later step and ends with the same
adapter, metrics and buffer as an uninterrupted run (the harness of tests/rl/test_resume.py)."""
from __future__ import annotations

import math
import subprocess

import pytest
import torch
from conftest import REPO, VARIED, adapter_weights, cli_cmd, cli_main, sets, step_records, subprocess_env

STEPS = 4
BASE = VARIED + [f"train.steps={STEPS}", "train.save_every=1", "train.keep_last=2", "train.batch_size=4",
                 "train.micro_batch_size=4"]
ARMS = {
    # 4 prompts x 2 rollouts = 8 rows a step: the probe is warm from step 2 on
    "poise": ["estimator.name=poise", "estimator.rollouts_per_prompt=2",
              "estimator.options={min_rows: 8, ridge: cv, pca_prompt: 4, pca_hidden: 4}"],
    "basis_probe": ["estimator.name=basis_probe", "estimator.history=true", "estimator.options={min_rows: 4}"],
    # basis mix (tracker, probe, mix losses in the checkpoint) and value sampling (its own tracker): 8 training
    # prompts, so every prompt comes back every other step
    "basis_mix": ["estimator.options={mix: true, probe_min_rows: 4}", "data.train_size=8",
                  "data.value_sampling=1.0"],
    # SPO's tracker, its kept responses (the drift at a prompt's next visit) and its prompt sampling: 8 training
    # prompts, initial counts from K=2 reference samples
    "spo": ["estimator.name=spo", "estimator.prior_samples=2", "data.train_size=8"],
}
KILLS = [("poise", "generation:3"), ("poise", "checkpoint:3"), ("basis_probe", "optimizer:3"),
         ("basis_mix", "generation:3"), ("spo", "generation:3")]
COMPARED = ("reward_mean", "baseline_mean", "explained_variance", "loss", "advantage_std", "grad_norm",
            "replay_rows", "mix_weight_loo", "mix_weight_tracker", "value_sampling_skipped", "spo_rho_mean",
            "cum_trained_tokens", "cum_forward_only_tokens", "cum_reference_tokens")


def _args(arm, run):
    return ["train", "--preset", "smoke", *sets(BASE + ARMS[arm]), "--output", str(run), "--no-progress"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The killed runs (subprocesses, started first, all at once) and the uninterrupted ones (in-process)."""
    root = tmp_path_factory.mktemp("probe_resume")
    procs = {}
    for arm, point in KILLS:
        run = root / f"{arm}-{point.replace(':', '-')}"
        procs[(arm, point)] = (run, subprocess.Popen(cli_cmd(*_args(arm, run)), cwd=REPO,
                                                     env=subprocess_env(BASIS_LITE_KILL_AT=point),
                                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    ref = {}
    for arm in ARMS:
        ref[arm] = root / f"{arm}-reference"
        assert cli_main(*_args(arm, ref[arm])) == 0
    killed = {}
    for key, (run, p) in procs.items():
        _, stderr = p.communicate(timeout=240)
        killed[key] = (run, p.returncode, stderr)
    return ref, killed


def _replay(run, key="replay"):
    from basis_lite.runs import checkpoint as ckpt

    return ckpt.load_state(ckpt.latest_checkpoint(run))[key]


def test_the_probe_is_in_use(runs):
    ref, _ = runs
    recs = step_records(ref["poise"])
    # RLOO's baselines average to the reward mean (G = 2); the probe's do not
    assert recs[0]["baseline_mean"] == pytest.approx(recs[0]["reward_mean"], abs=1e-7)
    assert all(abs(r["baseline_mean"] - r["reward_mean"]) > 1e-6 for r in recs[1:])
    assert [r["replay_rows"] for r in recs] == [8, 16, 24, 32]
    assert all(r["trajectory_feature_s"] > 0 for r in recs)
    assert "trajectory_feature_s" not in step_records(ref["basis_probe"])[0]
    state = _replay(ref["poise"])
    assert state["trajectory"].shape[0] == 32 and state["prompt_features"].shape[0] == 32
    assert state["step"].tolist() == [s for s in range(1, STEPS + 1) for _ in range(8)]


@pytest.mark.parametrize("arm,point", KILLS)
def test_killed_probe_run_resumes_exactly(runs, arm, point):
    ref, killed = runs
    run, rc, stderr = killed[(arm, point)]
    assert rc == -9, f"expected SIGKILL at {point}, got rc {rc}:\n{stderr[-3000:]}"
    assert not (run / "adapter").exists()
    assert cli_main("train", "--resume", str(run), "--no-progress") == 0
    want, got = step_records(ref[arm]), step_records(run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(want, got):
        for k in COMPARED:
            if k in a:
                assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9), (a["step"], k, a[k], b[k])
    wr, wg = adapter_weights(ref[arm] / "adapter"), adapter_weights(run / "adapter")
    for k in wr:
        torch.testing.assert_close(wg[k], wr[k], atol=1e-6, rtol=0, msg=k)
    sr, sg = _replay(ref[arm]) or {}, _replay(run) or {}  # (spo keeps no replay buffer)
    assert sr.keys() == sg.keys()
    for k, v in sr.items():
        if isinstance(v, torch.Tensor):  # bit for bit (nan where a prompt had no sibling)
            torch.testing.assert_close(sg[k], v, rtol=0, atol=0, equal_nan=True, msg=k)
        else:
            assert v == sg[k], k
    for key in ("estimator_state", "value_tracker", "sampler"):  # the trackers and mix losses, bit for bit
        _assert_same(_replay(run, key), _replay(ref[arm], key), key)


def _assert_same(a, b, where):
    """a == b, nested, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=where)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_the_mix_tracks_repeated_prompts(runs):
    ref, _ = runs
    recs = step_records(ref["basis_mix"])
    assert all(abs(sum(r[f"mix_weight_{p}"] for p in ("loo", "pool", "probe", "tracker")) - 1) < 1e-9 for r in recs)
    state = _replay(ref["basis_mix"], "estimator_state")
    assert state["tracker"]["t"] == STEPS and len(state["tracker"]["table"]) == 8  # all 8 prompts seen
    assert _replay(ref["basis_mix"], "value_tracker")["t"] == STEPS


def test_spo_keeps_its_tracker_and_measures_the_drift_of_revisited_prompts(runs):
    ref, _ = runs
    recs = step_records(ref["spo"])
    # step 1 sees its prompts for the first time (rho_max, nothing to measure); a revisited prompt's kept response is
    # scored again (a forward-only pass) and its drift sets its decay; prioritized sampling decides which come back
    assert recs[0]["spo_rho_mean"] == 0.96 and recs[0]["forward_only_tokens"] == 0
    assert any(r["forward_only_tokens"] > 0 for r in recs[1:])
    for r in recs:
        assert (r["forward_only_tokens"] > 0) == (not math.isnan(r["spo_drift_mean"]))
        assert 0.875 <= r["spo_rho_mean"] <= 0.96
        assert math.isnan(r["spo_drift_mean"]) or r["spo_drift_mean"] > 0
    state = _replay(ref["spo"], "estimator_state")
    assert 4 < len(state["counts"]) <= 8 and set(state["responses"]["ids"]) == set(state["counts"])
