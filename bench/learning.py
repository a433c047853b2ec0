"""Learning speed on the CPU: held-out accuracy against wall-clock for BASIS (one rollout per prompt), GRPO (8) and
REINFORCE++ (one), with BASIS's offline prior pass counted in its clock.

New comparisons run with bench/compare.py (every arm x seed on one commit, each run's raw files kept, every table
rebuilt by bench/report.py); this script stays for the results under bench/results/learning/ and the EAPO arms.
The arms of both are bench/lib/arms.py's table.

What it measures
----------------
Every arm trains the same preset (default ``cpu-smollm2-arith``: SmolLM2-135M-Instruct on built-in arithmetic) for
the same number of steps, from the same seed, with the SAME NUMBER OF ROLLOUTS PER STEP (B = the preset's
``train.batch_size``), so a step costs about the same in every arm and only what the rollouts are spent on differs:

    basis         estimator basis,        B prompts x 1 rollout,  no prior (estimator.prior_samples=0)
    basis_prior   estimator basis,        B prompts x 1 rollout,  offline prior with K reference rollouts per
                                          training prompt (--prior-samples, default 4), computed COLD for this run
    basis_probe   estimator basis_probe,  B prompts x 1 rollout,  the online prompt probe as the prior (no prior pass)
    reinforce_pp  estimator reinforce_pp, B prompts x 1 rollout
    grpo8         estimator grpo,         B/8 prompts x 8 rollouts (B must be a multiple of 8)
    rloo2         estimator rloo,         B/2 prompts x 2 rollouts (POISE's fallback alone)
    poise         estimator poise,        B/2 prompts x 2 rollouts (trajectory features captured while generating)
    poise_wide    estimator poise,        B prompts x 2 rollouts: TWICE the rollouts per step of every other arm,
                                          compared with them at equal wall-clock (its steps cost more)
    basis_raw     as basis with estimator.normalize=never: the advantages r - b not divided by the batch std
                                          (BASIS's behaviour before issue 22 made auto = on for basis)
    basis_mix, basis_value, grpo8_wide    the mix option, prompt selection by value, GRPO 8 x B (issue 22)

EAPO arms (not in the default --arms; run them in this order, the last needs the first's adapter):

    eapo_prior    estimator basis on the preset's own levels (the easy ones: 1-3 for the default preset); its
                  final adapter is the prior of hard_eapo
    hard          estimator basis on the harder levels --hard-levels (default 4,5), trained and evaluated there
    hard_eapo     as hard, with eapo.prior_adapter = eapo_prior's adapter (--eapo-prior PATH: an adapter from
                  elsewhere instead): experience injection with the eapo.* defaults, plus any --set eapo.*

hard_eapo is paired by seed with hard (the same eval problems, prompts and initial adapter); the prior's own training
time is its arm's clock, not hard_eapo's (a prior is an earlier run a user already has). Injection doubles the rows of
every decode step, so hard_eapo's generation costs more per step than hard's; both clocks are reported.

Each arm runs ``basis_lite.trainer.train()`` in a fresh Python process (clean memory, threads and RNG), with a greedy
held-out eval every E steps (``train.eval_every``) plus the trainer's evals before and after training.

The clock of an eval point is the training compute spent to reach it: the cumulative ``generation_s + training_s``
of the steps up to that point (from metrics.jsonl), so eval, checkpoint, model-load and start-up time are NOT in it.
For ``basis_prior`` the prior pass (``prior_seconds`` in the run's summary.json) is added to every point: its
curve starts at x = prior seconds. The prior is also reported on its own, because a cached prior is reused by later
runs on the same data and settings (``basis-lite prior`` precomputes it): the chart draws the prior as a shaded
segment and the same curve without it (dashed, "prior cached").

A cold prior cache per run: the trainer reads and writes the prior under ``cache_root(cfg.model.cache_dir)``, the
folder the built-in model is converted into. The basis_prior arm gets its own ``model.cache_dir`` (emptied before a
fresh run) holding a symlink to the already converted built-in model in the shared cache, so the model is not
converted again and the prior is always computed, never read from an earlier run's cache.

Wall-clock depends on everything else running on the machine: the JSON records the machine, the torch thread
count and the load average before and after every arm. Compare arms from one invocation, on an otherwise idle machine.

Reproduce
---------
    python bench/learning.py                                   # all four arms, preset defaults (40 steps, eval every 10)
    python bench/learning.py --steps 40 --eval-every 10 --eval-size 150 --arms basis,basis_prior,reinforce_pp,grpo8
    python bench/learning.py --analyze-only                    # rebuild learning.{json,md,png} from the run folders
    python bench/learning.py --preset smoke --steps 2 --eval-every 1 --arms reinforce_pp,grpo8 --quiet \\
        --set train.threads=1 --set data.eval_size=4           # plumbing check on the tiny random model, ~20 s

The online-probe arms (issue 11) beside today's, 3 seeds (the finished arms of an earlier run in the same --runs
folder are skipped; about 2 h on 2 cores for the four new arms, poise_wide's steps costing about twice the others'):

    python bench/learning.py --steps 20 --eval-every 10 --seeds 0 1 2 --quiet \\
        --arms basis,reinforce_pp,grpo8,basis_probe,rloo2,poise,poise_wide

Seeds: one run per arm is one sample of a noisy process (sampling, prompt order and LoRA init all follow
``train.seed``; the eval set is fixed by ``data.seed``). ``--seeds 0 1 2`` runs every arm once per seed (runs under
``<runs>/seed<S>/``, ``train.seed=S`` added to every arm) and reports the mean accuracy over seeds at each eval
step with its standard error, each seed's numbers, and the paired per-seed difference of every arm to
``reinforce_pp`` (the same seed shares the eval problems, the training prompts and the initial adapter).

    python bench/learning.py --steps 20 --eval-every 10 --arms basis,reinforce_pp --seeds 0 1 2 --quiet

Issue 22 on the default task (bench/results/learning/default*/; each default-job arm is about 2.5-4 min on 2
cores with avx512_bf16, grpo8_wide about 10 min): five seeds of BASIS as shipped, BASIS with raw advantages,
REINFORCE++, GRPO and RLOO at equal rollouts, one seed per invocation so that other jobs can run between them; the
BASIS paper's comparison (GRPO with 8 rollouts for each of the same 32 prompts, 8x the rollouts per step) beside
BASIS in one invocation:

    for s in 0 1 2 3 4; do python bench/learning.py --steps 20 --eval-every 5 --seeds $s --quiet \
        --arms basis,basis_raw,reinforce_pp,grpo8,rloo2 --runs runs/l22; done
    python bench/learning.py --analyze-only --steps 20 --eval-every 5 --seeds 0 1 2 3 4 \
        --arms basis,basis_raw,reinforce_pp,grpo8,rloo2 --runs runs/l22 --out bench/results/learning/default
    python bench/learning.py --steps 20 --eval-every 5 --seeds 0 --quiet --arms basis,grpo8_wide --runs runs/l22w \
        --out bench/results/learning/default-wide

The held-out split of the default task cannot grow much (level 1 has 100 distinct problems, 50 of them held out),
so the seeds, not the eval size, set the standard error.

The same arms on the previous default mix (bench/results/learning/add2/, seeds 0-4, about 13 min per seed) and on
wordproblems (bench/results/learning/wordproblems/, about 35 min per seed), one seed per invocation:

    python bench/learning.py --preset cpu-smollm2-arith-add2 --steps 20 --eval-every 5 --seeds $s --quiet \
        --arms basis,basis_raw,reinforce_pp,grpo8,rloo2 --runs runs/l22add2
    python bench/learning.py --steps 20 --eval-every 5 --seeds $s --quiet --set data.dataset=wordproblems \
        --set 'data.levels=[1,4,5]' --arms basis,basis_raw,reinforce_pp,grpo8,rloo2 --runs runs/l22wp

(then --analyze-only with all the seeds and the same --preset / --set, and --out the results folder).
The mix and value-sampling options beside BASIS on the default task (bench/results/learning/mix/, seeds 0-2, run
before normalize became auto, so with raw advantages throughout):

    python bench/learning.py --steps 20 --eval-every 5 --seeds $s --quiet --arms basis,basis_mix,basis_value \
        --runs runs/l22mix

Not run yet: GRPO 32x8 on the previous mix and on wordproblems, and with today's BASIS beside it.

Which ``basis`` ran in those folders: the runs of issue 22 before ``estimator.normalize`` became auto (= on for
basis) ran BASIS with raw advantages; they were arm ``basis`` then and are ``basis_raw`` now. The runs with ``--set
estimator.normalize=true`` (the arm ``basis_norm`` of the time) are ``basis`` now: the same settings as today's
default. The run folders were renamed so (their settings files rewritten to the equivalent overrides) and the
results folders rebuilt with --analyze-only; each results README says which commit ran what.

EAPO (prior on levels 1-3, then levels 4-5 with and without injection, three seeds; about 2 hours on 2 cores):

    python bench/learning.py --steps 20 --eval-every 10 --arms eapo_prior,hard,hard_eapo --seeds 0 1 2 --quiet \
        --out bench/results/learning/eapo

Outputs: ``--out`` (default bench/results/learning) gets learning.json (per arm: eval points (step, clock_s,
eval_accuracy), prior seconds, final accuracy, settings; the machine record of bench/lib/provenance.py),
learning.md (table) and learning.png (accuracy vs wall-clock). The run folders (checkpoints, metrics.jsonl,
summary.json, one log per arm) go to ``--runs`` (default runs/bench-learning-<preset>, git-ignored). Resumable per
arm: an arm whose run folder holds summary.json is skipped, one with a checkpoint is resumed
(``train(resume=True)``), anything else is started afresh; the arm's settings are stored next to its folder and a
rerun with different settings stops with an error instead of mixing.

Expected runtime (preset defaults, 2 CPU cores): one default run is ~20 min of training + ~1 min per eval, so the
four arms take ~3-4x one default run (~1.5 h with eval every 10 steps), PLUS the basis_prior arm's prior pass:
K x train_size reference rollouts (4 x 2000 = 8000, ~6x the 40 x 32 = 1280 rollouts of the training run itself:
on the order of an hour on 2 cores). That cost is the point of counting it; to make the comparison cheaper use
``--prior-samples 2`` or a smaller ``--set data.train_size=...`` (the same for every arm).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# the arms train in their own processes; the driver reads configs (yaml) and metrics, and imports torch only for the
# machine record (its version and thread count)
from basis_lite.config import ConfigError, load_config  # noqa: E402
from bench.lib.arms import ARMS as ARM_TABLE  # noqa: E402
from bench.lib.arms import EAPO_ARMS, arm_overrides, use_cold_cache  # noqa: E402
from bench.lib.curves import first_point_reaching, read_run  # noqa: E402
from bench.lib.paths import results_dir, shown  # noqa: E402
from bench.lib.provenance import flags_line, loadavg, machine_record  # noqa: E402
from bench.lib.report import fmt_seconds, markdown_table, write_json  # noqa: E402

DEFAULT_ARMS = ("basis", "basis_prior", "reinforce_pp", "grpo8")  # --arms picks the others
PROBE_ARMS = ("basis_probe", "rloo2", "poise", "poise_wide")
MIX_ARMS = ("basis_mix", "basis_value", "basis_raw", "grpo8_wide")  # issue 22
ARMS = DEFAULT_ARMS + PROBE_ARMS + MIX_ARMS + EAPO_ARMS
COLORS = {a: ARM_TABLE[a].color for a in ARMS}
DESCRIPTIONS = {a: ARM_TABLE[a].description for a in ARMS}
# paired differences by seed: arm -> the arm it is compared with
PAIR_BASE = {"basis": "reinforce_pp", "basis_prior": "reinforce_pp", "grpo8": "reinforce_pp",
             "basis_probe": "reinforce_pp", "rloo2": "reinforce_pp", "poise": "reinforce_pp",
             "poise_wide": "reinforce_pp", "hard_eapo": "hard", "basis_mix": "basis", "basis_value": "basis",
             "grpo8_wide": "basis"}


# ----------------------------------------------------------------------------------------------------------------
# arm settings


def base_overrides(args) -> list[str]:
    """--set items first, then the benchmark's own (steps, eval cadence, eval size): the same for every arm."""
    out = list(args.set or [])
    if args.steps is not None:
        out.append(f"train.steps={args.steps}")
    if args.eval_size is not None:
        out.append(f"data.eval_size={args.eval_size}")
    return out


