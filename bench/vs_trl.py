"""basis-lite against TRL's GRPOTrainer on the CPU: held-out accuracy against training wall-clock, and peak memory.

Install TRL first, without letting it move torch or transformers (check with `--dry-run`; if it wants to, add
`--no-deps` and install only what is missing: accelerate, datasets):

    pip install --dry-run trl==1.15.0      # must not list torch or transformers
    pip install trl==1.15.0 matplotlib     # trl pulls accelerate and datasets if they are missing

Arms (each in its own Python process, so their peak RSS are separate; one after the other, never in parallel):

    basis   basis-lite's default run: the preset through basis_lite.trainer.train(), B prompts x 1 rollout
            (B = the preset's train.batch_size), read back from its run folder (metrics.jsonl)
    trl8    TRL GRPOTrainer, B/8 prompts x 8 generations per step (the same B rollouts per step)
    trl4    TRL GRPOTrainer, B/4 prompts x 4 generations per step

What every arm shares (all read from the preset at run time, nothing hard-coded):

- the model: basis_lite.model.loading.load_policy() builds base + LoRA for every arm (the built-in SmolLM2 folder, the
  dtype from basis_lite.model.dtypes.resolve_dtype(model.dtype), LoRA r / alpha / dropout / target modules, adapters in
  fp32, gradient checkpointing), after the same seed, so the initial adapter is the same too;
  TRL gets that PeftModel instead of a model path and a peft_config;
- optimizer and learning-rate schedule: basis-lite's own make_optimizer / make_scheduler (AdamW; linear warmup
  from lr/(w+1), cosine down to 10%), handed to TRL through `optimizers=`, because TRL's warmup starts at lr 0;
- prompts: basis_lite.data.format_prompt (system prompt, instruction, chat template) over the training split, in
  the order basis-lite's PromptSampler draws them (TRL with shuffle_dataset=False);
- sampling: temperature, top_p, top_k and max new tokens (TRL: max_completion_length);
- reward: basis_lite.rewards.scorer.RewardScorer (math-verify correctness), given to TRL as a reward function that reads
  the gold answer from the dataset's "answer" column;
- loss: token-level PPO clip with clip_low / clip_high (TRL: epsilon / epsilon_high, loss_type="dapo"), no KL
  (beta = train.kl_coef = 0), one update per batch of rollouts (num_iterations=1), gradient clipping at
  train.max_grad_norm, train.micro_batch_size sequences per forward/backward (TRL: per_device_train_batch_size,
  with gradient_accumulation_steps = B / micro-batch);
- evaluation: basis_lite.rl.evaluate.evaluate() with the arguments train() passes it (greedy, eval_max_new_tokens,
  eval_batch_size, the held-out split load_examples(cfg.data, "eval")), on the same HF engine, before training,
  every --eval-every steps and at the end. --eval-limit N keeps the first N held-out problems (the split is drawn
  round-robin over the levels); it never changes data.eval_size, which would change the training split too.

What TRL cannot do on a CPU as shipped: TRL 1.15.0 computes GRPO's token log-probs with a Triton kernel
(trl.trainer.utils._ChunkedLogProbFunction) and has no PyTorch fallback, so GRPOTrainer fails at its first loss
without a GPU. On a CPU the TRL arms replace that kernel with TorchLogProbHead below, which scores tokens with
basis-lite's chunked log-prob function (the one the basis arm uses); log-probs, entropy and gradients match a plain
log_softmax to float32 rounding.

What differs on purpose: the advantage. basis is BASIS (one rollout per prompt, a baseline pooled from the other
prompts of the batch); the TRL arms are GRPO as TRL runs it (group mean baseline, divided by the group's std:
scale_rewards="group", TRL's default).

The clock. For every arm the clock is TRAINING ONLY: generation + update (forward, backward, optimizer step), summed
over steps. Evaluation, model loading, checkpoint writing and reward scoring (the same math-verify function in every
arm) are not in it. basis: generation_s + training_s from metrics.jsonl. TRL: each optimizer step timed from
on_step_begin to on_step_end, minus the time spent in the reward function; the evaluations run after on_step_end.

Headline: the clock basis-lite needs to reach TRL's final held-out accuracy (its first eval point at or above it)
divided by TRL's total clock, for each TRL arm; the target is <= 1/3, and the number is reported whichever way it
falls. Eval points are every --eval-every steps, so "reached" is only known at that granularity.

Usage:

    python bench/vs_trl.py                                   # full benchmark: preset steps, all three arms
    python bench/vs_trl.py --steps 20 --eval-every 5 --arms basis,trl8,trl4
    python bench/vs_trl.py --quick                           # plumbing check: 2 steps, eval every step on 8
                                                             # problems; results go under the runs folder

Runtime (2 AVX2 cores, fp32, no other load): a training step of 32 rollouts takes about 35-55 s in every arm
(2-step checks: generation 17-36 s, update 18-20 s) and an eval of the 150 held-out problems about 1.5-2 min, so
the default 20 steps with an eval every 5 steps take about 20-30 min per arm, 1-1.5 h for the three. Another
process on the same cores slows a step many times over (oversubscribed threads): run it on an idle machine.

Outputs (--out, default bench/results/vs_trl; with --quick and no --out: <runs>/quick): vs_trl.json (every eval point,
each arm's clock and peak RSS, CPU model and speed-relevant flags, torch/transformers/trl versions, git commit),
vs_trl.md (table and headline) and vs_trl.png (held-out accuracy against training clock). Run folders, logs and the
TRL adapters go to --runs (default runs/vs_trl, git-ignored). An arm whose folder holds a result for the same
settings is not run again (delete the folder, or pass --fresh, to redo it).
"""
from __future__ import annotations

import argparse
import json
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

# the driver imports no torch: the arms run in their own processes; only the config loader (yaml) is needed here
from basis_lite.config import DEFAULT_PRESET, ConfigError, load_config, to_dict  # noqa: E402
from bench.lib.curves import first_point_reaching, read_run  # noqa: E402
from bench.lib.paths import results_dir  # noqa: E402
from bench.lib.provenance import flags_line, loadavg, machine_record  # noqa: E402
from bench.lib.recorders import peak_rss_mb  # noqa: E402
from bench.lib.report import fmt_seconds, markdown_table, text_table, write_json  # noqa: E402

ARMS = ("basis", "trl8", "trl4")
GROUPS = {"trl8": 8, "trl4": 4}
TARGET_RATIO = 1 / 3
TRL_VERSION = "1.15.0"
INSTALL_HINT = f"pip install trl=={TRL_VERSION}  (check `pip install --dry-run trl=={TRL_VERSION}` first: it must " \
               f"not change torch or transformers)"
