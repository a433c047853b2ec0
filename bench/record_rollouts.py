"""Record real rollouts for the value-MSE benchmark (``bench/value_mse.py``), once, compactly.

For one task family it samples, from the built-in SmolLM2 with the preset's prompt format (``--preset``, default
``cpu-smollm2-arith``: its system prompt, instruction, data.levels and generation.max_new_tokens unless overridden):
  - ``ref``: the reference model (base, adapter disabled) at temperature 1.0, K samples per prompt (the BASIS prior),
  - one or more shifted policies, M samples per prompt each: the same model at a lower temperature (``t0.7``), and,
    when ``--adapter`` points at a trained LoRA with non-zero lora_B, that trained policy (``trained``) at the
    temperature it was trained at (the preset's, or ``--adapter-temperature``),
and the prompt feature of each policy (mean of the last 4 prompt positions of the middle layer, captured from the
policy's own prefill by the trainer's rollout engine, ``HFEngine``). On the CPU that engine samples with its fast
path (engines/fast_cpu.py: merged weights, the same prompt features, about 3x faster than generate());
``--engine generate`` uses transformers' generate() instead, as the recordings before the fast path did.

The prompts are the first N of the train split in the order the trainer's data loader draws them (round-robin over
the levels); a question the draw revisits (``data.revisit``: level 1 of the default preset has 50 training
questions) is recorded again as its own prompt, with its own samples, under the id ``ID#k``, so the prompts keep
the training draw's level shares.

Stored in ``bench/results/record_rollouts/rollouts_<family>.npz`` (rewards uint8 [N, S], features float16 [N, D],
completion lengths uint8, plus a JSON ``meta`` string: questions, answers, levels, settings, timings, the adapter's
sha256, the machine record of bench/lib/provenance.py).
The file is rewritten after every policy, so an interrupted recording keeps what it finished. ``--max-seconds``
stops a long policy part-way (exit status 3, the prompts done so far saved); ``--append`` continues it with the
same result as one uninterrupted run (each generate() chunk is seeded from its first prompt's index).

Note: ``HFEngine.generate(prompts, SamplingParams(n=S))`` with S > 1 hands every rollout of a chunk the features of
the first prompts of the chunk (transformers expands the inputs before the prefill; ``feats[p]`` then indexes the
expanded batch). This script sidesteps it by repeating each prompt S times with n = 1, which is the same compute.

The default task (levels [1, 3, 5]; 2 CPU cores, bf16 as the run was trained; bench/results/value_mse/default/):

    python bench/record_rollouts.py --prompts 512 --ref-samples 8 --policy-samples 8 --temps --threads 2 \
        --dtype bfloat16 --out bench/results/record_rollouts/rollouts_arithmetic_default.npz --max-seconds 420
    python bench/record_rollouts.py --prompts 512 --ref-samples 8 --policy-samples 8 --temps --threads 2 \
        --dtype bfloat16 --out bench/results/record_rollouts/rollouts_arithmetic_default.npz --max-seconds 420 \
        --append --adapter runs/l22/seed0/basis/checkpoints/step-000010/adapter     # each repeated until it exits 0

(the adapter: the BASIS arm of ``bench/learning.py`` on the default preset, seed 0, after 10 of 20 steps; 233 s +
260 s of sampling, bench/results/value_mse/default/README.md).

The recordings of the previous task (the default preset then, now ``cpu-smollm2-arith-add2``: levels [1, 2, 3],
no revisits; generate(), before the fast path (``--engine generate`` samples as they did); 2 CPU cores,
2026-11-30; 34 + 27 + 34 minutes):

    python bench/record_rollouts.py --preset cpu-smollm2-arith-add2 --prompts 512 --ref-samples 8 \
        --policy-samples 8 --temps 0.7 --threads 2 --out bench/results/record_rollouts/rollouts_arithmetic.npz
    python bench/record_rollouts.py --preset cpu-smollm2-arith-add2 --prompts 512 --ref-samples 8 \
        --policy-samples 8 --temps 0.7 --threads 2 --out bench/results/record_rollouts/rollouts_arithmetic.npz \
        --append --adapter runs/bench-learning-cpu-smollm2-arith/seed0/basis/checkpoints/step-000010/adapter
    python bench/record_rollouts.py --preset cpu-smollm2-arith-add2 --family wordproblems --levels 1 2 4 6 \
        --prompts 256 --ref-samples 6 --policy-samples 6 --temps 0.7 --max-new-tokens 80 --threads 2 --batch 96 \
        --out bench/results/record_rollouts/rollouts_wordproblems.npz

(each adapter is the BASIS arm of ``bench/learning.py --seeds 0`` after 10 of its 20 steps: a policy mid-training).
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
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.lib.paths import results_dir  # noqa: E402
from bench.lib.provenance import machine_record, with_load_after  # noqa: E402


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
             seed: int, require_boxed: bool, log_every: int = 0, start: int = 0, out=None,
             deadline: float | None = None):
    """n samples per prompt, from prompt ``start`` on, into ``out`` = (rewards uint8 [N, n], lengths uint8 [N, n],
    features float32 [N, D] or None; fresh when None). Stops after the chunk that passes ``deadline`` (time.time()).
    Returns (rewards, lengths, features, seconds, prompts done). Chunk c (prompts c * per_call onwards) is seeded
    from its first prompt's index, so a recording resumed at a chunk boundary is the one made in a single run."""
    import torch

    from basis_lite.engines.base import SamplingParams
    from basis_lite.rewards.scorer import correctness

    N = len(prompts)
    rewards, lengths, feats = out if out is not None else (np.zeros((N, n), dtype=np.uint8),
                                                          np.zeros((N, n), dtype=np.uint8), None)
    per_call = max(1, engine.batch_size // n)  # prompts per generate() call
    if start % per_call:
        raise ValueError(f"resume at prompt {start}: not a multiple of {per_call} prompts per call (--batch changed?)")
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, n=1)
    t0 = time.time()
    done = start
    for s in range(start, N, per_call):
        if deadline is not None and s > start and time.time() > deadline:
            break
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
        done = idx[-1] + 1
        if log_every and (s // per_call) % log_every == 0:
            print(f"  {done}/{N} prompts, {time.time() - t0:.0f}s, mean reward so far "
                  f"{rewards[:done].mean():.3f}", flush=True)
    return rewards, lengths, feats, time.time() - t0, done


def unique_ids(ids: list[str]) -> list[str]:
    """Ids made distinct: the k-th repeat of an id (a revisited question, ``data.revisit``) becomes ``id#k``."""
    seen: dict[str, int] = {}
    out = []
    for i in ids:
        k = seen.get(i, 0)
        seen[i] = k + 1
        out.append(i if k == 0 else f"{i}#{k}")
    return out


def sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu-smollm2-arith", help="prompt format, model and reward settings")
    ap.add_argument("--family", default="arithmetic", choices=("arithmetic", "algebra", "wordproblems"))
    ap.add_argument("--levels", type=int, nargs="+", default=None, help="default: the preset's data.levels")
    ap.add_argument("--prompts", type=int, default=192,
                    help="training prompts: the first N of the train split as the trainer draws it (a revisited "
                         "question is recorded again, under the id ID#k)")
    ap.add_argument("--ref-samples", type=int, default=8, help="K: reference samples per prompt (T=1.0)")
    ap.add_argument("--policy-samples", type=int, default=16, help="M: samples per prompt for each policy")
    ap.add_argument("--temps", type=float, nargs="*", default=[0.7], help="shifted policies: base at these temps")
    ap.add_argument("--adapter", default="", help="trained LoRA folder (policy 'trained') if usable")
    ap.add_argument("--adapter-temperature", type=float, default=None,
                    help="sampling temperature of the 'trained' policy (default: the preset's generation.temperature, "
                         "the temperature it was trained at)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the preset's generation.max_new_tokens")
    ap.add_argument("--batch", type=int, default=128, help="sequences per generate() call")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (2 threads on 2 busy cores ran 5x slower)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the model's dtype; record a trained adapter in the dtype it was trained in (its run's "
                         "decided.json)")
    ap.add_argument("--engine", default="auto", choices=("auto", "generate"),
                    help="auto: the trainer's rollout engine (on the CPU its fast path, engines/fast_cpu.py, with the "
                         "same prompt features); generate: transformers' generate() (generation.fast_cpu=off)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--offset", type=int, default=0, help="skip the first OFFSET train examples (record in chunks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="default bench/results/record_rollouts/rollouts_<family>.npz")
    ap.add_argument("--label", default=None,
                    help="the name bench/value_mse.py gives this recording's scenarios (files with one label are "
                         "concatenated); default: the file name after rollouts_ (rollouts_arithmetic.npz: arithmetic)")
    ap.add_argument("--append", action="store_true",
                    help="keep the policies already in --out, add the new ones, and finish a policy an earlier "
                         "--max-seconds stopped")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="stop sampling after about this many seconds (the chunk under way finishes), save, and exit "
                         "3; run again with --append to continue where it stopped (same --batch)")
    a = ap.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    from basis_lite.config import load_config
    from basis_lite.data import format_prompt, load_examples
    from basis_lite.engines.hf import HFEngine
    from basis_lite.model.loading import load_policy

    t_start = time.time()
    deadline = None if a.max_seconds is None else t_start + a.max_seconds
    out = Path(a.out) if a.out else results_dir("record_rollouts") / f"rollouts_{a.family}.npz"
    out.parent.mkdir(parents=True, exist_ok=True)
    overrides = [f"data.dataset={a.family}"]
    if a.levels is not None:
        overrides.append(f"data.levels={json.dumps(a.levels)}")
    if a.max_new_tokens is not None:
        overrides.append(f"generation.max_new_tokens={a.max_new_tokens}")
    cfg = load_config(a.preset, overrides)
    levels, max_new = list(cfg.data.levels), cfg.generation.max_new_tokens
    exs = load_examples(cfg.data, "train")[a.offset:a.offset + a.prompts]
    ids = unique_ids([ex.id for ex in exs])
    model, tok = load_policy(cfg, torch.device(a.device), getattr(torch, a.dtype))
    prompts = [format_prompt(tok, ex.prompt, cfg.data) for ex in exs]
    answers = [ex.answer for ex in exs]
    engine = HFEngine(model, tok, batch_size=a.batch, fast_cpu="auto" if a.engine == "auto" else "off")
    req_boxed = cfg.reward.require_boxed

    arrays: dict[str, np.ndarray] = {}
    meta = {
        "preset": a.preset, "family": a.family, "label": a.label or out.stem.removeprefix("rollouts_"),
        "levels": levels, "n_prompts": len(exs), "model": cfg.model.name,
        "dtype": a.dtype, "device": a.device, "offset": a.offset, "threads": a.threads, "max_new_tokens": max_new,
        "batch": a.batch, "require_boxed": req_boxed, "instruction": cfg.data.instruction,
        "system_prompt": cfg.data.system_prompt, "feature_layer": engine.feature_layer,
        "feature_tokens": engine.feature_tokens, "seed": a.seed, "ids": ids,
        "revisited": sum(i != ex.id for i, ex in zip(ids, exs)), "questions": [ex.question for ex in exs],
        "answers": answers, "example_levels": [ex.meta.get("level") for ex in exs],
        "example_kinds": [ex.meta.get("family") for ex in exs], "example_prompt": prompts[0], "policies": {},
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_record(),
    }
    if a.append and out.exists():
        with np.load(out) as z:
            arrays = {k: z[k] for k in z.files if k != "meta"}
            old = json.loads(str(z["meta"]))
        if old["ids"] != meta["ids"]:
            raise SystemExit(f"--append: {out} holds other prompts")
        meta["policies"] = old["policies"]
        meta["recorded_at"] = old.get("recorded_at", meta["recorded_at"])
        meta["sessions"] = old.get("sessions", [])

    def save():
        tmp = out.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, meta=np.array(json.dumps(meta)), **arrays)
        os.replace(tmp, out)
        print(f"  saved {out} ({out.stat().st_size / 1e6:.2f} MB)", flush=True)

    def complete(name) -> bool:
        p = meta["policies"].get(name)
        return p is not None and p.get("done", len(prompts)) >= len(prompts)

    def run(name, n, temperature, seed, ctx=None, adapter="") -> bool:
        """Sample policy `name` (or its rest); True when it is complete."""
        import contextlib

        prev = meta["policies"].get(name)
        start = prev.get("done", 0) if prev else 0
        have = None
        if prev and start:
            if prev["samples"] != n or prev["temperature"] != temperature or prev.get("batch", a.batch) != a.batch:
                raise SystemExit(f"--append: {name} was started with other settings: {prev}")
            have = (arrays[f"{name}_rewards"], arrays[f"{name}_lengths"],
                    arrays[f"{name}_features"].astype(np.float32))
        print(f"[{a.family}] {name}: {len(prompts)} prompts x {n} samples, T={temperature}, from prompt {start}",
              flush=True)
        with (ctx or contextlib.nullcontext()):
            r, ln, f, sec, done = generate(engine, prompts, answers, n, temperature, max_new, seed + 7919 * a.offset,
                                           req_boxed, log_every=4, start=start, out=have, deadline=deadline)
        arrays[f"{name}_rewards"], arrays[f"{name}_lengths"] = r, ln
        arrays[f"{name}_features"] = f.astype(np.float16)
        sec += prev.get("seconds", 0.0) if prev and start else 0.0
        meta["policies"][name] = {"samples": n, "temperature": temperature, "seconds": round(sec, 1),
                                  "mean_reward": float(r[:done].mean()), "seed": seed, "done": done,
                                  "batch": a.batch, "reference": name == "ref", "adapter": adapter,
                                  "engine": "generate()" if engine.fast_cpu_fallback else "fast_cpu"}
        if adapter:
            meta["policies"][name]["adapter_sha256"] = sha256(Path(adapter) / "adapter_model.safetensors")
        print(f"  {name}: {done}/{len(prompts)} prompts, mean reward {r[:done].mean():.3f}, {sec:.0f}s"
              + (f" (fell back to generate(): {engine.fast_cpu_fallback})" if engine.fast_cpu_fallback else ""),
              flush=True)
        save()
        return done >= len(prompts)

    todo = []
    if a.ref_samples > 0:
        todo.append(("ref", a.ref_samples, 1.0, a.seed + 1, True, ""))
    for k, t in enumerate(a.temps):
        todo.append((f"t{t:g}", a.policy_samples, t, a.seed + 10 + k, True, ""))
    if a.adapter:
        ok, why = _adapter_ok(a.adapter)
        print(f"adapter {a.adapter}: {'usable' if ok else 'NOT usable'} ({why})", flush=True)
        if ok:
            t_adapter = cfg.generation.temperature if a.adapter_temperature is None else a.adapter_temperature
            todo.append(("trained", a.policy_samples, t_adapter, a.seed + 100, False, a.adapter))
    finished = True
    for name, n, temp, seed, base, adapter in todo:
        if complete(name):
            continue
        if deadline is not None and time.time() > deadline:
            finished = False
            break
        if adapter:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            set_peft_model_state_dict(model, load_file(str(Path(adapter) / "adapter_model.safetensors")))
        if not run(name, n, temp, seed, model.disable_adapter() if base else None, adapter):
            finished = False
            break
    meta.setdefault("sessions", []).append(round(time.time() - t_start, 1))
    meta["total_seconds"] = round(sum(meta["sessions"]), 1)
    meta["machine"] = with_load_after(meta["machine"])
    save()
    if not finished:
        print(f"stopped at --max-seconds {a.max_seconds:g}: run again with --append to continue", flush=True)
        return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
