"""bench/learning.py end to end on the smoke preset (tiny random model, two arms, 2 steps): its bookkeeping, not learning.

The random model scores 0, so the accuracies are all 0; what is checked is that every eval point is there with a
clock that only grows, that the arms spend the same rollouts per step, the outputs exist, a rerun skips finished
arms, and (on hand-made run folders, no training) that the prior pass is added to basis_prior's clock.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST, REPO, bench_module, sets, subprocess_env

SCRIPT = REPO / "bench" / "learning.py"
STEPS, EVAL_EVERY = 2, 1
ARMS = ("reinforce_pp", "grpo8")


def _args(out: Path, runs: Path, steps: int = STEPS) -> list[str]:
    # smoke's train.batch_size is 8: grpo8 runs 1 prompt x 8 rollouts, reinforce_pp 8 x 1
    return ["--preset", "smoke", "--steps", str(steps), "--eval-every", str(EVAL_EVERY), "--arms", ",".join(ARMS),
            "--out", str(out), "--runs", str(runs), "--quiet", *sets(FAST + ["train.batch_size=8"])]


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=timeout)
    proc.wall = time.time() - t0
    return proc


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench_learning")
    out, runs = d / "out", d / "runs"
    proc = _run(_args(out, runs))
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return out, runs, json.loads((out / "learning.json").read_text())


@pytest.fixture(scope="module")
def mod():
    return bench_module("learning.py")


def test_eval_points_and_clock(bench):
    _, _, rep = bench
    assert rep["arm_order"] == list(ARMS)
    assert {"machine", "settings", "command", "created"} <= set(rep)
    for arm in ARMS:
        r = rep["arms"][arm]
        assert r["status"] == "done" and r["steps"] == STEPS
        pts = r["points"]
        # before training (step 0), every eval_every steps, and the final eval at the last step
        assert [p["step"] for p in pts] == list(range(0, STEPS + 1, EVAL_EVERY)), pts
        assert [p["final"] for p in pts] == [False] * (len(pts) - 1) + [True]
        clocks = [p["clock_s"] for p in pts]
        assert clocks[0] == 0.0
        assert all(b > a for a, b in zip(clocks, clocks[1:])), clocks
        assert all(0.0 <= p["eval_accuracy"] <= 1.0 for p in pts)
        assert r["prior_seconds"] == 0.0 and clocks[-1] == pytest.approx(r["total_clock_s"], abs=1e-3)
        assert r["total_clock_s"] == pytest.approx(r["generation_s"] + r["training_s"], abs=2e-3)
        assert r["final_accuracy"] == pts[-1]["eval_accuracy"]
        assert r["accuracy_before"] == pts[0]["eval_accuracy"]
    # the same rollouts per step in every arm, spent differently
    s_r, s_g = rep["arms"]["reinforce_pp"]["settings"], rep["arms"]["grpo8"]["settings"]
    assert (s_r["prompts_per_step"], s_r["rollouts_per_prompt"], s_r["estimator"]) == (8, 1, "reinforce_pp")
    assert (s_g["prompts_per_step"], s_g["rollouts_per_prompt"], s_g["estimator"]) == (1, 8, "grpo")


def test_outputs(bench):
    out, runs, _ = bench
    md = (out / "learning.md").read_text()
    assert md.startswith("# Learning speed")
    for arm in ARMS:
        assert f"| {arm} |" in md
        assert (runs / arm / "summary.json").exists() and (runs / f"{arm}.log").exists()
    assert (out / "learning.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rerun_skips_finished_arms(bench, tmp_path):
    out, runs, rep = bench
    out2 = tmp_path / "out2"
    proc = _run(_args(out2, runs), timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("skipped") == len(ARMS), proc.stdout
    rep2 = json.loads((out2 / "learning.json").read_text())
    for arm in ARMS:
        assert rep2["arms"][arm]["points"] == rep["arms"][arm]["points"]
    # other settings on the same run folders: refused, nothing mixed
    assert _run(_args(tmp_path / "out3", runs, steps=STEPS + 1), timeout=60).returncode == 2


def test_every_run_arm_is_stamped_with_its_machine(bench):
    out, runs, rep = bench
    for arm in ARMS:
        stamp = json.loads((runs / f"{arm}.machine.json").read_text())
        assert stamp["cpu_model"] and "avx2" in stamp["cpu_flags"]
        assert rep["arms"][arm]["machine"] == stamp
    assert "Machine: " in (out / "learning.md").read_text()


def test_seeds_from_two_machines_are_named_apart(mod, tmp_path):
    """Seeds run in other invocations (here: seed 1 stamped by another machine, seed 0 unstamped, i.e. measured
    where the report's invocation ran) get one machine line each, and per-seed cells carry their own clocks."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    _fake_run(runs / "seed0" / "basis", [(2.0, 1.0)], [0.1, 0.5], None)
    _fake_run(runs / "seed1" / "basis", [(4.0, 4.0)], [0.2, 0.7], None)
    other = {"cpu_model": "Other CPU", "cores": 2, "cpu_flags": {"avx2": True, "avx512f": True}, "torch": "9",
             "git_commit": "abcdef1234567"}
    (runs / "seed1" / "basis.machine.json").write_text(json.dumps(other))
    assert mod.main(["--preset", "smoke", "--arms", "basis", "--seeds", "0", "1", "--out", str(out), "--runs",
                     str(runs), "--analyze-only"]) == 0
    rep = json.loads((out / "learning.json").read_text())
    assert rep["per_seed"]["1"]["basis"]["machine"] == other and "machine" not in rep["per_seed"]["0"]["basis"]
    md = (out / "learning.md").read_text()
    assert "Machines (the arms ran in several invocations" in md
    assert "- basis@seed1: Other CPU, 2 cores; flags: avx2 avx512f; torch 9; commit abcdef1234" in md
    assert f"- basis@seed0: {mod._machine_line(rep['machine'])}" in md
    assert "| basis | 0.500 (3.00 s) | 0.700 (8.00 s) |" in md
    assert "--analyze-only" in rep["rebuilt_by"] and "Rebuilt (no training) from the run folders" in md


def test_grpo8_needs_a_multiple_of_8(mod, tmp_path, capsys):
    rc = mod.main(["--preset", "smoke", "--arms", "grpo8", "--out", str(tmp_path / "o"), "--runs",
                   str(tmp_path / "r"), "--set", "train.batch_size=12"])
    assert rc == 2 and "multiple of 8" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def _fake_run(run_dir: Path, step_times: list[tuple[float, float]], accs: list[float], prior_s: float | None):
    """A finished run folder as train() leaves it: eval before, eval after every step, final eval, summary.json."""
    run_dir.mkdir(parents=True)
    n = len(step_times)
    lines = [{"step": 0, "event": "eval", "eval_accuracy": accs[0], "eval_n": 10}]
    for s, (g, t) in enumerate(step_times, 1):
        lines.append({"step": s, "generation_s": g, "training_s": t, "reward_mean": 0.0})
        lines.append({"step": s, "event": "eval" if s < n else "eval_final", "eval_accuracy": accs[s], "eval_n": 10})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = {"steps": n, "eval_after": {"accuracy": accs[-1]}}
    if prior_s is not None:
        summary.update(prior_seconds=prior_s, prior_cached=False)
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_prior_counted_in_clock(mod, tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "out"
    times = [(2.0, 1.0), (2.5, 0.5), (3.0, 1.0)]
    _fake_run(runs / "basis", times, [0.1, 0.2, 0.3, 0.4], None)
    _fake_run(runs / "basis_prior", times, [0.1, 0.3, 0.4, 0.5], 7.0)
    assert mod.main(["--preset", "smoke", "--arms", "basis,basis_prior", "--out", str(out), "--runs", str(runs),
                     "--analyze-only"]) == 0
    rep = json.loads((out / "learning.json").read_text())
    base = [p["clock_s"] for p in rep["arms"]["basis"]["points"]]
    assert base == [0.0, 3.0, 6.0, 10.0]
    bp = rep["arms"]["basis_prior"]
    assert [p["clock_s"] for p in bp["points"]] == [7.0, 10.0, 13.0, 17.0]
    assert [p["train_clock_s"] for p in bp["points"]] == base
    assert bp["prior_seconds"] == 7.0 and bp["total_clock_s"] == 17.0 and bp["train_clock_s"] == 10.0
    assert bp["final_accuracy"] == 0.5 and bp["accuracy_before"] == 0.1
    md = (out / "learning.md").read_text()
    assert "| basis_prior |" in md and "7.00 s" in md
    assert (out / "learning.png").read_bytes()[:4] == b"\x89PNG"


def test_seeds_mean_se_and_paired_difference(mod, tmp_path):
    """--seeds: per-seed run folders are averaged per eval point (with the SE over seeds) and paired by seed."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    times = [(2.0, 1.0), (2.5, 0.5), (3.0, 1.0)]
    _fake_run(runs / "seed0" / "basis", times, [0.1, 0.3, 0.5, 0.6], None)
    _fake_run(runs / "seed0" / "reinforce_pp", times, [0.1, 0.2, 0.4, 0.5], None)
    _fake_run(runs / "seed1" / "basis", times, [0.2, 0.3, 0.4, 0.8], None)
    _fake_run(runs / "seed1" / "reinforce_pp", [(4.0, 2.0)] * 3, [0.2, 0.3, 0.4, 0.6], None)
    assert mod.main(["--preset", "smoke", "--arms", "basis,reinforce_pp", "--seeds", "0", "1", "--out", str(out),
                     "--runs", str(runs), "--analyze-only"]) == 0
    rep = json.loads((out / "learning.json").read_text())
    assert set(rep["per_seed"]) == {"0", "1"} and rep["settings"]["seeds"] == [0, 1]
    b = rep["arms"]["basis"]
    assert b["seeds"] == ["0", "1"] and b["status"] == "done"
    last = b["points"][-1]
    assert last["final"] and last["eval_accuracy"] == pytest.approx(0.7)
    assert last["eval_accuracy_se"] == pytest.approx(0.1)  # sd 0.1414 / sqrt(2)
    assert b["final_accuracy"] == pytest.approx(0.7) and b["accuracy_before"] == pytest.approx(0.15)
    r = rep["arms"]["reinforce_pp"]
    assert r["points"][-1]["clock_s"] == pytest.approx((10.0 + 18.0) / 2)  # clocks are means over seeds
    pr = rep["paired"]["basis"]
    assert pr["vs"] == "reinforce_pp" and pr["final_accuracy_diff"] == pytest.approx({"0": 0.1, "1": 0.2})
    assert pr["mean_diff"] == pytest.approx(0.15) and pr["se"] == pytest.approx(0.05)
    assert pr["clock_ratio"] == pytest.approx(20.0 / 28.0)
    md = (out / "learning.md").read_text()
    assert "0.700 +- 0.100" in md and "+0.150 +- 0.050" in md and "| seed 0 | seed 1 |" in md
    # a missing seed run leaves that arm partial, and the other seeds still count
    import shutil
    shutil.rmtree(runs / "seed1" / "basis")
    assert mod.main(["--preset", "smoke", "--arms", "basis,reinforce_pp", "--seeds", "0", "1", "--out",
                     str(tmp_path / "out2"), "--runs", str(runs), "--analyze-only"]) == 0
    rep2 = json.loads((tmp_path / "out2" / "learning.json").read_text())
    assert rep2["arms"]["basis"]["status"] == "partial" and rep2["arms"]["basis"]["final_accuracy"] == 0.6
    assert rep2["paired"]["basis"]["seeds"] == ["0"] and rep2["paired"]["basis"]["se"] is None


def test_eapo_arms_settings_and_pairing(mod, tmp_path, capsys):
    """The EAPO arms: hard levels for hard and hard_eapo, the eapo_prior arm's adapter as hard_eapo's prior (a
    missing one fails that arm before any training), and hard_eapo paired with hard, not with reinforce_pp."""
    assert mod.DEFAULT_ARMS == ("basis", "basis_prior", "reinforce_pp", "grpo8")  # EAPO arms only when asked for
    ov = mod.arm_overrides("hard_eapo", 8, 4, [4, 5], "runs/x/adapter")
    assert "data.levels=[4, 5]" in ov and "eapo.prior_adapter=runs/x/adapter" in ov
    assert not any(o.startswith(("data.levels", "eapo.")) for o in mod.arm_overrides("eapo_prior", 8, 4, [4, 5]))
    assert mod._arg_path(mod.ROOT / "runs" / "a") == "runs/a" and mod._arg_path(tmp_path) == str(tmp_path)

    runs, out = tmp_path / "runs", tmp_path / "out"
    rc = mod.main(["--preset", "smoke", "--arms", "hard_eapo", "--seeds", "0", "--out", str(out), "--runs", str(runs),
                   "--quiet", "--set", "train.threads=1"])
    err = capsys.readouterr().err
    assert rc == 1 and "no prior adapter at" in err and str(runs / "seed0" / "eapo_prior" / "adapter") in err
    assert not (runs / "seed0" / "hard_eapo").exists()

    times = [(2.0, 1.0), (2.0, 1.0)]
    for sd, (h, e) in {"0": (0.2, 0.3), "1": (0.4, 0.4)}.items():
        _fake_run(runs / f"seed{sd}" / "eapo_prior", times, [0.5, 0.6, 0.7], None)
        _fake_run(runs / f"seed{sd}" / "hard", times, [0.1, 0.1, h], None)
        _fake_run(runs / f"seed{sd}" / "hard_eapo", [(4.0, 2.0)] * 2, [0.1, 0.2, e], None)
    assert mod.main(["--preset", "smoke", "--arms", "eapo_prior,hard,hard_eapo", "--seeds", "0", "1", "--out",
                     str(out), "--runs", str(runs), "--analyze-only"]) == 0
    rep = json.loads((out / "learning.json").read_text())
    assert set(rep["paired"]) == {"hard_eapo"}
    pr = rep["paired"]["hard_eapo"]
    assert pr["vs"] == "hard" and pr["final_accuracy_diff"] == pytest.approx({"0": 0.1, "1": 0.0})
    assert pr["mean_diff"] == pytest.approx(0.05) and pr["se"] == pytest.approx(0.05) and pr["clock_ratio"] == 2.0
    md = (out / "learning.md").read_text()
    assert "hard_eapo minus hard: final accuracy +0.050 +- 0.050" in md and "EAPO arms:" in md


def test_time_to_accuracy_and_basis_against_grpo_at_equal_prompts(mod, tmp_path):
    """The time-to-accuracy table reads the mean curve (first eval point at or above each threshold, per-seed counts)
    and the headline divides the clock basis needs to reach another arm's final accuracy by that arm's clock; basis
    minus grpo8_wide is paired by seed."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    for sd, b_accs, w_accs in (("0", [0.2, 0.5, 0.6, 0.7], [0.2, 0.4, 0.6, 0.6]),
                               ("1", [0.2, 0.4, 0.6, 0.7], [0.2, 0.5, 0.6, 0.8])):
        _fake_run(runs / f"seed{sd}" / "basis", [(1.0, 1.0)] * 3, b_accs, None)
        _fake_run(runs / f"seed{sd}" / "grpo8_wide", [(4.0, 6.0)] * 3, w_accs, None)
        _fake_run(runs / f"seed{sd}" / "grpo8", [(0.5, 0.5)] * 3, [0.2, 0.3, 0.4, 0.5], None)
    assert mod.main(["--preset", "smoke", "--arms", "basis,grpo8_wide,grpo8", "--seeds", "0", "1", "--out", str(out),
                     "--runs", str(runs), "--analyze-only", "--thresholds", "0.45,0.6,0.75"]) == 0
    rep = json.loads((out / "learning.json").read_text())
    tta = rep["time_to_accuracy"]
    assert tta["thresholds"] == [0.45, 0.6, 0.75]
    b = tta["arms"]["basis"]
    # basis mean curve: 0.2, 0.45, 0.6, 0.7 at clocks 0, 2, 4, 6
    assert b["mean_curve"] == {"0.45": 2.0, "0.6": 4.0, "0.75": None}
    assert b["seeds_reaching"] == {"0.45": 2, "0.6": 2, "0.75": 0} and b["n_seeds"] == 2
    w = tta["arms"]["grpo8_wide"]  # mean 0.2, 0.45, 0.6, 0.7 at clocks 0, 10, 20, 30; seed 1 alone reaches 0.8
    assert w["mean_curve"] == {"0.45": 10.0, "0.6": 20.0, "0.75": None} and w["seeds_reaching"]["0.75"] == 1
    hr = tta["basis_reaches"]["grpo8_wide"]
    assert hr["accuracy"] == pytest.approx(0.7) and hr["clock_s"] == pytest.approx(6.0)
    assert hr["ratio"] == pytest.approx(6.0 / 30.0)
    assert tta["basis_reaches"]["grpo8"]["clock_s"] == pytest.approx(4.0)  # grpo8's final 0.5: basis at step 2
    assert tta["basis_reaches"]["grpo8"]["ratio"] == pytest.approx(4.0 / 3.0)
    pw = rep["paired"]["grpo8_wide"]  # PAIR_BASE: grpo8_wide minus basis
    assert pw["vs"] == "basis" and pw["final_accuracy_diff"] == pytest.approx({"0": -0.1, "1": 0.1})
    assert set(rep["paired_basis"]) == {"grpo8"}
    pb = rep["paired_basis"]["grpo8"]
    assert pb["final_accuracy_diff"] == pytest.approx({"0": 0.2, "1": 0.2}) and pb["clock_ratio"] == pytest.approx(2.0)
    md = (out / "learning.md").read_text()
    assert "| basis | 2.00 s (2/2) | 4.00 s (2/2) | - (0/2) |" in md
    assert "basis reaches grpo8_wide's final accuracy 0.700 after 6.00 s" in md and "0.20x" in md
    assert "basis minus grpo8: final accuracy +0.200 +- 0.000 (SE over 2 seeds)" in md


def test_thresholds_are_checked(mod, capsys):
    with pytest.raises(SystemExit):
        mod.parse_args(["--thresholds", "0.5,1.5"])
    assert "--thresholds" in capsys.readouterr().err