COLORS = {"basis": "tab:blue", "trl8": "tab:red", "trl4": "tab:orange"}
LABELS = {"basis": "basis-lite (BASIS, 1 rollout/prompt)", "trl8": "TRL GRPO, G=8", "trl4": "TRL GRPO, G=4"}
CLOCK_NOTE = ("Clock = training only: generation + update (forward, backward, optimizer step) summed over steps. "
              "Evaluation, model loading, checkpoint writing and reward scoring are excluded in every arm.")
PACKAGES = ("transformers", "trl", "peft", "accelerate", "datasets")  # versions in the machine record


# ----------------------------------------------------------------------------------------------------------------
# pure helpers (tested without a model)


def headline(basis: dict, trl: dict) -> dict:
    """basis-lite's clock to reach TRL's final accuracy, as a fraction of TRL's total clock."""
    target = trl["final_accuracy"]
    trl_clock = trl["total_clock_s"]
    hit = first_point_reaching(basis["points"], target)
    out = {"trl_final_accuracy": target, "trl_total_clock_s": trl_clock, "target_ratio": TARGET_RATIO,
           "basis_final_accuracy": basis["final_accuracy"], "basis_total_clock_s": basis["total_clock_s"],
           "reached": hit is not None}
    if hit is not None:
        out["basis_clock_to_reach_s"] = hit["clock_s"]
        out["basis_step_to_reach"] = hit["step"]
        out["ratio"] = hit["clock_s"] / trl_clock if trl_clock > 0 else None
        out["meets_target"] = out["ratio"] is not None and out["ratio"] <= TARGET_RATIO + 1e-12
    else:
        # not reached within the run: the ratio is larger than all of basis-lite's clock over TRL's
        out["ratio"] = None
        out["ratio_lower_bound"] = basis["total_clock_s"] / trl_clock if trl_clock > 0 else None
        out["meets_target"] = False
    return out


def summarize_arm(arm: str, points: list[dict], step_clocks: list[float], extra: dict | None = None) -> dict:
    """One arm's record from its eval points (step, clock_s, accuracy, ...) and per-step training clocks."""
    pts = sorted(points, key=lambda p: (p["step"], p.get("final", False)))
    rec = {"arm": arm, "label": LABELS.get(arm, arm), "points": pts, "steps": len(step_clocks),
           "total_clock_s": round(sum(step_clocks), 3),
           "mean_step_s": round(sum(step_clocks) / len(step_clocks), 3) if step_clocks else None,
           "accuracy_before": pts[0]["accuracy"] if pts and pts[0]["step"] == 0 else None,
           "final_accuracy": pts[-1]["accuracy"] if pts else None}
    rec.update(extra or {})
    return rec


def cumulative(step_clocks: list[float]) -> list[float]:
    """Clock after each step: [c1, c1+c2, ...]; index k-1 is the clock at the end of step k."""
    out, total = [], 0.0
    for c in step_clocks:
        total += c
        out.append(total)
    return out


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1024:.2f} GB" if x >= 1024 else f"{x:.0f} MB"


