"""PNG charts of a run's metrics.jsonl (`basis-lite plot RUN_DIR [--out DIR]`; matplotlib, Agg, imported only here).

    plots = plot_run(run_dir, out=None)      Plots(paths written, lines skipped, the metrics file)
    figures = build_figures(steps, evals, rollouts_per_step=None, title="")   {file name: matplotlib Figure}

Charts (each written only when its data is there):

    training.png            one page: reward and accuracy with the held-out evals, explained variance, loss, KL,
                            entropy, completion length, gradient norm, learning rate
    reward.png              reward mean, accuracy and format rate of the sampled training rollouts vs step, with
                            every held-out eval point (greedy accuracy, a different quantity: labelled so) and its
                            95% Wilson interval on the same axes
    explained_variance.png  explained variance of the rewards by the baseline vs step, with what the leave-one-out
                            batch mean scores, 1 - (B/(B-1))^2 (the step's `explained_variance_loo_ref` when the
                            metrics carry it, else from the config's rollouts per step), and a note on reading it
    step_time.png           generation and training seconds per step, stacked
    eval_accuracy.png       held-out greedy accuracy (overall, with its 95% Wilson interval, and per level) at every
                            eval point, values written

Noisy per-step series are drawn twice: the raw values thin and faint, and a centred moving average over `window`
steps (odd, about a tenth of the run, at least 3) on top; runs shorter than 5 steps are drawn raw only. Eval points
are never smoothed. The rollouts per step for the explained-variance reference come from the run's config.yaml
(train.batch_size x estimator.rollouts_per_prompt) when it is there.

The metrics are read with `basis_lite.runs.metrics.read_metrics`: lines that fail to parse (a run killed mid-write) are
skipped and counted; when a step appears twice (a run resumed without truncation) the later record wins. Torch-free.
"""
from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .runs.metrics import FILE as METRICS_FILE
from .runs.metrics import loo_reference_ev, read_metrics
from .safeio import check_run_folder, read_regular

MIN_SMOOTH_POINTS = 5
RAW_ALPHA = 0.35
EV_NOTE = ("Explained variance = 1 - Var(r - b) / Var(r) over the rollouts of a step. With one rollout per prompt most "
           "of the reward variance is the luck of each single rollout, which no baseline can predict: values near 0 "
           "are expected even from a good baseline. A leave-one-out baseline (b never uses the rollout's own reward) "
           "built from the plain batch mean scores 1 - (B/(B-1))^2 for B rollouts per step (dashed): above that line "
           "the baseline removes more variance than that batch mean, by telling easier prompts from harder ones; "
           "below it, less.")
TRAINING_PANELS = [("loss", "loss (policy + KL)"), ("kl", "KL to the reference (k3)"), ("entropy", "entropy (nats/token)"),
                   ("completion_len", "completion length (tokens)"), ("grad_norm", "gradient norm (before clipping)"),
                   ("lr", "learning rate")]


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


