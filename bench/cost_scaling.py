#!/usr/bin/env python
"""How a training step's cost grows with the model, the completion budget and the batch: basis-lite (one rollout
per prompt) beside TRL's GRPOTrainer with 8 generations per prompt, on the same CPU, one process at a time.

    python bench/cost_scaling.py --set data.dataset=wordproblems       # 135M: budgets 48/128/256, batches 16/32/64
    python bench/cost_scaling.py --models builtin:smollm2-135m-instruct,/path/to/a/local/model/folder
    python bench/cost_scaling.py --report bench/results/scaling-wordproblems   # tables again from the raw files
    python bench/cost_scaling.py --quick                               # plumbing: smoke preset, 2 small points

Points. One axis at a time around a base point (the first model, the first budget, the batch nearest the preset's
train.batch_size): every budget at the base model and batch, every batch at the base model and budget, every model
at the base budget and batch (`--grid full`: every combination). The default models are the built-in SmolLM2-135M
and `shapes:smollm2-135m`, `shapes:smollm2-360m`: SmolLM2's architecture at those sizes with random weights (see
SHAPES: no package registry holds SmolLM2-360M's weights; a step's cost follows the shapes and the tokens, and random
weights run every completion to the budget, so the two shapes models compare sizes at equal tokens; on the model
axis each is set against the first model of its kind; they earn no reward, so their points score with
bench/lib/cost_reward.py, deterministic and varied, for the update to run). A point sets generation.max_new_tokens,
train.batch_size (rollouts per step) and model.name; model.max_seq_length grows with the budget so that the
preset's room for the prompt stays the same.

Each point runs bench/vs_trl.py once with arms `basis` and `trl8` (each arm in its own process, one after the
other: their peak resident sets are separate), --steps S (default 3) and an eval of one held-out problem, so the
time is training time. Per arm and point this script keeps, in OUT/points/<point>.json (committed, the raw file):
every step's generation and update seconds, basis-lite's update parts (forward with the graph, log-prob passes,
backward, optimizer, from its metrics.jsonl), tokens generated per step, the fraction of completions cut off at the
budget (basis-lite: rollouts that did not stop by themselves; TRL: completions/clipped_ratio), the process's peak
resident set (VmHWM / ru_maxrss of the arm's process, its whole life: load, evals and steps), and for basis-lite
the peak that `basis-lite plan` estimates for the same config. OUT/scaling.md is rebuilt from those files: seconds
per step as the mean over the steps after the first (the first warms up), the share of each part, which part
dominates, and each point's cost as a multiple of the smallest point on its axis.

The TRL arm needs trl (`pip install -e '.[test]'` installs the pinned version); vs_trl.py's docstring says what it
matches between the arms and what it cannot.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from basis_lite.config import DEFAULT_PRESET, ConfigError, load_config  # noqa: E402
from basis_lite.model.shape import KNOWN_SHAPES  # noqa: E402
from bench.lib.curves import read_run  # noqa: E402
from bench.lib.paths import RESULTS, shown  # noqa: E402
from bench.lib.provenance import flags_line, loadavg, machine_record  # noqa: E402
from bench.lib.report import fmt, markdown_table, mean_present, text_table, write_json  # noqa: E402

ARMS = ("basis", "trl8")
TOKENS = (48, 128, 256)
BATCHES = (16, 32, 64)
BUILTIN = "builtin:smollm2-135m-instruct"
PARTS = ("generation_s", "forward_s", "logprob_s", "backward_s", "optimizer_s")
PART_NAMES = {"generation_s": "generation", "forward_s": "forward", "logprob_s": "log-probs",
              "backward_s": "backward", "optimizer_s": "optimizer", "update_s": "update"}
QUICK = {"preset": "smoke", "models": ["builtin:tiny-random"], "tokens": [8, 12], "batches": [8, 16], "steps": 2}
# `shapes:<name>` models: the SmolLM2 architecture at a published size with random weights, the built-in model's
# tokenizer and chat template (no package registry holds SmolLM2-360M's weights). A step's cost depends on the
# shapes and the tokens, not on the weights; random weights almost never sample the stop token, so every completion
# runs to the budget. They earn no reward, so their points add SHAPES_REWARD (deterministic, varied): without it
# every advantage would be 0 and no update would run.
# The sizes are the plan's table of published shapes (basis_lite.model.shape.KNOWN_SHAPES), as config.json keys.
def _config_sizes(s) -> dict:
    return {"hidden_size": s.hidden, "intermediate_size": s.intermediate, "num_hidden_layers": s.layers,
            "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads}


SHAPES = {k: _config_sizes(KNOWN_SHAPES[k]) for k in ("smollm2-135m", "smollm2-360m")}


class ScalingError(Exception):
    """Bad input: exit 2 with one line."""


SHAPES_REWARD = "bench.lib.cost_reward:varied"
DEFAULT_MODELS = ",".join([BUILTIN] + [f"shapes:{k}" for k in SHAPES])


def model_tag(name: str) -> str:
    """A short file-name-safe tag of a model name: its last path part, lower case (shapes-<size> for shapes:)."""
    if name.startswith("shapes:"):
        return "shapes-" + model_tag(name[len("shapes:"):])
    tag = re.sub(r"[^a-z0-9.]+", "-", name.rstrip("/").split("/")[-1].split(":")[-1].lower()).strip("-")
    return tag or "model"


def make_points(models: list[str], tokens: list[int], batches: list[int], base_batch: int,
                grid: str = "axes") -> list[dict]:
    """The points to measure, in order: {name, model, tokens, batch, axes}; `axes` names the axes the point lies on
    (the base point lies on all three)."""
    if not models or not tokens or not batches:
        raise ScalingError("--models, --tokens and --batches each need at least one value")
    base = (models[0], tokens[0], min(batches, key=lambda b: (abs(b - base_batch), b)))
    combos = [(m, t, b) for m in models for t in tokens for b in batches] if grid == "full" else \
        list(dict.fromkeys([(base[0], t, base[2]) for t in tokens] + [(base[0], base[1], b) for b in batches] +
                           [(m, base[1], base[2]) for m in models]))
    tags = {m: model_tag(m) for m in models}
    if len(set(tags.values())) != len(tags):
        raise ScalingError(f"--models: two models give the same tag ({tags}); name them by distinct folders")
    out = []
    for m, t, b in combos:
        axes = [ax for ax, same in (("model", (t, b) == base[1:]), ("tokens", (m, b) == (base[0], base[2])),
                                    ("batch", (m, t) == base[:2])) if same]
        out.append({"name": f"{tags[m]}-t{t}-b{b}", "model": m, "tokens": t, "batch": b, "axes": axes})
    return out


def shapes_name(model: str) -> str | None:
    """The SHAPES key of a `shapes:<name>` model, None for any other model.name; ScalingError for an unknown one."""
    if not model.startswith("shapes:"):
        return None
    name = model[len("shapes:"):]
    if name not in SHAPES:
        raise ScalingError(f"--models: unknown {model!r}; shapes models: {', '.join('shapes:' + k for k in SHAPES)}")
    return name


def shapes_model_dir(model: str, runs: Path, cache_dir: str = "", source: str = BUILTIN) -> str:
    """The local folder of a `shapes:` model under RUNS/models/, built once (seed 0) from the `source` model's
    config, tokenizer and chat template (the built-in SmolLM2) with SHAPES' sizes; any other model.name is returned
    as it is."""
    name = shapes_name(model)
    if name is None:
        return model
    folder = runs / "models" / name
    if (folder / "model.safetensors").exists():
        return str(folder)
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from basis_lite.model.loading import resolve_model_path

    src = Path(resolve_model_path(source, cache_dir))
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors", "basis_lite_manifest.json"):
            shutil.copy2(f, tmp / f.name)
    config = AutoConfig.from_pretrained(src)
    for k, v in SHAPES[name].items():
        setattr(config, k, v)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return str(folder)


def point_overrides(cfg0, point: dict) -> list[str]:
    """--set items of a point: its budget, batch and model, and a max_seq_length that keeps the preset's room for
    the prompt."""
    room = cfg0.model.max_seq_length - cfg0.generation.max_new_tokens
    out = [f"generation.max_new_tokens={point['tokens']}", f"train.batch_size={point['batch']}",
           f"model.name={point.get('model_path', point['model'])}",
           f"model.max_seq_length={max(cfg0.model.max_seq_length, room + point['tokens'])}"]
    if point["model"].startswith("shapes:"):  # random weights earn no reward: without one, no update would run
        out.append(f"reward.functions=[{SHAPES_REWARD}]")
    return out


def check_points(preset: str, base: list[str], points: list[dict], arms: list[str]) -> None:
    """Every point's config loads and TRL can split its batch; ScalingError naming the point otherwise."""
    cfg0 = load_config(preset, base)
    for p in points:
        shapes_name(p["model"])
        stand_in = BUILTIN if p["model"].startswith("shapes:") else p["model"]  # a shapes: folder is built later
        try:
            cfg = load_config(preset, base + point_overrides(cfg0, {**p, "model_path": stand_in}))
        except ConfigError as e:
            raise ScalingError(f"point {p['name']}: {e}") from None
        if "trl8" in arms and cfg.train.batch_size % 8:
            raise ScalingError(f"point {p['name']}: train.batch_size={cfg.train.batch_size} does not divide into "
                               f"groups of 8 for trl8; use batches that are multiples of 8")


