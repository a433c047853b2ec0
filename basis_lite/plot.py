"""PNG charts of a run's metrics.jsonl (`basis-lite plot RUN_DIR [--out DIR]`; matplotlib, Agg, imported only here).

    plots = plot_run(run_dir, out=None)      Plots(paths written, lines skipped, the metrics file)

Charts (each written only when its data is there):

    reward.png              reward mean, accuracy and format rate of the rollouts vs step
    explained_variance.png  explained variance of the rewards by the baseline vs step (1 = perfect, 0 = a constant)
    step_time.png           generation and training seconds per step, stacked
    eval_accuracy.png       held-out greedy accuracy (overall and per level) at the eval points

The metrics are read with `basis_lite.metrics.read_metrics`: lines that fail to parse (a run killed mid-write) are
skipped and counted; when a step appears twice (a run resumed without truncation) the later record wins. Torch-free.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .metrics import FILE as METRICS_FILE
from .metrics import read_metrics


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


@dataclass
class Plots:
    paths: list[Path]  # the charts written
    skipped: int  # lines of the metrics file that did not parse
    metrics: Path  # the metrics file read


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Plots:
    """Write the charts into `out` (default RUN_DIR/plots). ConfigError when there is nothing to plot."""
    try:
        import matplotlib  # noqa: F401  (drawn on Agg canvases directly: no global backend switch, no display)
    except ImportError:
        raise ConfigError("`basis-lite plot` needs matplotlib: pip install 'basis-lite[plot]'") from None
    run_dir = Path(run_dir)
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        what = "no such folder" if not run_dir.exists() else "no metrics.jsonl there"
        raise ConfigError(f"{run_dir}: {what}; `basis-lite plot` takes a run folder written by `basis-lite train`")
    steps, evals, skipped = read_metrics(metrics)
    if not steps and not evals:
        bad = f"{skipped} line(s) did not parse; " if skipped else ""
        raise ConfigError(f"{metrics}: no step or eval records to plot ({bad}is the run just starting?)")
    out = Path(out) if out else run_dir / "plots"
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
    return Plots(written, skipped, metrics)
