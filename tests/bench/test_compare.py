"""bench/compare.py: the comparison harness on the smoke preset (tiny random model, 2 steps, 2 arms x 2 seeds), and its
refusals, run order and resume on their own.

The random model learns nothing; what is checked is the bookkeeping a reviewer relies on: every run's summary.json
fields (from the run's own metrics.jsonl, the driver's measurements and the machine), the one-commit and clean-tree
rules, the arms interleaved and rotated, and an interrupted comparison continuing where it stopped.
"""
from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, VARIED, bench_module, sets, subprocess_env

from basis_lite.config import ConfigError
from basis_lite.estimators import estimator_names
from basis_lite.safeio import RunLock
from bench.lib.arms import ARMS as ARMS_TABLE

SCRIPT = REPO / "bench" / "compare.py"
ARMS = ("basis", "reinforce_pp")
SEEDS = (0, 1)
FIELDS = ("arm", "seed", "commit", "dirty", "cpu_flags", "cpu_model", "torch", "torch_threads", "loadavg_before",
          "loadavg_after", "accuracy_before", "accuracy_after", "accuracy_before_by_level", "accuracy_after_by_level",
          "clock_s", "generation_s", "update_s", "eval_s", "load_s", "reference_s", "wall_s", "prompt_tokens",
          "generated_tokens", "trained_tokens", "reference_tokens", "cost_source", "peak_rss_mb",
          "explained_variance_mean", "rollouts_per_step", "eval_set", "env")


@pytest.fixture(scope="module")
def cmp():
    return bench_module("compare.py")


def _args(folder: Path, work: Path, arms=ARMS, seeds=SEEDS, steps: int = 2) -> list[str]:
    return [str(folder), "--preset", "smoke", "--arms", ",".join(arms), "--seeds", *map(str, seeds), "--steps",
            str(steps), "--eval-every", "1", "--work", str(work), "--allow-dirty", *sets(VARIED)]


def _run(args: list[str], timeout: float = 400) -> subprocess.CompletedProcess:
    # LRU_CACHE_CAPACITY 129 (the product's own default is 128): a variable each summary's `env` must record
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO,
                          env={**subprocess_env(), "LRU_CACHE_CAPACITY": "129"}, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    d = tmp_path_factory.mktemp("compare")
    folder, work = d / "smoke-cmp", d / "work" / "smoke-cmp"
    proc = _run(_args(folder, work))
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return folder, work, proc


def _summary(folder: Path, arm: str, seed: int) -> dict:
    return json.loads((folder / "runs" / arm / f"seed{seed}" / "summary.json").read_text())


