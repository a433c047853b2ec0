"""Record real rollouts for the value-MSE benchmark (``bench/value_mse.py``), once, compactly.

For one task family it samples, from the built-in SmolLM2 with the ``cpu-smollm2-arith`` prompt format:
  - ``ref``: the reference model (base, adapter disabled) at temperature 1.0, K samples per prompt (the BASIS prior),
  - one or more shifted policies, M samples per prompt each: the same model at a lower temperature (``t0.7``), and,
    when ``--adapter`` points at a trained LoRA with non-zero lora_B, that trained policy (``trained``) at the
    temperature it was trained at (the preset's, or ``--adapter-temperature``),
and the prompt feature of each policy (mean of the last 4 prompt positions of the middle layer, captured from the
policy's own prefill, exactly as ``HFEngine`` does during training).

Stored in ``bench/results/rollouts_<family>.npz`` (rewards uint8 [N, S], features float16 [N, D], completion
lengths uint8, plus a JSON ``meta`` string: questions, answers, levels, settings, timings). The file is rewritten
after every policy, so an interrupted recording keeps what it finished.

Note: ``HFEngine.generate(prompts, SamplingParams(n=S))`` with S > 1 hands every rollout of a chunk the features of
the first prompts of the chunk (transformers expands the inputs before the prefill; ``feats[p]`` then indexes the
expanded batch). This script sidesteps it by repeating each prompt S times with n = 1, which is the same compute.

The committed recordings (2 CPU cores, 2026-11-30; 34 + 27 + 34 minutes):

    python bench/record_rollouts.py --family arithmetic --prompts 512 --ref-samples 8 --policy-samples 8 \
        --temps 0.7 --max-new-tokens 48 --threads 2 --out bench/results/rollouts_arithmetic.npz
    python bench/record_rollouts.py --family arithmetic --prompts 512 --ref-samples 8 --policy-samples 8 \
        --temps 0.7 --max-new-tokens 48 --threads 2 --out bench/results/rollouts_arithmetic.npz --append \
        --adapter runs/bench-learning-cpu-smollm2-arith/seed0/basis/checkpoints/step-000010/adapter
    python bench/record_rollouts.py --family wordproblems --levels 1 2 4 6 --prompts 256 --ref-samples 6 \
        --policy-samples 6 --temps 0.7 --max-new-tokens 80 --threads 2 --batch 96 \
        --out bench/results/rollouts_wordproblems.npz

(the adapter is the BASIS arm of ``bench/learning.py --seeds 0`` after 10 of its 20 steps: a policy mid-training).
On a GPU the same takes minutes: ``--device cuda --dtype bfloat16 --batch 512``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"


def _adapter_ok(path: str) -> tuple[bool, str]:
    """(usable, why): a saved LoRA adapter whose lora_B weights are not all zero."""
    p = Path(path)
    f = p / "adapter_model.safetensors"
    if not f.exists():
        return False, f"no {f}"
    from safetensors.torch import load_file

    sd = load_file(str(f))
    bs = [v for k, v in sd.items() if "lora_B" in k]
    if not bs:
        return False, "no lora_B tensors"
    mx = max(float(v.abs().max()) for v in bs)
    return (mx > 0, f"max |lora_B| = {mx:.3g}")


def generate(engine, prompts: list[str], answers: list[str], n: int, temperature: float, max_new_tokens: int,
             seed: int, require_boxed: bool, log_every: int = 0):
    """n samples per prompt: rewards uint8 [N, n], lengths uint8 [N, n], features float32 [N, D], seconds."""
    import torch

    from basis_lite.engines.base import SamplingParams
    from basis_lite.rewards import correctness

    N = len(prompts)
    rewards = np.zeros((N, n), dtype=np.uint8)
    lengths = np.zeros((N, n), dtype=np.uint8)
    feats = None
    per_call = max(1, engine.batch_size // n)  # prompts per generate() call
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, n=1)
    t0 = time.time()
    for s in range(0, N, per_call):
        idx = list(range(s, min(N, s + per_call)))
        torch.manual_seed(seed * 1_000_003 + s)
        flat = [prompts[i] for i in idx for _ in range(n)]  # n = 1 per row: each row's feature is its own
        rolls = engine.generate(flat, params, with_features=True)
        for j, i in enumerate(idx):
            rs = rolls[j * n:(j + 1) * n]
            rewards[i] = [int(correctness(r.text, answers[i], require_boxed=require_boxed)) for r in rs]
            lengths[i] = [min(255, len(r.completion_ids)) for r in rs]
            if feats is None:
                feats = np.zeros((N, rs[0].feature.numel()), dtype=np.float32)
            feats[i] = rs[0].feature.float().numpy()
        if log_every and (s // per_call) % log_every == 0:
            done = idx[-1] + 1
            print(f"  {done}/{N} prompts, {time.time() - t0:.0f}s, mean reward so far "
                  f"{rewards[:done].mean():.3f}", flush=True)
    return rewards, lengths, feats, time.time() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu-smollm2-arith", help="prompt format, model and reward settings")
    ap.add_argument("--family", default="arithmetic", choices=("arithmetic", "algebra", "wordproblems"))
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--prompts", type=int, default=192, help="training prompts (the first N of the train split)")
    ap.add_argument("--ref-samples", type=int, default=8, help="K: reference samples per prompt (T=1.0)")
    ap.add_argument("--policy-samples", type=int, default=16, help="M: samples per prompt for each policy")
    ap.add_argument("--temps", type=float, nargs="*", default=[0.7], help="shifted policies: base at these temps")
    ap.add_argument("--adapter", default="", help="trained LoRA folder (policy 'trained') if usable")
    ap.add_argument("--adapter-temperature", type=float, default=None,
                    help="sampling temperature of the 'trained' policy (default: the preset's generation.temperature, "
                         "the temperature it was trained at)")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--batch", type=int, default=128, help="sequences per generate() call")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (2 threads on 2 busy cores ran 5x slower)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="float32 generated 1.6x faster than bfloat16 on the shared 2-core machine")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--offset", type=int, default=0, help="skip the first OFFSET train examples (record in chunks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="default bench/results/rollouts_<family>.npz")
    ap.add_argument("--append", action="store_true", help="keep the policies already in --out, add the new ones")
    a = ap.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    from basis_lite.config import load_config
    from basis_lite.data import format_prompt, load_examples
    from basis_lite.engines.hf import HFEngine
    from basis_lite.models import load_policy

    out = Path(a.out) if a.out else RESULTS / f"rollouts_{a.family}.npz"
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = load_config(a.preset, [f"data.dataset={a.family}", f"data.levels={json.dumps(a.levels)}",
                                            f"generation.max_new_tokens={a.max_new_tokens}"])
    exs = load_examples(cfg.data, "train")[a.offset:a.offset + a.prompts]
    t_start = time.time()
    model, tok = load_policy(cfg, torch.device(a.device), getattr(torch, a.dtype))
    prompts = [format_prompt(tok, ex.question, cfg.data) for ex in exs]
    answers = [ex.answer for ex in exs]
    engine = HFEngine(model, tok, batch_size=a.batch)
    req_boxed = cfg.reward.require_boxed

    arrays: dict[str, np.ndarray] = {}
    meta = {
        "preset": a.preset, "family": a.family, "levels": a.levels, "n_prompts": len(exs), "model": cfg.model.name,
        "dtype": a.dtype, "device": a.device, "offset": a.offset, "threads": a.threads, "max_new_tokens": a.max_new_tokens, "batch": a.batch,
        "require_boxed": req_boxed, "instruction": cfg.data.instruction, "system_prompt": cfg.data.system_prompt,
        "feature_layer": engine.feature_layer, "feature_tokens": engine.feature_tokens, "seed": a.seed,
        "ids": [ex.id for ex in exs], "questions": [ex.question for ex in exs], "answers": answers,
        "example_levels": [ex.meta.get("level") for ex in exs], "example_kinds": [ex.meta.get("family") for ex in exs],
        "example_prompt": prompts[0], "policies": {}, "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if a.append and out.exists():
        with np.load(out) as z:
            arrays = {k: z[k] for k in z.files if k != "meta"}
            old = json.loads(str(z["meta"]))
        if old["ids"] != meta["ids"]:
            raise SystemExit(f"--append: {out} holds other prompts")
        meta["policies"] = old["policies"]

    def save():
        tmp = out.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, meta=np.array(json.dumps(meta)), **arrays)
        os.replace(tmp, out)
        print(f"  saved {out} ({out.stat().st_size / 1e6:.2f} MB)", flush=True)

    def run(name, n, temperature, seed, ctx=None):
        print(f"[{a.family}] {name}: {len(prompts)} prompts x {n} samples, T={temperature}", flush=True)
        import contextlib

        with (ctx or contextlib.nullcontext()):
            r, ln, f, sec = generate(engine, prompts, answers, n, temperature, a.max_new_tokens, seed + 7919 * a.offset, req_boxed,
                                     log_every=4)
        arrays[f"{name}_rewards"], arrays[f"{name}_lengths"] = r, ln
        arrays[f"{name}_features"] = f.astype(np.float16)
        meta["policies"][name] = {"samples": n, "temperature": temperature, "seconds": round(sec, 1),
                                  "mean_reward": float(r.mean()), "seed": seed,
                                  "reference": name == "ref", "adapter": a.adapter if name == "trained" else ""}
        print(f"  {name}: mean reward {r.mean():.3f}, {sec:.0f}s", flush=True)
        save()

    if "ref_rewards" not in arrays and a.ref_samples > 0:
        run("ref", a.ref_samples, 1.0, a.seed + 1, model.disable_adapter())
    for k, t in enumerate(a.temps):
        name = f"t{t:g}"
        if f"{name}_rewards" not in arrays:
            run(name, a.policy_samples, t, a.seed + 10 + k, model.disable_adapter())
    if a.adapter:
        ok, why = _adapter_ok(a.adapter)
        print(f"adapter {a.adapter}: {'usable' if ok else 'NOT usable'} ({why})", flush=True)
        if ok and "trained_rewards" not in arrays:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            set_peft_model_state_dict(model, load_file(str(Path(a.adapter) / "adapter_model.safetensors")))
            t_adapter = cfg.generation.temperature if a.adapter_temperature is None else a.adapter_temperature
            run("trained", a.policy_samples, t_adapter, a.seed + 100)
    meta["total_seconds"] = round(time.time() - t_start, 1)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
