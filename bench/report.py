"""Every table, plot and verdict of a comparison, rebuilt from its raw run files only.

    python bench/report.py bench/results/default-dev            # report.md, report.json, comparison.png
    python bench/report.py bench/results/default-dev --check    # exit 1 when report.md or a marked block differs

Reads FOLDER/runs/<arm>/seed<k>/summary.json and metrics.jsonl.gz (bench/compare.py writes them) and nothing else:

- accuracy at equal rollouts: per arm, the held-out greedy accuracy after training (mean, standard error, n seeds),
  before training, per level, with its clock, tokens, peak memory and mean explained variance;
- paired by seed against basis: basis minus the arm on the seeds both ran, the mean difference with its 95 %
  t-interval (Student's t with n - 1 degrees of freedom, computed here: scipy is not a dependency); "ahead" or
  "behind" (basis against the arm) only when the interval excludes 0, "tie" otherwise;
- held-out accuracy against tokens generated (reference samples included: an arm that draws them starts there)
  and against clock, the mean over seeds with a band of one standard error;
- the Pareto frontier of final accuracy against clock and against tokens generated: the arms no other arm beats
  at a lower or equal cost;
- the cost (clock and tokens, on the mean curve) to reach each of --targets, and how many seeds reach it;
- per run: each seed's accuracy before and after, its cut-off share, clock, wall, peak RSS and the 1-minute load
  average at its start and end, so a single run's figure quoted in prose is read here, not typed.

Marked blocks: a page holding `<!-- report:NAME -->` ... `<!-- /report:NAME -->` (NAME = the folder's name; or
NAME/PART with PART one of accuracy, paired, targets, pareto, runs) gets that part of the report between the markers
whenever this script runs (default pages: README.md and docs/results.md; --pages to choose), so no figure there
is typed by hand. --check writes nothing and exits 1 when report.md or such a block differs from what the raw files
give now (one line per difference).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.arms import ARMS  # noqa: E402
from bench.lib.curves import first_point_reaching, read_run  # noqa: E402
from bench.lib.paths import REPO, shown  # noqa: E402
from bench.lib.provenance import flags_line  # noqa: E402
from bench.lib.report import fmt_seconds, markdown_table, mean_present, write_json  # noqa: E402

BASE = "basis"
TARGETS = (0.55, 0.60, 0.65)
PARTS = ("accuracy", "paired", "targets", "pareto", "runs")
DEFAULT_PAGES = ("README.md", "docs/results.md")
BLOCK = re.compile(r"<!-- report:(?P<name>[\w.\-]+(?:/\w+)?) -->\n(?P<body>.*?)\n?<!-- /report:(?P=name) -->", re.S)


# ----------------------------------------------------------------------------------------------------------------
# statistics


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p (0.5 < p < 1), by bisection on t_cdf."""
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2.0


def mean_se(xs: list[float]) -> tuple[float | None, float | None]:
    """(mean, standard error of the mean); SE None for fewer than 2 values, both None for none."""
    n = len(xs)
    if n == 0:
        return None, None
    m = sum(xs) / n
    if n < 2:
        return m, None
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)


def paired_interval(diffs: list[float], level: float = 0.95) -> dict:
    """Mean of paired differences with its t-interval: {n, mean, se, t_crit, lo, hi, t, verdict}; the verdict is
    "ahead" when the interval lies above 0, "behind" below 0, "tie" when it holds 0 (and "n/a" under 2 pairs)."""
    n = len(diffs)
    m, se = mean_se(diffs)
    out = {"n": n, "mean": m, "se": se, "t_crit": None, "lo": None, "hi": None, "t": None, "verdict": "n/a"}
    if se is None:
        return out
    tc = t_quantile(0.5 + level / 2.0, n - 1)
    out.update(t_crit=tc, lo=m - tc * se, hi=m + tc * se, t=(m / se if se > 0 else math.copysign(math.inf, m)
                                                               if m else 0.0))
    out["verdict"] = "ahead" if out["lo"] > 0 else "behind" if out["hi"] < 0 else "tie"
    return out


