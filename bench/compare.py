"""One learning comparison on one commit: every arm x seed, one training process at a time, each run's raw files kept.

    python bench/compare.py bench/results/default-dev --seeds 0-7 --steps 20 --eval-every 5 \\
        --arms basis,basis_raw,reinforce_pp,grpo8,rloo2,rloo2_norm,grpo8_wide,spo,astar,basis_mix,trl8
    python bench/compare.py bench/results/default-confirm --seeds 100-107 --eval-set 1 --steps 20 --eval-every 5 \\
        --arms basis,reinforce_pp,grpo8,rloo2_norm,grpo8_wide,astar
    python bench/report.py bench/results/default-dev          # every table, plot and verdict, from the raw files

The arms are bench/lib/arms.py's table (each at the preset's B = train.batch_size rollouts per step; trl8 is TRL's
GRPOTrainer and trl_a2po TRL's A2POTrainer, through bench/vs_trl.py's workers). For each seed in the order given,
every arm runs once, the arms in the order given rotated by one more place per seed (seed 1 of 0-7 starts with the
second arm), so a slow drift of the machine falls on every arm alike. Each run is a fresh Python process (`--worker`)
training the preset with train.seed = the seed, the comparison's --set items and the arm's settings; the driver waits
for it with os.wait4 and takes the run's peak memory from the kernel's record of that process (ru_maxrss: its
high-water mark, or the larger of any child it waited for), not from the trainer's own log; it also reads the child's
resident set every 50 ms (peak_rss_sampled_mb), and where that exceeds ru_maxrss by more than 5 % the trainer cleared
the kernel's high-water mark during the run (bench/report.py says so).

One commit: the working tree must hold no uncommitted change to a tracked file that a run executes or reads
(`--allow-dirty` runs anyway and marks every run dirty, with the sha256 of `git diff HEAD`), and a comparison folder
started on one commit refuses to continue on another unless the two differ only in files no run executes or reads
(results, docs, tests: NOT_RUN_CODE), so that committing the finished runs does not end a comparison that takes
several sessions; its runs then still record the first commit, whose code they ran, and comparison.json the later
checkouts. The comparison's settings (preset, steps, eval cadence, eval set, --set) are fixed by its first
invocation (FOLDER/comparison.json); a later one may add arms and seeds.

Resumable: a run whose summary.json exists is done and kept; any other run (interrupted, failed) starts again from
nothing, so a run's clock and memory are always one process's. `--stop-after MINUTES` ends an invocation between runs
(none starts that its arm's longest finished run says would end later), and two failed runs in a row end it too (a
broken install fails every run); the same command continues either. One harness trains at a time: it holds a lock on
the folder above --work (runs/compare by default) while it runs.

Each run leaves FOLDER/runs/<arm>/seed<k>/ with
    summary.json       what bench/report.py reads (fields: docs/comparison.md)
    metrics.jsonl.gz   the trainer's metrics.jsonl, every step and eval line (for TRL, the same fields from its logs)
The training folders (checkpoints, adapters, logs) go to --work (default runs/compare/<folder name>, git-ignored)
and are deleted after a run finishes unless --keep-work.

Clock: clock_s = generation + update seconds summed over the steps, plus the reference samples drawn before training
(astar: K per training prompt, into a cold cache of the run's own); eval, model load and the rest of the process's
wall time are recorded beside it (eval_s, load_s, wall_s). Tokens, a cost that does not depend on the machine:
prompt_tokens, generated_tokens, trained_tokens (forward + backward) and reference_tokens from the trainer's
per-step counters in metrics.jsonl; a counter the trainer does not write is derived where metrics.jsonl allows
(generated tokens from completion_len) or left null, and `cost_source` says which.
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# the driver reads configs (yaml) and metrics; torch only for the machine record; the runs train in their own process
from basis_lite.config import DEFAULT_PRESET, ConfigError, load_config  # noqa: E402
from basis_lite.estimators import estimator_names  # noqa: E402
from basis_lite.safeio import RunLock  # noqa: E402
from bench.lib.arms import ARMS, arm_overrides, check_estimators, prompts_per_step, use_cold_cache  # noqa: E402
from bench.lib.curves import read_run  # noqa: E402
from bench.lib.paths import REPO, shown  # noqa: E402
from bench.lib.provenance import git_changed_files, git_commit, git_diff_sha256, loadavg, machine_record  # noqa: E402
from bench.lib.recorders import patched, rss_mb, timer  # noqa: E402
from bench.lib.report import write_json  # noqa: E402
from bench.vs_trl import INSTALL_HINT, a2po_config_kwargs, trl_config_kwargs, worker_a2po, worker_trl  # noqa: E402

DEFAULT_ARMS = ("basis", "basis_raw", "reinforce_pp", "grpo8", "rloo2", "rloo2_norm", "grpo8_wide", "spo", "astar",
                "basis_mix", "trl8")
COMPARISON = "comparison.json"
SUMMARY = "summary.json"
METRICS = "metrics.jsonl.gz"
PACKAGES = ("transformers", "peft", "trl")
TRL_ARMS = {"trl": worker_trl, "trl_a2po": worker_a2po}  # Arm.external: the bench/vs_trl.py worker that trains it
COSTS = ("prompt_tokens", "generated_tokens", "trained_tokens")
# what a TRL worker returns beside its run, copied into summary.json when present
TRL_FIELDS = ("trl", "logprob_head", "reward_s", "kept_prompts", "logits_divided_by")
# the comparison's settings: fixed by its first invocation
FIXED = ("preset", "steps", "eval_every", "eval_set", "set")
# paths no run executes or reads: a change there leaves a comparison on the same code (top-level *.md files too)
NOT_RUN_CODE = ("bench/results/", "docs/", "tests/", "notebooks/", ".ci/")


class CompareError(Exception):
    """Bad input or a state the harness refuses (dirty tree, other commit, other settings): exit 2, one line."""


# ----------------------------------------------------------------------------------------------------------------
# the plan


def parse_seeds(tokens: list[str]) -> list[int]:
    """'0-7' and '100' style tokens -> the seeds in the order given; CompareError on a bad token or a repeat."""
    seeds: list[int] = []
    for tok in tokens:
        lo, sep, hi = tok.partition("-")
        try:
            part = list(range(int(lo), int(hi) + 1)) if sep else [int(tok)]
        except ValueError:
            part = []
        if not part or min(part) < 0:
            raise CompareError(f"--seeds: {tok!r} is not a seed or a range; expected non-negative integers such as "
                               f"0-7 or 100-107 or 0 1 2")
        seeds += part
    if len(set(seeds)) != len(seeds):
        raise CompareError(f"--seeds: {' '.join(tokens)} repeats a seed")
    return seeds


def run_order(arms: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """Every (arm, seed): seed by seed in the order given, the arms rotated by one more place per seed."""
    out = []
    for i, seed in enumerate(seeds):
        k = i % len(arms)
        out += [(arm, seed) for arm in arms[k:] + arms[:k]]
    return out


def tree_state(allow_dirty: bool, repo=REPO) -> dict:
    """{commit, dirty[, diff_sha256]} of the checkout the runs train from; CompareError on uncommitted changes to
    tracked files a run executes or reads (run_code) without `allow_dirty` (with it, dirty is true whatever git
    says: the tree may change between runs of a long comparison)."""
    commit = git_commit(repo)
    if commit == "unknown":
        raise CompareError(f"{repo} is not a git checkout: a comparison records the commit it ran on")
    dirty = bool(run_code(git_changed_files(repo=repo) or []))
    if dirty and not allow_dirty:
        raise CompareError("the working tree has uncommitted changes to tracked files the runs execute or read "
                           "(git status; results, docs and tests do not count): a comparison "
                           "runs on one commit; commit or stash them, or pass --allow-dirty (every run is then "
                           "marked dirty)")
    out = {"commit": commit, "dirty": bool(allow_dirty or dirty)}
    if out["dirty"]:
        out["diff_sha256"] = git_diff_sha256(repo)
    return out


def run_code(paths: list[str]) -> list[str]:
    """The paths of `paths` that a run may execute or read: all but NOT_RUN_CODE and top-level *.md files."""
    return [p for p in paths if p and not p.startswith(NOT_RUN_CODE) and not ("/" not in p and p.endswith(".md"))]


def code_changes(old: str, new: str, repo=REPO) -> list[str] | None:
    """The files a run executes or reads that differ between commits `old` and `new`; None when git cannot compare
    them (a commit this checkout does not hold)."""
    changed = git_changed_files(old, new, repo)
    return None if changed is None else run_code(changed)


def base_overrides(args) -> list[str]:
    """What every arm of the comparison shares: --set items, then steps, eval cadence and eval set."""
    cfg0 = load_config(args.preset, list(args.set))
    steps = args.steps if args.steps is not None else cfg0.train.steps
    every = args.eval_every if args.eval_every is not None else (cfg0.train.eval_every or max(1, steps // 4))
    return list(args.set) + [f"train.steps={steps}", f"train.eval_every={every}", f"data.eval_set={args.eval_set}"]


def plan(args) -> tuple[dict, dict]:
    """({(arm, seed): run spec}, the comparison's settings); every run's config is loaded and checked first."""
    check_estimators([a for a in args.arms], estimator_names())
    base = base_overrides(args)
    cfg0 = load_config(args.preset, base)
    batch = cfg0.train.batch_size
    external = [a for a in args.arms if ARMS[a].external]
    if external:
        import importlib.util

        if importlib.util.find_spec("trl") is None:
            raise CompareError(f"arm {external[0]} needs trl: {INSTALL_HINT}")
    specs = {}
    for arm, seed in run_order(args.arms, args.seeds):
        a = ARMS[arm]
        ov = [f"train.seed={seed}"] + base + arm_overrides(arm, batch)
        cfg = load_config(args.preset, ov)  # ConfigError on a bad --set or arm, before any run starts
        if a.external == "trl":
            trl_config_kwargs(cfg, a.group, cfg.train.steps, "", True)  # ConfigError on a batch TRL cannot split
        elif a.external == "trl_a2po":
            a2po_config_kwargs(cfg, cfg.train.steps, "", True, a.prior_samples, 0.5)
        specs[(arm, seed)] = {
            "arm": arm, "seed": seed, "preset": args.preset, "overrides": ov, "external": a.external,
            "estimator": a.estimator, "description": a.description, "group": a.group,
            "prompts_per_step": prompts_per_step(a, batch), "rollouts_per_prompt": a.group, "tempered": a.tempered,
            "rollouts_per_step": prompts_per_step(a, batch) * a.group, "steps": cfg.train.steps,
            "eval_every": cfg.train.eval_every, "eval_set": cfg.data.eval_set, "prior_samples":
            (a.prior_samples or 0) if a.external else cfg.estimator.prior_samples}
    settings = {"preset": args.preset, "steps": cfg0.train.steps, "eval_every": cfg0.train.eval_every,
                "eval_set": args.eval_set, "set": list(args.set), "rollouts_per_step": batch,
                "model": cfg0.model.name, "dataset": cfg0.data.dataset, "levels": cfg0.data.levels,
                "eval_size": cfg0.data.eval_size, "train_size": cfg0.data.train_size}
    return specs, settings


def recorded_command(folder: Path, argv: list[str]) -> str:
    """The invocation as comparison.json records it, with no machine path: the folder argument written as
    bench/results/<name> when it lies in a bench/results folder (of this checkout, or of another one that a worktree
    at the comparison's commit writes into), else as `shown` writes paths."""
    where = folder.resolve()
    as_written = (f"bench/results/{where.name}" if where.parent.name == "results" and where.parent.parent.name == "bench"
                  else shown(where))
    return "python bench/compare.py " + " ".join(
        as_written if not a.startswith("-") and Path(a).resolve() == where else a for a in argv)


def open_comparison(folder: Path, tree: dict, settings: dict, args, argv: list[str]) -> dict:
    """FOLDER/comparison.json, created or continued: CompareError when it ran on another commit or with other
    settings; the arms and seeds of this invocation are added to it."""
    path = folder / COMPARISON
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    command = recorded_command(folder, argv)
    if path.exists():
        rec = json.loads(path.read_text())
        if rec["commit"] != tree["commit"]:
            changed = code_changes(rec["commit"], tree["commit"])
            if changed is None or changed:
                what = ("a commit this checkout does not hold" if changed is None else
                        "the code differs: " + ", ".join(changed[:4]) + (", ..." if len(changed) > 4 else ""))
                raise CompareError(f"{shown(folder)} ran on commit {rec['commit'][:12]}; this checkout is "
                                   f"{tree['commit'][:12]} ({what}). A comparison runs on one commit: check out "
                                   f"{rec['commit'][:12]}, or start a new comparison folder")
            rec["checkouts"] = list(dict.fromkeys(rec.get("checkouts", []) + [tree["commit"]]))
        old = {k: rec["settings"].get(k) for k in FIXED}
        new = {k: settings.get(k) for k in FIXED}
        if old != new:
            diff = ", ".join(f"{k} {old[k]!r} -> {new[k]!r}" for k in FIXED if old[k] != new[k])
            raise CompareError(f"{shown(folder)} was started with other settings ({diff}); run it with its own "
                               f"(see {COMPARISON}) or start a new comparison folder")
        rec["dirty"] = bool(rec.get("dirty") or tree["dirty"])
        rec["arms"] = list(dict.fromkeys(rec["arms"] + list(args.arms)))
        rec["seeds"] = list(dict.fromkeys(rec["seeds"] + list(args.seeds)))
        rec["invocations"].append({"command": command, "started": now})
    else:
        rec = {"comparison": folder.name, "commit": tree["commit"], "dirty": tree["dirty"], "settings": settings,
               "arms": list(args.arms), "seeds": list(args.seeds), "invocations": [{"command": command,
                                                                                   "started": now}]}
    write_json(path, rec, indent=2)
    return rec


# ----------------------------------------------------------------------------------------------------------------
# the worker: one run, one fresh process


def worker(spec_path: str) -> int:
    """`python bench/compare.py --worker SPEC.json`: one run (started by the driver); writes WORK/worker.json."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    spec = json.loads(Path(spec_path).read_text())
    info = worker_trl_arm(spec) if spec["external"] in TRL_ARMS else worker_basis_lite(spec)
    write_json(Path(spec["work"]) / "worker.json", info, indent=1)
    return 0


def worker_basis_lite(spec: dict) -> dict:
    """basis_lite.trainer.train() on the run's config, its evals and model load timed; a cold reference cache
    when the arm draws reference samples."""
    import torch

    from basis_lite import trainer

    work = Path(spec["work"])
    cfg = load_config(spec["preset"], spec["overrides"])
    if cfg.estimator.prior_samples > 0:
        use_cold_cache(cfg, work / "cache")
    acc = {"eval_s": 0.0, "load_s": 0.0}
    with patched(trainer, "run_eval", timer(acc, "eval_s")), patched(trainer, "build_policy", timer(acc, "load_s")):
        summary = trainer.train(cfg, work / "run", progress=False)
    keep = ("eval_before", "eval_after", "prior_seconds", "prior_cached", "seconds", "reference_tokens",
            "reference_prompt_tokens")
    return {**acc, "torch_threads": torch.get_num_threads(), "train_summary": {k: summary.get(k) for k in keep}}


def worker_trl_arm(spec: dict) -> dict:
    """TRL's GRPOTrainer or A2POTrainer through bench/vs_trl.py's workers, evals and model load timed; the eval
    points, step clocks and token counts written as the trainer's metrics.jsonl would hold them; A2PO's Stage 1 (its
    reference samples) as the trainer's summary records a cold prior."""
    import basis_lite.model.loading as loading
    import basis_lite.rl.evaluate as evaluate

    work = Path(spec["work"])
    run_dir = work / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    acc = {"eval_s": 0.0, "load_s": 0.0}
    trl_spec = {**spec, "eval_limit": None, "progress": False, "run_dir": str(run_dir)}
    with patched(evaluate, "evaluate", timer(acc, "eval_s")), patched(loading, "load_policy", timer(acc, "load_s")):
        res = TRL_ARMS[spec["external"]](trl_spec)
    history = json.loads((run_dir / "trl_log_history.json").read_text())
    lines = trl_metrics_lines(res, history, spec["rollouts_per_step"])
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    ref = res.get("reference") or {}
    summary = {"prior_seconds": ref["seconds"], "prior_cached": False, "reference_tokens": ref["generated_tokens"],
               "reference_prompt_tokens": ref["prompt_tokens"]} if ref else {}
    return {**acc, "torch_threads": res["threads"], **{k: res.get(k) for k in TRL_FIELDS}, "train_summary": summary}


def trl_metrics_lines(res: dict, history: list[dict], rollouts: int) -> list[dict]:
    """metrics.jsonl lines of a TRL run: a step line per optimizer step (generation_s, training_s = the update,
    reward_mean, and the tokens: counted by the worker where its step record has them (A2PO: prompt_tokens,
    generated_tokens, trained_tokens = their sum, all of which it forwards and backpropagates), else from TRL's log
    (GRPO: generated_tokens = completions/mean_length x rollouts, trained_tokens = the step's growth of num_tokens,
    prompt_tokens = the difference)), then the eval lines."""
    logs = {int(h["step"]): h for h in history if "step" in h}
    lines, seen = [], 0.0
    for p in res["per_step"]:
        s = int(p["step"])
        rec = {"step": s, "generation_s": p["generation_s"], "training_s": p["update_s"],
               "reward_mean": p["reward_mean"]}
        h = logs.get(s, {})
        if "generated_tokens" in p:
            rec.update(completion_len=p["generated_tokens"] / rollouts, generated_tokens=p["generated_tokens"],
                       prompt_tokens=p["prompt_tokens"], trained_tokens=p["prompt_tokens"] + p["generated_tokens"])
        elif "completions/mean_length" in h and "num_tokens" in h:
            gen = h["completions/mean_length"] * rollouts
            rec.update(completion_len=h["completions/mean_length"], generated_tokens=round(gen),
                       trained_tokens=round(h["num_tokens"] - seen), prompt_tokens=round(h["num_tokens"] - seen - gen))
            seen = h["num_tokens"]
        lines.append(rec)
    for p in res["points"]:
        lines.append({"step": p["step"], "event": "eval_final" if p["final"] else "eval", "eval_accuracy":
                      p["accuracy"], "eval_n": p["n"],
                      **{f"eval_accuracy_level{k}": v for k, v in p.get("by_level", {}).items()}})
    return lines


# ----------------------------------------------------------------------------------------------------------------
# the driver: one run


def run_dirs(folder: Path, work: Path, arm: str, seed: int) -> tuple[Path, Path]:
    """(FOLDER/runs/<arm>/seed<k>, WORK/<arm>/seed<k>)."""
    return folder / "runs" / arm / f"seed{seed}", work / arm / f"seed{seed}"


def is_done(result_dir: Path) -> bool:
    return (result_dir / SUMMARY).is_file()


def run_child(cmd: list[str], log_path: Path) -> dict:
    """Run `cmd` (output to `log_path`) and wait for it with os.wait4: {returncode, wall_s, peak_rss_mb: the
    kernel's rusage of that process (ru_maxrss, KiB on Linux), peak_rss_sampled_mb: its resident set read every 50 ms by
    this process, a check that holds even where the child resets its own high-water mark}."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.time()
    sampled, stop = [0.0], threading.Event()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

        def sample():
            while not stop.wait(0.05):
                sampled[0] = max(sampled[0], rss_mb(proc.pid))

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.terminate()
            proc.wait()
            raise
        finally:
            stop.set()
            thread.join()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    return {"returncode": proc.returncode, "wall_s": time.time() - t0, "peak_rss_mb": usage.ru_maxrss / 1024,
            "peak_rss_sampled_mb": sampled[0]}


def _finite(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _levels(ev: dict | None) -> dict[str, float]:
    return {k[len("eval_accuracy_level"):]: v for k, v in (ev or {}).items() if k.startswith("eval_accuracy_level")}


def summarize(spec: dict, run_dir: Path, info: dict, measured: dict) -> dict:
    """The run's summary.json from its metrics.jsonl, the worker's record and what the driver measured."""
    steps, evals = read_run(run_dir)
    order = sorted(steps)
    before = next((e for e in evals if e["step"] == 0 and e.get("event") == "eval"), None)
    after = next((e for e in evals if e.get("event") == "eval_final"), None)
    gen = sum(_finite(steps[s].get("generation_s")) or 0.0 for s in order)
    upd = sum(_finite(steps[s].get("training_s")) or 0.0 for s in order)
    ts = info.get("train_summary") or {}
    reference_s = _finite(ts.get("prior_seconds")) or 0.0
    evs = [v for v in (_finite(steps[s].get("explained_variance")) for s in order) if v is not None]
    costs, source = {}, {}
    for key in COSTS:
        if order and all(key in steps[s] for s in order):
            costs[key], source[key] = int(sum(steps[s][key] for s in order)), f"metrics.jsonl {key}"
        else:
            costs[key], source[key] = None, "not recorded (this trainer writes no per-step counter)"
    if spec["external"] == "trl":
        source.update({k: "TRL's log: num_tokens and completions/mean_length (trl_metrics_lines)" for k in COSTS
                       if costs[k] is not None})
    elif spec["external"] == "trl_a2po":
        source.update({k: "counted from the tokens A2PO's generate calls returned (bench/vs_trl.py _count_generated)"
                       for k in COSTS if costs[k] is not None})
    if costs["generated_tokens"] is None and order and all("completion_len" in steps[s] for s in order):
        costs["generated_tokens"] = int(round(sum(steps[s]["completion_len"] for s in order)
                                              * spec["rollouts_per_step"]))
        source["generated_tokens"] = "metrics.jsonl completion_len (the step's mean) x rollouts per step"
    last = steps[order[-1]] if order else {}
    if "cum_reference_tokens" in last:
        costs["reference_tokens"], source["reference_tokens"] = last["cum_reference_tokens"], \
            "metrics.jsonl cum_reference_tokens"
    elif ts.get("reference_tokens") is not None:
        costs["reference_tokens"], source["reference_tokens"] = ts["reference_tokens"], "the trainer's summary"
    elif not spec["prior_samples"]:
        costs["reference_tokens"], source["reference_tokens"] = 0, "no reference samples (estimator.prior_samples=0)"
    else:
        costs["reference_tokens"], source["reference_tokens"] = None, "not recorded by this trainer"
    rec = {
        "arm": spec["arm"], "seed": spec["seed"], "description": spec["description"], "estimator": spec["estimator"],
        "prompts_per_step": spec["prompts_per_step"], "rollouts_per_prompt": spec["rollouts_per_prompt"],
        "rollouts_per_step": spec["rollouts_per_step"], "steps": len(order), "eval_every": spec["eval_every"],
        "eval_set": spec["eval_set"], "eval_n": (after or {}).get("eval_n"), "preset": spec["preset"],
        "overrides": spec["overrides"], **measured["tree"],
        "accuracy_before": (before or {}).get("eval_accuracy"), "accuracy_after": (after or {}).get("eval_accuracy"),
        "accuracy_before_by_level": _levels(before), "accuracy_after_by_level": _levels(after),
        "clock_s": round(gen + upd + reference_s, 3), "generation_s": round(gen, 3), "update_s": round(upd, 3),
        "reference_s": round(reference_s, 3), "reference_cached": ts.get("prior_cached"),
        "eval_s": round(info.get("eval_s", 0.0), 3), "load_s": round(info.get("load_s", 0.0), 3),
        "wall_s": round(measured["wall_s"], 3), **costs, "cost_source": source,
        "peak_rss_mb": round(measured["peak_rss_mb"], 1),
        "peak_rss_source": "ru_maxrss of the training process (os.wait4 in the driver)",
        "peak_rss_sampled_mb": round(measured.get("peak_rss_sampled_mb", 0.0), 1),
        "explained_variance_mean": sum(evs) / len(evs) if evs else None, "explained_variance_steps": len(evs),
        **measured["machine"], "torch_threads": info.get("torch_threads"),
        "loadavg_before": measured["loadavg_before"], "loadavg_after": measured["loadavg_after"],
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    for key in TRL_FIELDS:
        if info.get(key) is not None:
            rec[key] = info[key]
    return rec


def keep_run(run_dir: Path, result_dir: Path, summary: dict) -> None:
    """A finished run's raw files into its results folder: metrics.jsonl gzipped, then summary.json (last: its
    presence marks the run done)."""
    result_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "rb") as src, gzip.GzipFile(result_dir / METRICS, "wb", mtime=0) as dst:
        shutil.copyfileobj(src, dst)
    write_json(result_dir / SUMMARY, summary, indent=1)


def run_one(spec: dict, folder: Path, work: Path, tree: dict, machine: dict, keep_work: bool) -> bool:
    """Train one (arm, seed) unless it is done; True when its summary.json is there afterwards."""
    arm, seed = spec["arm"], spec["seed"]
    result_dir, work_dir = run_dirs(folder, work, arm, seed)
    if is_done(result_dir):
        print(f"[{arm} seed {seed}] done already: kept", flush=True)
        return True
    for d in (result_dir, work_dir):  # anything left by an interrupted or failed run: start it again
        if d.exists():
            shutil.rmtree(d)
    work_dir.mkdir(parents=True)
    spec_path = work_dir / "spec.json"
    write_json(spec_path, {**spec, "work": str(work_dir)}, indent=1)
    print(f"[{arm} seed {seed}] training: {spec['prompts_per_step']} prompts x {spec['rollouts_per_prompt']} "
          f"rollouts, {spec['steps']} steps (log {shown(work_dir / 'log.txt')})", flush=True)
    load_before = loadavg()
    child = run_child([sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)],
                      work_dir / "log.txt")
    load_after = loadavg()
    rc, wall, peak = child["returncode"], child["wall_s"], child["peak_rss_mb"]
    run_dir = work_dir / "run"
    if rc != 0 or not (work_dir / "worker.json").exists() or not (run_dir / "metrics.jsonl").exists():
        tail = (work_dir / "log.txt").read_text(errors="replace")[-3000:]
        print(f"[{arm} seed {seed}] FAILED (exit {rc}) after {wall:.0f} s; the run starts again next time; log "
              f"{shown(work_dir / 'log.txt')}:\n{tail}", file=sys.stderr, flush=True)
        return False
    info = json.loads((work_dir / "worker.json").read_text())
    summary = summarize(spec, run_dir, info, {"tree": tree, "machine": machine, **child,
                                              "loadavg_before": load_before, "loadavg_after": load_after})
    keep_run(run_dir, result_dir, summary)
    if not keep_work:
        shutil.rmtree(work_dir)
    print(f"[{arm} seed {seed}] done in {wall:.0f} s: accuracy {summary['accuracy_before']} -> "
          f"{summary['accuracy_after']}, clock {summary['clock_s']:.0f} s, peak RSS {peak:.0f} MB", flush=True)
    return True


def expected_wall_s(folder: Path, arm: str) -> float:
    """How long a run of `arm` takes, from the arm's finished runs in this folder: the longest wall_s of their
    summary.json files (0.0 when none has finished)."""
    walls = []
    for path in (folder / "runs" / arm).glob("seed*/" + SUMMARY):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            w = json.loads(path.read_text()).get("wall_s")
            if isinstance(w, (int, float)) and math.isfinite(w):
                walls.append(float(w))
    return max(walls, default=0.0)


def train_in_order(order, specs, folder: Path, work: Path, tree: dict, machine: dict, args):
    """Train the runs of `order` one at a time: (failed runs, runs not started, why they were not).

    Stops early, between runs, when two runs in a row failed (a broken install or machine fails every run) or when
    --stop-after's time would be over before the next run ends by expected_wall_s (a run is never cut short)."""
    deadline = time.monotonic() + 60 * args.stop_after if args.stop_after else None
    failed, streak = [], 0
    for i, (arm, seed) in enumerate(order):
        if deadline is not None and not is_done(run_dirs(folder, work, arm, seed)[0]) and \
                time.monotonic() + expected_wall_s(folder, arm) > deadline:
            why, rest = f"--stop-after {args.stop_after:g} min", order[i:]
            break
        if run_one(specs[(arm, seed)], folder, work, tree, machine, args.keep_work):
            streak = 0
            continue
        failed.append(f"{arm} seed {seed}")
        streak += 1
        if streak == 2:
            why, rest = "two runs in a row failed", order[i + 1:]
            break
    else:
        return failed, [], ""
    return failed, [k for k in rest if not is_done(run_dirs(folder, work, *k)[0])], why


# ----------------------------------------------------------------------------------------------------------------
# main


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("folder", type=Path, help="the comparison's results folder, e.g. bench/results/default-dev")
    p.add_argument("--seeds", nargs="+", required=True, help="train.seed of the runs: 0-7 (development), 100-107 "
                                                             "(confirmation), or a list such as 0 1 2")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated, from bench/lib/arms.py: "
                   f"{', '.join(a for a in ARMS if a not in ('eapo_prior', 'hard', 'hard_eapo'))} "
                   f"(default {','.join(DEFAULT_ARMS)})")
    p.add_argument("--preset", default=DEFAULT_PRESET, help=f"preset of every run (default {DEFAULT_PRESET})")
    p.add_argument("--steps", type=int, default=None, help="train.steps (default: the preset's)")
    p.add_argument("--eval-every", type=int, default=None, help="train.eval_every (default: the preset's, or "
                                                                "steps // 4)")
    p.add_argument("--eval-set", type=int, default=0, choices=(0, 1), help="data.eval_set: 0 the development "
                   "held-out set (default), 1 the confirmation set drawn from problems set 0 never holds")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every run (repeatable)")
    p.add_argument("--allow-dirty", action="store_true", help="run from a tree with uncommitted changes; every run "
                                                              "is marked dirty")
    p.add_argument("--work", type=Path, default=None, help="training folders (default runs/compare/<folder name>)")
    p.add_argument("--keep-work", action="store_true", help="keep each run's training folder (checkpoints, adapter, "
                                                            "log) after it finished")
    p.add_argument("--stop-after", type=float, default=None, metavar="MINUTES",
                   help="start no run after MINUTES from now, nor one that would end later by the longest finished "
                        "run of its arm in the folder; a run in progress is never cut short (the same command "
                        "continues the rest)")
    p.add_argument("--dry-run", action="store_true", help="check everything, print the runs in order, train nothing")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1])
    args = parse_args(argv)
    try:
        args.seeds = parse_seeds(args.seeds)
        args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
        bad = [a for a in args.arms if a not in ARMS or a in ("eapo_prior", "hard", "hard_eapo")]
        if bad or not args.arms or len(set(args.arms)) != len(args.arms):
            raise CompareError(f"--arms: {','.join(bad) or args.arms} not accepted; choose distinct arms from "
                               f"{', '.join(a for a in ARMS if a not in ('eapo_prior', 'hard', 'hard_eapo'))}")
        if args.stop_after is not None and not (math.isfinite(args.stop_after) and args.stop_after > 0):
            raise CompareError(f"--stop-after: {args.stop_after:g}; expected a positive number of minutes")
        for name in ("steps", "eval_every"):
            v = getattr(args, name)
            if v is not None and v < 1:
                raise CompareError(f"--{name.replace('_', '-')}: {v}; expected a positive integer")
        tree = tree_state(args.allow_dirty)
        specs, settings = plan(args)
    except (CompareError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    folder = args.folder.resolve()
    work = (args.work or ROOT / "runs" / "compare" / folder.name).resolve()
    order = list(specs)
    todo = [k for k in order if not is_done(run_dirs(folder, work, *k)[0])]
    print(f"{shown(folder)}: {len(order)} runs ({len(args.arms)} arms x {len(args.seeds)} seeds), {len(todo)} to "
          f"train, commit {tree['commit'][:12]}{' (dirty)' if tree['dirty'] else ''}", flush=True)
    if args.dry_run:
        for arm, seed in order:
            print(f"  {'train' if (arm, seed) in todo else 'done '}  {arm} seed {seed}")
        return 0
    lock = RunLock(work.parent)
    try:
        lock.acquire()
    except ConfigError:
        print(f"error: another bench/compare.py trains from {shown(work.parent)} (its .lock is held): one training "
              f"process at a time; wait for it to finish", file=sys.stderr)
        return 2
    try:
        try:
            rec = open_comparison(folder, tree, settings, args, argv)
            tree = {**tree, "commit": rec["commit"]}  # the code every run of the comparison trains
        except CompareError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        machine = {k: v for k, v in machine_record(PACKAGES).items()
                   if k not in ("git_commit", "git_dirty", "loadavg_before")}
        failed, left, why = train_in_order(order, specs, folder, work, tree, machine, args)
    finally:
        lock.release()
    if left:
        print(f"stopped ({why}); not started: {', '.join(f'{a} seed {s}' for a, s in left)}; run the same command "
              f"again to continue", file=sys.stderr if failed else sys.stdout, flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}; run the same command again to retry them", file=sys.stderr)
        return 1
    if left:
        return 0
    print(f"all {len(order)} runs done; tables and plots: python bench/report.py {shown(folder)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