# ----------------------------------------------------------------------------------------------------------------
# one point: run vs_trl.py, keep the raw numbers


def basis_steps(run_dir: Path) -> list[dict]:
    """Per step of basis-lite's run (its metrics.jsonl, read as bench/lib/curves.read_run reads it): the parts of its
    clock, tokens generated and the fraction cut off."""
    out = []
    steps, _evals = read_run(run_dir)
    for rec in steps.values():
        row = {"step": rec["step"], "update_s": rec["training_s"], **{k: rec.get(k, 0.0) for k in PARTS},
               "generated_tokens": rec.get("generated_tokens"), "clipped_fraction": rec.get("clipped_fraction"),
               "completion_len": rec.get("completion_len"), "trained_sequences": rec.get("trained_sequences")}
        out.append(row)
    return out


def trl_steps(result: dict, history: list[dict], batch: int) -> list[dict]:
    """Per step of the TRL arm: generation and update seconds (vs_trl's clock), tokens and the clipped ratio from
    TRL's log history (one entry per optimizer step)."""
    logged = [h for h in history if "completions/mean_length" in h]
    out = []
    for i, st in enumerate(result["per_step"]):
        h = logged[i] if i < len(logged) else {}
        mean_len = h.get("completions/mean_length")
        out.append({"step": st["step"], "generation_s": st["generation_s"], "update_s": st["update_s"],
                    "generated_tokens": None if mean_len is None else round(mean_len * batch),
                    "clipped_fraction": h.get("completions/clipped_ratio"), "completion_len": mean_len})
    return out