def pareto(points: dict[str, tuple[float, float]]) -> list[str]:
    """The arms on the frontier of (cost, accuracy): none is matched or beaten on accuracy by an arm that costs no
    more; cheapest first."""
    ranked = sorted(points, key=lambda a: (points[a][0], -points[a][1]))
    out, best = [], -math.inf
    for a in ranked:
        if points[a][1] > best:
            out.append(a)
            best = points[a][1]
    return out


# ----------------------------------------------------------------------------------------------------------------
# the raw files


def load_runs(folder: Path) -> dict[str, dict[int, dict]]:
    """{arm: {seed: run}} of every finished run (summary.json present): run = {summary, points, cut_off}, points =
    the eval points with step, accuracy, clock (reference samples + generation + update up to that step) and tokens
    (reference samples + tokens generated up to that step); cut_off = the mean over steps of the share of rollouts
    that hit the completion budget (metrics.jsonl clipped_fraction; None where the trainer writes none)."""
    runs: dict[str, dict[int, dict]] = {}
    for path in sorted((folder / "runs").glob("*/seed*/summary.json")):
        s = json.loads(path.read_text())
        steps, evals = read_run(path.parent)
        clock, tokens = s.get("reference_s") or 0.0, s.get("reference_tokens") or 0
        at = {0: (clock, tokens)}
        for n in sorted(steps):
            st = steps[n]
            clock += (st.get("generation_s") or 0.0) + (st.get("training_s") or 0.0)
            gen = st.get("generated_tokens")
            tokens += gen if gen is not None else (st.get("completion_len") or 0.0) * s["rollouts_per_step"]
            at[n] = (clock, tokens)
        points = []
        for e in evals:
            c, t = at.get(int(e["step"]), at[max(k for k in at if k <= int(e["step"]))])
            points.append({"step": int(e["step"]), "final": e.get("event") == "eval_final",
                           "accuracy": e["eval_accuracy"], "clock_s": c, "tokens": t})
        cut = [st["clipped_fraction"] for st in steps.values() if st.get("clipped_fraction") is not None]
        runs.setdefault(s["arm"], {})[int(s["seed"])] = {"summary": s, "points": points,
                                                         "cut_off": sum(cut) / len(cut) if cut else None}
    return runs


def per_run(runs: dict) -> list[dict]:
    """One row per finished run, arms in arm_order, seeds ascending: the figures a single run is quoted by."""
    rows, keys = [], machine_keys(runs)
    for a in arm_order(runs):
        for k in sorted(runs[a]):
            s = runs[a][k]["summary"]
            rows.append({"arm": a, "seed": k, "accuracy_before": s.get("accuracy_before"),
                         "accuracy_after": s["accuracy_after"], "cut_off": runs[a][k]["cut_off"],
                         "clock_s": s.get("clock_s"), "wall_s": s.get("wall_s"), "peak_rss_mb": s.get("peak_rss_mb"),
                         "load_before": (s.get("loadavg_before") or [None])[0],
                         "load_after": (s.get("loadavg_after") or [None])[0],
                         "machine": keys.index(_machine_key(s)) + 1})
    return rows


def arm_order(runs: dict) -> list[str]:
    """basis first, then the arms in bench/lib/arms.py's order, then any other."""
    known = [a for a in ARMS if a in runs]
    rest = sorted(a for a in runs if a not in ARMS)
    return sorted(known, key=lambda a: a != BASE) + rest


# ----------------------------------------------------------------------------------------------------------------
# the analysis


def mean_curve(seed_runs: dict[int, dict]) -> list[dict]:
    """The eval points every seed has, averaged: step, accuracy (mean, SE), clock and tokens (means)."""
    keys = set.intersection(*[{(p["step"], p["final"]) for p in r["points"]} for r in seed_runs.values()])
    out = []
    for step, final in sorted(keys):
        ps = [next(p for p in r["points"] if (p["step"], p["final"]) == (step, final)) for r in seed_runs.values()]
        m, se = mean_se([p["accuracy"] for p in ps])
        out.append({"step": step, "final": final, "accuracy": m, "se": se,
                    "clock_s": sum(p["clock_s"] for p in ps) / len(ps), "tokens": sum(p["tokens"] for p in ps) / len(ps)})
    return out