def test_seeds_and_the_order_of_the_runs(cmp):
    assert cmp.parse_seeds(["0-2", "5"]) == [0, 1, 2, 5]
    assert cmp.parse_seeds(["100-103"]) == [100, 101, 102, 103]
    for bad in (["x"], ["3-1"], ["-1"], ["0-2", "2"]):
        with pytest.raises(cmp.CompareError, match="--seeds"):
            cmp.parse_seeds(bad)
    # seed by seed, every arm once per seed, the arms rotated by one more place for each seed
    assert cmp.run_order(["a", "b", "c"], [0, 1, 2, 3]) == [
        ("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1), ("c", 2), ("a", 2), ("b", 2),
        ("a", 3), ("b", 3), ("c", 3)]


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def test_a_dirty_tree_is_refused_unless_allowed_and_then_marked(cmp, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "code.py").write_text("x = 1\n")
    _git(repo, "add", "code.py")
    _git(repo, "commit", "-qm", "one")
    clean = cmp.tree_state(False, repo)
    assert clean["dirty"] is False and len(clean["commit"]) == 40 and "diff_sha256" not in clean
    (repo / "new_results.json").write_text("{}")  # untracked files (a comparison's own results) do not count
    assert cmp.tree_state(False, repo)["dirty"] is False
    (repo / "code.py").write_text("x = 2\n")
    with pytest.raises(cmp.CompareError, match="uncommitted changes.*--allow-dirty"):
        cmp.tree_state(False, repo)
    dirty = cmp.tree_state(True, repo)
    assert dirty["dirty"] is True and dirty["commit"] == clean["commit"] and len(dirty["diff_sha256"]) == 64
    (repo / "code.py").write_text("x = 3\n")
    assert cmp.tree_state(True, repo)["diff_sha256"] != dirty["diff_sha256"]  # other changes, another hash
    _git(repo, "checkout", "code.py")
    assert cmp.tree_state(True, repo)["dirty"] is True  # --allow-dirty marks every run, clean or not
    with pytest.raises(cmp.CompareError, match="not a git checkout"):
        cmp.tree_state(False, tmp_path / "elsewhere")


def test_a_comparison_continues_on_a_commit_that_changed_only_results_docs_or_tests(cmp, tmp_path):
    """Committing finished runs (or docs, or tests) between two invocations leaves the code the runs train the
    same: the comparison continues; a change to code, a preset or a top-level non-markdown file ends it."""
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "code.py").write_text("x = 1\n")
    (repo / "docs" / "a.md").write_text("a\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "one")
    first = cmp.tree_state(False, repo)["commit"]
    (repo / "docs" / "a.md").write_text("b\n")  # a tracked doc edited: not a dirty tree for a comparison
    assert cmp.tree_state(False, repo)["dirty"] is False
    for path in ("bench/results/c/runs/basis/seed0/summary.json", "tests/test_x.py", "README.md"):
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text("{}\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "results")
    second = cmp.tree_state(False, repo)["commit"]
    assert second != first and cmp.code_changes(first, second, repo) == []
    (repo / "code.py").write_text("x = 2\n")
    (repo / "presets").mkdir()
    (repo / "presets" / "p.yaml").write_text("a: 1\n")
    with pytest.raises(cmp.CompareError, match="uncommitted changes"):
        cmp.tree_state(False, repo)
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "code")
    third = cmp.tree_state(False, repo)["commit"]
    assert cmp.code_changes(first, third, repo) == ["code.py", "presets/p.yaml"]
    assert cmp.code_changes("0" * 40, third, repo) is None


def test_the_recorded_command_holds_no_machine_path(cmp, tmp_path):
    main_results = tmp_path / "main" / "bench" / "results" / "dev"  # a worktree writing into main's folder
    assert cmp.recorded_command(main_results, [str(main_results), "--seeds", "4-7", "--arms", "basis"]) == \
        "python bench/compare.py bench/results/dev --seeds 4-7 --arms basis"
    other = tmp_path / "elsewhere" / "cmp"
    assert cmp.recorded_command(other, [str(other), "--seeds", "0"]) == "python bench/compare.py cmp --seeds 0"
    assert str(tmp_path) not in cmp.recorded_command(other, [str(other), "--seeds", "0"])


def test_an_arm_the_installed_package_cannot_run_fails_clearly(cmp, tmp_path, capsys):
    from bench.lib.arms import check_estimators

    known = estimator_names()
    check_estimators(["basis", "reinforce_pp", "grpo8", "rloo2_norm", "trl8"], known)  # all registered (trl8: TRL)
    with pytest.raises(ConfigError, match=r"arm\(s\) astar \(estimator.name=astar\).*registers basis"):
        check_estimators(["basis", "astar"], tuple(n for n in known if n != "astar"))
    rc = cmp.main([str(tmp_path / "c"), "--preset", "smoke", "--seeds", "0", "--arms", "basis,nope",
                   "--allow-dirty"])
    assert rc == 2 and "--arms: nope not accepted" in capsys.readouterr().err
    rc = cmp.main([str(tmp_path / "c"), "--preset", "smoke", "--seeds", "0", "--arms", "basis,grpo8",
                   "--allow-dirty", "--set", "train.batch_size=12"])
    assert rc == 2 and "not a multiple of 8" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_dry_run_lists_the_runs_in_order(cmp, tmp_path, capsys):
    rc = cmp.main([str(tmp_path / "c"), "--preset", "smoke", "--seeds", "0-1", "--arms", "basis,grpo8,rloo2_norm",
                   "--allow-dirty", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and "6 runs (3 arms x 2 seeds), 6 to train" in out
    runs = [line.split()[1:] for line in out.splitlines() if line.startswith("  train")]
    assert runs == [["basis", "seed", "0"], ["grpo8", "seed", "0"], ["rloo2_norm", "seed", "0"],
                    ["grpo8", "seed", "1"], ["rloo2_norm", "seed", "1"], ["basis", "seed", "1"]]
    assert not (tmp_path / "c").exists()


def test_every_run_leaves_its_summary_and_metrics(smoke):
    folder, work, proc = smoke
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    # the runs in the order trained: seed 0 in the given order, seed 1 rotated
    trained = [line.split("]")[0][1:] for line in proc.stdout.splitlines() if "] training" in line]
    assert trained == ["basis seed 0", "reinforce_pp seed 0", "reinforce_pp seed 1", "basis seed 1"]
    for arm in ARMS:
        for seed in SEEDS:
            s = _summary(folder, arm, seed)
            assert set(FIELDS) <= set(s), set(FIELDS) - set(s)
            assert (s["arm"], s["seed"], s["commit"], s["dirty"]) == (arm, seed, head, True)
            assert f"train.seed={seed}" in s["overrides"] and s["eval_set"] == 0
            assert s["rollouts_per_step"] == 8 and s["steps"] == 2
            assert 0.0 <= s["accuracy_after"] <= 1.0 and set(s["accuracy_after_by_level"]) == {"1", "2"}
            parts = s["generation_s"] + s["update_s"] + s["reference_s"]
            assert s["clock_s"] == pytest.approx(parts, abs=2e-3) and s["clock_s"] > 0
            assert s["wall_s"] > s["clock_s"] + s["eval_s"] + s["load_s"] > 0
            assert s["eval_s"] > 0 and s["load_s"] > 0
            assert 100 < s["peak_rss_mb"] < 8000 and "ru_maxrss" in s["peak_rss_source"]
            assert 100 < s["peak_rss_sampled_mb"] < 8000  # read from outside every 50 ms
            assert s["torch_threads"] == 1 and "avx2" in s["cpu_flags"] and len(s["loadavg_before"]) == 3
            assert s["env"]["LRU_CACHE_CAPACITY"] == "129"
            with gzip.open(folder / "runs" / arm / f"seed{seed}" / "metrics.jsonl.gz", "rt") as f:
                lines = [json.loads(x) for x in f]
            steps = [x for x in lines if "event" not in x]
            assert [x["step"] for x in steps] == [1, 2]
            evs = [x["explained_variance"] for x in steps]
            assert s["explained_variance_mean"] == pytest.approx(sum(evs) / len(evs)) and math.isfinite(
                s["explained_variance_mean"])
            assert [(x["step"], x["event"]) for x in lines if "event" in x] == [(0, "eval"), (1, "eval"),
                                                                             (2, "eval_final")]
            # the trainer's own counters when it writes them, else derived from completion_len (and said so)
            if "generated_tokens" in steps[0]:
                assert s["generated_tokens"] == sum(x["generated_tokens"] for x in steps)
            else:
                assert s["generated_tokens"] == round(sum(x["completion_len"] for x in steps) * 8)
                assert "completion_len" in s["cost_source"]["generated_tokens"]
            assert s["reference_tokens"] == 0
    rec = json.loads((folder / "comparison.json").read_text())
    assert rec["commit"] == head and rec["arms"] == list(ARMS) and rec["seeds"] == list(SEEDS)
    assert rec["settings"]["eval_set"] == 0 and rec["settings"]["steps"] == 2
    assert not any(work.glob("*/seed*"))  # training folders go once a run is done


def test_an_interrupted_comparison_continues(smoke, tmp_path):
    folder, work, _ = smoke
    kept = {(a, s): (folder / "runs" / a / f"seed{s}" / "summary.json").read_text() for a in ARMS for s in SEEDS}
    # a run interrupted after its metrics were copied but before its summary: it starts again from nothing
    (folder / "runs" / "reinforce_pp" / "seed1" / "summary.json").unlink()
    (work / "reinforce_pp" / "seed1" / "run").mkdir(parents=True)
    proc = _run(_args(folder, work))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("done already: kept") == 3 and "4 runs (2 arms x 2 seeds), 1 to train" in proc.stdout
    assert [line for line in proc.stdout.splitlines() if "] training" in line][0].startswith("[reinforce_pp seed 1]")
    for key, text in kept.items():
        if key != ("reinforce_pp", 1):
            assert (folder / "runs" / key[0] / f"seed{key[1]}" / "summary.json").read_text() == text
    assert set(FIELDS) <= set(_summary(folder, "reinforce_pp", 1))
    # other settings, or another commit, on the same folder: refused before anything trains
    proc = _run(_args(folder, work, steps=3))
    assert proc.returncode == 2 and "other settings (steps 2 -> 3)" in proc.stderr
    rec = json.loads((folder / "comparison.json").read_text())
    tampered = tmp_path / "other-commit"
    (tampered / "runs").mkdir(parents=True)
    (tampered / "comparison.json").write_text(json.dumps({**rec, "commit": "0" * 40}))
    proc = _run(_args(tampered, tmp_path / "w2"))
    assert proc.returncode == 2 and "ran on commit 000000000000" in proc.stderr


def test_stop_after_starts_no_run_that_would_end_too_late(cmp, smoke, tmp_path, capsys):
    """--stop-after: a run is judged by the longest finished run of its arm (summary.json's wall_s), and the
    invocation stops before it rather than cut it short; the same command continues later."""
    import shutil

    folder, work = tmp_path / "smoke-cmp", tmp_path / "work" / "smoke-cmp"
    shutil.copytree(smoke[0], folder)
    walls = [_summary(folder, "reinforce_pp", s)["wall_s"] for s in SEEDS]
    assert cmp.expected_wall_s(folder, "reinforce_pp") == max(walls) > 0
    assert cmp.expected_wall_s(folder, "grpo8") == 0.0  # no finished run: judged 0 s
    (folder / "runs" / "reinforce_pp" / "seed1" / "summary.json").unlink()
    assert cmp.expected_wall_s(folder, "reinforce_pp") == walls[0]
    (folder / "runs" / "reinforce_pp" / "seed0" / "summary.json").write_text("{not json")
    assert cmp.expected_wall_s(folder, "reinforce_pp") == 0.0  # an unreadable summary counts for nothing
    (folder / "runs" / "reinforce_pp" / "seed0" / "summary.json").write_text(json.dumps({"wall_s": walls[0]}))
    rc = cmp.main(_args(folder, work) + ["--stop-after", str(walls[0] / 2 / 60)])
    out = capsys.readouterr().out
    assert rc == 0 and "4 runs (2 arms x 2 seeds), 1 to train" in out
    assert "] training" not in out and "stopped (--stop-after" in out and "not started: reinforce_pp seed 1" in out
    assert not (folder / "runs" / "reinforce_pp" / "seed1" / "summary.json").exists()  # nothing trained
    rc = cmp.main(_args(folder, work) + ["--stop-after", "0", "--dry-run"])
    assert rc == 2 and "--stop-after: 0; expected a positive number of minutes" in capsys.readouterr().err


def test_two_failed_runs_in_a_row_end_the_invocation(tmp_path):
    """A worker that cannot start (here: a model path that does not exist) fails every run alike: the harness stops
    after two failures in a row instead of trying them all, and says which runs it did not start."""
    folder = tmp_path / "broken"
    proc = _run(_args(folder, tmp_path / "work" / "broken", steps=1) + ["--set", f"model.name={tmp_path / 'none'}"])
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert [line.split("]")[0][1:] for line in proc.stdout.splitlines() if "] training" in line] == \
        ["basis seed 0", "reinforce_pp seed 0"]
    assert "stopped (two runs in a row failed); not started: reinforce_pp seed 1, basis seed 1" in proc.stderr
    assert "failed: basis seed 0, reinforce_pp seed 0" in proc.stderr
    assert not list((folder / "runs").glob("*/seed*/summary.json"))


def test_one_harness_trains_at_a_time(cmp, tmp_path, capsys):
    work = tmp_path / "runs" / "c"
    with RunLock(work.parent):
        rc = cmp.main([str(tmp_path / "c"), "--preset", "smoke", "--seeds", "0", "--arms", "basis", "--allow-dirty",
                       "--work", str(work)])
    assert rc == 2 and "one training process at a time" in capsys.readouterr().err


def _one_step_of(arm: str, tmp_path: Path, *overrides: str) -> dict:
    """The summary.json of one 1-step run of `arm` (seed 0) through the harness, with every field a run records;
    `overrides` are more --set items."""
    folder = tmp_path / f"{arm}-cmp"
    proc = _run(_args(folder, tmp_path / "work" / f"{arm}-cmp", arms=(arm,), seeds=(0,), steps=1) + sets(overrides))
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    s = _summary(folder, arm, 0)
    assert set(FIELDS) <= set(s)
    return s


def test_trl_arm_runs_through_vs_trl_worker(tmp_path):
    """TRL's GRPOTrainer (G=8) as an arm: the same summary fields, its token counts from TRL's own log."""
    pytest.importorskip("trl")
    s = _one_step_of("trl8", tmp_path)
    assert (s["prompts_per_step"], s["rollouts_per_prompt"], s["estimator"]) == (1, 8, "TRL GRPOTrainer")
    assert s["trained_tokens"] == s["prompt_tokens"] + s["generated_tokens"] > s["generated_tokens"] > 0
    assert "TRL's log" in s["cost_source"]["trained_tokens"] and s["trl"]
    assert s["explained_variance_mean"] is None and s["accuracy_after"] is not None and s["peak_rss_mb"] > 100


@pytest.mark.parametrize("arm", ["trl_a2po", "trl_a2po_tempered"])
def test_trl_a2po_arm_runs_through_vs_trl_worker(tmp_path, arm):
    """TRL's A2POTrainer as an arm: its Stage 1 (8 reference samples per prompt) timed into the clock and its tokens
    into reference_tokens, its steps' tokens counted from what its generate calls returned; the tempered arm records
    the temperature its logits were divided by."""
    pytest.importorskip("trl.experimental.a2po")
    s = _one_step_of(arm, tmp_path, "generation.temperature=0.8")
    assert (s["prompts_per_step"], s["rollouts_per_prompt"]) == (8, 1)
    assert s["estimator"] == ARMS_TABLE[arm].estimator and s["estimator"].startswith("TRL A2POTrainer")
    assert s.get("logits_divided_by") == (0.8 if arm == "trl_a2po_tempered" else None)
    assert s["reference_s"] > 0 and s["reference_cached"] is False
    assert s["clock_s"] == pytest.approx(s["generation_s"] + s["update_s"] + s["reference_s"], abs=2e-3)
    # Stage 1 sampled 8 completions of each of the run's 8 prompts, up to the preset's 12 new tokens each
    assert 8 * 8 <= s["reference_tokens"] <= 8 * 8 * 12
    assert 8 <= s["generated_tokens"] <= 8 * 12
    assert s["trained_tokens"] == s["prompt_tokens"] + s["generated_tokens"]
    assert "A2PO's generate" in s["cost_source"]["trained_tokens"] and s["trl"]
    assert 1 <= s["kept_prompts"] <= 8 and s["accuracy_after"] is not None