def plan_peak_gib(preset: str, overrides: list[str]) -> float | None:
    from basis_lite.plan import estimate_memory

    try:
        return round(float(estimate_memory(load_config(preset, overrides))["total"]), 3)
    except (ConfigError, KeyError, ValueError):
        return None


def run_point(point: dict, args, base: list[str], out: Path, runs: Path, machine: dict) -> dict | None:
    """The point's raw record (also written to OUT/points/<name>.json), or None when an arm failed."""
    cfg0 = load_config(args.preset, base)
    point = {**point, "model_path": shapes_model_dir(point["model"], runs, cfg0.model.cache_dir)}
    overrides = base + point_overrides(cfg0, point)
    pdir = runs / point["name"]
    cmd = [sys.executable, str(ROOT / "bench" / "vs_trl.py"), "--preset", args.preset, "--steps", str(args.steps),
           "--eval-every", str(args.steps), "--eval-limit", "1", "--arms", ",".join(args.arms), "--quiet",
           "--out", str(pdir / "report"), "--runs", str(pdir)] + [a for o in overrides for a in ("--set", o)]
    print(f"[{point['name']}] {' '.join(point['axes']) or 'grid'}: {point['batch']} rollouts x {point['tokens']} "
          f"tokens, {point['model']}", flush=True)
    load_before, t0 = loadavg(), time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        print(f"[{point['name']}] vs_trl.py failed (exit {proc.returncode}); logs in {pdir}/<arm>/log.txt",
              file=sys.stderr, flush=True)
        return None
    arms = {}
    for arm in args.arms:
        result = json.loads((pdir / arm / "result.json").read_text())
        if arm == "basis":
            steps = basis_steps(pdir / arm / "run")
        else:
            hist_path = pdir / arm / "trl_log_history.json"
            steps = trl_steps(result, json.loads(hist_path.read_text()) if hist_path.exists() else [], point["batch"])
        arms[arm] = {"steps": steps, "peak_rss_mb": result.get("peak_rss_mb"), "dtype": result.get("dtype"),
                     "threads": result.get("threads"), "process_wall_s": result.get("process_wall_s"),
                     "loadavg_before": result.get("loadavg_before"), "loadavg_after": result.get("loadavg_after")}
        if arm == "basis":
            arms[arm]["plan_peak_gib"] = plan_peak_gib(args.preset, overrides)
    rec = {**{k: v for k, v in point.items() if k != "model_path"}, "preset": args.preset,
           "overrides": [o for o in overrides if not o.startswith("model.name=")] + [f"model.name={point['model']}"], "steps": args.steps, "arms": arms,
           "machine": flags_line(machine), "commit": machine.get("git_commit"), "dirty": machine.get("git_dirty"),
           "wall_s": round(time.time() - t0, 1), "loadavg_before": load_before, "loadavg_after": loadavg()}
    write_json(out / "points" / f"{point['name']}.json", rec)
    return rec