def analyze(runs: dict, targets=TARGETS) -> dict:
    """Everything the report shows, as numbers (report.json)."""
    arms = arm_order(runs)
    per_arm = {}
    for a in arms:
        rs = runs[a]
        ss = [rs[k]["summary"] for k in sorted(rs)]
        acc, se = mean_se([s["accuracy_after"] for s in ss])
        levels = sorted({lv for s in ss for lv in s.get("accuracy_after_by_level", {})}, key=lambda x: (len(x), x))
        curve = mean_curve(rs)
        per_arm[a] = {
            "seeds": sorted(rs), "n": len(ss), "description": ss[0].get("description"),
            "prompts_per_step": ss[0]["prompts_per_step"], "rollouts_per_prompt": ss[0]["rollouts_per_prompt"],
            "rollouts": ss[0]["rollouts_per_step"] * ss[0]["steps"],
            "accuracy_before": mean_present(s["accuracy_before"] for s in ss), "accuracy_after": acc, "accuracy_se": se,
            "accuracy_after_by_level": {lv: mean_present(s.get("accuracy_after_by_level", {}).get(lv) for s in ss)
                                        for lv in levels},
            **{k: mean_present(s.get(k) for s in ss) for k in ("clock_s", "generation_s", "update_s", "reference_s",
                                                       "eval_s", "load_s", "wall_s", "generated_tokens",
                                                       "trained_tokens", "prompt_tokens", "reference_tokens",
                                                       "peak_rss_mb", "explained_variance_mean")},
            "peak_rss_mb_max": max((s["peak_rss_mb"] for s in ss if s.get("peak_rss_mb") is not None), default=None),
            "cut_off": mean_present(rs[k]["cut_off"] for k in sorted(rs)),
            "curve": curve,
            "targets": {},
        }
        final_tokens = curve[-1]["tokens"] if curve else None
        per_arm[a]["cost_tokens"] = final_tokens
        for t in targets:
            hit = first_point_reaching(curve, t)
            reach = sum(first_point_reaching(r["points"], t) is not None for r in rs.values())
            per_arm[a]["targets"][f"{t:g}"] = {"clock_s": hit["clock_s"] if hit else None,
                                               "tokens": hit["tokens"] if hit else None, "step": hit["step"] if hit
                                               else None, "seeds_reaching": reach, "n": len(rs)}
    paired = {}
    if BASE in runs:
        for a in arms:
            if a == BASE:
                continue
            seeds = sorted(set(runs[a]) & set(runs[BASE]))
            diffs = [runs[BASE][k]["summary"]["accuracy_after"] - runs[a][k]["summary"]["accuracy_after"]
                     for k in seeds]
            paired[a] = {"seeds": seeds, "diffs": diffs, **paired_interval(diffs)}
    front_clock = pareto({a: (p["clock_s"], p["accuracy_after"]) for a, p in per_arm.items()
                          if p["clock_s"] is not None})
    front_tokens = pareto({a: (p["cost_tokens"], p["accuracy_after"]) for a, p in per_arm.items()
                           if p["cost_tokens"] is not None})
    every = [r["summary"] for rs in runs.values() for r in rs.values()]
    understated = [f"{s['arm']} seed {s['seed']}" for s in every
                   if (s.get("peak_rss_sampled_mb") or 0) > 1.05 * (s.get("peak_rss_mb") or 0)]
    rows = per_run(runs)
    return {"arms": per_arm, "order": arms, "paired": paired, "runs": rows, "targets": [f"{t:g}" for t in targets],
            "pareto": {"clock": front_clock, "tokens": front_tokens},
            "rss_understated": understated, "commits": sorted({s["commit"] for s in every}), "dirty": any(s.get("dirty") for s in every),
            "machines": _machines(runs),
            "load_1min": {k: [min(v), max(v)] if v else None for k, v in (
                (when, [r[f"load_{when}"] for r in rows if r[f"load_{when}"] is not None]) for when in ("before", "after"))},
            "settings": {**{k: every[0].get(k) for k in ("preset", "steps", "eval_every", "eval_set", "eval_n")},
                         "overrides": _common_overrides(every)} if every else {},
            "cost_source": sorted({f"{k}: {v}" for s in every for k, v in (s.get("cost_source") or {}).items()
                                   if not v.startswith(("metrics.jsonl ", "no reference samples"))})}