def table_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the results table: one row per arm, one column per eval step."""
    arms = [a for a in report["arm_order"] if a in report["arms"]]
    steps = sorted({p["step"] for a in arms for p in report["arms"][a]["points"]})
    head = ["arm", "prompts x rollouts", "steps", "train clock", "generation + update", "s/step", "peak RSS"]
    head += [f"acc @{s}" for s in steps]
    rows = []
    for a in arms:
        r = report["arms"][a]
        by_step = {p["step"]: p for p in r["points"]}
        split = (f"{fmt_seconds(r['generation_s'])} + {fmt_seconds(r['update_s'])}"
                 if r.get("generation_s") is not None and r.get("update_s") is not None else "-")
        row = [a, f"{r.get('prompts_per_step', '?')} x {r.get('rollouts_per_prompt', '?')}", str(r["steps"]),
               fmt_seconds(r["total_clock_s"]), split, fmt_seconds(r.get("mean_step_s")), _mb(r.get("peak_rss_mb"))]
        for s in steps:
            p = by_step.get(s)
            row.append(f"{p['accuracy']:.3f} ({fmt_seconds(p['clock_s'])})" if p else "-")
        rows.append(row)
    return head, rows


def headline_text(arm: str, h: dict) -> str:
    name = LABELS.get(arm, arm)
    if h["reached"]:
        verdict = "meets" if h["meets_target"] else "misses"
        where = (f"at {fmt_seconds(h['basis_clock_to_reach_s'])} of training clock (eval at step "
                 f"{h['basis_step_to_reach']})" if h["basis_step_to_reach"] > 0 else
                 "before training (step 0: TRL ended no higher than where every arm started)")
        return (f"basis-lite reached {name}'s final held-out accuracy {h['trl_final_accuracy']:.3f} {where}; "
                f"{name} took {fmt_seconds(h['trl_total_clock_s'])} in all: ratio **{h['ratio']:.3f}** ({verdict} the "
                f"1/3 target).")
    lb = h.get("ratio_lower_bound")
    above = f"; the ratio is above {lb:.3f}" if lb is not None else ""
    return (f"basis-lite did not reach {name}'s final held-out accuracy {h['trl_final_accuracy']:.3f} within its run "
            f"(final {h['basis_final_accuracy']:.3f} after {fmt_seconds(h['basis_total_clock_s'])}){above} (misses "
            f"the 1/3 target).")


def markdown(report: dict) -> str:
    st = report["settings"]
    head, rows = table_rows(report)
    lines = ["# basis-lite vs TRL GRPOTrainer on the CPU", "",
             f"Preset `{st['preset']}`: model `{st['model']}` ({st.get('dtype', '?')}), dataset `{st['dataset']}`, "
             f"{st['steps']} steps of {st['rollouts_per_step']} rollouts in every arm, greedy held-out eval of "
             f"{st['eval_n']} problems "
             + (f"every {st['eval_every']} steps" if st["eval_every"] else "before and after training")
             + (f" (--eval-limit {st['eval_limit']}: a subset of the held-out split)" if st.get("eval_limit") else "")
             + ".", "", CLOCK_NOTE, "",
             "Cells: held-out accuracy (training clock at that point).", "", markdown_table(head, rows)]
    lines += ["", "## Headline (target <= 1/3, reported whichever way it falls)", "",
              "Training clock basis-lite needs to reach TRL's final held-out accuracy, divided by TRL's total "
              "training clock:", ""]
    if report.get("headline"):
        for arm, h in report["headline"].items():
            lines.append(f"- {headline_text(arm, h)}")
    else:
        lines.append("- not computed: it needs the basis arm and at least one TRL arm.")
    lines += ["", "## Settings", "", "Shared: " + ", ".join(f"{k} {v}" for k, v in st.get("shared", {}).items()) + ".",
              "", "TRL GRPOConfig: " + ", ".join(f"`{k}={v}`" for k, v in st.get("trl_config", {}).items()) + ".", ""]
    for note in report.get("not_matched", []):
        lines.append(f"- Not matched exactly: {note}")
    m = report.get("machine", {})
    lines += ["", f"Machine: {flags_line(m)}; {m.get('cpus_usable', '?')} CPUs usable; load average at start "
              f"{m.get('loadavg_before')}. torch threads per arm: "
              + ", ".join(f"{a} {report['arms'][a].get('threads')}" for a in report["arm_order"] if a in report["arms"])
              + ".", "",
              "Load average (1/5/15 min) before -> after each arm: " + "; ".join(
                  f"{a} {report['arms'][a].get('loadavg_before')} -> {report['arms'][a].get('loadavg_after')}"
                  for a in report["arm_order"] if a in report["arms"]) + ". Another process on the same cores "
              "slows the clock of the arm it overlaps.", "",
              "Versions: " + ", ".join(f"{k} {m.get(k)}" for k in ("python", "torch", *PACKAGES))
              + f". Commit {m.get('git_commit')}" + (" (with uncommitted changes)" if m.get("git_dirty") else "") + ".",
              "",
              f"Command: `{report.get('command', '')}`", "",
              f"Generated {report.get('created', '')} by bench/vs_trl.py; data in vs_trl.json, chart vs_trl.png.", ""]
    return "\n".join(lines)


def print_table(report: dict) -> None:
    print(text_table(*table_rows(report)))
    print(CLOCK_NOTE)
    for arm, h in (report.get("headline") or {}).items():
        print(headline_text(arm, h).replace("**", ""))


def write_png(report: dict, path: Path) -> bool:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)", file=sys.stderr)
        return False
    arms = [a for a in report["arm_order"] if a in report["arms"] and report["arms"][a]["points"]]
    span = max([p["clock_s"] for a in arms for p in report["arms"][a]["points"]] + [1.0])
    scale, unit = (60.0, "min") if span > 600 else (1.0, "s")
    fig = Figure(figsize=(8.5, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for a in arms:
        r = report["arms"][a]
        xs = [p["clock_s"] / scale for p in r["points"]]
        ys = [p["accuracy"] for p in r["points"]]
        ax.plot(xs, ys, marker="o", color=COLORS.get(a), label=f"{LABELS.get(a, a)}: {r.get('prompts_per_step')} x "
                f"{r.get('rollouts_per_prompt')}")
    for a, h in (report.get("headline") or {}).items():
        ax.axhline(h["trl_final_accuracy"], color=COLORS.get(a), ls=":", lw=1)
        if h["reached"]:
            ax.plot([h["basis_clock_to_reach_s"] / scale], [h["trl_final_accuracy"]], marker="*", ms=12,
                    color=COLORS.get(a), ls="none", label=f"basis-lite reaches {a}'s final accuracy: ratio "
                    f"{h['ratio']:.2f}")
    st = report["settings"]
    ax.set_xlabel(f"training clock, generation + update ({unit}; no eval, load or reward time)")
    ax.set_ylabel(f"held-out accuracy (greedy, n={st['eval_n']})")
    ax.set_title(f"basis-lite vs TRL GRPO on {report.get('machine', {}).get('cpu_model', 'CPU')}, "
                 f"{st['rollouts_per_step']} rollouts/step", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    return True


# ----------------------------------------------------------------------------------------------------------------
# inside an arm's process


def _eval_point(step: int, clock: float, ev: dict, final: bool = False) -> dict:
    return {"step": step, "clock_s": round(clock, 3), "accuracy": ev["accuracy"], "n": ev["n"],
            "by_level": {k: v["accuracy"] for k, v in ev.get("by_level", {}).items()}, "final": final}


def _limit_eval(examples: list, limit: int | None) -> list:
    # the split is drawn round-robin over the levels, so its first N problems are spread over the levels as well
    return examples[:limit] if limit else examples


def worker_basis(spec: dict) -> dict:
    """The basis arm: basis_lite.trainer.train() on the preset, then its run folder read back."""
    import torch

    from basis_lite import trainer as bl_trainer
    from basis_lite.model.dtypes import resolve_device, resolve_dtype

    cfg = load_config(spec["preset"], spec["overrides"])
    limit = spec.get("eval_limit")
    if limit:
        # train() evaluates on load_examples(cfg.data, "eval"); changing data.eval_size would change the training
        # split too (the built-in tasks draw the eval problems first), so the eval list is cut here instead
        if not hasattr(bl_trainer, "load_examples"):
            raise RuntimeError("--eval-limit: basis_lite.trainer no longer imports load_examples; run without it")
        full_load = bl_trainer.load_examples
        bl_trainer.load_examples = lambda data_cfg, split: (
            _limit_eval(full_load(data_cfg, split), limit) if split == "eval" else full_load(data_cfg, split))
    run_dir = Path(spec["run_dir"]) / "run"
    t0 = time.time()
    summary = bl_trainer.train(cfg, run_dir, progress=spec["progress"])
    wall = time.time() - t0
    steps, evals = read_run(run_dir)
    order = sorted(steps)
    gen = [float(steps[s]["generation_s"]) for s in order]
    upd = [float(steps[s]["training_s"]) for s in order]
    clocks = [g + u for g, u in zip(gen, upd)]
    cum = dict(zip(order, cumulative(clocks)))
    cum[0] = 0.0
    points = []
    for ev in evals:
        s = int(ev["step"])
        by_level = {k[len("eval_accuracy_level"):]: v for k, v in ev.items() if k.startswith("eval_accuracy_level")}
        points.append({"step": s, "clock_s": round(cum.get(s, 0.0), 3), "accuracy": ev["eval_accuracy"],
                       "n": ev["eval_n"], "by_level": by_level, "final": ev["event"] == "eval_final"})
    dtype = str(resolve_dtype(cfg.model.dtype, resolve_device(cfg.device))).replace("torch.", "")
    return {"points": points, "step_clocks": clocks, "generation_s": round(sum(gen), 3),
            "update_s": round(sum(upd), 3), "per_step": [{"step": s, "generation_s": steps[s]["generation_s"],
                                                          "update_s": steps[s]["training_s"],
                                                          "reward_mean": steps[s].get("reward_mean"),
                                                          "completion_len": steps[s].get("completion_len")}
                                                         for s in order],
            "dtype": dtype, "threads": torch.get_num_threads(), "process_train_wall_s": round(wall, 1),
            "run_seconds": summary.get("seconds"), **peak_rss_mb()}


class TorchLogProbHead:
    """Stands in for TRL's fused log-prob kernel (`trl.trainer.utils._ChunkedLogProbFunction`) on a CPU.

    TRL 1.15.0 computes GRPO's per-token log-probs with a Triton kernel and has no PyTorch fallback: without triton
    the trainer fails at its first loss ('NoneType' object has no attribute 'apply'), and Triton kernels cannot
    read CPU tensors anyway. This takes the kernel's arguments and returns the same (log_probs, entropy, ...) tuple,
    computed by basis-lite's own chunked log-prob function (the one the basis arm trains with): the lm_head runs
    on `chunk_size` tokens at a time, each chunk checkpointed, logits in fp32; the entropy is a metric (no grad).
    Only what GRPO asks for is supported: log-probs and entropy.
    """

    chunk_size = 1024  # tokens per lm_head chunk: the arm's train.logprob_chunk_size, set by worker_trl

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, vocab_chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs", "entropy")):
        import torch

        from basis_lite.losses.policy import chunked_token_logprobs

        unsupported = [o for o in outputs if o not in ("log_probs", "entropy")]
        if unsupported:
            raise NotImplementedError(f"TorchLogProbHead: outputs {unsupported} are not computed")

        class Head(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.weight, self.bias = weight, bias

            def forward(self, h):
                z = torch.nn.functional.linear(h, self.weight.to(h.dtype),
                                               None if self.bias is None else self.bias.to(h.dtype))
                z = z * logit_scale
                if final_logit_softcapping:
                    z = final_logit_softcapping * torch.tanh(z / final_logit_softcapping)
                return z

        ones = torch.ones(1, hidden.shape[0], dtype=torch.bool, device=hidden.device)
        lp, ent = chunked_token_logprobs(hidden.unsqueeze(0), Head(), targets.unsqueeze(0), ones,
                                         chunk_size=TorchLogProbHead.chunk_size, temperature=temperature,
                                         with_entropy="entropy" in outputs)
        return lp[0], (ent[0] if ent is not None else None), None, None, None


def basis_lite_function(name: str):
    """A basis-lite setup function (make_engine, make_optimizer, make_scheduler, seed_everything) by name, from the
    module that holds it: basis_lite.runtime / basis_lite.rl.update, or basis_lite.trainer in older layouts."""
    import importlib

    for module in ("basis_lite.runtime", "basis_lite.rl.update", "basis_lite.trainer"):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(mod, name):
            return getattr(mod, name)
    raise RuntimeError(f"basis_lite has no {name}() in runtime, update or trainer: bench/vs_trl.py needs updating")


def _trainer_kwargs(cfg, steps: int, output_dir: str, use_cpu: bool) -> dict:
    """The TRL config keyword arguments both TRL arms share, mirroring the basis-lite config: B = train.batch_size
    rollouts per optimizer step in micro-batches of train.micro_batch_size, the sampling, the optimizer settings,
    no autocast, logging every step, nothing saved."""
    t, g = cfg.train, cfg.generation
    rollouts, micro = t.batch_size, t.micro_batch_size  # basis-lite's rollouts per step: batch_size prompts x 1
    if rollouts % micro:
        raise ConfigError(f"train.batch_size={rollouts} is not a multiple of train.micro_batch_size={micro}")
    return dict(
        output_dir=output_dir, use_cpu=use_cpu, seed=t.seed, max_steps=steps,
        # rollouts per optimizer step = per_device_train_batch_size (completions) x gradient_accumulation_steps
        per_device_train_batch_size=micro, gradient_accumulation_steps=rollouts // micro,
        max_completion_length=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
        learning_rate=t.lr, max_grad_norm=t.max_grad_norm, weight_decay=t.weight_decay,
        warmup_steps=t.warmup_steps,  # informational: the scheduler itself comes from basis-lite (optimizers=)
        # the model arrives in the resolved dtype; no mixed-precision autocast on top (basis-lite has none)
        bf16=False, fp16=False,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
    )


def trl_config_kwargs(cfg, group: int, steps: int, output_dir: str, use_cpu: bool) -> dict:
    """GRPOConfig keyword arguments that mirror the basis-lite config (see the module docstring); generation_batch_size
    defaults to the rollouts per optimizer step, so one generate() of all rollouts per step."""
    t = cfg.train
    if t.batch_size % group:
        raise ConfigError(f"train.batch_size={t.batch_size} is not a multiple of {group}: TRL with G={group} needs "
                          f"{t.batch_size}/{group} whole prompts per step")
    return dict(
        _trainer_kwargs(cfg, steps, output_dir, use_cpu), top_k=cfg.generation.top_k,
        num_generations=group, num_iterations=1, shuffle_dataset=False,
        beta=t.kl_coef, epsilon=t.clip_low, epsilon_high=t.clip_high, loss_type="dapo",
        mask_truncated_completions=False, entropy_coef=0.0, top_entropy_quantile=1.0,  # entropy: a metric only
    )


def a2po_config_kwargs(cfg, steps: int, output_dir: str, use_cpu: bool, samples: int, beta1: float) -> dict:
    """A2POConfig keyword arguments that mirror the basis-lite config: the same rollouts per step (B prompts x 1
    completion), micro-batches, sampling, optimizer settings; `samples` reference completions per prompt for V*
    (num_value_samples) at `beta1`, and basis-lite's train.astar_beta as the loss's beta2."""
    return dict(
        _trainer_kwargs(cfg, steps, output_dir, use_cpu), top_k=cfg.generation.top_k or None,  # A2PO: None = off
        num_value_samples=samples, beta1=beta1, beta2=cfg.train.astar_beta, filter_all_incorrect=True,
        remove_unused_columns=False,
    )


def _trl_run(spec: dict, run_prompts_only: bool = False):
    """What both TRL arms share, as a namespace: the config, threads, device and dtype; the model + LoRA built by
    basis-lite after the same seed (the same initial adapter) with its optimizer and scheduler; `evaluate_now` (the
    eval train() runs) and its `points`; `dataset`: the training prompts in the order basis-lite's sampler draws them
    (one epoch, or with `run_prompts_only` the steps x train.batch_size a run draws) with their "answer" column;
    `reward`: basis-lite's scorer as a TRL reward function; `timing` (counters of the current step, zeroed at its
    start) and `StepClock`, a callback that times each optimizer step, reward scoring left out, into `clocks` and
    `per_step`, and runs the evals between steps."""
    from types import SimpleNamespace

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from basis_lite.data import PromptSampler, format_prompt, load_examples
    from basis_lite.model.dtypes import resolve_device, resolve_dtype
    from basis_lite.model.loading import load_policy
    from basis_lite.rewards.scorer import RewardScorer
    from basis_lite.rl.evaluate import evaluate

    make_engine, make_optimizer, make_scheduler, seed_everything = (
        basis_lite_function(n) for n in ("make_engine", "make_optimizer", "make_scheduler", "seed_everything"))
    run = SimpleNamespace(cfg=load_config(spec["preset"], spec["overrides"]), clocks=[], per_step=[])
    cfg = run.cfg
    steps, eval_every = cfg.train.steps, spec["eval_every"]
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)  # as train() does; 0 leaves torch's default (all cores)
    run.threads = torch.get_num_threads()
    run.device = resolve_device(cfg.device)
    run.dtype = resolve_dtype(cfg.model.dtype, run.device)
    train_ex = load_examples(cfg.data, "train")
    eval_ex = _limit_eval(load_examples(cfg.data, "eval"), spec.get("eval_limit"))
    seed_everything(cfg.train.seed)  # the order train() uses: seed, then model + LoRA (same initial adapter)
    run.model, run.tok = load_policy(cfg, run.device, run.dtype)
    engine = make_engine(cfg, run.model, run.tok)  # eval only: TRL generates its rollouts itself

    def evaluate_now(desc: str) -> dict:  # the call train() makes for its evals
        return evaluate(engine, run.tok, eval_ex, cfg.data, max_new_tokens=cfg.train.eval_max_new_tokens,
                        require_boxed=cfg.reward.require_boxed, batch_size=cfg.train.eval_batch_size,
                        progress=spec["progress"], desc=desc)

    run.evaluate_now = evaluate_now
    run.points = [_eval_point(0, 0.0, evaluate_now("eval (before)"))]
    order = next(PromptSampler(train_ex, len(train_ex), seed=cfg.train.seed))
    if run_prompts_only:
        order = [order[i % len(order)] for i in range(steps * cfg.train.batch_size)]
    run.dataset = Dataset.from_dict({"prompt": [format_prompt(run.tok, ex.question, cfg.data) for ex in order],
                                     "answer": [ex.answer for ex in order]})
    run.scorer = RewardScorer(cfg.reward)
    timing = run.timing = {"reward_s": 0.0, "generation_s": 0.0, "reward_sum": 0.0, "reward_n": 0}

    def reward(prompts, completions, answer, **kwargs):
        t0 = time.perf_counter()
        total = run.scorer(list(prompts), list(completions), list(answer)).total
        timing["reward_s"] += time.perf_counter() - t0
        timing["reward_sum"] += sum(total)
        timing["reward_n"] += len(total)
        return total

    run.reward = reward

    class StepClock(TrainerCallback):
        """Times each optimizer step (generation + reward + update) and runs the evals outside that time."""

        def on_step_begin(self, args, state, control, **kwargs):
            timing.update({k: 0.0 if isinstance(v, float) else 0 for k, v in timing.items()})
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_s = time.perf_counter() - self.t0
            clock = step_s - timing["reward_s"]
            run.clocks.append(clock)
            step = state.global_step
            counters = {k: v for k, v in timing.items() if k.endswith("_tokens")}
            run.per_step.append({"step": step, "step_s": round(step_s, 4), "reward_s": round(timing["reward_s"], 4),
                                 "generation_s": round(timing["generation_s"], 4),
                                 "update_s": round(clock - timing["generation_s"], 4),
                                 "reward_mean": timing["reward_sum"] / max(1, timing["reward_n"]),
                                 "threads": torch.get_num_threads(), **counters})
            print(f"[{spec['arm']}] step {step}/{steps}: clock {clock:.1f}s (generation {timing['generation_s']:.1f}s, "
                  f"update {clock - timing['generation_s']:.1f}s; reward {timing['reward_s']:.2f}s not counted), "
                  f"reward {run.per_step[-1]['reward_mean']:.3f}", flush=True)
            if eval_every and step % eval_every == 0 and step < steps:
                run.points.append(_eval_point(step, sum(run.clocks), evaluate_now(f"eval (step {step})")))

    run.StepClock = StepClock
    run.optimizer = make_optimizer(cfg, run.model, run.device)
    run.scheduler = make_scheduler(cfg, run.optimizer)
    return run


def _trl_train(run, trainer, spec: dict) -> dict:
    """trainer.train() with the thread count basis-lite uses, the final eval, the adapter and TRL's log saved; the
    result fields both TRL arms return."""
    import torch

    torch.set_num_threads(run.threads)  # whatever the trainer's setup did, train with the thread count basis-lite uses
    t0 = time.time()
    try:
        trainer.train()
    finally:
        run.scorer.close()
    wall = time.time() - t0
    run.points.append(_eval_point(run.cfg.train.steps, sum(run.clocks), run.evaluate_now("eval (after)"), final=True))
    run.model.save_pretrained(Path(spec["run_dir"]) / "adapter")
    history = [h for h in trainer.state.log_history if "loss" in h or "reward" in h]
    (Path(spec["run_dir"]) / "trl_log_history.json").write_text(json.dumps(history, indent=1, default=float))
    gen = sum(p["generation_s"] for p in run.per_step)
    return {"points": run.points, "step_clocks": run.clocks, "generation_s": round(gen, 3),
            "update_s": round(sum(run.clocks) - gen, 3),
            "reward_s": round(sum(p["reward_s"] for p in run.per_step), 3), "per_step": run.per_step,
            "dtype": str(run.dtype).replace("torch.", ""),
            "base_weight_dtype": str(next(p for p in run.model.parameters() if not p.requires_grad).dtype),
            "threads": run.threads, "threads_during_steps": sorted({p["threads"] for p in run.per_step}),
            "process_train_wall_s": round(wall, 1), "history": history}


def worker_trl(spec: dict) -> dict:
    """A TRL arm: GRPOTrainer on the same model, data, reward and schedule; eval with basis-lite's evaluate()."""
    try:
        import trl
        import trl.trainer.utils as trl_utils
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        raise SystemExit(f"trl is not installed: {INSTALL_HINT}") from None

    run = _trl_run(spec)
    cfg, group = run.cfg, spec["group"]
    logprob_head = "TRL's Triton kernel"
    if trl_utils._ChunkedLogProbFunction is None or run.device.type == "cpu":
        TorchLogProbHead.chunk_size = cfg.train.logprob_chunk_size
        trl_utils._ChunkedLogProbFunction = TorchLogProbHead  # read by TRL's fused forward at each call
        logprob_head = (f"basis-lite's chunked_token_logprobs (chunks of {cfg.train.logprob_chunk_size} tokens) in "
                        f"place of TRL's Triton kernel, which needs triton and a GPU")
    conf_kwargs = trl_config_kwargs(cfg, group, cfg.train.steps, str(Path(spec["run_dir"]) / "trl_output"),
                                    use_cpu=run.device.type == "cpu")
    trainer = GRPOTrainer(model=run.model, reward_funcs=run.reward, args=GRPOConfig(**conf_kwargs),
                          train_dataset=run.dataset, processing_class=run.tok, callbacks=[run.StepClock()],
                          optimizers=(run.optimizer, run.scheduler))
    generate = trainer._generate

    def timed_generate(*args, **kwargs):
        t0 = time.perf_counter()
        out = generate(*args, **kwargs)
        run.timing["generation_s"] += time.perf_counter() - t0
        return out

    trainer._generate = timed_generate  # generation time, for the split in the table (the clock does not need it)
    res = _trl_train(run, trainer, spec)
    zero_std = [h["frac_reward_zero_std"] for h in res.pop("history") if "frac_reward_zero_std" in h]
    return {**res, "frac_groups_zero_std": round(sum(zero_std) / len(zero_std), 4) if zero_std else None,
            "trl_config": {k: v for k, v in conf_kwargs.items() if k != "output_dir"},
            "trl": trl.__version__, "logprob_head": logprob_head, **peak_rss_mb()}


