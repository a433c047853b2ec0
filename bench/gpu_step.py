#!/usr/bin/env python
"""One RL step on a GPU, measured: basis-lite (HF engine), basis-lite + Unsloth, and TRL's GRPOTrainer as the anchor.

Workload: a random-init model of Qwen2.5-1.5B's shape (built from a config: no download; the
byte-level ChatML tokenizer of the tiny test model, whose ids fit in Qwen's vocabulary), 4-bit NF4 base + LoRA r=16
on all linear layers, 64 completions x exactly 256 new tokens per step:
    basis-hf             basis-lite's load_policy + HFEngine (min_new_tokens=256) + trainer.policy_update,
                         64 prompts x 1 rollout, random +-1 advantages (every sequence trains)
    basis-unsloth        the same through basis_lite.model.unsloth (Unsloth's generate), if unsloth imports
    basis-unsloth-vllm   the same with generation.engine=vllm (Unsloth fast_inference), if vllm imports too
    trl-grpo             TRL GRPOTrainer, 8 prompts x 8 generations (G=8), per_device_train_batch_size 8 x
                         gradient_accumulation_steps 8, min_new_tokens=256, beta=0, adamw_8bit
Each variant runs in its own process (Unsloth patches transformers on import; peaks stay separate). Per variant:
generation seconds and training seconds per step (mean over the measured steps, after one warm-up step), peak
GPU memory (torch max_memory_allocated; for basis-lite also per phase: load, generation, update; and the device's
used memory at the end), and basis-lite's `plan` estimate for the same config next to it. Results are written after
every variant, and a variant that runs past --variant-timeout is stopped and recorded as such. Prints a table;
writes bench/results/gpu_step/gpu_step.json (and $OUT/gpu_step.json).

Run it on a GPU machine without network (written for an H200 with Python 3.12, torch 2.11, transformers 5.17):
    once, on a machine with network: download the GPU wheels into .whl/ (git-ignored) and copy the folder over
    on the GPU machine: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                   --target .whl/site .whl/*.whl && export PYTHONPATH=$PWD:$PWD/.whl/site \
                   && python3 bench/gpu_step.py --out "$OUT"
    (about 5-8 minutes for all variants. The wheels carry no vLLM,
    so basis-unsloth-vllm is skipped there and Unsloth falls back to its own generate.)
On a CPU only `--help` and `--dry-run` work: the dry run goes through the basis-hf code path on the tiny random
model (no 4-bit, 4 prompts x 8 tokens) so that this script is exercised by the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.lib.paths import results_dir  # noqa: E402
from bench.lib.provenance import machine_record  # noqa: E402
from bench.lib.report import write_json  # noqa: E402

VARIANTS = ("basis-hf", "basis-unsloth", "basis-unsloth-vllm", "trl-grpo")
QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096,
                  rope_theta=1000000.0, rms_norm_eps=1e-6)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)}")
    ap.add_argument("--completions", type=int, default=64, help="completions per step (default 64)")
    ap.add_argument("--new-tokens", type=int, default=256, help="forced new tokens per completion (default 256)")
    ap.add_argument("--group", type=int, default=8, help="TRL generations per prompt (default 8)")
    ap.add_argument("--micro-batch", type=int, default=8, help="basis-lite train.micro_batch_size (default 8)")
    ap.add_argument("--steps", type=int, default=3, help="steps per variant; the first is a warm-up (default 3)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--model-dir", default=None, help="reuse a saved random-init model folder")
    ap.add_argument("--variant-timeout", type=float, default=240,
                    help="seconds before one variant's process is stopped and recorded as timed out (default 240)")
    ap.add_argument("--out", default=None, help="folder for gpu_step.json (also written to bench/results/gpu_step/)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: run the basis-hf path on builtin:tiny-random (4 prompts x 8 tokens), no 4-bit")
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # child process: run one variant
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------------
# shared pieces


def make_prompts(tok, n: int) -> list[str]:
    qs = [f"What is {17 + 3 * i} + {25 + 7 * i}?" for i in range(n)]  # short: < 64 byte-level tokens with the template
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in qs]


def build_random_model(folder: Path, dtype_name: str) -> Path:
    """A random-init Qwen2.5-1.5B-shaped model + the byte-level ChatML tokenizer, saved to `folder` (once)."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from basis_lite.model.loading import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    config = Qwen2Config(**QWEN25_15B, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(getattr(torch, dtype_name))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return folder