def _machine_key(s: dict) -> str:
    """A run's kind of machine: CPU model and flags, torch, threads, the kernel level torch ran at."""
    return (flags_line(s) + f"; torch {s.get('torch')}, {s.get('torch_threads')} threads"
            + f", kernels at {s.get('torch_cpu_capability') or 'unrecorded'}")


def machine_keys(runs: dict) -> list[str]:
    """The kinds of machine the runs ran on, sorted; a run's machine number is its key's place here, from 1."""
    return sorted({_machine_key(r["summary"]) for rs in runs.values() for r in rs.values()})


def _machines(runs: dict) -> list[str]:
    """One line per kind of machine, numbered as in the per-run table, naming its arms."""
    arms: dict[str, set[str]] = {k: set() for k in machine_keys(runs)}
    for a, rs in runs.items():
        for r in rs.values():
            arms[_machine_key(r["summary"])].add(a)
    return [f"{i}. {k}: {', '.join(sorted(names))}" for i, (k, names) in enumerate(arms.items(), 1)]


# ----------------------------------------------------------------------------------------------------------------
# the text


def _acc(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _tok(x) -> str:
    if x is None:
        return "-"
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def _mb(x) -> str:
    return "-" if x is None else f"{x:.0f} MB"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _signed(x) -> str:
    return "-" if x is None else f"{x:+.3f}"


def part_accuracy(rep: dict) -> str:
    head = ["arm", "prompts x rollouts", "rollouts", "seeds", "before", "after (mean ± SE)", "after by level",
            "clock", "tokens generated", "tokens trained", "cut off", "peak RSS", "explained variance"]
    rows = []
    for a in rep["order"]:
        p = rep["arms"][a]
        after = _acc(p["accuracy_after"]) + (f" ± {p['accuracy_se']:.3f}" if p["accuracy_se"] is not None else "")
        lv = " / ".join(f"{k}: {_acc(v)}" for k, v in p["accuracy_after_by_level"].items()) or "-"
        gen = _tok(p["generated_tokens"]) + (f" + {_tok(p['reference_tokens'])} ref." if p["reference_tokens"]
                                             else "")
        rows.append([a, f"{p['prompts_per_step']} x {p['rollouts_per_prompt']}", p["rollouts"], p["n"],
                     _acc(p["accuracy_before"]), after, lv, fmt_seconds(p["clock_s"]), gen,
                     _tok(p["trained_tokens"]), _pct(p.get("cut_off")),
                     _mb(p["peak_rss_mb"]),
                     "-" if p["explained_variance_mean"] is None else f"{p['explained_variance_mean']:+.2f}"])
    return markdown_table(head, rows)


def part_paired(rep: dict) -> str:
    if not rep["paired"]:
        return f"No paired differences: the comparison has no {BASE} runs."
    head = ["arm", "seeds", f"{BASE} − arm", "95 % interval", "t", f"{BASE} is"]
    rows = []
    for a, d in rep["paired"].items():
        ci = "-" if d["lo"] is None else f"[{d['lo']:+.3f}, {d['hi']:+.3f}]"
        t = "-" if d["t"] is None else f"{d['t']:.2f}"
        verdict = d["verdict"] if d["verdict"] != "tie" else f"tie ({ci})"
        rows.append([a, d["n"], _signed(d["mean"]), ci, t, verdict])
    return (markdown_table(head, rows) + "\n\nPaired by seed (same eval problems, prompts and initial adapter): "
            f"{BASE}'s held-out accuracy after training minus the arm's; \"ahead\" or \"behind\" only where the 95 % "
            "t-interval excludes 0.")


def part_targets(rep: dict) -> str:
    head = ["arm"] + [f"≥ {t}" for t in rep["targets"]]
    rows = []
    for a in rep["order"]:
        cells = []
        for t in rep["targets"]:
            c = rep["arms"][a]["targets"][t]
            cell = "-" if c["clock_s"] is None else f"{fmt_seconds(c['clock_s'])}, {_tok(c['tokens'])} tok"
            cells.append(f"{cell} ({c['seeds_reaching']}/{c['n']} seeds)")
        rows.append([a] + cells)
    return (markdown_table(head, rows) + "\n\nCost to reach a held-out accuracy: clock and tokens generated at the "
            "first eval point of the mean curve at or above it (\"-\": the mean curve never does); in brackets, how "
            "many seeds reach it on their own.")


def part_pareto(rep: dict) -> str:
    def line(kind, front):
        costs = {"clock": lambda p: fmt_seconds(p["clock_s"]), "tokens": lambda p: _tok(p["cost_tokens"]) + " tok"}
        return ", ".join(f"{a} ({_acc(rep['arms'][a]['accuracy_after'])} at {costs[kind](rep['arms'][a])})"
                         for a in front) or "-"
    return (f"Pareto frontier, final accuracy against clock: {line('clock', rep['pareto']['clock'])}.\n\n"
            f"Against tokens generated: {line('tokens', rep['pareto']['tokens'])}.\n\nAn arm is on the frontier "
            "when no arm costing no more ends at least as accurate (means over seeds).")


def part_runs(rep: dict) -> str:
    def load(x):
        return "-" if x is None else f"{x:.2f}"
    head = ["arm", "seed", "before", "after", "cut off", "clock", "wall", "peak RSS", "load at start → end", "machine"]
    rows = [[r["arm"], r["seed"], _acc(r["accuracy_before"]), _acc(r["accuracy_after"]), _pct(r["cut_off"]),
             fmt_seconds(r["clock_s"]), fmt_seconds(r["wall_s"]), _mb(r["peak_rss_mb"]),
             f"{load(r['load_before'])} → {load(r['load_after'])}", r["machine"]] for r in rep["runs"]]
    return (markdown_table(head, rows) + "\n\nEach run on its own: held-out accuracy before and after training, the "
            "share of its rollouts cut off at the completion budget (mean over steps), its training clock, the whole "
            "run's wall time (load, evals and start-up included), its peak RSS, the machine's 1-minute load average "
            "when it started and ended, and the machine it ran on (numbered as in \"Where it ran\").")


PART_TEXT = {"accuracy": part_accuracy, "paired": part_paired, "targets": part_targets, "pareto": part_pareto,
             "runs": part_runs}


def block_text(rep: dict, part: str | None) -> str:
    """A marked block's content: one part, or (no part) the accuracy and paired tables."""
    if part is None:
        return part_accuracy(rep) + "\n\n" + part_paired(rep)
    return PART_TEXT[part](rep)


# overrides every run carries that the report's first line states in its own words
_SAID = ("train.steps=", "train.eval_every=", "data.eval_set=")


def _common_overrides(every: list[dict]) -> list[str]:
    """The `--set` overrides that every run of the comparison shares (the task, budgets, ...), in the first run's
    order; the per-arm and per-seed ones (estimator, batch, seed) differ between runs and drop out."""
    shared = set.intersection(*(set(s.get("overrides") or []) for s in every))
    return [o for o in every[0].get("overrides") or [] if o in shared and not o.startswith(_SAID)]


def markdown(name: str, rep: dict) -> str:
    st = rep["settings"]
    eval_set = {0: "development (data.eval_set 0)", 1: "confirmation (data.eval_set 1)"}.get(st.get("eval_set"),
                                                                                            st.get("eval_set"))
    seeds = sorted({k for p in rep["arms"].values() for k in p["seeds"]})
    lines = [f"# Comparison {name}", "",
             f"Preset `{st.get('preset')}`"
             + (" with " + ", ".join(f"`{o}`" for o in st["overrides"]) if st.get("overrides") else "")
             + f", {st.get('steps')} steps, held-out greedy eval on {st.get('eval_n')} "
             f"problems of the {eval_set} set every {st.get('eval_every')} steps; seeds {', '.join(map(str, seeds))}. "
             f"Commit {', '.join(c[:12] for c in rep['commits'])}"
             + (" (with uncommitted changes: not reproducible from the commit alone)" if rep["dirty"] else "")
             + (" — MORE THAN ONE COMMIT: the pairs compare different code" if len(rep["commits"]) > 1 else "")
             + ". Rebuilt by `python bench/report.py` from runs/*/seed*/ (summary.json, metrics.jsonl.gz) alone.", "",
             "## Accuracy at equal rollouts", "", part_accuracy(rep), "",
             "Clock: generation + update seconds summed over the steps, plus reference samples drawn before training "
             "(no eval, load or start-up time). Tokens generated: the rollouts' completion tokens (+ reference "
             "samples). Cut off: the share of rollouts that hit the completion budget (clipped_fraction), the mean over "
             "steps and seeds. Peak RSS: the training process's, from the kernel (ru_maxrss).", "",
             "## Paired by seed against basis", "", part_paired(rep), "",
             "## Cost to reach a held-out accuracy", "", part_targets(rep), "",
             "## Pareto frontier", "", part_pareto(rep), "",
             "![held-out accuracy against tokens generated and clock, and the Pareto frontier](comparison.png)", "",
             "## Per run", "", part_runs(rep), "",
             "## Where it ran", ""]
    lines += rep["machines"]
    if len(rep["machines"]) > 1:
        lines += ["", "Each line names the arms with a run there. Clocks compare only within one line. A run on "
                  "another line is another draw of its seed's trajectory unless a rerun there gave the same numbers: "
                  "the same kernel level is not enough (bench/results/avx2cap-repro/)."]
    lo = rep["load_1min"]
    lines += ["", f"1-minute load average at the start of the runs: {lo['before']}, at their end: {lo['after']} "
              "(lowest, highest); the clocks are comparable only on an otherwise idle machine."]
    if rep["rss_understated"]:
        lines += ["", "Peak RSS understated: in " + ", ".join(rep["rss_understated"]) + " the driver's own 50 ms "
                  "readings of the process's resident set (peak_rss_sampled_mb) exceed its ru_maxrss by more than "
                  "5 %: the trainer cleared the kernel's high-water mark during the run."]
    if rep["cost_source"]:
        lines += ["", "Counters not read from the trainer's own: " + "; ".join(rep["cost_source"]) + "."]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# the plot


def write_png(rep: dict, path: Path) -> bool:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)", file=sys.stderr)
        return False
    fig = Figure(figsize=(15, 4.8), dpi=100)
    FigureCanvasAgg(fig)
    ax_tok, ax_clk, ax_par = (fig.add_subplot(1, 3, i) for i in (1, 2, 3))
    span = max([p["clock_s"] or 0.0 for p in rep["arms"].values()] + [1.0])
    scale, unit = (60.0, "min") if span > 600 else (1.0, "s")
    for a in rep["order"]:
        p = rep["arms"][a]
        color = ARMS[a].color if a in ARMS else None
        cv = p["curve"]
        ys = [c["accuracy"] for c in cv]
        lo = [c["accuracy"] - (c["se"] or 0.0) for c in cv]
        hi = [c["accuracy"] + (c["se"] or 0.0) for c in cv]
        for ax, xs in ((ax_tok, [c["tokens"] / 1e3 for c in cv]), (ax_clk, [c["clock_s"] / scale for c in cv])):
            ax.plot(xs, ys, marker="o", ms=3, lw=1.8, color=color, label=f"{a} (n={p['n']})")
            if p["n"] > 1:
                ax.fill_between(xs, lo, hi, color=color, alpha=0.15, lw=0)
        if p["clock_s"] is not None and p["accuracy_after"] is not None:
            ax_par.errorbar([p["clock_s"] / scale], [p["accuracy_after"]], yerr=[p["accuracy_se"] or 0.0], fmt="o",
                            color=color, capsize=3)
            ax_par.annotate(a, (p["clock_s"] / scale, p["accuracy_after"]), xytext=(4, 4), textcoords="offset points",
                            fontsize=8)
    front = rep["pareto"]["clock"]
    if front:
        ax_par.step([rep["arms"][a]["clock_s"] / scale for a in front],
                    [rep["arms"][a]["accuracy_after"] for a in front], where="post", color="gray", ls="--", lw=1,
                    marker="o", ms=13, mfc="none", label="Pareto frontier")
        ax_par.legend(fontsize=8, loc="lower right")
    ax_tok.set_xlabel("tokens generated (thousands; reference samples included)")
    ax_clk.set_xlabel(f"training clock, generation + update ({unit})")
    ax_par.set_xlabel(f"training clock ({unit})")
    ax_par.margins(0.15)
    for ax in (ax_tok, ax_clk, ax_par):
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
    ax_tok.set_title("accuracy vs tokens generated (mean ± SE over seeds)", fontsize=10)
    ax_clk.set_title("accuracy vs clock", fontsize=10)
    ax_par.set_title("final accuracy vs clock, Pareto frontier", fontsize=10)
    ax_clk.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, format="png")
    tmp.replace(path)
    return True


