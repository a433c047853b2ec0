"""`basis-lite plot RUN_DIR [--out DIR]`: PNG charts of a run's metrics.jsonl (matplotlib, Agg, imported only here).

Charts (each written only when its data is there):

    reward.png              reward mean, accuracy and format rate of the rollouts vs step
    explained_variance.png  explained variance of the rewards by the baseline vs step (1 = perfect, 0 = a constant)
    step_time.png           generation and training seconds per step, stacked
    eval_accuracy.png       held-out greedy accuracy (overall and per level) at the eval points

Lines that fail to parse (a run killed mid-write) are skipped with a count; when a step appears twice (a run resumed
without truncation) the later record wins.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .config import ConfigError


def read_metrics(path: Path) -> tuple[list[dict], list[dict], int]:
    """(step records sorted by step, eval records sorted by step, number of lines skipped)."""
    steps: dict[int, dict] = {}
    evals: list[dict] = []
    skipped = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), (int, float)):
                skipped += 1
                continue
            if rec.get("event") in ("eval", "eval_final"):
                if "eval_accuracy" in rec:
                    evals.append(rec)
            elif "event" not in rec:
                steps[int(rec["step"])] = rec
    evals.sort(key=lambda r: (r["step"], r.get("event") == "eval_final"))
    return [steps[s] for s in sorted(steps)], evals, skipped


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _series(records: list[dict], key: str) -> tuple[list[float], list[float]] | None:
    pts = [(r["step"], _num(r[key])) for r in records if key in r]
    if not pts:
        return None
    return [p[0] for p in pts], [p[1] for p in pts]


def _figure():
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("step")
    return fig, ax


def _save(fig, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, format="png")
    tmp.replace(path)
    return path


def _all_nan(ys: list[float]) -> bool:
    return all(math.isnan(y) for y in ys)


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the charts; returns the paths written. ConfigError when there is nothing to plot."""
    try:
        import matplotlib  # noqa: F401  (drawn on Agg canvases directly: no global backend switch, no display)
    except ImportError:
        raise ConfigError("`basis-lite plot` needs matplotlib: pip install 'basis-lite[plot]'") from None
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        what = "no such folder" if not run_dir.exists() else "no metrics.jsonl there"
        raise ConfigError(f"{run_dir}: {what}; `basis-lite plot` takes a run folder written by `basis-lite train`")
    steps, evals, skipped = read_metrics(metrics)
    if skipped:
        print(f"skipped {skipped} line(s) of {metrics} that did not parse")
    if not steps and not evals:
        raise ConfigError(f"{metrics}: no step or eval records to plot (is the run just starting?)")
    out = Path(out_dir) if out_dir else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    title = run_dir.resolve().name
    written: list[Path] = []

    # 1. rewards
    lines = [(k, lab) for k, lab in (("reward_mean", "reward mean"), ("accuracy", "accuracy (correct answers)"),
                                     ("format_rate", "format rate")) if _series(steps, k)]
    if lines:
        fig, ax = _figure()
        for key, label in lines:
            xs, ys = _series(steps, key)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
        ax.set_ylabel("per rollout, batch mean")
        ax.set_title(f"{title}: training rewards")
        ax.legend(loc="best")
        written.append(_save(fig, out / "reward.png"))

    # 2. explained variance of the rewards by the baseline
    s = _series(steps, "explained_variance")
    if s:
        xs, ys = s
        fig, ax = _figure()
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, color="tab:purple")
        ax.axhline(0.0, color="grey", lw=0.8, ls="--")
        ax.set_ylabel("explained variance  1 - Var(r - b) / Var(r)")
        ax.set_title(f"{title}: baseline explained variance")
        if _all_nan(ys):
            ax.text(0.5, 0.5, "undefined at every step\n(rewards constant within each batch)",
                    transform=ax.transAxes, ha="center", va="center", color="grey")
            ax.set_ylim(-1, 1)
            ax.set_xlim(min(xs) - 0.5, max(xs) + 0.5)
        written.append(_save(fig, out / "explained_variance.png"))

    # 3. step time
    g, t = _series(steps, "generation_s"), _series(steps, "training_s")
    if g or t:
        fig, ax = _figure()
        if g and t and g[0] == t[0]:
            xs = g[0]
            gy = [0.0 if math.isnan(y) else y for y in g[1]]
            ty = [0.0 if math.isnan(y) else y for y in t[1]]
            ax.stackplot(xs, gy, ty, labels=["generation", "training"], alpha=0.8)
        else:
            for ser, label in ((g, "generation"), (t, "training")):
                if ser:
                    ax.plot(ser[0], ser[1], label=label)
        ax.set_ylabel("seconds per step")
        ax.set_title(f"{title}: step time")
        ax.legend(loc="upper left")
        written.append(_save(fig, out / "step_time.png"))

    # 4. held-out eval accuracy
    if evals:
        fig, ax = _figure()
        xs = [r["step"] for r in evals]
        ax.plot(xs, [_num(r["eval_accuracy"]) for r in evals], marker="o", lw=2, color="black", label="overall")
        level_keys = sorted({k for r in evals for k in r if k.startswith("eval_accuracy_level")},
                            key=lambda k: (len(k), k))
        for key in level_keys:
            pts = [(r["step"], _num(r[key])) for r in evals if key in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", ls="--",
                    label=key.replace("eval_accuracy_", "").replace("level", "level "))
        n = evals[-1].get("eval_n")
        ax.set_ylabel("greedy accuracy" + (f" (n={n})" if n else ""))
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{title}: held-out accuracy")
        ax.legend(loc="best")
        written.append(_save(fig, out / "eval_accuracy.png"))
    return written


def run_plot_command(args) -> int:
    paths = plot_run(args.run_dir, getattr(args, "out", None))
    for p in paths:
        print(p)
    return 0
