"""bench/report.py on hand-made comparison folders (no training): the t quantile and the paired 95 % intervals against
numbers worked out by hand, the verdicts, the curves' clock and tokens, the cost to reach a target, the Pareto
frontier, and --check failing on a tampered report or marked block.

The run folders are written the way bench/compare.py writes them: a metrics.jsonl in the trainer's format, turned
into summary.json by compare.summarize and kept by compare.keep_run.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, bench_module


@pytest.fixture(scope="module")
def rp():
    return bench_module("report.py")


@pytest.fixture(scope="module")
def cmp():
    return bench_module("compare.py", "bench_compare_for_report")


BASIS = [0.60, 0.62, 0.58, 0.64, 0.61]
# basis minus the arm, seed by seed
DIFFS = {"reinforce_pp": [0.05, 0.02, 0.01, 0.06, 0.05],  # mean 0.038, sd 0.0216795: ahead
         "grpo8": [0.04, -0.03, 0.02, -0.01, 0.00],  # mean 0.004, sd 0.0270185: tie
         "rloo2": [-0.03, -0.05, -0.04, -0.06, -0.02],  # mean -0.040, sd 0.0158114: behind
         "basis_raw": [0.02, 0.04, 0.03]}  # seeds 0-2 only: mean 0.030, sd 0.01, t(2)


def _write_run(cmp, tmp: Path, folder: Path, arm: str, seed: int, accs: list[float], reference=(0, 0.0)):
    """A finished 2-step run (eval every step, 3 s and 100 tokens per step) of `arm`, kept in `folder`; a run with
    reference samples also gets an RSS reading above its ru_maxrss."""
    run_dir = tmp / "src" / arm / f"seed{seed}"
    run_dir.mkdir(parents=True)
    lines = [{"step": 0, "event": "eval", "eval_accuracy": accs[0], "eval_n": 150, "eval_accuracy_level1": accs[0]}]
    for step in (1, 2):
        lines.append({"step": step, "generation_s": 2.0, "training_s": 1.0, "explained_variance": 0.1 * step,
                      "clipped_fraction": 0.25 * (step - 1),
                      "completion_len": 12.5, "prompt_tokens": 400, "generated_tokens": 100, "trained_tokens": 450,
                      "cum_reference_tokens": reference[0]})
        lines.append({"step": step, "event": "eval" if step == 1 else "eval_final", "eval_accuracy": accs[step],
                      "eval_n": 150, "eval_accuracy_level1": accs[step]})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    spec = {"arm": arm, "seed": seed, "description": arm, "estimator": arm, "prompts_per_step": 8,
            "rollouts_per_prompt": 1, "rollouts_per_step": 8, "eval_every": 1, "eval_set": 0, "preset": "p",
            "overrides": [], "external": "", "prior_samples": 8 if reference[0] else 0}
    info = {"eval_s": 1.0, "load_s": 2.0, "torch_threads": 2, "train_summary": {"prior_seconds": reference[1]}}
    measured = {"tree": {"commit": "c" * 40, "dirty": False}, "wall_s": 60.0, "peak_rss_mb": 1500.0 + seed,
                "peak_rss_sampled_mb": 1490.0 + (600.0 if reference[0] else 0.0),
                "machine": {"cpu_model": "Test CPU", "cores": 2, "cpu_flags": {"avx2": True}, "torch": "2.x"},
                "loadavg_before": [0.5, 0.4, 0.3], "loadavg_after": [1.5, 0.6, 0.4]}
    summary = cmp.summarize(spec, run_dir, info, measured)
    cmp.keep_run(run_dir, folder / "runs" / arm / f"seed{seed}", summary)


@pytest.fixture()
def folder(cmp, tmp_path):
    out = tmp_path / "synthetic-dev"
    for seed, acc in enumerate(BASIS):
        _write_run(cmp, tmp_path, out, "basis", seed, [0.3, acc - 0.05, acc])
    for arm, diffs in DIFFS.items():
        for seed, d in enumerate(diffs):
            acc = BASIS[seed] - d
            _write_run(cmp, tmp_path, out, arm, seed, [0.3, acc - 0.05, acc])
    # an arm drawing reference samples before training: 500 tokens, 4 s, where its curve starts
    _write_run(cmp, tmp_path, out, "astar", 0, [0.3, 0.4, 0.5], reference=(500, 4.0))
    return out


def test_t_quantile_matches_the_table(rp):
    for df, t in ((1, 12.706), (2, 4.303), (4, 2.776), (7, 2.365), (29, 2.045), (120, 1.980)):
        assert rp.t_quantile(0.975, df) == pytest.approx(t, abs=5e-4)
    assert rp.t_quantile(0.95, 10) == pytest.approx(1.812, abs=5e-4)
    assert rp.t_cdf(0.0, 3) == pytest.approx(0.5) and rp.t_cdf(-12.706, 1) == pytest.approx(0.025, abs=1e-5)


def test_paired_intervals_against_hand_values(rp, folder):
    rep = rp.analyze(rp.load_runs(folder))
    p = rep["paired"]
    # mean +- t(0.975, n-1) * sd / sqrt(n), sd and the intervals worked out by hand
    hand = {"reinforce_pp": (5, 0.038, 0.0110815, 0.0649185, "ahead"),
            "grpo8": (5, 0.004, -0.0295475, 0.0375475, "tie"),
            "rloo2": (5, -0.040, -0.0596323, -0.0203677, "behind"),
            "basis_raw": (3, 0.030, 0.0051582, 0.0548418, "ahead")}
    for arm, (n, mean, lo, hi, verdict) in hand.items():
        d = p[arm]
        assert (d["n"], d["verdict"]) == (n, verdict), arm
        assert (d["mean"], d["lo"], d["hi"]) == pytest.approx((mean, lo, hi), abs=2e-6), arm
    assert p["reinforce_pp"]["t"] == pytest.approx(0.038 / 0.0096954, abs=1e-3)
    assert p["basis_raw"]["seeds"] == [0, 1, 2]  # paired on the seeds both ran only
    assert p["astar"]["verdict"] == "n/a" and p["astar"]["lo"] is None  # one pair: no interval
    a = rep["arms"]["basis"]
    assert (a["n"], a["accuracy_after"]) == (5, pytest.approx(0.61))
    assert a["accuracy_se"] == pytest.approx(0.0223607 / 5 ** 0.5, abs=1e-6)  # sd of 0.60 0.62 0.58 0.64 0.61
    assert a["accuracy_after_by_level"] == {"1": pytest.approx(0.61)} and a["peak_rss_mb_max"] == 1504.0
    assert a["explained_variance_mean"] == pytest.approx(0.15) and a["trained_tokens"] == 900
    # the driver's own RSS readings above ru_maxrss (here astar's, 2090 against 1500 MB): the kernel's mark was reset
    assert rep["rss_understated"] == ["astar seed 0"]


def test_curves_targets_and_pareto(rp, folder):
    runs = rp.load_runs(folder)
    pts = [(p["step"], p["clock_s"], p["tokens"]) for p in runs["astar"][0]["points"]]
    assert pts == [(0, 4.0, 500), (1, 7.0, 600), (2, 10.0, 700)]  # reference samples first, then 3 s, 100 tokens
    assert [(p["clock_s"], p["tokens"]) for p in runs["basis"][0]["points"]] == [(0.0, 0), (3.0, 100), (6.0, 200)]
    rep = rp.analyze(runs, targets=(0.55, 0.6))
    t = rep["arms"]["basis"]["targets"]
    # mean curve 0.30 / 0.56 / 0.61: 0.55 first reached at step 1, 0.60 at step 2
    assert (t["0.55"]["step"], t["0.55"]["clock_s"], t["0.55"]["tokens"]) == (1, 3.0, 100)
    assert (t["0.6"]["step"], t["0.6"]["clock_s"], t["0.6"]["seeds_reaching"], t["0.6"]["n"]) == (2, 6.0, 4, 5)
    assert rep["arms"]["astar"]["targets"]["0.55"]["clock_s"] is None
    # rloo2 ends highest at the same clock as every arm but astar, which costs more: the frontier is rloo2 alone
    assert rep["pareto"]["clock"] == ["rloo2"] and rep["pareto"]["tokens"] == ["rloo2"]
    assert rp.pareto({"a": (1, 0.5), "b": (2, 0.6), "c": (2, 0.55), "d": (3, 0.6), "e": (0.5, 0.4)}) == ["e", "a", "b"]


def test_report_files_and_blocks_and_check(rp, folder, tmp_path, capsys):
    page = tmp_path / "page.md"
    page.write_text("# Results\n\n<!-- report:synthetic-dev -->\nold numbers\n<!-- /report:synthetic-dev -->\n\n"
                    "Text between.\n\n<!-- report:synthetic-dev/targets -->\n<!-- /report:synthetic-dev/targets -->\n"
                    "<!-- report:another -->\nkept as it is\n<!-- /report:another -->\n")
    assert rp.main([str(folder), "--pages", str(page)]) == 0
    md = (folder / "report.md").read_text()
    assert md.startswith("# Comparison synthetic-dev")
    assert "| reinforce_pp | 5 | +0.038 | [+0.011, +0.065] | 3.92 | ahead |" in md
    assert "| grpo8 | 5 | +0.004 | [-0.030, +0.038] | 0.33 | tie ([-0.030, +0.038]) |" in md
    assert "| rloo2 | 5 | -0.040 | [-0.060, -0.020] | -5.66 | behind |" in md
    assert "| basis | 8 x 1 | 16 | 5 | 0.300 | 0.610 ± 0.010 | 1: 0.610 |" in md
    # cut off: steps 1 and 2 clip 0 % and 25 % of their rollouts, 12.5 % on average over steps and seeds
    assert rp.analyze(rp.load_runs(folder))["arms"]["basis"]["cut_off"] == pytest.approx(0.125)
    assert "| 12.5 % | 1502 MB |" in md
    # per run: basis seed 3 ends at 0.64; astar's one run starts its clock with 4 s of reference samples
    assert "| basis | 3 | 0.300 | 0.640 | 12.5 % | 6.00 s | 60 s | 1503 MB | 0.50 → 1.50 | 1 |" in md
    assert "| astar | 0 | 0.300 | 0.500 | 12.5 % | 10 s |" in md
    assert md.index("## Per run") < md.index("## Where it ran")
    assert (folder / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((folder / "report.json").read_text())["paired"]["rloo2"]["verdict"] == "behind"
    text = page.read_text()
    assert "old numbers" not in text and "kept as it is" in text and "Text between." in text
    block = text.split("<!-- report:synthetic-dev -->\n")[1].split("\n<!-- /report:synthetic-dev -->")[0]
    assert block == rp.part_accuracy(rp.analyze(rp.load_runs(folder))) + "\n\n" + rp.part_paired(
        rp.analyze(rp.load_runs(folder)))
    assert "| basis | 3.00 s, 100 tok (5/5 seeds) | 6.00 s, 200 tok (4/5 seeds) | - (0/5 seeds) |" in text
    assert rp.main([str(folder), "--check", "--pages", str(page)]) == 0
    # a figure typed over in the page, or in report.md: --check fails and names it
    page.write_text(text.replace("+0.038", "+0.048", 1))
    capsys.readouterr()
    assert rp.main([str(folder), "--check", "--pages", str(page)]) == 1
    assert "page.md: a report:synthetic-dev block differs" in capsys.readouterr().err
    page.write_text(text)
    (folder / "report.md").write_text(md.replace("ahead", "tie", 1))
    assert rp.main([str(folder), "--check", "--pages", str(page)]) == 1
    assert "report.md differs from the raw files" in capsys.readouterr().err
    page.write_text(text + "<!-- report:synthetic-dev/bogus -->\n<!-- /report:synthetic-dev/bogus -->\n")
    assert rp.main([str(folder), "--pages", str(page)]) == 2
    assert "unknown block part" in capsys.readouterr().err
    assert rp.main([str(tmp_path / "empty"), "--pages"]) == 2


COMMITTED = sorted(p.parent for p in (REPO / "bench" / "results").glob("*/comparison.json"))


@pytest.mark.parametrize("folder", COMMITTED, ids=[p.name for p in COMMITTED])
def test_committed_comparisons_agree_with_their_report_and_pages(rp, folder, capsys):
    """Every comparison committed under bench/results/: its report.md and the README's and docs' marked blocks are
    what its raw run files give now (bench/report.py --check), so no committed figure of it is typed by hand."""
    rc = rp.main([str(folder), "--check"])
    assert rc == 0, capsys.readouterr().err


def test_machines_are_listed_apart_with_their_arms_and_kernel_level(rp):
    """Runs on two kinds of machine (or one machine with capped kernels) give one line each, naming the arms there."""
    def summary(arm, avx512, cap):
        return {"arm": arm, "cpu_model": "AMD EPYC", "cores": 2, "torch": "2.13.0+cpu", "torch_threads": 2,
                "torch_cpu_capability": cap,
                "cpu_flags": {"avx2": True, "fma": True, "avx512f": avx512, "avx512_bf16": avx512}, "accuracy_after": 0.5}
    runs = {"basis": {0: {"summary": summary("basis", False, "AVX2"), "cut_off": 0.0},
                      1: {"summary": summary("basis", True, "AVX2"), "cut_off": 0.0}},
            "trl8": {0: {"summary": summary("trl8", True, "AVX2"), "cut_off": 0.0}},
            "grpo8": {0: {"summary": summary("grpo8", True, "AVX512"), "cut_off": 0.0}}}
    lines = rp._machines(runs)
    assert len(lines) == 3 and [m.split(". ")[0] for m in lines] == ["1", "2", "3"]
    capped = [m for m in lines if "flags: avx2 fma avx512f" in m and "kernels at AVX2" in m]
    assert len(capped) == 1 and capped[0].endswith(": basis, trl8")
    assert any("without avx512f" in m and m.endswith("kernels at AVX2: basis") for m in lines)
    assert any(m.endswith("kernels at AVX512: grpo8") for m in lines)
    # a run's machine number (the per-run table's column, from per_run) is its line's number
    number = {(r["arm"], r["seed"]): r["machine"] for r in rp.per_run(runs)}
    assert lines[number["trl8", 0] - 1] == capped[0] and number["basis", 1] == number["trl8", 0] != number["basis", 0]


def test_the_first_line_names_the_overrides_every_run_shares(rp):
    """A comparison run with `--set data.dataset=...` says so in report.md's first line; the per-arm and per-seed
    overrides (estimator, batch, seed), and those the line states in its own words, are left out."""
    every = [{"overrides": ["train.seed=0", "data.dataset=wordproblems", "train.steps=20", "estimator.name=basis"]},
             {"overrides": ["train.seed=1", "data.dataset=wordproblems", "train.steps=20", "estimator.name=grpo"]}]
    assert rp._common_overrides(every) == ["data.dataset=wordproblems"]
    assert rp._common_overrides([{"overrides": []}, {}]) == []
    # the committed wordproblems comparison (report.md equal to what the raw files give: the test above)
    runs = rp.load_runs(REPO / "bench" / "results" / "wordproblems-confirm")
    first = rp.markdown("wordproblems-confirm", rp.analyze(runs)).splitlines()[2]
    assert first.startswith("Preset `cpu-smollm2-arith` with `data.dataset=wordproblems`, "), first
    assert "generation.max_new_tokens=320" in first and "estimator.name" not in first and "train.seed" not in first