# ----------------------------------------------------------------------------------------------------------------
# blocks in pages


def refresh_blocks(text: str, name: str, rep: dict) -> str:
    """`text` with every block of comparison `name` (`<!-- report:NAME[/PART] -->`) holding what the raw files
    give now; other blocks untouched."""
    def sub(m):
        block, _, part = m.group("name").partition("/")
        if block != name:
            return m.group(0)
        return f"<!-- report:{m.group('name')} -->\n{block_text(rep, part or None)}\n<!-- /report:{m.group('name')} -->"
    return BLOCK.sub(sub, text)


def check_part_names(text: str, name: str) -> list[str]:
    """The blocks of `name` whose PART is not one of PARTS."""
    return [m.group("name") for m in BLOCK.finditer(text)
            if m.group("name").partition("/")[0] == name and m.group("name").partition("/")[2] not in ("", *PARTS)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("folder", type=Path, help="a comparison folder of bench/compare.py")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when report.md or a marked block "
                                                        "differs from what the raw files give")
    p.add_argument("--pages", nargs="*", type=Path, default=None,
                   help=f"pages whose marked blocks to refresh or check (default {' '.join(DEFAULT_PAGES)})")
    p.add_argument("--targets", default=",".join(f"{t:g}" for t in TARGETS),
                   help="held-out accuracies for the cost-to-reach table (default 0.55,0.6,0.65)")
    args = p.parse_args(argv)
    folder = args.folder.resolve()
    try:
        targets = tuple(float(x) for x in args.targets.split(",") if x.strip())
    except ValueError:
        targets = ()
    if not targets or not all(0 < t <= 1 for t in targets):
        print(f"error: --targets: {args.targets!r}; expected accuracies in (0, 1] such as 0.55,0.6", file=sys.stderr)
        return 2
    runs = load_runs(folder)
    if not runs:
        print(f"error: {shown(folder)} holds no finished run (runs/<arm>/seed<k>/summary.json); run bench/compare.py "
              f"first", file=sys.stderr)
        return 2
    name = folder.name
    rep = analyze(runs, targets)
    md = markdown(name, rep)
    pages = [pg if pg.is_absolute() else REPO / pg for pg in (args.pages if args.pages is not None
                                                              else [Path(x) for x in DEFAULT_PAGES])]
    bad_parts = [f"{shown(pg)}: {n}" for pg in pages if pg.exists() for n in check_part_names(pg.read_text(), name)]
    if bad_parts:
        print(f"error: unknown block part in {', '.join(bad_parts)}; parts: {', '.join(PARTS)}", file=sys.stderr)
        return 2
    if args.check:
        stale = []
        if not (folder / "report.md").exists() or (folder / "report.md").read_text() != md:
            stale.append(f"{shown(folder / 'report.md')} differs from the raw files")
        for pg in pages:
            if pg.exists():
                text = pg.read_text()
                if refresh_blocks(text, name, rep) != text:
                    stale.append(f"{shown(pg)}: a report:{name} block differs from the raw files")
        for line in stale:
            print(f"stale: {line}", file=sys.stderr)
        if stale:
            print(f"rebuild with: python bench/report.py {shown(folder)}", file=sys.stderr)
            return 1
        print(f"{shown(folder)}: report.md and the marked blocks agree with the raw files")
        return 0
    (folder / "report.md").write_text(md)
    write_json(folder / "report.json", rep, indent=1)
    write_png(rep, folder / "comparison.png")
    for pg in pages:
        if pg.exists():
            text = pg.read_text()
            new = refresh_blocks(text, name, rep)
            if new != text:
                pg.write_text(new)
                print(f"refreshed the report:{name} blocks of {shown(pg)}")
    print(f"wrote {shown(folder / 'report.md')}, report.json, comparison.png")
    print(part_paired(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
