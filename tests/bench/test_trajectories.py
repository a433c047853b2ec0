"""bench/record_trajectories.py, bench/value_mse.py --trajectories and the online-probe arms of bench/learning.py on
the smoke preset: their bookkeeping (not the numbers a real run gives)."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from conftest import VARIED, bench_module, sets, step_records, train_smoke

# generate() in both runs: the recorded run samples with trajectory features, which the fast CPU path leaves to it
OVERRIDES = VARIED + ["train.steps=3", "train.batch_size=4", "generation.fast_cpu=off"]


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    d = tmp_path_factory.mktemp("traj")
    out = d / "trajectories_smoke.npz"
    rt = bench_module("record_trajectories.py")
    assert rt.main(["--preset", "smoke", "--record-steps", "2", "3", "--probe-prompts", "6", "--samples", "4",
                    "--out", str(out), "--runs", str(d / "rec"), *sets(OVERRIDES)]) == 0
    return d, out


def test_recording_leaves_the_training_run_as_it_is(recording, tmp_path):
    d, out = recording
    plain = train_smoke(tmp_path / "plain", *OVERRIDES)
    want, got = step_records(plain), step_records(d / "rec")
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(want, got):
        for k in ("reward_mean", "baseline_mean", "loss", "grad_norm", "completion_len"):
            assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-9), (a["step"], k)
    with np.load(out) as z:
        meta = json.loads(str(z["meta"]))
        assert z["train_rewards"].shape == (3, 4, 2)  # the run's rollout + one recorded sibling
        assert z["train_trajectory"].shape[:3] == (3, 4, 2) and z["probe_rewards"].shape == (2, 6, 4)
        assert z["probe_trajectory"].shape[:3] == (2, 6, 4)
        assert z["probe_prompt_features"].shape[:2] == (2, 6)
        recorded = z["train_rewards"][:, :, 0].mean(1)
    assert meta["kind"] == "trajectories" and meta["record_steps"] == [2, 3] and len(meta["train_ids"]) == 3
    assert meta["probe_selection"] == "uniform sample of the train split" and len(set(meta["probe_ids"])) == 6
    np.testing.assert_allclose(recorded, [r["reward_mean"] for r in want], rtol=1e-6)


def test_probe_prompts_have_the_training_mix_of_problem_kinds():
    """The built-in arithmetic split is drawn round-robin over its levels, so its head over-represents the small
    levels (add1, sub1) that the rest barely holds; the probe prompts are a uniform sample, so their mix of kinds is
    the split's (what the training batches draw from)."""
    from basis_lite.config import load_config
    from basis_lite.data import load_examples

    rt = bench_module("record_trajectories.py", "bench_record_trajectories_pick")
    vt = bench_module("value_mse_trajectories.py", "bench_value_mse_trajectories_mix")
    cfg = load_config("cpu-smollm2-arith-add2", [])  # the mix the recordings in bench/results were made on
    train = load_examples(cfg.data, "train")
    split = vt.kind_mix([ex.id for ex in train])["add2"]
    head = vt.kind_mix([ex.id for ex in train[:128]])["add2"]
    picked = rt.probe_examples(train, 128, cfg.data.seed)
    assert len({ex.id for ex in picked}) == 128 and {ex.id for ex in picked} <= {ex.id for ex in train}
    assert split > 0.9 and head < split - 0.2  # why the head is not used
    assert abs(vt.kind_mix([ex.id for ex in picked])["add2"] - split) < 0.08
    assert rt.probe_examples(train, 128, cfg.data.seed) == picked  # seeded
    # the default mix revisits level 1's questions: the probe prompts are still distinct
    train = load_examples(load_config("cpu-smollm2-arith", []).data, "train")
    picked = rt.probe_examples(train, 128, cfg.data.seed)
    assert len({ex.id for ex in picked}) == 128 and {ex.id for ex in picked} <= {ex.id for ex in train}