def _arg_path(path) -> str:
    """A path for a config value: relative to the repository when inside it (the workers run there, and results
    never hold machine paths), else absolute."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(p)


def plan_arms(args) -> tuple[dict, dict]:
    """({arm: overrides}, shared settings); every arm's config is loaded and validated before anything runs."""
    base = base_overrides(args)
    cfg0 = load_config(args.preset, base)
    eval_every = args.eval_every if args.eval_every is not None else (
        cfg0.train.eval_every or max(1, cfg0.train.steps // 4))
    base.append(f"train.eval_every={eval_every}")
    batch = cfg0.train.batch_size
    plans = {}
    for arm in args.arms:
        ov = base + arm_overrides(arm, batch, args.prior_samples, args.hard_levels,
                                  getattr(args, "eapo_prior_path", ""))
        cfg = load_config(args.preset, ov)  # raises ConfigError on a bad --set, before any run starts
        plans[arm] = {"overrides": ov, "estimator": cfg.estimator.name, "prompts_per_step": cfg.train.batch_size,
                      "rollouts_per_prompt": cfg.estimator.rollouts_per_prompt,
                      "rollouts_per_step": cfg.train.batch_size * cfg.estimator.rollouts_per_prompt,
                      "prior_samples": cfg.estimator.prior_samples, "steps": cfg.train.steps,
                      "eval_every": cfg.train.eval_every, "eval_size": cfg.data.eval_size,
                      "threads": cfg.train.threads}
    shared = {"preset": args.preset, "steps": cfg0.train.steps, "eval_every": eval_every,
              "eval_size": cfg0.data.eval_size, "rollouts_per_step": batch, "prior_samples": args.prior_samples,
              "model": cfg0.model.name, "dataset": cfg0.data.dataset, "train_size": cfg0.data.train_size,
              "set": list(args.set or []), "threads": cfg0.train.threads, "levels": cfg0.data.levels}
    if any(a in EAPO_ARMS for a in args.arms):
        shared["hard_levels"] = args.hard_levels
    return plans, shared


# ----------------------------------------------------------------------------------------------------------------
# the worker: one arm, one fresh process


def worker(spec_path: str) -> int:
    """`python bench/learning.py --worker SPEC.json`: train one arm (run by the driver, not by hand)."""
    import logging

    spec = json.loads(Path(spec_path).read_text())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from basis_lite.trainer import train

    cfg = load_config(spec["preset"], spec["overrides"])
    if spec.get("prior_cache"):
        use_cold_cache(cfg, spec["prior_cache"])
    summary = train(cfg, spec["run_dir"], resume=spec["resume"], progress=spec["progress"])
    print(json.dumps({"prior_seconds": summary.get("prior_seconds"), "prior_cached": summary.get("prior_cached"),
                      "seconds": summary.get("seconds")}))
    return 0


# ----------------------------------------------------------------------------------------------------------------
# the driver


@functools.lru_cache(maxsize=1)
def machine_info() -> dict:
    """Where this invocation measures (bench/lib/provenance.py's record), read once."""
    return machine_record()


def _has_checkpoint(run_dir: Path) -> bool:
    """A complete checkpoint to resume from (as basis_lite.runs.checkpoint.latest_checkpoint, without importing torch)."""
    ck = run_dir / "checkpoints"
    return ck.is_dir() and any((p / "MANIFEST.json").exists() for p in ck.glob("step-*"))  # checkpoint.MANIFEST


def run_arm(arm: str, plan: dict, args, runs: Path) -> dict:
    """Train one arm in a subprocess unless its run folder already holds a finished run. Returns run info."""
    run_dir = runs / arm
    settings_path = runs / f"{arm}.settings.json"
    settings = {"preset": args.preset, "overrides": plan["overrides"]}
    if settings_path.exists() and run_dir.exists():
        old = json.loads(settings_path.read_text())
        if old != settings:
            raise ConfigError(f"{run_dir} was run with other settings ({old}); now {settings}. Use another --runs "
                              f"folder or delete {run_dir} (and {settings_path}) to start that arm over")
    if (run_dir / "summary.json").exists():
        print(f"[{arm}] done already ({run_dir}): skipped", flush=True)
        return {"skipped": True}

    prior = next((o.split("=", 1)[1] for o in plan["overrides"] if o.startswith("eapo.prior_adapter=")), "")
    if prior and not (ROOT / prior / "adapter_config.json").exists():  # ROOT / an absolute path is that path
        print(f"[{arm}] FAILED: no prior adapter at {prior} (run the eapo_prior arm first, in the same --arms, or "
              f"pass --eapo-prior PATH)", file=sys.stderr, flush=True)
        return {"skipped": False, "returncode": 1}
    resume = (run_dir / "metrics.jsonl").exists() and _has_checkpoint(run_dir)
    prior_cache = runs / f"{arm}.cache" if plan["prior_samples"] > 0 else None
    if not resume:
        if run_dir.exists():
            shutil.rmtree(run_dir)  # a start that wrote no checkpoint: start over
        if prior_cache is not None and (prior_cache / "priors").exists():
            shutil.rmtree(prior_cache / "priors")  # cold prior for a fresh run
    runs.mkdir(parents=True, exist_ok=True)
    settings_path.write_text(json.dumps(settings, indent=2))
    spec = {"preset": args.preset, "overrides": plan["overrides"], "run_dir": str(run_dir), "resume": resume,
            "progress": not args.quiet, "prior_cache": str(prior_cache) if prior_cache else None}
    spec_path = runs / f"{arm}.spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)]
    log_path = runs / f"{arm}.log"
    print(f"[{arm}] {'resuming' if resume else 'training'}: {plan['prompts_per_step']} prompts x "
          f"{plan['rollouts_per_prompt']} rollouts, {plan['steps']} steps -> {run_dir}", flush=True)
    load_before = loadavg()
    t0 = time.time()
    if args.quiet:
        with open(log_path, "a") as log:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    else:
        proc = subprocess.run(cmd, cwd=ROOT, env=env)
    wall = time.time() - t0
    info = {"skipped": False, "resumed": resume, "process_wall_s": wall, "loadavg_before": load_before,
            "loadavg_after": loadavg(), "returncode": proc.returncode}
    if proc.returncode != 0:
        tail = log_path.read_text()[-3000:] if args.quiet and log_path.exists() else ""
        print(f"[{arm}] FAILED (exit {proc.returncode}) after {wall:.0f} s" + (f"; log {log_path}:\n{tail}" if tail
                                                                               else ""), file=sys.stderr, flush=True)
    else:
        print(f"[{arm}] finished in {wall:.0f} s", flush=True)
    # where this arm's clock was measured: arms of one report can come from several invocations (and machines)
    (runs / f"{arm}.machine.json").write_text(json.dumps(machine_info(), indent=2))
    return info


# ----------------------------------------------------------------------------------------------------------------
# analysis: run folders -> per-arm curves


def _f(v) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return 0.0
    return x if math.isfinite(x) else 0.0


def curve(run_dir: Path, prior_seconds: float = 0.0) -> dict:
    """Eval points with the clock = cumulative generation_s + training_s up to their step (+ the prior pass)."""
    steps, evals = read_run(run_dir)
    cum, total, gen, trn = {0: 0.0}, 0.0, 0.0, 0.0
    for s in sorted(steps):
        g, t = _f(steps[s].get("generation_s")), _f(steps[s].get("training_s"))
        gen, trn = gen + g, trn + t
        total += g + t
        cum[s] = total
    keys = sorted(cum)

    def clock_at(step: int) -> float:
        known = [k for k in keys if k <= step]
        return cum[known[-1]] if known else 0.0

    points = []
    for ev in evals:
        c = clock_at(int(ev["step"]))
        points.append({"step": int(ev["step"]), "clock_s": round(c + prior_seconds, 4), "train_clock_s": round(c, 4),
                       "eval_accuracy": ev["eval_accuracy"], "eval_n": ev.get("eval_n"),
                       "final": ev.get("event") == "eval_final"})
    return {"points": points, "steps_done": max(steps) if steps else 0, "generation_s": round(gen, 3),
            "training_s": round(trn, 3), "train_clock_s": round(total, 3)}


def collect_arm(arm: str, runs: Path, plan: dict | None, old: dict | None, run_info: dict | None) -> dict | None:
    """One arm's record from its run folder (or the previous JSON's record when the folder is gone)."""
    run_dir = runs / arm
    if not (run_dir / "metrics.jsonl").exists():
        return old
    summary = {}
    if (run_dir / "summary.json").exists():
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
        except json.JSONDecodeError:
            summary = {}
    prior_s = _f(summary.get("prior_seconds"))
    c = curve(run_dir, prior_s)
    rec = dict(old or {})
    if plan is None and (runs / f"{arm}.settings.json").exists():
        plan = {"overrides": json.loads((runs / f"{arm}.settings.json").read_text()).get("overrides")}
    if plan is not None:
        rec["settings"] = plan
    rec.update({
        "arm": arm, "description": DESCRIPTIONS.get(arm, arm), "run_dir": shown(run_dir),
        "status": "done" if summary else "partial",
        "points": c["points"], "steps": c["steps_done"], "generation_s": c["generation_s"],
        "training_s": c["training_s"], "train_clock_s": c["train_clock_s"],
        "prior_seconds": round(prior_s, 3), "prior_cached": summary.get("prior_cached"),
        "total_clock_s": round(c["train_clock_s"] + prior_s, 3),
        "accuracy_before": c["points"][0]["eval_accuracy"] if c["points"] and c["points"][0]["step"] == 0 else None,
        "final_accuracy": (summary.get("eval_after") or {}).get("accuracy"),
        "run_seconds": summary.get("seconds"),
    })
    if (runs / f"{arm}.machine.json").exists():
        rec["machine"] = json.loads((runs / f"{arm}.machine.json").read_text())
    if run_info and not run_info.get("skipped"):
        rec["last_invocation"] = run_info
    return rec


# ----------------------------------------------------------------------------------------------------------------
# report: markdown and PNG


def _acc(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _acc_se(p: dict) -> str:
    se = p.get("eval_accuracy_se")
    return f"{p['eval_accuracy']:.3f}" + (f" +- {se:.3f}" if se is not None else "")


def _machine_line(m: dict) -> str:
    return f"{flags_line(m)}; torch {m.get('torch', '?')}; commit {str(m.get('git_commit', '?'))[:10]}"


def _machines(report: dict, arms: list[str]) -> dict[str, list[str]]:
    """{machine line: the arms (arm@seed with seeds) measured there}; an arm without its own stamp ran where the
    report's invocation did."""
    default = report.get("machine", {})
    groups = report.get("per_seed") or {None: report.get("arms", {})}
    out: dict[str, list[str]] = {}
    for sd, recs in groups.items():
        for a in arms:
            if a in recs:
                out.setdefault(_machine_line(recs[a].get("machine") or default), []).append(
                    a if sd is None else f"{a}@seed{sd}")
    return out or {_machine_line(default): []}


def write_md(report: dict, path: Path) -> None:
    arms = [a for a in report["arm_order"] if a in report["arms"]]
    sh = report.get("settings", {})
    eval_steps = sorted({p["step"] for a in arms for p in report["arms"][a]["points"]
                         if p["step"] > 0 and not p["final"]})
    lines = ["# Learning speed: held-out accuracy vs wall-clock (CPU)", "",
             f"Preset `{sh.get('preset')}` (model `{sh.get('model')}`, dataset `{sh.get('dataset')}`, "
             f"train_size {sh.get('train_size')}), {sh.get('steps')} steps, {sh.get('rollouts_per_step')} rollouts "
             f"per step in every arm" + (" but poise_wide (twice that)" if "poise_wide" in arms else "")
             + f", greedy eval on {sh.get('eval_size')} held-out problems every "
             f"{sh.get('eval_every')} steps. Extra settings: {', '.join(sh.get('set') or []) or 'none'}.", "",
             "Clock = cumulative generation + training seconds of the steps so far (no eval, checkpoint or load "
             "time); for basis_prior the prior pass is added (and shown on its own: a cached prior is reused by "
             "later runs). Cells: accuracy (clock).", ""]
    if any(a in EAPO_ARMS for a in arms):
        lines += [f"EAPO arms: eapo_prior trains on the preset's levels {sh.get('levels')} and its adapter is the "
                  f"prior; hard and hard_eapo train and evaluate on levels {sh.get('hard_levels')}, hard_eapo "
                  "injecting the prior's tokens at critical points (eapo.* settings: the defaults unless in the extra "
                  "settings). Their accuracies are on other eval problems than eapo_prior's.", ""]
    head = ["arm", "rollouts/step", "steps", "train clock", "prior pass", "total clock", "acc before"]
    head += [f"@{s}" for s in eval_steps] + ["acc after"]
    rows = []
    for a in arms:
        r = report["arms"][a]
        st = r.get("settings") or {}
        by = {p["step"]: p for p in r["points"] if not p["final"]}
        fin = [p for p in r["points"] if p["final"]]
        rps = (f"{st.get('prompts_per_step')}x{st.get('rollouts_per_prompt')}" if st.get("prompts_per_step")
               else "-")
        row = [a + ("" if r.get("status") == "done" else f" ({r.get('status')})"), rps, str(r.get("steps", "-")),
               fmt_seconds(r.get("train_clock_s", 0.0)),
               fmt_seconds(r["prior_seconds"]) + (" (cached)" if r.get("prior_cached") else "")
               if r.get("prior_seconds") else "-", fmt_seconds(r.get("total_clock_s", 0.0)),
               _acc(r.get("accuracy_before"))]
        for s in eval_steps:
            p = by.get(s)
            row.append(f"{_acc_se(p)} ({fmt_seconds(p['clock_s'])})" if p else "-")
        row.append(f"{_acc_se(fin[-1])} ({fmt_seconds(fin[-1]['clock_s'])})" if fin else "-")
        rows.append(row)
    lines.append(markdown_table(head, rows))
    if report.get("per_seed"):
        seeds = list(report["per_seed"])
        lines += ["", f"Means over seeds (train.seed) {', '.join(seeds)} +- the standard error over seeds; clocks are "
                  "means. Final held-out accuracy per seed (training clock):", ""]
        rows = []
        for a in arms:
            recs = [report["per_seed"][sd].get(a) or {} for sd in seeds]
            rows.append([a] + [_acc(r.get("final_accuracy")) + (f" ({fmt_seconds(r['total_clock_s'])})"
                                                                 if r.get("points") else "") for r in recs])
        lines.append(markdown_table(["arm"] + [f"seed {sd}" for sd in seeds], rows))
        for a, pr in report.get("paired", {}).items():
            lines += ["", _paired_line(a, pr["vs"], pr)]
    for a, pr in report.get("paired_basis", {}).items():
        lines += ["", _paired_line("basis", a, pr)]
    lines += _time_to_accuracy_md(report.get("time_to_accuracy"), arms)
    machines = _machines(report, arms)
    if len(machines) == 1:
        lines += ["", f"Machine: {next(iter(machines))}; train.threads={sh.get('threads') or 'all'}.", ""]
    else:
        lines += ["", f"Machines (the arms ran in several invocations; compare clocks within one machine only; "
                  f"train.threads={sh.get('threads') or 'all'}):", ""]
        lines += [f"- {', '.join(who)}: {line}" for line, who in machines.items()] + [""]
    loads = [(a, report["arms"][a].get("last_invocation")) for a in arms]
    loads = [(a, li) for a, li in loads if li]
    if loads:
        lines.append("Load average (1/5/15 min) around each arm: " + "; ".join(
            f"{a} {li.get('loadavg_before')} -> {li.get('loadavg_after')}" for a, li in loads) + ".")
        lines.append("")
    lines += [f"Command: `{report.get('command', '')}`", ""]
    if report.get("rebuilt_by"):
        lines += [f"Rebuilt (no training) from the run folders, and from the earlier learning.json for arms whose "
                  f"folders are gone, by `{report['rebuilt_by']}`.", ""]
    lines += [f"Generated {report.get('created', '')} by bench/learning.py; data in learning.json, chart "
              "learning.png.", ""]
    path.write_text("\n".join(lines))


def _paired_line(arm: str, base: str, pr: dict) -> str:
    return (f"Paired by seed, {arm} minus {base}: final accuracy {pr['mean_diff']:+.3f}"
            + (f" +- {pr['se']:.3f} (SE over {len(pr['seeds'])} seeds)" if pr["se"] is not None else " (one seed)")
            + "; per seed " + ", ".join(f"{sd}: {d:+.3f}" for sd, d in pr["final_accuracy_diff"].items())
            + f"; training clock {pr['clock_ratio']:.2f}x {base}'s.")


def _time_to_accuracy_md(tta: dict | None, arms: list[str]) -> list[str]:
    if not tta or not tta.get("arms"):
        return []
    ts = tta["thresholds"]
    lines = ["", "Training clock to reach a held-out accuracy (first eval point of the mean curve at or above it; "
             "\"-\" = not reached; in brackets, how many seeds reach it on their own):", ""]
    rows = []
    for a in arms:
        row = tta["arms"].get(a)
        if row is None:
            continue
        cells = []
        for t in ts:
            c = row["mean_curve"].get(str(t))
            cell = "-" if c is None else fmt_seconds(c)
            if "seeds_reaching" in row:
                cell += f" ({row['seeds_reaching'][str(t)]}/{row['n_seeds']})"
            cells.append(cell)
        rows.append([a] + cells)
    lines.append(markdown_table(["arm"] + [f">= {t:g}" for t in ts], rows))
    for a, r in tta.get("basis_reaches", {}).items():
        lines.append("")
        if r["clock_s"] is None:
            lines.append(f"basis does not reach {a}'s final accuracy {r['accuracy']:.3f} within its run (basis final "
                         f"{_acc(r['basis_final_accuracy'])} after {fmt_seconds(r['basis_total_clock_s'] or 0.0)}; "
                         f"{a} took {fmt_seconds(r['other_clock_s'])}).")
        else:
            lines.append(f"basis reaches {a}'s final accuracy {r['accuracy']:.3f} after {fmt_seconds(r['clock_s'])} "
                         f"of training clock, {r['ratio']:.2f}x the {fmt_seconds(r['other_clock_s'])} {a} trained for.")
    return lines


def write_png(report: dict, path: Path) -> bool:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)", file=sys.stderr)
        return False
    arms = [a for a in report["arm_order"] if a in report["arms"] and report["arms"][a]["points"]]
    span = max([p["clock_s"] for a in arms for p in report["arms"][a]["points"]] + [1.0])
    minutes = span > 600
    scale = 60.0 if minutes else 1.0
    fig = Figure(figsize=(8.5, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for a in arms:
        r = report["arms"][a]
        st = r.get("settings") or {}
        color = COLORS.get(a, None)
        xs = [p["clock_s"] / scale for p in r["points"]]
        ys = [p["eval_accuracy"] for p in r["points"]]
        label = a + (f" ({st['prompts_per_step']}x{st['rollouts_per_prompt']})" if st.get("prompts_per_step") else "")
        prior = r.get("prior_seconds") or 0.0
        if prior > 0:
            ax.axvspan(0, prior / scale, color=color, alpha=0.10, lw=0)
            ax.plot([0, prior / scale], [ys[0], ys[0]], color=color, ls=":", lw=1.5)
            ax.annotate(f"prior pass (K={st.get('prior_samples', '?')}): {fmt_seconds(prior)}",
                        xy=(prior / scale / 2, ys[0]), xytext=(0, 8), textcoords="offset points", ha="center",
                        fontsize=8, color=color)
            ax.plot([p["train_clock_s"] / scale for p in r["points"]], ys, color=color, ls="--", lw=1, alpha=0.6,
                    label=f"{a}, prior cached (reused)")
            label += " incl. prior"
        if r.get("seeds"):
            label += f", mean of {len(r['seeds'])} seeds"
            ax.errorbar(xs, ys, yerr=[p.get("eval_accuracy_se") or 0.0 for p in r["points"]], fmt="none",
                        ecolor=color, capsize=3, lw=1)
        ax.plot(xs, ys, marker="o", ms=4, lw=2, color=color, label=label)
    sh = report.get("settings", {})
    ax.set_xlabel(f"training wall-clock, generation + update ({'min' if minutes else 's'}; eval time excluded)")
    ax.set_ylabel(f"held-out greedy accuracy (n={sh.get('eval_size')})")
    ax.set_title(f"{sh.get('preset')}: accuracy vs wall-clock, {sh.get('rollouts_per_step')} rollouts/step", fontsize=10)
    top = max([p["eval_accuracy"] for a in arms for p in report["arms"][a]["points"]] + [0.0])
    ax.set_ylim(-0.02, min(1.02, max(0.1, top * 1.15 + 0.02)))
    ax.set_xlim(left=0)
    ax.grid(True, alpha=0.3)
    if arms:
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, format="png")
    tmp.replace(path)
    return True


# ----------------------------------------------------------------------------------------------------------------
# main


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="cpu-smollm2-arith")
    p.add_argument("--steps", type=int, default=None, help="train.steps (default: the preset's)")
    p.add_argument("--eval-every", type=int, default=None,
                   help="train.eval_every (default: the preset's, or steps // 4)")
    p.add_argument("--eval-size", type=int, default=None, help="data.eval_size (default: the preset's)")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                   help=f"comma-separated, from {','.join(ARMS)} (default {','.join(DEFAULT_ARMS)})")
    p.add_argument("--prior-samples", type=int, default=4, help="K for basis_prior (default 4)")
    p.add_argument("--hard-levels", default="4,5", help="data.levels of the hard and hard_eapo arms (default 4,5)")
    p.add_argument("--eapo-prior", default=None,
                   help="hard_eapo: this adapter as the prior instead of the eapo_prior arm's (<runs>/eapo_prior/adapter)")
    p.add_argument("--out", default=str(results_dir("learning")),
                   help="folder for learning.{json,md,png} (default bench/results/learning)")
    p.add_argument("--runs", default=None, help="folder for the run folders (default runs/bench-learning-<preset>)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every arm (repeatable)")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="run every arm once per train.seed (runs under <runs>/seed<S>) and report means over seeds")
    p.add_argument("--thresholds", default="0.5,0.55,0.6,0.65",
                   help="held-out accuracies for the time-to-accuracy table (comma-separated, default 0.5,0.55,0.6,0.65)")
    p.add_argument("--analyze-only", action="store_true", help="no training: rebuild the outputs from JSON/run folders")
    p.add_argument("--quiet", action="store_true", help="arm output to <runs>/<arm>.log, no progress bars")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in args.arms if a not in ARMS]
    if bad or not args.arms:
        p.error(f"--arms: unknown {bad}; choose from {', '.join(ARMS)}")
    if args.seeds is not None and len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds: {args.seeds} repeats a seed")
    try:
        args.thresholds = sorted(float(x) for x in args.thresholds.split(",") if x.strip())
    except ValueError:
        p.error(f"--thresholds: expected comma-separated accuracies such as 0.5,0.6, got {args.thresholds!r}")
    if not args.thresholds or not all(0.0 < t <= 1.0 for t in args.thresholds):
        p.error(f"--thresholds: {args.thresholds} must be accuracies in (0, 1]")
    if args.prior_samples < 1:
        p.error("--prior-samples must be >= 1")
    try:
        args.hard_levels = [int(x) for x in args.hard_levels.split(",") if x.strip()]
    except ValueError:
        p.error(f"--hard-levels: expected comma-separated integers such as 4,5, got {args.hard_levels!r}")
    for name in ("steps", "eval_every", "eval_size"):
        v = getattr(args, name)
        if v is not None and v < (0 if name != "steps" else 1):
            p.error(f"--{name.replace('_', '-')}: {v} is out of range")
    return args