def basis_config(model_name: str, args, backend: str, engine: str, dry: bool):
    from basis_lite.config import load_config

    data = {
        "device": "cpu" if dry else "cuda",
        "model": {"name": model_name, "backend": backend, "dtype": "float32" if dry else args.dtype,
                  "load_in_4bit": not dry, "max_seq_length": 64 + args.new_tokens, "gradient_checkpointing": True,
                  "fast_inference": engine == "vllm", "gpu_memory_utilization": 0.3},
        "lora": {"r": 4 if dry else 16, "alpha": 8 if dry else 32, "target_modules": "all-linear"},
        "generation": {"engine": engine, "temperature": 1.0, "max_new_tokens": args.new_tokens,
                       "batch_size": args.completions},
        "estimator": {"name": "reinforce_pp", "rollouts_per_prompt": 1},
        "train": {"steps": args.steps, "batch_size": args.completions, "micro_batch_size": args.micro_batch,
                  "lr": 1e-5, "warmup_steps": 0, "logprob_chunk_size": 1024, "seed": 0},
    }
    return load_config(data=data)


def force_new_tokens(model, engine, n: int) -> None:
    """Make every completion exactly n tokens: min_new_tokens for HF generate, min_tokens for vLLM."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.generation_config.min_new_tokens = n
    if hasattr(engine, "_sampling_params"):
        from vllm import SamplingParams as VSP

        orig = engine._sampling_params

        def with_min_tokens(params, n_prompts):
            out = []
            for sp in orig(params, n_prompts):
                out.append(VSP(n=sp.n, max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p,
                               top_k=sp.top_k, seed=sp.seed, min_tokens=n))
            return out

        engine._sampling_params = with_min_tokens


def cuda_peak() -> dict:
    import torch

    if not torch.cuda.is_available():
        from basis_lite.model.loading import peak_memory_mb

        return {"peak_allocated_gib": peak_memory_mb(torch.device("cpu")) / 1024, "device_used_gib": None}
    free, total = torch.cuda.mem_get_info()
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
            "device_used_gib": (total - free) / 2**30}


# ----------------------------------------------------------------------------------------------------------------
# variants (each in its own process on a GPU)


def run_basis(args, model_dir: str, backend: str, engine_name: str, dry: bool = False) -> dict:
    import torch

    from basis_lite.engines.base import params_from_config
    from basis_lite.model.dtypes import resolve_device, resolve_dtype
    from basis_lite.plan import estimate_memory
    from basis_lite.rl.update import make_optimizer, policy_update
    from basis_lite.runtime import build_policy, seed_everything

    cfg = basis_config(model_dir, args, backend, engine_name, dry)
    device = resolve_device(cfg.device)
    seed_everything(0)
    t0 = time.time()
    model, tok, engine = build_policy(cfg, device, resolve_dtype(cfg.model.dtype, device))
    load_s = time.time() - t0
    force_new_tokens(model, engine, args.new_tokens)
    optimizer = make_optimizer(cfg, model, device)
    prompts = make_prompts(tok, args.completions)
    params = params_from_config(cfg.generation, n=1)
    gen, train, lens = [], [], []
    cuda = device.type == "cuda"
    phase_peak = {"load": 0.0, "generation": 0.0, "training": 0.0}  # GiB allocated, the most seen in each phase
    peak_reserved = 0.0  # GiB: torch's reserved-memory peak, across the phase resets

    def phase_end(name):  # note the phase's peak, then start a fresh count for the next phase
        nonlocal peak_reserved
        if cuda:
            torch.cuda.synchronize()
            phase_peak[name] = max(phase_peak[name], torch.cuda.max_memory_allocated() / 2**30)
            peak_reserved = max(peak_reserved, torch.cuda.max_memory_reserved() / 2**30)
            torch.cuda.reset_peak_memory_stats()

    phase_end("load")
    for step in range(args.steps):
        t0 = time.time()
        engine.sync(model)
        rollouts = engine.generate(prompts, params, with_features=True)
        phase_end("generation")
        t1 = time.time()
        adv = (torch.randint(0, 2, (len(rollouts),)) * 2 - 1).float()
        stats, ok = policy_update(cfg, model, optimizer, rollouts, adv, tok.pad_token_id, device, step)
        phase_end("training")
        t2 = time.time()
        gen.append(t1 - t0)
        train.append(t2 - t1)
        lens.append(sum(len(r.completion_ids) for r in rollouts) / len(rollouts))
        print(f"  [{args.variant or 'dry-run'}] step {step}: generate {gen[-1]:.1f}s, train {train[-1]:.1f}s, "
              f"mean completion {lens[-1]:.0f} tokens, loss {stats['loss']:.4f}, ok={ok}", flush=True)
    if cuda:
        print(f"  [{args.variant}] peak allocated GiB by phase: "
              + ", ".join(f"{k} {v:.2f}" for k, v in phase_peak.items()), flush=True)
    measured = slice(1, None) if args.steps > 1 else slice(0, None)
    est = estimate_memory(cfg)
    return {"variant": args.variant or f"basis-{backend}", "load_s": load_s,
            "generation_s": sum(gen[measured]) / len(gen[measured]),
            "training_s": sum(train[measured]) / len(train[measured]), "mean_completion_tokens": lens[-1],
            "completions": len(prompts), "engine": type(engine).__name__, "plan_estimate_gib": est["total"],
            "plan_parts_gib": est, **cuda_peak(),
            **({"peak_allocated_gib": max(phase_peak.values()), "peak_reserved_gib": peak_reserved,
                "phase_peak_allocated_gib": phase_peak} if cuda else {})}


def run_trl(args, model_dir: str) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, BitsAndBytesConfig, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    n_prompts = args.completions // args.group
    prompts = make_prompts(tok, n_prompts * (args.steps + 1))
    dataset = Dataset.from_dict({"prompt": prompts})
    dtype = getattr(torch, args.dtype)
    conf = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"), per_device_train_batch_size=args.group,
        gradient_accumulation_steps=n_prompts, num_generations=args.group, max_completion_length=args.new_tokens,
        generation_kwargs={"min_new_tokens": args.new_tokens}, learning_rate=1e-5, beta=0.0,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, gradient_checkpointing=True,
        max_steps=args.steps, logging_steps=1, report_to="none", save_strategy="no", use_vllm=False,
        optim="adamw_8bit", seed=0, model_init_kwargs={"dtype": args.dtype}, shuffle_dataset=False)
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=dtype)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")

    def reward(completions, **kw):
        return [float(i % 2) for i in range(len(completions))]

    t0 = time.time()
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=conf, train_dataset=dataset,
                          processing_class=tok, quantization_config=bnb, peft_config=lora)
    load_s = time.time() - t0
    gen_times: list[float] = []
    step_times: list[float] = []
    orig_generate = trainer._generate

    def timed_generate(*a, **k):
        torch.cuda.synchronize()
        s = time.time()
        out = orig_generate(*a, **k)
        torch.cuda.synchronize()
        gen_times.append(time.time() - s)
        return out

    trainer._generate = timed_generate

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            torch.cuda.synchronize()
            self.t = time.time()

        def on_step_end(self, *a, **k):
            torch.cuda.synchronize()
            step_times.append(time.time() - self.t)
            print(f"  [trl-grpo] step {len(step_times) - 1}: {step_times[-1]:.1f}s", flush=True)

    trainer.add_callback(StepTimer())
    trainer.train()
    m = slice(1, None) if len(step_times) > 1 else slice(0, None)
    step_s = sum(step_times[m]) / len(step_times[m])
    gen_s = sum(gen_times[m]) / max(1, len(gen_times[m])) if gen_times else float("nan")
    return {"variant": "trl-grpo", "load_s": load_s, "generation_s": gen_s, "training_s": step_s - gen_s,
            "step_s": step_s, "completions": args.completions, "engine": "transformers generate (TRL)",
            "plan_estimate_gib": None, **cuda_peak()}


def run_variant(args) -> dict:
    v = args.variant
    if v == "basis-hf":
        return run_basis(args, args.model_dir, "hf", "hf")
    if v == "basis-unsloth":
        return run_basis(args, args.model_dir, "unsloth", "hf")
    if v == "basis-unsloth-vllm":
        return run_basis(args, args.model_dir, "unsloth", "vllm")
    if v == "trl-grpo":
        return run_trl(args, args.model_dir)
    raise SystemExit(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")


def skip_reason(variant: str) -> str | None:
    import importlib.util

    if variant.startswith("basis-unsloth") and importlib.util.find_spec("unsloth") is None:
        return "unsloth not installed"
    if variant == "basis-unsloth-vllm" and importlib.util.find_spec("vllm") is None:
        return "vllm not installed"
    if variant == "trl-grpo" and importlib.util.find_spec("trl") is None:
        return "trl not installed"
    return None


# ----------------------------------------------------------------------------------------------------------------
# driver


def table(rows: list[dict]) -> str:
    head = (f"{'variant':<20}{'gen s':>8}{'train s':>9}{'step s':>8}{'peak alloc GiB':>16}{'device GiB':>12}"
            f"{'plan GiB':>10}  note")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r or "skipped" in r:
            lines.append(f"{r['variant']:<20}{'-':>8}{'-':>9}{'-':>8}{'-':>16}{'-':>12}{'-':>10}  "
                         f"{r.get('skipped') or r.get('error', '')[-200:]}")
            continue
        step = r.get("step_s") or r["generation_s"] + r["training_s"]
        dev = r.get("device_used_gib")
        plan = r.get("plan_estimate_gib")
        lines.append(f"{r['variant']:<20}{r['generation_s']:>8.1f}{r['training_s']:>9.1f}{step:>8.1f}"
                     f"{r['peak_allocated_gib']:>16.2f}{(f'{dev:.2f}' if dev is not None else '-'):>12}"
                     f"{(f'{plan:.2f}' if plan is not None else '-'):>10}  {r.get('engine', '')}")
    return "\n".join(lines)


def write_results(rows: list[dict], args, meta: dict) -> list[Path]:
    payload = {"meta": meta, "results": rows}
    outs = []
    targets = [Path(args.out)] if args.out else []
    if not args.dry_run:
        targets.append(results_dir("gpu_step"))
        if os.environ.get("OUT") and not args.out:
            targets.append(Path(os.environ["OUT"]))
    for folder in targets:
        outs.append(write_json(folder / ("gpu_step_dryrun.json" if args.dry_run else "gpu_step.json"), payload,
                               indent=2))
    return outs


def environment() -> dict:
    """The machine record (bench/lib/provenance.py) with the packages that matter here, CUDA and the GPU."""
    import torch

    return {**machine_record(("transformers", "peft", "bitsandbytes", "trl", "unsloth", "vllm")),
            "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.variant:  # child process
        try:
            row = run_variant(args)
        except Exception as e:  # noqa: BLE001 - report, don't hide: the parent prints it in the table
            import traceback

            traceback.print_exc()
            row = {"variant": args.variant, "error": f"{type(e).__name__}: {e}"}
        Path(args.json).write_text(json.dumps(row, default=str))
        return 0

    if args.dry_run:
        args.completions, args.new_tokens, args.steps, args.micro_batch = 4, 8, 1, 2
        from basis_lite.model.loading import builtin_tiny_random_dir

        row = run_basis(args, str(builtin_tiny_random_dir()), "hf", "hf", dry=True)
        row["variant"] = "basis-hf (dry run, CPU, tiny-random)"
        rows = [row]
        print(table(rows))
        for p in write_results(rows, args, {"dry_run": True}):
            print(f"wrote {p}")
        return 0

    import torch

    if not torch.cuda.is_available():
        print("bench/gpu_step.py needs a CUDA GPU (use --dry-run to exercise the code path on a CPU)", file=sys.stderr)
        return 2
    model_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="qwen25-1.5b-random-"))
    t0 = time.time()
    build_random_model(model_dir, args.dtype)
    print(f"random-init Qwen2.5-1.5B-shaped model in {model_dir} ({time.time() - t0:.0f}s)", flush=True)
    rows = []
    meta = {"workload": f"{args.completions} completions x {args.new_tokens} forced tokens, random-init "
                        f"Qwen2.5-1.5B shape, 4-bit NF4, LoRA r=16 all-linear, {args.dtype}",
            "steps": args.steps, "measured": "mean of the steps after the first", **environment()}
    for v in [x.strip() for x in args.variants.split(",") if x.strip()]:
        why = skip_reason(v)
        if why:
            rows.append({"variant": v, "skipped": why})
            print(f"{v}: skipped ({why})", flush=True)
            continue
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out_json = f.name
        cmd = [sys.executable, str(Path(__file__).resolve()), "--variant", v, "--json", out_json,
               "--model-dir", str(model_dir), "--completions", str(args.completions), "--new-tokens",
               str(args.new_tokens), "--group", str(args.group), "--micro-batch", str(args.micro_batch),
               "--steps", str(args.steps), "--dtype", args.dtype]
        print(f"{v}: running", flush=True)
        t0 = time.time()
        try:
            rc = subprocess.run(cmd, cwd=REPO, timeout=args.variant_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {args.variant_timeout:.0f}s"
        try:
            row = json.loads(Path(out_json).read_text())
        except (OSError, json.JSONDecodeError):
            row = {"variant": v, "error": f"child exited {rc} without a result"}
        row["wall_s"] = time.time() - t0
        rows.append(row)
        write_results(rows, args, meta)  # after every variant: a later hang or kill keeps what was measured
    print()
    print(table(rows))
    for p in write_results(rows, args, meta):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