def test_value_mse_on_trajectories(recording):
    d, out = recording
    vm = bench_module("value_mse.py", "bench_value_mse_t")
    prefix = d / "vmt"
    assert vm.main(["--trajectories", str(out), "--batch-sizes", "3", "6", "--resamples", "2", "--min-rows", "4",
                    "--out", str(prefix), "--no-plot"]) == 0
    rep = json.loads(prefix.with_suffix(".json").read_text())
    assert list(rep["steps"]) == ["2", "3"]
    for t, s in rep["steps"].items():
        # a probe at step t reads the training steps before t only: 4 rows a step (8 with the siblings)
        assert s["buffer_rows_one_rollout"] == 4 * (int(t) - 1) and s["buffer_rows_two_rollouts"] == 8 * (int(t) - 1)
        assert s["probes"]["poise:default"]["warm"] and s["probes"]["basis_probe:default"]["warm"]
        assert list(s["results"]) == ["3", "6"]
        cell = s["results"]["6"]
        for name in ("reinforce_pp", "rloo_G2", "rloo_G2_emp", "group_mean_G8", "basis:default",
                     "basis_probe:default", "poise:default", "poise:+reward", "x:sibling_shrunk"):
            assert {"mse", "mse_raw", "truth_noise", "ratio"} <= set(cell[name]), name
        assert cell["group_mean_G8"]["mse"] < cell["group_mean_G2"]["mse"]
    md = prefix.with_suffix(".md").read_text()
    assert md.startswith("# Value-estimate MSE of online probes") and "## Targets on the mid-training steps" in md
    assert "Problem kinds (share of prompts): training batches" in md and "all analysed" in md


def test_value_mse_on_trajectories_of_some_problem_kinds(recording):
    d, out = recording
    vm = bench_module("value_mse.py", "bench_value_mse_k")
    vt = sys.modules["bench.value_mse_trajectories"]
    with np.load(out) as z:
        ids = json.loads(str(z["meta"]))["probe_ids"]
    kind, share = next(iter(vt.kind_mix(ids).items()))
    n = round(share * len(ids))
    prefix = d / "vmk"
    args = ["--trajectories", str(out), "--batch-sizes", "4", "--resamples", "2", "--min-rows", "4",
            "--variants", "poise:default", "--no-plot"]
    assert 4 <= n < len(ids)  # the smoke split is mostly add1: a strict subset to keep
    assert vm.main(args + ["--kinds", kind, "--out", str(prefix)]) == 0
    rep = json.loads(prefix.with_suffix(".json").read_text())
    assert rep["recording"]["probe_prompts"] == n and rep["recording"]["kinds"] == [kind]
    assert rep["recording"]["probe_kind_mix"] == {kind: 1.0}
    assert all(s["n_prompts"] == n for s in rep["steps"].values())
    with pytest.raises(SystemExit, match="no-such-kind: 0 probe prompts"):
        vm.main(args + ["--kinds", "no-such-kind", "--out", str(d / "vmx")])


def test_learning_arms_for_the_probe_estimators():
    lm = bench_module("learning.py", "bench_learning_arms")
    assert lm.arm_overrides("poise", 32, 4)[-1] == "train.batch_size=16"
    assert lm.arm_overrides("rloo2", 32, 4)[:2] == ["estimator.name=rloo", "estimator.rollouts_per_prompt=2"]
    assert lm.arm_overrides("poise_wide", 32, 4)[-1] == "train.batch_size=32"
    assert lm.arm_overrides("basis_probe", 32, 4)[0] == "estimator.name=basis_probe"
    args = lm.parse_args(["--preset", "smoke", "--steps", "2", "--arms", "basis_probe,rloo2,poise,poise_wide",
                          "--set", "train.batch_size=8"])
    plans, _ = lm.plan_arms(args)
    assert {a: p["rollouts_per_step"] for a, p in plans.items()} == {"basis_probe": 8, "rloo2": 8, "poise": 8,
                                                                     "poise_wide": 16}
    assert lm.parse_args(["--preset", "smoke"]).arms == list(lm.DEFAULT_ARMS)
    with pytest.raises(lm.ConfigError, match="not a multiple of 2"):
        lm.arm_overrides("poise", 7, 4)