def aggregate(per_seed: dict[str, dict], arm_order: list[str]) -> dict[str, dict]:
    """Per arm, the mean over seeds at every eval point all its seeds reached, with the standard error."""
    out = {}
    for arm in arm_order:
        recs = {sd: r[arm] for sd, r in per_seed.items() if arm in r and r[arm].get("points")}
        if not recs:
            continue
        keys = set.intersection(*[{(p["step"], p["final"]) for p in r["points"]} for r in recs.values()])
        points = []
        for step, final in sorted(keys):
            ps = [next(p for p in r["points"] if (p["step"], p["final"]) == (step, final)) for r in recs.values()]
            acc = [p["eval_accuracy"] for p in ps]
            n = len(acc)
            mean = sum(acc) / n
            se = math.sqrt(sum((a - mean) ** 2 for a in acc) / (n - 1) / n) if n > 1 else None
            points.append({"step": step, "final": final, "eval_accuracy": mean, "eval_accuracy_se": se,
                           "per_seed": dict(zip(recs, acc)), "n_seeds": n,
                           "clock_s": sum(p["clock_s"] for p in ps) / n,
                           "train_clock_s": sum(p["train_clock_s"] for p in ps) / n})
        first = next(iter(recs.values()))

        def mean_of(key):
            vals = [r.get(key) for r in recs.values() if r.get(key) is not None]
            return sum(vals) / len(vals) if vals else None

        out[arm] = {"arm": arm, "description": first.get("description"), "settings": first.get("settings"),
                    "seeds": list(recs), "status": "done" if all(r.get("status") == "done" for r in recs.values())
                    and len(recs) == len(per_seed) else "partial",
                    "points": points, "steps": min(r.get("steps", 0) for r in recs.values()),
                    "train_clock_s": mean_of("train_clock_s") or 0.0, "prior_seconds": mean_of("prior_seconds") or 0.0,
                    "total_clock_s": mean_of("total_clock_s") or 0.0, "accuracy_before": mean_of("accuracy_before"),
                    "final_accuracy": mean_of("final_accuracy")}
    return out