# ----------------------------------------------------------------------------------------------------------------
# the tables, from the raw files alone


def steady(steps: list[dict]) -> list[dict]:
    """The steps after the first (the first warms up); all of them when there is only one."""
    return steps[1:] if len(steps) > 1 else steps


def trained_nothing(step: dict) -> bool:
    """A basis-lite step whose update trained no sequence: every advantage was 0 (all rewards of the batch alike),
    so no forward or backward ran. Older raw files lack trained_sequences: no forward and no backward time then."""
    if step.get("trained_sequences") is not None:
        return step["trained_sequences"] == 0
    return "forward_s" in step and not step["forward_s"] and not step.get("backward_s")


def arm_summary(arm: str, rec: dict) -> dict:
    """Seconds per step and its parts (means over the steady steps; the update's over the steady steps that trained
    something, or over every step that did when none of the steady ones did), tokens per step, clipped fraction,
    peaks."""
    st = steady(rec["steps"])
    trained = [s for s in st if not trained_nothing(s)] or [s for s in rec["steps"] if not trained_nothing(s)]
    parts = ("generation_s", "update_s") + (("forward_s", "logprob_s", "backward_s", "optimizer_s")
                                            if arm == "basis" else ())
    out = {k: mean_present(s.get(k) for s in (st if k == "generation_s" else trained)) for k in parts}
    out["untrained_steps"] = sum(trained_nothing(s) for s in rec["steps"])
    out["step_s"] = (out["generation_s"] or 0.0) + (out["update_s"] or 0.0)
    out["generated_tokens"] = mean_present(s.get("generated_tokens") for s in st)
    out["clipped_fraction"] = mean_present(s.get("clipped_fraction") for s in rec["steps"])
    split = {k: out[k] for k in (("generation_s", "forward_s", "logprob_s", "backward_s", "optimizer_s")
                                 if arm == "basis" else ("generation_s", "update_s")) if out.get(k) is not None}
    out["dominant"] = max(split, key=split.get) if split else None
    out["dominant_share"] = split[out["dominant"]] / out["step_s"] if split and out["step_s"] else None
    out["peak_rss_mb"] = rec.get("peak_rss_mb")
    out["plan_peak_gib"] = rec.get("plan_peak_gib")
    return out