def smoothing_window(n: int) -> int:
    """The moving-average window for a series of n points: odd, about n/10, at least 3; 1 (none) below 5 points."""
    if n < MIN_SMOOTH_POINTS:
        return 1
    w = max(3, n // 10)
    return w if w % 2 else w + 1


def smooth(ys: list[float], window: int) -> list[float]:
    """Centred moving average (the window shrinks at the ends, NaNs are left out of each mean)."""
    half = window // 2
    out = []
    for i in range(len(ys)):
        vals = [y for y in ys[max(0, i - half):i + half + 1] if not math.isnan(y)]
        out.append(sum(vals) / len(vals) if vals else math.nan)
    return out


def wilson_interval(correct: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (`correct` of `n`; 95% for z = 1.96)."""
    if n <= 0:
        return math.nan, math.nan
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _eval_errors(evals: list[dict], ys: list[float]) -> list[list[float]] | None:
    """[below, above] distances of each eval point to its 95% Wilson interval (0 where eval_n is unknown)."""
    lo, hi = [], []
    for r, y in zip(evals, ys):
        n = int(_num(r.get("eval_n"))) if not math.isnan(_num(r.get("eval_n"))) else 0
        if n <= 0 or math.isnan(y):
            lo.append(0.0)
            hi.append(0.0)
            continue
        a, b = wilson_interval(round(y * n), n)
        lo.append(max(0.0, y - a))
        hi.append(max(0.0, b - y))
    return [lo, hi] if any(lo) or any(hi) else None


def _all_nan(ys: list[float]) -> bool:
    return all(math.isnan(y) for y in ys)


def _figure(rows: int = 1, cols: int = 1, size: tuple[float, float] = (7, 4)):
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=size, dpi=100)
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(rows * cols)]
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        ax.set_xlabel("step")
    return fig, axes


def _draw(ax, xs, ys, label: str, color=None, smooth_it: bool = True, lw: float = 1.8) -> None:
    """A per-step series: raw (faint) + centred moving average, or the raw values alone for short runs."""
    w = smoothing_window(len(xs)) if smooth_it else 1
    marker = "o" if len(xs) < 30 else None
    if w == 1:
        ax.plot(xs, ys, marker=marker, markersize=3, color=color, lw=lw, label=label)
        return
    (raw,) = ax.plot(xs, ys, marker=marker, markersize=2, color=color, lw=0.8, alpha=RAW_ALPHA)
    ax.plot(xs, smooth(ys, w), color=raw.get_color(), lw=lw, label=f"{label} (mean of {w} steps)")


def _draw_evals(ax, evals: list[dict]) -> None:
    if not evals:
        return
    xs = [r["step"] for r in evals]
    ys = [_num(r["eval_accuracy"]) for r in evals]
    n = evals[-1].get("eval_n")
    ax.errorbar(xs, ys, yerr=_eval_errors(evals, ys), marker="D", markersize=6, lw=1.2, ls="--", color="black",
                capsize=3, zorder=5, label="held-out accuracy, greedy decoding (eval" + (f", n={n}" if n else "")
                + "; bars: 95% Wilson interval)")


@dataclass
class Plots:
    paths: list[Path]  # the charts written
    skipped: int  # lines of the metrics file that did not parse
    metrics: Path  # the metrics file read


def _rollouts_per_step(run_dir: Path) -> int | None:
    try:
        import yaml

        cfg = yaml.safe_load(read_regular(run_dir / "config.yaml", 1 << 20).decode("utf-8")) or {}
        n = int(cfg["train"]["batch_size"]) * int((cfg.get("estimator") or {}).get("rollouts_per_prompt", 1) or 1)
        return n if n > 1 else None
    except (OSError, KeyError, TypeError, ValueError, AttributeError, ImportError):
        return None
    except Exception:  # noqa: BLE001 - a malformed YAML file only loses the reference line
        return None


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Plots:
    """Write the charts into `out` (default RUN_DIR/plots). ConfigError when there is nothing to plot."""
    try:
        import matplotlib  # noqa: F401  (drawn on Agg canvases directly: no global backend switch, no display)
    except ImportError:
        raise ConfigError("`basis-lite plot` needs matplotlib: pip install 'basis-lite[plot]'") from None
    run_dir = Path(run_dir)
    metrics = run_dir / METRICS_FILE
    check_run_folder(run_dir)  # no link out of the run folder: plots/ and metrics.jsonl stay inside it
    if not metrics.is_file():
        what = "no such folder" if not run_dir.exists() else "no metrics.jsonl there"
        raise ConfigError(f"{run_dir}: {what}; `basis-lite plot` takes a run folder written by `basis-lite train`")
    steps, evals, skipped = read_metrics(metrics)
    if not steps and not evals:
        bad = f"{skipped} line(s) did not parse; " if skipped else ""
        raise ConfigError(f"{metrics}: no step or eval records to plot ({bad}is the run just starting?)")
    out = Path(out) if out else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    figures = build_figures(steps, evals, _rollouts_per_step(run_dir), run_dir.resolve().name)
    return Plots([_save(fig, out / name) for name, fig in figures.items()], skipped, metrics)


def _save(fig, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, format="png")
    tmp.replace(path)
    return path


# ----------------------------------------------------------------------------------------------------------------
# the charts


def build_figures(steps: list[dict], evals: list[dict], rollouts_per_step: int | None = None,
                  title: str = "") -> dict:
    """{file name: Figure} for the records given (see the module docstring for what each holds)."""
    figures = {}
    has_training = any(_series(steps, k) for k, _ in TRAINING_PANELS)
    if has_training:
        figures["training.png"] = _training_page(steps, evals, rollouts_per_step, title)
    rewards = [(k, lab) for k, lab in (("reward_mean", "training reward mean, sampled rollouts"),
                                       ("accuracy", "training accuracy, sampled rollouts"),
                                       ("format_rate", "training format rate, sampled rollouts")) if _series(steps, k)]
    if rewards:
        fig, (ax,) = _figure(size=(8, 4.5))
        _reward_axes(ax, steps, evals, rewards)
        ax.set_title(f"{title}: sampled training rollouts vs greedy held-out eval")
        figures["reward.png"] = fig
    if _series(steps, "explained_variance"):
        fig, (ax,) = _figure(size=(8, 5.2))
        _ev_axes(ax, steps, rollouts_per_step)
        ax.set_title(f"{title}: baseline explained variance")
        fig.text(0.02, 0.02, "\n".join(textwrap.wrap(EV_NOTE, 130)), fontsize=7.5, va="bottom", ha="left",
                 color="dimgrey")
        from matplotlib.layout_engine import TightLayoutEngine

        fig.set_layout_engine(TightLayoutEngine(rect=(0, 0.17, 1, 1)))
        figures["explained_variance.png"] = fig
    g, t = _series(steps, "generation_s"), _series(steps, "training_s")
    if g or t:
        fig, (ax,) = _figure()
        if g and t and g[0] == t[0]:
            gy = [0.0 if math.isnan(y) else y for y in g[1]]
            ty = [0.0 if math.isnan(y) else y for y in t[1]]
            ax.stackplot(g[0], gy, ty, labels=["generation", "training"], alpha=0.8)
        else:
            for ser, label in ((g, "generation"), (t, "training")):
                if ser:
                    ax.plot(ser[0], ser[1], label=label)
        ax.set_ylabel("seconds per step")
        ax.set_title(f"{title}: step time")
        ax.legend(loc="upper left")
        figures["step_time.png"] = fig
    if evals:
        figures["eval_accuracy.png"] = _eval_figure(evals, title)
    return figures


def _reward_axes(ax, steps, evals, rewards) -> None:
    """Reward series (a series equal to an earlier one at every step is drawn once, the labels joined) and the evals."""
    drawn: list[tuple[list, list[float], list[str]]] = []
    for key, label in rewards:
        xs, ys = _series(steps, key)
        same = next((d for d in drawn if d[0] == xs and d[1] == ys), None)
        if same:
            same[2].append(label)
        else:
            drawn.append((xs, ys, [label]))
    for xs, ys, labels in drawn:
        _draw(ax, xs, ys, " = ".join(labels))
    _draw_evals(ax, evals)
    ax.set_ylabel("training: batch mean per sampled rollout\neval: greedy accuracy", fontsize=8)
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="upper left", fontsize=8, framealpha=0.7)


def _ev_axes(ax, steps, rollouts_per_step) -> None:
    """Explained variance with the leave-one-out batch mean's value as a reference line."""
    xs, ys = _series(steps, "explained_variance")
    _draw(ax, xs, ys, "explained variance", color="tab:purple")
    ax.axhline(0.0, color="grey", lw=0.8)
    logged = _series(steps, "explained_variance_loo_ref")
    if logged and not _all_nan(logged[1]):
        ax.plot(logged[0], logged[1], color="tab:red", lw=1, ls="--", drawstyle="steps-mid",
                label="leave-one-out batch mean, 1-(B/(B-1))^2 (logged per step)")
    elif rollouts_per_step:
        ref = loo_reference_ev(rollouts_per_step)
        ax.axhline(ref, color="tab:red", lw=1, ls="--",
                   label=f"leave-one-out batch mean, 1-(B/(B-1))^2, B={rollouts_per_step}: {ref:.3f}")
    ax.set_ylabel("1 - Var(r - b) / Var(r)")
    if _all_nan(ys):
        ax.text(0.5, 0.5, "undefined at every step\n(rewards constant within each batch)",
                transform=ax.transAxes, ha="center", va="center", color="grey")
        ax.set_ylim(-1, 1)
        ax.set_xlim(min(xs) - 0.5, max(xs) + 0.5)
    ax.legend(loc="best", fontsize=7, framealpha=0.7)


def _training_page(steps, evals, rollouts_per_step, title: str):
    fig, axes = _figure(2, 4, size=(17, 7.5))
    rewards = [(k, lab) for k, lab in (("reward_mean", "training reward, sampled"),
                                       ("accuracy", "training accuracy, sampled")) if _series(steps, k)]
    _reward_axes(axes[0], steps, evals, rewards)
    axes[0].set_title("sampled training reward vs greedy held-out accuracy", fontsize=9)
    if _series(steps, "explained_variance"):
        _ev_axes(axes[1], steps, rollouts_per_step)
    axes[1].set_title("baseline explained variance")
    for ax, (key, label) in zip(axes[2:], TRAINING_PANELS):
        s = _series(steps, key)
        ax.set_title(label)
        if not s or _all_nan(s[1]):
            ax.text(0.5, 0.5, "not recorded", transform=ax.transAxes, ha="center", va="center", color="grey")
            continue
        _draw(ax, s[0], s[1], label, color="tab:blue", smooth_it=key != "lr")
        if key == "kl" and all(y == 0 for y in s[1]):
            ax.text(0.5, 0.6, "0 at every step: not computed\n(train.kl_coef = 0)", transform=ax.transAxes,
                    ha="center", va="center", color="grey")
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    fig.suptitle(f"{title}: training" if title else "training")
    return fig


def _eval_figure(evals: list[dict], title: str):
    fig, (ax,) = _figure()
    xs = [r["step"] for r in evals]
    ys = [_num(r["eval_accuracy"]) for r in evals]
    ax.errorbar(xs, ys, yerr=_eval_errors(evals, ys), marker="o", lw=2, color="black", capsize=3,
                label="overall (bars: 95% Wilson interval)")
    for x, y in zip(xs, ys):
        if not math.isnan(y):
            ax.annotate(f"{y:.3f}", (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    level_keys = sorted({k for r in evals for k in r if k.startswith("eval_accuracy_level")},
                        key=lambda k: (len(k), k))
    for key in level_keys:
        pts = [(r["step"], _num(r[key])) for r in evals if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", ls="--",
                label=key.replace("eval_accuracy_", "").replace("level", "level "))
    n = evals[-1].get("eval_n")
    ax.set_ylabel("greedy accuracy" + (f" (n={n})" if n else ""))
    ax.set_ylim(-0.02, 1.08)
    ax.set_title(f"{title}: held-out accuracy at every eval")
    ax.legend(loc="best", fontsize=8)
    return fig