# basis against the other arms users would pick instead of it, reported as "basis minus X" (PAIR_BASE pairs basis
# with reinforce_pp, and grpo8_wide, basis_mix and basis_value with basis already)
BASIS_VS = ("grpo8", "rloo2", "basis_raw")


def _paired_diff(per_seed: dict[str, dict], arm: str, base: str) -> dict | None:
    """`arm` minus `base`, seed by seed (same eval problems, prompts and initial adapter): final accuracy and
    training clock, with the mean difference and its standard error over seeds; None if no seed has both."""
    rows = {sd: (r[arm].get("final_accuracy"), r[base].get("final_accuracy"), r[arm].get("total_clock_s"),
                 r[base].get("total_clock_s")) for sd, r in per_seed.items() if arm in r and base in r}
    rows = {sd: v for sd, v in rows.items() if None not in v}
    if not rows:
        return None
    d = [a - b for a, b, _, _ in rows.values()]
    n = len(d)
    m = sum(d) / n
    se = math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1) / n) if n > 1 else None
    return {"vs": base, "seeds": list(rows), "final_accuracy_diff": dict(zip(rows, d)), "mean_diff": m, "se": se,
            "clock_ratio": sum(c for _, _, c, _ in rows.values()) / max(1e-9, sum(c for _, _, _, c in rows.values()))}