def growth(points: list[dict], arm: str) -> dict:
    """{(point name, axis): step_s / step_s of the smallest point on that axis}; on the model axis the reference is
    the first model of the same kind (`shapes:` models against the first `shapes:` model, others against the
    first other), so that sizes are compared at the same completion lengths."""
    out = {}
    for axis in ("model", "tokens", "batch"):
        on = [p for p in points if axis in p["axes"] and arm in p["arms"]]
        for p in on:
            same = [q for q in on if axis != "model" or
                    q["model"].startswith("shapes:") == p["model"].startswith("shapes:")]
            if len(same) < 2:
                continue
            first = same[0] if axis == "model" else min(same, key=lambda q: q[axis])
            ref = arm_summary(arm, first["arms"][arm])["step_s"]
            if ref:
                out[(p["name"], axis)] = arm_summary(arm, p["arms"][arm])["step_s"] / ref
    return out


TABLE = ("point", "axis", "arm", "s/step", "x smallest", "generation", "update (fwd / logp / bwd / opt)",
         "dominant", "tokens/step", "cut off", "peak RSS", "plan")


def table_rows(points: list[dict]) -> list[list[str]]:
    rows = []
    arms = list(dict.fromkeys(a for p in points for a in p["arms"]))
    grows = {a: growth(points, a) for a in arms}
    for p in points:
        for arm in arms:
            if arm not in p["arms"]:
                continue
            s = arm_summary(arm, p["arms"][arm])
            upd = fmt(s["update_s"], ".1f")
            if arm == "basis":
                upd += " (" + " / ".join(fmt(s[k], ".1f") for k in ("forward_s", "logprob_s", "backward_s",
                                                                      "optimizer_s")) + ")"
            g = [f"{ax} x{grows[arm][(p['name'], ax)]:.2f}" for ax in p["axes"] if (p["name"], ax) in grows[arm]]
            if s["untrained_steps"]:
                upd += f"; {s['untrained_steps']} of {len(p['arms'][arm]['steps'])} steps trained nothing"
            dom = "-" if s["dominant"] is None else f"{PART_NAMES[s['dominant']]} {s['dominant_share']:.0%}"
            rows.append([p["name"], ", ".join(p["axes"]) or "-", arm, fmt(s["step_s"], ".1f"), "; ".join(g) or "-",
                         fmt(s["generation_s"], ".1f"), upd, dom, fmt(s["generated_tokens"], ".0f"),
                         "-" if s["clipped_fraction"] is None else f"{s['clipped_fraction']:.0%}",
                         "-" if s["peak_rss_mb"] is None else f"{s['peak_rss_mb'] / 1024:.2f} GiB",
                         "-" if s["plan_peak_gib"] is None else f"{s['plan_peak_gib']:.2f} GiB"])
    return rows


def load_points(out: Path) -> list[dict]:
    files = sorted((out / "points").glob("*.json"))
    if not files:
        raise ScalingError(f"{shown(out)}/points/ holds no point files: nothing to report")
    order = {}
    if (out / "scaling.json").exists():
        order = {n: i for i, n in enumerate(json.loads((out / "scaling.json").read_text()).get("points", []))}
    pts = [json.loads(f.read_text()) for f in files]
    return sorted(pts, key=lambda p: (order.get(p["name"], len(order)), p["name"]))


