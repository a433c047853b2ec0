"""Data-parallel scaling: steps per second and value-estimate quality against the number of processes, at a fixed
per-rank batch, and what the all-gather of the per-prompt quantities costs per step.

    python bench/scaling.py                                          # 1 and 2 processes, the default preset
    python bench/scaling.py --procs 1 2 4 --per-rank-batch 16 --steps 8
    python bench/scaling.py --preset smoke --per-rank-batch 2 --steps 3 --eval-size 4 --out /tmp/scaling   # a check

Speed. For each N: `python -m torch.distributed.run --standalone --nproc_per_node N -m basis_lite train --preset P`
with train.batch_size = N x b (the global batch), train.threads = cores // N (the N processes share this machine's
cores, so on one machine N processes do N times the work on the same cores: what scales here is the batch BASIS
pools over, not the speed; on N GPUs each rank has its own card), a checkpoint only at the end and a small held-out
eval. N = 1 runs under torchrun too, through the same code. From the run's metrics.jsonl, over the steps after the
first (which warms up): step wall time, steps/s, prompts/s, generation and training time, the all-gather (its
transfer, the wait for the slowest rank before it, its bytes), the gradient all-reduce (time and bytes), and the
explained variance of the live baselines (noisy over a few steps).

Value-estimate quality. The baselines of N ranks with b prompts each are those of one process with N x b prompts
(tests/rl/test_distributed.py checks it), so the quality at each global batch is measured on the recorded real
SmolLM2 rollouts with bench/value_mse.py's protocol: the baseline MSE of BASIS (default, no prior) against the
Monte-Carlo values, as a ratio to REINFORCE++'s batch mean (lower is better), per recorded scenario.

Writes OUT.json and OUT.md (default bench/results/scaling/scaling) with the git commit, the CPU and its flags; run
logs and run folders go to OUT-runs/.
"""
from __future__ import annotations

import argparse
import glob
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.paths import results_dir  # noqa: E402
from bench.lib.provenance import flags_line, machine_record, with_load_after  # noqa: E402
from bench.lib.report import markdown_table, write_json  # noqa: E402

SPEED_FIELDS = ("step_s", "generation_s", "training_s", "gather_s", "gather_wait_s", "gather_bytes", "allreduce_s",
                "allreduce_bytes", "explained_variance", "reward_mean")


def launch_command(n: int, preset: str, overrides: list[str], run_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), "-m",
           "basis_lite", "train", "--preset", preset, "--output", str(run_dir), "--no-progress"]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


