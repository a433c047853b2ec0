"""`basis-lite eval` (greedy pass@1, sampled pass@k, per-level table, --base, --dataset, errors) and `basis-lite plot`
(valid PNGs from metrics.jsonl, bad lines skipped, clear errors), on one real smoke training per module."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from conftest import SMALL, train_smoke  # noqa: E402

import cli  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("BASIS_LITE_CACHE", str(tmp_path_factory.mktemp("cache")))
    run = train_smoke(tmp_path_factory.mktemp("evalplot") / "run", *SMALL, "train.steps=2", "train.eval_every=1",
                      one_thread=True)
    yield run
    mp.undo()


def _check_result(res: dict, n: int) -> None:
    assert 0.0 <= res["accuracy"] <= 1.0
    assert res["n"] == n
    assert res["by_level"], "the arithmetic task has levels; the breakdown is missing"
    assert sum(v["n"] for v in res["by_level"].values()) == n
    for v in res["by_level"].values():
        assert 0.0 <= v["accuracy"] <= 1.0


# ----------------------------------------------------------------------------------------------------------------
# eval


def test_eval_run_folder_writes_json_and_prints_table(run, capsys):
    assert cli.main(["eval", str(run), "--limit", "3"]) == 0
    res = json.loads((run / "eval.json").read_text())
    _check_result(res, 3)
    assert res["base"] is False and res["adapter"] == str(run / "adapter")
    assert res["dataset"] == "arithmetic" and "k" not in res
    out = capsys.readouterr().out
    assert "greedy pass@1" in out and "overall" in out and "level 1" in out and str(run / "eval.json") in out


def test_eval_writes_per_problem_samples_and_shows_misses(run, tmp_path, capsys):
    """eval_samples.jsonl beside the JSON: one line per problem whose verdicts recompute from its own completion
    and gold and add up to the accuracy; --show-misses prints the misses."""
    from basis_lite.data import load_examples
    from basis_lite.rewards.answers import extracted_answer
    from basis_lite.rewards.scorer import correctness
    from basis_lite.runs.saved import load_run_config, resolve_target

    out = tmp_path / "e.json"
    assert cli.main(["eval", str(run), "--limit", "4", "--out", str(out), "--show-misses", "2"]) == 0
    res = json.loads(out.read_text())
    samples = tmp_path / "e_samples.jsonl"
    assert res["samples_file"] == str(samples)
    recs = [json.loads(line) for line in samples.read_text().splitlines()]
    examples = load_examples(load_run_config(resolve_target(run)).data, "eval")[:4]
    assert [r["id"] for r in recs] == [ex.id for ex in examples]
    assert [r["gold"] for r in recs] == [ex.answer for ex in examples]
    assert [r["prompt"] for r in recs] == [ex.question for ex in examples]
    assert [r["level"] for r in recs] == [ex.meta["level"] for ex in examples]
    for r in recs:
        assert r["correct"] == bool(correctness(r["completion"], r["gold"]))
        assert r["extracted"] == extracted_answer(r["completion"])
        assert r["prompt_text"].endswith("assistant\n") and r["prompt"] in r["prompt_text"]
    assert sum(r["correct"] for r in recs) / len(recs) == pytest.approx(res["accuracy"])
    printed = capsys.readouterr().out
    misses = [r for r in recs if not r["correct"]]
    assert f"{len(misses)} of 4 problems missed" in printed
    for r in misses[:2]:
        assert f"- {r['id']}" in printed and f"gold {r['gold']!r}" in printed
    for r in misses[2:]:
        assert f"- {r['id']}" not in printed


def test_extracted_answer():
    from basis_lite.rewards.answers import extracted_answer

    assert extracted_answer("so \\boxed{3} then \\boxed{ 42 } and \\boxed{}") == "42"
    assert extracted_answer("no box, 17") is None
    assert extracted_answer("no box, 17", require_boxed=False) == "17"


def test_eval_adapter_folder_with_samples_gives_pass_at_k(run, tmp_path, capsys):
    out = tmp_path / "sub" / "e.json"
    assert cli.main(["eval", str(run / "adapter"), "--samples", "2", "--limit", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    _check_result(res, 2)
    assert res["k"] == 2 and res["samples"] == 2
    assert 0.0 <= res["pass@1_sampled"] <= res["pass@2"] <= 1.0
    assert "pass@2" in capsys.readouterr().out


def test_eval_base_disables_the_adapter(run, capsys):
    before = (run / "eval.json").read_text() if (run / "eval.json").exists() else None
    assert cli.main(["eval", str(run), "--base", "--limit", "2"]) == 0
    res = json.loads((run / "eval_base.json").read_text())
    _check_result(res, 2)
    assert res["base"] is True and res["adapter"] is None
    assert "adapter disabled" in capsys.readouterr().out
    if before is not None:  # the adapter's results are not overwritten by the base evaluation
        assert (run / "eval.json").read_text() == before


def test_eval_checkpoint_folder_and_dataset_file(run, tmp_path):
    rows = [{"question": f"What is ${a} + {a}$?", "answer": str(2 * a)} for a in range(1, 9)]
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    out = tmp_path / "e.json"
    assert cli.main(["eval", str(ckpt), "--dataset", str(data), "--limit", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["dataset"] == str(data) and res["n"] == 2 and res["adapter"] == str(ckpt / "adapter")


@pytest.mark.parametrize("argv, message", [
    (["eval", "{tmp}/does-not-exist"], "no such run folder"),
    (["eval", "{tmp}"], "not a basis-lite run folder"),
    (["eval", "{run}", "--dataset", "no-such-dataset"], "data.dataset"),
    (["eval", "{run}", "--set", "train.no_such_key=1"], "unknown config key"),
    (["eval", "{run}", "--samples", "-1"], "--samples"),
    (["eval", "{run}", "--show-misses", "-1"], "--show-misses"),
])
def test_eval_user_errors_exit_2(run, tmp_path, capsys, argv, message):
    argv = [a.format(tmp=tmp_path, run=run) for a in argv]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------
# plot


def _assert_pngs(paths: list[Path]) -> None:
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == PNG_MAGIC, f"{p} is not a PNG"
        assert len(data) > 1000, f"{p} is suspiciously small"


def test_plot_writes_valid_pngs(run, capsys):
    assert cli.main(["plot", str(run)]) == 0
    names = {"training.png", "reward.png", "explained_variance.png", "step_time.png", "eval_accuracy.png"}
    assert {p.name for p in (run / "plots").iterdir()} == names
    _assert_pngs([run / "plots" / n for n in names])
    printed = capsys.readouterr().out
    assert all(str(run / "plots" / n) in printed for n in names)


def test_plot_skips_bad_lines_and_writes_to_out(run, tmp_path, capsys):
    copy = tmp_path / "copy"
    copy.mkdir()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    garbage = ["{not json", "[1, 2, 3]", '{"no_step": 1}', ""]
    mixed = lines[:2] + garbage + lines[2:] + ['{"step": 99, "reward_me']  # last line cut by a kill
    (copy / "metrics.jsonl").write_text("\n".join(mixed))
    out = tmp_path / "charts"
    assert cli.main(["plot", str(copy), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "skipped 4 line(s)" in printed
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == 5
    _assert_pngs(pngs)
    assert not (copy / "plots").exists()


def test_plot_only_eval_records(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "event": "eval", "eval_accuracy": 0.25,
                                                        "eval_n": 4}) + "\n")
    assert cli.main(["plot", str(tmp_path)]) == 0
    assert [p.name for p in (tmp_path / "plots").iterdir()] == ["eval_accuracy.png"]


def test_plot_errors_exit_2(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    assert cli.main(["plot", str(tmp_path / "nope")]) == 2
    assert "no such folder" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("garbage\n")
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert "no step or eval records" in capsys.readouterr().err
    assert not (tmp_path / "plots").exists()


# ----------------------------------------------------------------------------------------------------------------
# what the charts hold (matplotlib figures, inspected before they are written)


def _synthetic(n_steps: int = 40, eval_every: int = 10):
    import random

    rng = random.Random(0)
    steps = [{"step": s, "reward_mean": 0.1 + s / 100, "accuracy": 0.1 + s / 100, "format_rate": 0.5,
              "explained_variance": rng.gauss(0, 0.1), "loss": rng.gauss(0, 0.01), "kl": 0.0,
              "entropy": 1 - s / 100, "completion_len": 30.0, "grad_norm": 0.2, "lr": 1e-4,
              "generation_s": 1.0, "training_s": 2.0} for s in range(1, n_steps + 1)]
    evals = [{"step": s, "event": "eval", "eval_accuracy": 0.2 + s / 100, "eval_n": 50}
             for s in range(0, n_steps + 1, eval_every)]
    evals.append({"step": n_steps, "event": "eval_final", "eval_accuracy": 0.7, "eval_n": 50})
    return steps, evals


def _line(ax, prefix: str):
    """The line labelled `prefix...`: a plain line, or the data line of an error-bar plot (eval points)."""
    from matplotlib.container import ErrorbarContainer

    for c in ax.containers:
        if isinstance(c, ErrorbarContainer) and c.get_label().startswith(prefix):
            return c.lines[0]
    return next(ln for ln in ax.get_lines() if ln.get_label().startswith(prefix))


def test_charts_show_every_eval_point_smoothing_and_the_training_panels():
    from basis_lite.plot import build_figures, smooth, smoothing_window

    steps, evals = _synthetic()
    figs = build_figures(steps, evals, rollouts_per_step=32, title="t")
    assert set(figs) == {"training.png", "reward.png", "explained_variance.png", "step_time.png",
                         "eval_accuracy.png"}
    eval_steps = [r["step"] for r in evals]  # 0, 10, 20, 30, 40 and the final eval at 40
    for ax in (figs["reward.png"].axes[0], figs["training.png"].axes[0]):
        held_out = _line(ax, "held-out accuracy")
        assert list(held_out.get_xdata()) == eval_steps
        assert list(held_out.get_ydata()) == [r["eval_accuracy"] for r in evals]
    ax = figs["reward.png"].axes[0]
    # reward and accuracy are equal here: drawn once, both named; raw + a centred mean of 5 steps (40 steps)
    assert smoothing_window(40) == 5
    smoothed = _line(ax, "training reward mean, sampled rollouts = training accuracy, sampled rollouts (mean of 5 "
                         "steps)")
    ys = [r["reward_mean"] for r in steps]
    assert list(smoothed.get_ydata()) == pytest.approx(smooth(ys, 5))
    titles = [a.get_title() for a in figs["training.png"].axes]
    for word in ("reward", "explained variance", "loss", "KL", "entropy", "completion length", "gradient norm",
                 "learning rate"):
        assert any(word in t for t in titles), (word, titles)
    kl_ax = next(a for a in figs["training.png"].axes if a.get_title().startswith("KL"))
    assert any("not computed" in t.get_text() for t in kl_ax.texts)  # kl is 0 at every step here
    (eval_ax,) = figs["eval_accuracy.png"].axes
    assert [c.get_label() for c in eval_ax.containers] == ["overall (bars: 95% Wilson interval)"]
    assert not [ln for ln in eval_ax.get_lines() if ln.get_label().startswith("level")]
    assert len(figs["eval_accuracy.png"].axes[0].texts) == len(evals)  # every point's value written


def test_smoothing_is_a_centred_mean_and_short_runs_stay_raw():
    from basis_lite.plot import smooth, smoothing_window

    assert [smoothing_window(n) for n in (3, 4, 5, 29, 30, 100, 1000)] == [1, 1, 3, 3, 3, 11, 101]
    assert smooth([0.0, 3.0, 6.0, 9.0], 3) == [1.5, 3.0, 6.0, 7.5]
    assert smooth([1.0, float("nan"), 3.0], 3) == [1.0, 2.0, 3.0]
    from basis_lite.plot import build_figures

    steps, evals = _synthetic(n_steps=4, eval_every=2)
    ax = build_figures(steps, evals)["reward.png"].axes[0]
    assert not any("mean of" in ln.get_label() for ln in ax.get_lines())


def test_explained_variance_reference_is_what_the_leave_one_out_mean_scores():
    """The dashed line: 1 - (B/(B-1))^2, checked against the explained variance of a real leave-one-out batch mean
    (the metric the trainer logs) on random rewards; and the note is on the chart."""
    import numpy as np
    import torch

    from basis_lite.estimators.base import explained_variance
    from basis_lite.plot import EV_NOTE, build_figures
    from basis_lite.runs.metrics import loo_reference_ev

    rng = np.random.default_rng(0)
    for b in (8, 32, 128):
        r = torch.tensor(rng.integers(0, 2, b), dtype=torch.float64)
        loo = (r.sum() - r) / (b - 1)
        assert explained_variance(r, loo) == pytest.approx(loo_reference_ev(b), rel=1e-9)
    steps, evals = _synthetic()
    fig = build_figures(steps, evals, rollouts_per_step=32)["explained_variance.png"]
    ref = _line(fig.axes[0], "leave-one-out batch mean")
    assert list(ref.get_ydata()) == [pytest.approx(1 - (32 / 31) ** 2)] * 2
    assert any(t.get_text().replace("\n", " ").startswith(EV_NOTE[:60]) for t in fig.texts)
    no_cfg = build_figures(steps, evals)["explained_variance.png"]
    assert not any(ln.get_label().startswith("leave-one-out") for ln in no_cfg.axes[0].get_lines())


def test_plot_reads_rollouts_per_step_from_the_run_config(run, tmp_path):
    from basis_lite.plot import _rollouts_per_step

    assert _rollouts_per_step(run) == 8  # smoke preset: train.batch_size 8 x 1 rollout
    (tmp_path / "config.yaml").write_text("not: [valid")
    assert _rollouts_per_step(tmp_path) is None


def test_wilson_interval():
    from basis_lite.plot import wilson_interval

    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    assert wilson_interval(5, 10) == pytest.approx((1 - wilson_interval(5, 10)[1], 1 - wilson_interval(5, 10)[0]))


def _synthetic_ev(with_loo_field: bool):
    steps = [{"step": s, "reward_mean": 0.1 * s, "accuracy": 0.1 * s, "explained_variance": -0.05 * s,
              **({"explained_variance_loo_ref": -0.1 if s < 3 else -0.2} if with_loo_field else {})}
             for s in range(1, 6)]
    evals = [{"step": 0, "event": "eval", "eval_accuracy": 0.25, "eval_n": 20},
             {"step": 5, "event": "eval", "eval_accuracy": 0.8, "eval_n": 10}]
    return steps, evals


def test_reward_chart_labels_sampled_vs_greedy_with_wilson_bars():
    from matplotlib.container import ErrorbarContainer

    from basis_lite.plot import build_figures, wilson_interval

    steps, evals = _synthetic_ev(False)
    ax = build_figures(steps, evals, rollouts_per_step=8)["reward.png"].axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("sampled" in t and "training" in t for t in labels), labels
    assert any("greedy" in t and "Wilson" in t for t in labels), labels
    (bars,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    segments = bars.lines[2][0].get_segments()
    for seg, (k, n) in zip(segments, [(5, 20), (8, 10)]):
        assert [seg[0][1], seg[1][1]] == pytest.approx(list(wilson_interval(k, n)))


@pytest.mark.parametrize("with_field", [True, False])
def test_explained_variance_chart_draws_the_leave_one_out_reference(with_field):
    from basis_lite.plot import build_figures

    steps, evals = _synthetic_ev(with_field)
    ax = build_figures(steps, evals, rollouts_per_step=8)["explained_variance.png"].axes[0]
    refs = [ln for ln in ax.get_lines() if "leave-one-out" in ln.get_label()]
    assert len(refs) == 1
    if with_field:  # the logged field wins over the config's batch size
        assert list(refs[0].get_ydata()) == [-0.1, -0.1, -0.2, -0.2, -0.2]
    else:
        assert list(refs[0].get_ydata()) == pytest.approx([1 - (8 / 7) ** 2] * 2)


def test_peak_memory_keeps_an_earlier_larger_allocation():
    """peak_memory_mb is the process's peak since it started: after 160 MiB are freed it still reports them
    (nothing in the package resets the kernel's high-water mark). Run in a fresh interpreter: in a process that
    earlier tests grew, the allocator can serve the 160 MiB from memory that is already resident."""
    import json
    import subprocess
    import sys

    code = (
        "import json, torch\n"
        "from basis_lite.model.loading import peak_memory_mb\n"
        "cpu = torch.device('cpu')\n"
        "start = peak_memory_mb(cpu)\n"
        "big = torch.ones(40 * 2**20)\n"  # 160 MiB, touched
        "high = peak_memory_mb(cpu)\n"
        "del big\n"
        "print(json.dumps([start, high, peak_memory_mb(cpu)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    start, high, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert high - start > 100 and after >= high - 1, (start, high, after)  # (the kernel updates it lazily)