def _count_generated(generate, eos_ids: list[int], timing: dict | None, counts: dict):
    """`generate` wrapped: each call's prompt tokens (attention mask, once per returned sequence) and completion
    tokens (up to and including the first stop token) added to `counts`, its seconds to timing["generation_s"]."""
    import torch

    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        out = generate(*args, **kwargs)
        if timing is not None:
            timing["generation_s"] += time.perf_counter() - t0
        if args or "input_ids" not in kwargs or "attention_mask" not in kwargs:
            return out  # not A2PO's call (its calls pass the tokenizer's output as keywords)
        mask = kwargs["attention_mask"]
        completion = out[:, kwargs["input_ids"].shape[1]:]
        stop = torch.isin(completion, torch.tensor(eos_ids, device=completion.device))
        first = torch.where(stop.any(1), stop.int().argmax(1) + 1, torch.full_like(stop[:, 0], completion.shape[1],
                                                                                   dtype=torch.long))
        counts["prompt_tokens"] += int(mask.sum()) * (out.shape[0] // mask.shape[0])
        counts["generated_tokens"] += int(first.sum())
        return out

    return wrapped


def temper_logits(model, temperature: float) -> dict:
    """A forward hook on `model`'s output embedding (its logits layer) that divides the logits by `temperature`
    while the returned switch's "on" is true: sampling at temperature 1 then draws from the same distribution as
    sampling the raw logits at `temperature`, and a loss that scores the raw logits scores that distribution. A deep
    copy of the model (TRL's reference model) carries the hook and shares the switch."""
    if temperature <= 0:
        raise ConfigError(f"generation.temperature={temperature}: tempered logits need a temperature > 0")
    switch = {"on": True}

    def hook(module, args, output):
        return output / temperature if switch["on"] else output

    model.get_output_embeddings().register_forward_hook(hook)
    return switch


def worker_a2po(spec: dict) -> dict:
    """TRL's A*-PO trainer (trl.experimental.a2po.A2POTrainer) on the same model, data, reward and schedule, with
    spec["prior_samples"] reference samples per training prompt: Stage 1 (V* from the reference policy) timed and its
    tokens counted as the run's reference cost, Stage 2 steps timed like the GRPO arm's; eval with basis-lite's
    evaluate(). Its training set is the prompts basis-lite's sampler would draw in the run (steps x B), as the astar
    arm samples them; A2PO shuffles them itself and drops those whose samples all scored 0. With spec["tempered"]
    the model's logits are divided by generation.temperature (temper_logits) and TRL runs at temperature 1: the same
    sampling distribution, and TRL's loss, which scores raw logits, scores it too; evals see the raw logits."""
    try:
        import trl
        from trl.experimental.a2po import A2POConfig, A2POTrainer
    except ImportError:
        raise SystemExit(f"trl with trl.experimental.a2po is not installed: {INSTALL_HINT}") from None
    from basis_lite.estimators.reference_options import astar_options

    run = _trl_run(spec, run_prompts_only=True)
    cfg = run.cfg
    run.timing.update(prompt_tokens=0, generated_tokens=0)
    conf_kwargs = a2po_config_kwargs(cfg, cfg.train.steps, str(Path(spec["run_dir"]) / "trl_output"),
                                     run.device.type == "cpu", spec["prior_samples"],
                                     float(astar_options(cfg.estimator.options)["beta"]))
    tempered = {}
    if spec.get("tempered"):
        switch = temper_logits(run.model, cfg.generation.temperature)  # before A2POTrainer copies the model
        conf_kwargs["temperature"] = 1.0
        tempered = {"logits_divided_by": cfg.generation.temperature}
        evaluate_now = run.evaluate_now

        def untempered_eval(desc: str) -> dict:
            switch["on"] = False
            try:
                return evaluate_now(desc)
            finally:
                switch["on"] = True

        run.evaluate_now = untempered_eval
    trainer = A2POTrainer(model=run.model, reward_funcs=run.reward, args=A2POConfig(**conf_kwargs),
                          train_dataset=run.dataset, processing_class=run.tok, callbacks=[run.StepClock()],
                          optimizers=(run.optimizer, run.scheduler))
    reference = {"prompt_tokens": 0, "generated_tokens": 0}
    ref = trainer.accelerator.unwrap_model(trainer.ref_model)
    ref.generate = _count_generated(ref.generate, trainer.eos_token_ids, None, reference)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    policy.generate = _count_generated(policy.generate, trainer.eos_token_ids, run.timing, run.timing)
    stage1 = trainer._estimate_optimal_values

    def timed_stage1():
        t0 = time.perf_counter()
        stage1()
        reference["seconds"] = time.perf_counter() - t0

    trainer._estimate_optimal_values = timed_stage1
    res = _trl_train(run, trainer, spec)
    res.pop("history")
    if not reference["generated_tokens"]:
        raise RuntimeError("A2PO's Stage 1 generated no counted tokens: its reference model's generate was not the "
                           "one wrapped (bench/vs_trl.py worker_a2po needs updating for this TRL)")
    return {**res, "reference": reference, "kept_prompts": len(trainer.train_dataset),
            "trl_config": {k: v for k, v in conf_kwargs.items() if k != "output_dir"},
            "trl": trl.__version__, "logprob_head": "TRL A2PO's own (full logits, selective_log_softmax)",
            **tempered, **peak_rss_mb()}


def worker(spec_path: str) -> int:
    """`python bench/vs_trl.py --worker SPEC.json`: one arm in this process (started by the driver)."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    spec = json.loads(Path(spec_path).read_text())
    result = worker_basis(spec) if spec["arm"] == "basis" else worker_trl(spec)
    result.update(arm=spec["arm"], settings=spec["settings"], finished=datetime.now(timezone.utc).isoformat(
        timespec="seconds"))
    (Path(spec["run_dir"]) / "result.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


# ----------------------------------------------------------------------------------------------------------------
# the driver


NOT_MATCHED = [
    "the advantage, by design: BASIS (one rollout per prompt, baseline pooled over the other prompts) against TRL's "
    "GRPO (group mean, divided by the group std: scale_rewards='group', TRL's default).",
    "zero-advantage rollouts: basis-lite skips their forward/backward (their tokens still count in the loss "
    "divisor) and skips the optimizer step when no rollout has a non-zero advantage; TRL forwards every completion "
    "and always steps AdamW (whose moments still move the weights on an all-zero step).",
    "prompt length: TRL 1.15.0 has no max_prompt_length; basis-lite cuts prompts from the left to "
    "model.max_seq_length - max_new_tokens tokens and the loss sequence at model.max_seq_length. The default "
    "prompts (about 50 tokens) are far below both limits, so neither cuts anything.",
    "generation batching: basis-lite calls generate() on chunks of generation.batch_size prompts, TRL on all "
    "rollouts of a step at once (the same when the rollouts per step fit one chunk).",
    "micro-batches: TRL shuffles a step's rollouts before splitting them into micro-batches of "
    "per_device_train_batch_size, basis-lite orders its own; the summed gradient is the same.",
]


# ----------------------------------------------------------------------------------------------------------------
# driver: plan, run, report


def plan(args) -> tuple[dict, dict]:
    """({arm: spec}, shared settings); every arm's config is loaded and checked before anything runs."""
    base = list(args.set or [])
    cfg0 = load_config(args.preset, base)
    steps = args.steps if args.steps is not None else cfg0.train.steps
    eval_every = args.eval_every if args.eval_every is not None else (cfg0.train.eval_every or max(1, steps // 4))
    overrides = base + [f"train.steps={steps}", f"train.eval_every={eval_every}"]
    cfg = load_config(args.preset, overrides)
    specs = {}
    for arm in args.arms:
        if arm not in ARMS:
            raise ConfigError(f"--arms: unknown arm {arm!r}; choose from {', '.join(ARMS)}")
        group = GROUPS.get(arm, 1)
        if arm != "basis":
            trl_config_kwargs(cfg, group, steps, "", True)  # raises ConfigError on a batch size TRL cannot split
        # the resolved config is part of the settings: an edited preset is not mistaken for the one already run
        settings = {"arm": arm, "preset": args.preset, "overrides": overrides, "eval_limit": args.eval_limit,
                    "group": group, "config": json.loads(json.dumps(to_dict(cfg), default=str))}
        specs[arm] = {"arm": arm, "preset": args.preset, "overrides": overrides, "group": group,
                      "eval_every": eval_every, "eval_limit": args.eval_limit, "progress": not args.quiet,
                      "run_dir": str(args.runs / arm), "settings": settings,
                      "prompts_per_step": cfg.train.batch_size // group, "rollouts_per_prompt": group}
    t, g, lo = cfg.train, cfg.generation, cfg.lora
    shared = {
        "preset": args.preset, "model": cfg.model.name, "dataset": cfg.data.dataset, "steps": steps,
        "eval_every": eval_every, "eval_limit": args.eval_limit, "rollouts_per_step": t.batch_size,
        "set": base,
        "shared": {"model.dtype (preset)": cfg.model.dtype, "lora r/alpha/dropout": f"{lo.r}/{lo.alpha}/{lo.dropout}",
                   "lora target_modules": lo.target_modules, "lr": t.lr, "warmup_steps": t.warmup_steps,
                   "schedule": t.schedule, "weight_decay": t.weight_decay, "max_grad_norm": t.max_grad_norm,
                   "clip low/high": f"{t.clip_low}/{t.clip_high}", "kl_coef": t.kl_coef,
                   "micro_batch_size": t.micro_batch_size, "gradient_checkpointing": cfg.model.gradient_checkpointing,
                   "temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k,
                   "max_new_tokens": g.max_new_tokens, "eval_max_new_tokens": t.eval_max_new_tokens,
                   "system_prompt": repr(cfg.data.system_prompt), "instruction": repr(cfg.data.instruction),
                   "train_size": cfg.data.train_size, "eval_size": cfg.data.eval_size, "seed": t.seed,
                   "threads": t.threads or "torch default (all cores)"},
    }
    return specs, shared


def run_arm(spec: dict, args) -> dict | None:
    """The arm's result.json, from an earlier run with the same settings or from a fresh subprocess."""
    arm_dir = Path(spec["run_dir"])
    result_path = arm_dir / "result.json"
    if result_path.exists() and not args.fresh:
        old = json.loads(result_path.read_text())
        if old.get("settings") == spec["settings"]:
            print(f"[{spec['arm']}] done already ({arm_dir}): reused; --fresh runs it again", flush=True)
            return old
    if arm_dir.exists():
        shutil.rmtree(arm_dir)
    arm_dir.mkdir(parents=True)
    spec_path = arm_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)]
    print(f"[{spec['arm']}] {LABELS[spec['arm']]}: {spec['prompts_per_step']} prompts x {spec['rollouts_per_prompt']} "
          f"rollouts per step -> {arm_dir}", flush=True)
    load_before, t0 = loadavg(), time.time()
    if args.quiet:
        with open(arm_dir / "log.txt", "w") as log:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    else:
        proc = subprocess.run(cmd, cwd=ROOT, env=env)
    wall = time.time() - t0
    if proc.returncode != 0 or not result_path.exists():
        tail = (arm_dir / "log.txt").read_text()[-1500:] if args.quiet and (arm_dir / "log.txt").exists() else ""
        print(f"[{spec['arm']}] FAILED (exit {proc.returncode}) after {wall:.0f} s" + (f":\n{tail}" if tail else ""),
              file=sys.stderr, flush=True)
        return None
    result = json.loads(result_path.read_text())
    result.update(process_wall_s=round(wall, 1), loadavg_before=load_before, loadavg_after=loadavg())
    result_path.write_text(json.dumps(result, indent=1, default=str))
    print(f"[{spec['arm']}] finished in {wall:.0f} s (training clock {sum(result['step_clocks']):.0f} s, peak RSS "
          f"{_mb(result.get('peak_rss_mb'))})", flush=True)
    return result


def build_report(specs: dict, shared: dict, results: dict, argv: list[str], machine: dict) -> dict:
    arms = {}
    for arm, res in results.items():
        sp = specs[arm]
        arms[arm] = summarize_arm(arm, res["points"], res["step_clocks"], extra={
            "prompts_per_step": sp["prompts_per_step"], "rollouts_per_prompt": sp["rollouts_per_prompt"],
            **{k: res.get(k) for k in ("generation_s", "update_s", "reward_s", "peak_rss_mb", "vmhwm_mb",
                                       "ru_maxrss_mb", "threads", "dtype", "process_wall_s", "process_train_wall_s",
                                       "frac_groups_zero_std", "loadavg_before", "loadavg_after", "finished")
               if res.get(k) is not None}})
    arm_order = [a for a in specs if a in arms]
    report = {"benchmark": "basis-lite vs TRL GRPOTrainer: held-out accuracy vs training clock, peak RSS",
              "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": "python bench/vs_trl.py " + " ".join(argv), "clock": CLOCK_NOTE,
              "machine": machine, "arm_order": arm_order, "arms": arms,
              "settings": dict(shared), "not_matched": list(NOT_MATCHED)}
    st = report["settings"]
    ns = {p["n"] for a in arms.values() for p in a["points"]}
    st["eval_n"] = ns.pop() if len(ns) == 1 else sorted(ns)
    dtypes = {a["dtype"] for a in arms.values() if a.get("dtype")}
    st["dtype"] = dtypes.pop() if len(dtypes) == 1 else sorted(dtypes)
    if isinstance(st["dtype"], list):
        report["not_matched"].append(f"dtype: the arms resolved different dtypes {st['dtype']} (the preset changed "
                                     f"between arms?)")
    trl_res = next((results[a] for a in arm_order if a in GROUPS), None)
    if trl_res:
        st["trl_config"] = {k: v for k, v in trl_res.get("trl_config", {}).items() if k not in ("num_generations",)}
        st["trl_config"]["num_generations"] = ", ".join(f"{GROUPS[a]} ({a})" for a in arm_order if a in GROUPS)
    if trl_res and trl_res.get("logprob_head", "").startswith("basis-lite"):
        report["not_matched"].append(
            f"TRL's log-prob head: {trl_res['logprob_head']}. TRL 1.15.0 has no PyTorch fallback for it, so "
            f"GRPOTrainer cannot train on a CPU as shipped; the TRL arms therefore score tokens with the same "
            f"chunked function as basis-lite (bench/vs_trl.py: TorchLogProbHead).")
    elif trl_res:
        report["not_matched"].append("log-probs: TRL's fused Triton LM head and basis-lite's chunked log-softmax "
                                     "compute the same quantity with different kernels (rounding-level differences).")
    starts = {a: r["accuracy_before"] for a, r in arms.items()}
    if len(set(starts.values())) > 1:
        report["not_matched"].append(f"accuracy before training differs between arms ({starts}): the same model and "
                                     f"eval should give the same greedy answers; check the run logs.")
    if "basis" in arms:
        report["headline"] = {a: headline(arms["basis"], arms[a]) for a in arm_order if a in GROUPS}
    return report


def write_outputs(report: dict, out: Path) -> None:
    write_json(out / "vs_trl.json", report, indent=2)
    (out / "vs_trl.md").write_text(markdown(report))
    write_png(report, out / "vs_trl.png")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, help="training steps for every arm (default: the preset's train.steps)")
    ap.add_argument("--eval-every", type=int, help="held-out eval every N steps (default: train.eval_every, else "
                                                   "steps/4); plus before training and at the end")
    ap.add_argument("--eval-limit", type=int, help="evaluate only the first N held-out problems (quick checks); "
                                                   "the training split is unchanged")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma list from {', '.join(ARMS)}")
    ap.add_argument("--out", type=Path, help="results folder (default bench/results/vs_trl; with --quick "
                                             "<runs>/quick)")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "vs_trl", help="run folders (default runs/vs_trl)")
    ap.add_argument("--quick", action="store_true", help="plumbing check: --steps 2 --eval-every 1 --eval-limit 8 "
                                                         "unless given, results under the runs folder")
    ap.add_argument("--preset", default=DEFAULT_PRESET, help=f"preset for every arm (default {DEFAULT_PRESET})")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override for every arm")
    ap.add_argument("--fresh", action="store_true", help="run every arm again, even with a finished result")
    ap.add_argument("--quiet", action="store_true", help="arm output to <runs>/<arm>/log.txt instead of the console")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps = 2 if args.steps is None else args.steps
        args.eval_every = 1 if args.eval_every is None else args.eval_every
        args.eval_limit = 8 if args.eval_limit is None else args.eval_limit
    args.runs = args.runs.resolve()
    if args.out is None:
        args.out = args.runs / "quick" if args.quick else results_dir("vs_trl")
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for name in ("steps", "eval_every", "eval_limit"):
        v = getattr(args, name)
        if v is not None and v < (0 if name == "eval_every" else 1):
            ap.error(f"--{name.replace('_', '-')} must be positive")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker)
    try:
        specs, shared = plan(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if any(a in GROUPS for a in specs):
        import importlib.util

        if importlib.util.find_spec("trl") is None:
            print(f"error: the TRL arms need trl: {INSTALL_HINT}", file=sys.stderr)
            return 2
    machine = machine_record(PACKAGES)
    results, failed = {}, []
    for arm, spec in specs.items():
        res = run_arm(spec, args)
        if res is None:
            failed.append(arm)
            continue
        results[arm] = res
        write_outputs(build_report(specs, shared, results, argv, machine), args.out)  # partial results survive
    if not results:
        print("no arm finished", file=sys.stderr)
        return 1
    report = build_report(specs, shared, results, argv, machine)
    write_outputs(report, args.out)
    print()
    print_table(report)
    print(f"wrote {args.out / 'vs_trl.json'}, vs_trl.md, vs_trl.png")
    if failed:
        print(f"failed arms: {', '.join(failed)} (see the output above or {args.runs}/<arm>/log.txt)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