def render(out: Path) -> str:
    """OUT/scaling.md from OUT/scaling.json and OUT/points/*.json."""
    meta = json.loads((out / "scaling.json").read_text()) if (out / "scaling.json").exists() else {}
    points = load_points(out)
    lines = ["# How a step's cost grows (basis-lite beside TRL GRPO G=8)", "",
             f"Generated by `python bench/cost_scaling.py --report {shown(out)}` from `points/*.json`; measured with "
             f"`{meta.get('command', '?')}`.", ""]
    if meta.get("machine"):
        m = meta["machine"]
        lines += [f"Machine: {flags_line(m)}; torch {m.get('torch')} with {m.get('torch_threads')} threads; commit "
                  f"{str(m.get('git_commit'))[:12]}{' (dirty)' if m.get('git_dirty') else ''}.", ""]
    lines += ["s/step: mean generation + update seconds over the steps after the first (the first warms up); a "
              "basis-lite step whose batch rewards were all alike trains nothing (every advantage 0) and takes no "
              "update time, so the update's mean leaves such steps out and the table says how many there were; "
              "x smallest: against the smallest point on the same axis (the first model). update for basis-lite: "
              "forward with the graph / log-prob passes / backward / optimizer. dominant: the largest part "
              "(basis-lite: of its five; TRL: generation or update). tokens/step: completion tokens generated; cut "
              "off: completions that hit the budget. peak RSS: the arm's whole process (load, two one-problem evals, "
              "the steps); plan: the peak `basis-lite plan` estimates for the same config.", "",
              markdown_table(TABLE, table_rows(points)), ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=DEFAULT_PRESET, help=f"preset of every point (default {DEFAULT_PRESET})")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, every point")
    ap.add_argument("--models", default=DEFAULT_MODELS, help=f"comma list of model.name values or shapes:<size> "
                    f"(default {DEFAULT_MODELS})")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma list of completion budgets")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma list of rollouts per step")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma list from {', '.join(ARMS)}")
    ap.add_argument("--grid", choices=("axes", "full"), default="axes", help="axes: one axis at a time around the "
                    "base point (default); full: every combination")
    ap.add_argument("--steps", type=int, default=3, help="training steps per arm and point (default 3)")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/scaling-<dataset>)")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "cost_scaling", help="run folders (git-ignored)")
    ap.add_argument("--fresh", action="store_true", help="measure points whose raw file exists again")
    ap.add_argument("--dry-run", action="store_true", help="check every point's config and print them, run nothing")
    ap.add_argument("--quick", action="store_true", help="plumbing check: the smoke preset, 2 small budgets and "
                    "batches, 2 steps, results under the runs folder")
    ap.add_argument("--report", type=Path, default=None, metavar="OUT", help="only rebuild OUT/scaling.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.steps = QUICK["preset"], QUICK["steps"]
        args.models, args.tokens, args.batches = (",".join(map(str, QUICK[k])) for k in ("models", "tokens",
                                                                                         "batches"))
    try:
        args.models = [m.strip() for m in args.models.split(",") if m.strip()]
        args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
        args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        ap.error("--tokens and --batches take comma lists of whole numbers, e.g. 48,128,256")
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for a in args.arms:
        if a not in ARMS:
            ap.error(f"--arms: unknown arm {a!r}; choose from {', '.join(ARMS)}")
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    args.runs = args.runs.resolve()
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        if args.report:
            (args.report / "scaling.md").write_text(render(args.report))
            print(text_table(TABLE, table_rows(load_points(args.report))))
            return 0
        cfg0 = load_config(args.preset, list(args.set))
        out = args.out or (args.runs / "quick" if args.quick else RESULTS / f"scaling-{cfg0.data.dataset}")
        points = make_points(args.models, args.tokens, args.batches, cfg0.train.batch_size, args.grid)
        check_points(args.preset, list(args.set), points, args.arms)
    except (ScalingError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        for p in points:
            print(f"{p['name']}: {', '.join(p['axes']) or 'grid'}; --set " + " --set ".join(
                list(args.set) + point_overrides(cfg0, p)))
        return 0
    if "trl8" in args.arms:
        import importlib.util

        if importlib.util.find_spec("trl") is None:
            print("error: arm trl8 needs trl: pip install -e '.[test]' (the pinned version)", file=sys.stderr)
            return 2
    machine = machine_record()
    print(f"{len(points)} points x {len(args.arms)} arms, {args.steps} steps each; {flags_line(machine)}", flush=True)
    meta = {"command": "python bench/cost_scaling.py " + " ".join(argv), "machine": machine,
            "points": [p["name"] for p in points], "arms": args.arms}
    write_json(out / "scaling.json", meta)
    failed = []
    for p in points:
        if (out / "points" / f"{p['name']}.json").exists() and not args.fresh:
            print(f"[{p['name']}] measured already: kept (--fresh measures it again)", flush=True)
            continue
        if run_point(p, args, list(args.set), out, args.runs, machine) is None:
            failed.append(p["name"])
    if len(failed) == len(points):
        print(f"error: every point failed ({', '.join(failed)}); nothing to report", file=sys.stderr)
        return 1
    (out / "scaling.md").write_text(render(out))
    print(text_table(TABLE, table_rows(load_points(out))))
    print(f"wrote {shown(out)}/scaling.md")
    if failed:
        print(f"failed points: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