def run_one(n: int, args, work: Path) -> dict:
    """Train with n processes; the step statistics of its metrics.jsonl."""
    threads = max(1, args.cores // n)
    overrides = [f"train.batch_size={n * args.per_rank_batch}", f"train.steps={args.steps}",
                 f"train.save_every={args.steps}", f"train.threads={threads}", f"data.eval_size={args.eval_size}",
                 "train.eval_every=0", *args.set]
    run_dir = work / f"procs-{n}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = launch_command(n, args.preset, overrides, run_dir)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = str(threads)
    t0 = time.time()
    with open(work / f"procs-{n}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{n} processes: training failed (rc {proc.returncode}); see {work / f'procs-{n}.log'}")
    from basis_lite.runs.metrics import read_metrics

    steps, _evals, _skipped = read_metrics(run_dir / "metrics.jsonl")
    timed = steps[1:] or steps  # the first step warms up (allocations, first generate)
    out = {"procs": n, "per_rank_batch": args.per_rank_batch, "global_batch": n * args.per_rank_batch,
           "threads_per_rank": threads, "steps": len(steps), "timed_steps": len(timed), "wall_s": wall,
           "command": " ".join(cmd[1:])}
    for f in SPEED_FIELDS:
        # finite values only: explained variance is NaN on a step whose rewards are all equal
        vals = [r[f] for r in timed if isinstance(r.get(f), (int, float)) and math.isfinite(r[f])]
        out[f] = statistics.fmean(vals) if vals else float("nan")
    out["steps_per_s"] = 1.0 / out["step_s"]
    out["prompts_per_s"] = out["global_batch"] / out["step_s"]
    out["gather_share"] = out["gather_s"] / out["step_s"]
    return out


def value_quality(global_batches: list[int], resamples: int, seed: int) -> dict:
    """{scenario: {B: {"ratio", "ci90", "prompts"}}}: BASIS default (no prior) / REINFORCE++ baseline MSE."""
    import numpy as np

    from bench import value_mse as vm

    paths = sorted(glob.glob(str(vm.RECORDINGS / "rollouts_*.npz")))
    if not paths:
        return {}
    fams = vm.load_recordings(paths)
    specs = vm.estimator_specs([], ["default"])
    rng = np.random.default_rng(seed)
    out: dict = {}
    for sc in vm.scenarios_of(fams, [4]):
        n = sc.pol.shape[0]
        bs = [b for b in global_batches if 2 <= b <= n]
        if not bs:
            continue
        res = vm.run_scenario(sc, specs, bs, resamples, rng, group_emp=False)
        out[f"{sc.family}/{sc.policy}"] = {
            str(b): {"ratio": res[b]["basis:default@K0"]["ratio"], "ci90": res[b]["basis:default@K0"]["ratio_ci90"],
                     "prompts": n} for b in bs}
    return out


def markdown(report: dict) -> str:
    a = report["settings"]
    m = report["machine"]
    lines = [f"# Data-parallel scaling ({a['preset']}, {a['per_rank_batch']} prompts per rank, {a['steps']} steps)",
             "", f"Measured on {flags_line(m)}; commit {m['git_commit'][:10]}; load average before / after "
             f"{m.get('loadavg_before')} / {m.get('loadavg_after')}.",
             f"Command: `{report['command']}`", "",
             "Every process of a run shares the same cores (threads per rank = cores // processes): on one machine "
             "N processes do N times the work on the same cores, so steps/s is expected to fall as N grows, and "
             "prompts/s shows what the cores deliver; on N GPUs each rank has its own card. Means over the steps "
             "after the first.", "",
             markdown_table(
                 ("processes", "global batch", "threads/rank", "step s", "steps/s", "prompts/s", "generation s",
                  "training s", "all-gather s", "wait before it s", "all-gather KiB", "share of step",
                  "grad all-reduce s", "all-reduce MiB", "explained variance"),
                 [[r["procs"], r["global_batch"], r["threads_per_rank"], f"{r['step_s']:.2f}",
                   f"{r['steps_per_s']:.3f}", f"{r['prompts_per_s']:.2f}", f"{r['generation_s']:.2f}",
                   f"{r['training_s']:.2f}", f"{r['gather_s']:.4f}", f"{r['gather_wait_s']:.3f}",
                   f"{r['gather_bytes'] / 1024:.1f}", f"{100 * r['gather_share']:.2f}%", f"{r['allreduce_s']:.3f}",
                   f"{r['allreduce_bytes'] / 2**20:.2f}", f"{r['explained_variance']:+.3f}"]
                  for r in report["runs"]])]
    q = report["value_quality"]
    if q:
        bs = sorted({int(b) for v in q.values() for b in v})
        lines += ["", "Value-estimate quality at each global batch: baseline MSE of BASIS (default, no prior) / "
                  "REINFORCE++'s batch mean on the recorded SmolLM2 rollouts (bench/value_mse.py's protocol; "
                  "90% bootstrap interval; lower is better).", ""]
        lines.append(markdown_table(["scenario"] + [f"B={b}" for b in bs], [
            [name] + [f"{cells[str(b)]['ratio']:.2f} [{cells[str(b)]['ci90'][0]:.2f}, {cells[str(b)]['ci90'][1]:.2f}]"
                      if str(b) in cells else "-" for b in bs] for name, cells in q.items()]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="numbers of processes to compare")
    ap.add_argument("--per-rank-batch", type=int, default=16, help="prompts per rank and step (fixed)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--preset", default="cpu-smollm2-arith")
    ap.add_argument("--eval-size", type=int, default=16, help="held-out problems (evaluated before and after)")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores the processes share")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config overrides")
    ap.add_argument("--resamples", type=int, default=60, help="value quality: resampled batches at B=32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(results_dir("scaling") / "scaling"),
                    help="output prefix (.json, .md; runs in OUT-runs/; default bench/results/scaling/scaling)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    work = out.parent / f"{out.name}-runs"
    work.mkdir(parents=True, exist_ok=True)
    machine = machine_record()
    runs = []
    for n in a.procs:
        print(f"{n} process(es), {n * a.per_rank_batch} prompts per step ...", flush=True)
        runs.append(run_one(n, a, work))
        r = runs[-1]
        print(f"  {r['step_s']:.2f} s/step, all-gather {r['gather_s'] * 1e3:.1f} ms ({r['gather_bytes'] / 1024:.1f} "
              f"KiB), all-reduce {r['allreduce_s'] * 1e3:.1f} ms", flush=True)
    quality = value_quality([r["global_batch"] for r in runs], a.resamples, a.seed)
    report = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": "python bench/scaling.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "settings": {"procs": a.procs, "per_rank_batch": a.per_rank_batch, "steps": a.steps,
                           "preset": a.preset, "eval_size": a.eval_size, "cores": a.cores, "set": a.set},
              "machine": with_load_after(machine), "runs": runs, "value_quality": quality}
    write_json(out.with_suffix(".json"), report)
    md = markdown(report)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