def paired(per_seed: dict[str, dict], arm_order: list[str]) -> dict[str, dict]:
    """Every arm minus the arm PAIR_BASE names for it (reinforce_pp; hard for hard_eapo), seed by seed."""
    out = {}
    for arm in arm_order:
        base = PAIR_BASE.get(arm)
        if base is not None and base in arm_order and (pr := _paired_diff(per_seed, arm, base)) is not None:
            out[arm] = pr
    return out


def paired_basis(per_seed: dict[str, dict], arm_order: list[str]) -> dict[str, dict]:
    """basis minus each BASIS_VS arm that ran (keyed by that arm), seed by seed; only the seeds both ran count."""
    if "basis" not in arm_order:
        return {}
    out = {}
    for other in BASIS_VS:
        if other in arm_order and (pr := _paired_diff(per_seed, "basis", other)) is not None:
            out[other] = pr
    return out


def clock_reaching(points: list[dict], accuracy: float) -> float | None:
    """The clock of the first eval point at or above `accuracy` (bench/lib/curves.py); None if none is."""
    p = first_point_reaching(points, accuracy, key="eval_accuracy")
    return None if p is None else p["clock_s"]


def time_to_accuracy(report: dict, thresholds: list[float]) -> dict:
    """Per arm, the clock its (mean-over-seeds) curve needs to reach each threshold, and per seed how many reach it;
    and, for every other arm, the clock basis needs to reach that arm's final accuracy over that arm's total clock
    (the BASIS paper's "as accurate in less training time" question; < 1 means basis gets there sooner)."""
    arms = [a for a in report["arm_order"] if a in report["arms"] and report["arms"][a]["points"]]
    out = {"thresholds": thresholds, "arms": {}, "basis_reaches": {}}
    for a in arms:
        pts = report["arms"][a]["points"]
        row = {"mean_curve": {str(t): clock_reaching(pts, t) for t in thresholds}}
        if report.get("per_seed"):
            recs = [r[a] for r in report["per_seed"].values() if a in r and r[a].get("points")]
            row["seeds_reaching"] = {str(t): sum(clock_reaching(r["points"], t) is not None for r in recs)
                                     for t in thresholds}
            row["n_seeds"] = len(recs)
        out["arms"][a] = row
    if "basis" in arms:
        bpts = report["arms"]["basis"]["points"]
        for a in arms:
            if a == "basis":
                continue
            r = report["arms"][a]
            target, total = r.get("final_accuracy"), r.get("total_clock_s") or 0.0
            if target is None or total <= 0:
                continue
            c = clock_reaching(bpts, target)
            out["basis_reaches"][a] = {"accuracy": target, "clock_s": c, "other_clock_s": total,
                                       "ratio": None if c is None else c / total,
                                       "basis_final_accuracy": report["arms"]["basis"].get("final_accuracy"),
                                       "basis_total_clock_s": report["arms"]["basis"].get("total_clock_s")}
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker)
    out = Path(args.out)
    runs = Path(args.runs) if args.runs else ROOT / "runs" / f"bench-learning-{Path(args.preset).stem}"
    json_path = out / "learning.json"
    old = {}
    if json_path.exists():
        try:
            old = json.loads(json_path.read_text())
        except json.JSONDecodeError:
            old = {}
    seeds = [None] if args.seeds is None else list(args.seeds)
    plans_by_seed: dict = {}
    try:
        for sd in seeds:
            a = argparse.Namespace(**vars(args))
            a.eapo_prior_path = _arg_path(args.eapo_prior if args.eapo_prior else
                                          (runs if sd is None else runs / f"seed{sd}") / "eapo_prior" / "adapter")
            if sd is not None:  # first, like a --set: every arm of this seed gets it
                a.set = [f"train.seed={sd}"] + list(args.set or [])
            plans_by_seed[sd] = plan_arms(a)
        shared = dict(plans_by_seed[seeds[0]][1])
    except ConfigError as e:
        if not args.analyze_only:
            print(f"error: {e}", file=sys.stderr)
            return 2
        plans_by_seed, shared = {}, old.get("settings", {})
    if args.seeds is not None:
        shared["seeds"] = list(args.seeds)
        shared["set"] = list(args.set or [])  # without the per-seed train.seed
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "learning speed: held-out accuracy vs wall-clock (generation + training seconds)",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python bench/learning.py " + " ".join(argv),
        "settings": shared, "runs": shown(runs),
        "machine": old.get("machine") if args.analyze_only and old.get("machine") else machine_info(),
        "arm_order": list(dict.fromkeys(list(args.arms) + [a for a in old.get("arm_order", []) if a not in args.arms]))
        if args.analyze_only else list(args.arms),
        "arms": {},
    }
    if args.analyze_only:
        report["rebuilt_by"] = report["command"]  # the command of the runs stays the one recorded
        report["command"] = old.get("command", report["command"])
    same_preset = old.get("settings", {}).get("preset") in (None, args.preset)
    old_arms = old.get("arms", {}) if same_preset and "per_seed" not in old else {}
    old_seeds = old.get("per_seed", {}) if same_preset else {}
    if args.seeds is not None:
        report["per_seed"] = {str(sd): {} for sd in seeds}
    failed = []

    def save():
        if args.seeds is not None:
            report["arms"] = aggregate(report["per_seed"], report["arm_order"])
            report["paired"] = paired(report["per_seed"], report["arm_order"])
            report["paired_basis"] = paired_basis(report["per_seed"], report["arm_order"])
        report["time_to_accuracy"] = time_to_accuracy(report, args.thresholds)
        write_json(json_path, report, indent=2)
        write_md(report, out / "learning.md")
        write_png(report, out / "learning.png")

    for sd in seeds:
        seed_runs = runs if sd is None else runs / f"seed{sd}"
        plans = plans_by_seed.get(sd, ({}, {}))[0]
        for arm in report["arm_order"]:
            plan = plans.get(arm)
            info = None
            if not args.analyze_only:
                try:
                    info = run_arm(arm, plan, args, seed_runs)
                except ConfigError as e:
                    print(f"error: {e}", file=sys.stderr)
                    return 2
                if info.get("returncode", 0) != 0:
                    failed.append(arm if sd is None else f"{arm}@seed{sd}")
            if sd is None:
                rec = collect_arm(arm, seed_runs, plan, old_arms.get(arm), info)
                if rec is not None:
                    report["arms"][arm] = rec
            else:
                rec = collect_arm(arm, seed_runs, plan, old_seeds.get(str(sd), {}).get(arm), info)
                if rec is not None:
                    report["per_seed"][str(sd)][arm] = rec
            save()  # after every arm: partial results survive an interrupted benchmark
    save()
    print(f"wrote {json_path}, {out / 'learning.md'}, {out / 'learning.png'}")
    for arm in report["arm_order"]:
        r = report["arms"].get(arm)
        if r:
            print(f"  {arm:13s} steps {r['steps']:4d}  clock {fmt_seconds(r['total_clock_s']):>9s}  prior "
                  f"{r['prior_seconds']:7.1f} s  acc {_acc(r.get('accuracy_before'))} -> {_acc(r.get('final_accuracy'))}"
                  + (f"  (mean of seeds {r['seeds']})" if r.get("seeds") else ""))
    for arm, pr in report.get("paired", {}).items():
        print(f"  {arm} - {pr['vs']}: final accuracy {pr['mean_diff']:+.3f}"
              + (f" +- {pr['se']:.3f} (SE over seeds {pr['seeds']})" if pr["se"] is not None else "")
              + f", clock ratio {pr['clock_ratio']:.2f}")
    if failed:
        print(f"failed arms: {', '.join(failed)} (see {runs}/<arm>.log or the output above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
