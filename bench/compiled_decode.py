#!/usr/bin/env python
"""Would a compiled decode step pay on the CPU? The fast rollout engine's decode forward, eager against torch.compile.

    python bench/compiled_decode.py                        # bf16 (what `auto` picks on avx512_bf16 / AMX), 4 calls
    python bench/compiled_decode.py --dtype float32 --calls 3 --out /tmp/cd

Much of a bf16 decode step on 2 cores is small ops between the matrix products (tens of thousands per rollout:
casts around the adapter, norms, rotary, attention's small products), so compiling the step (inductor fuses the
elementwise work into a few C++ loops) is the lever left for generation's time. This bench measures both sides of
that trade on the default job's first rollout (the preset's first prompt batch, chat template and system prompt,
generation.max_new_tokens, temperature, prompt features on, fresh adapter), each mode in its own process, one after
the other:

- `eager`: the engine as shipped (engines/fast_cpu.py).
- `compiled_cold`: the engine's decode forward (one new token per row, no feature layer) through
  `torch.compile(dynamic=True)`, with an empty inductor cache (a fresh TORCHINDUCTOR_CACHE_DIR): a user's first job.
  Prefills stay eager: they run twice per rollout.
- `compiled_warm`: the same in a new process reading the cache the cold one wrote: every later job.
- `layer_cold`, `layer_warm`: one decoder layer's decode step compiled once and called for every layer, the weights
  passed as tensors (`_layer_step`: the engine's bf16 layer written out, adapter beside the base as the engine runs
  it), so dynamo traces one layer instead of thirty; its own fresh cache, then warm. Over a bf16 base only.

Each process loads the model, makes one eager 2-token warm-up call (it builds the engine), then `--calls` rollout
calls with the global RNG reseeded before each (seed i for call i, the same in every mode); call 0 carries the
compilation. Steady = median of calls 1.. of seconds per sampled token (modes sample different tokens: the
compiled kernels round differently). The greedy outputs of the batch (one more call) are compared with the
eager ones row by row: inductor's fused kernels round differently, so rows may part where two logits are near-tied.
The job estimate is for `train.steps` rollouts of this size: saved = steps x eager's mean tokens per call x (eager's
steady - the mode's steady), paid = the mode's call 0 - its steady time for call 0's tokens; the evals' decoding is not
counted.

Writes compiled_decode.json and .md (default bench/results/compiled_decode/) with the machine record (CPU flags,
commit, load before and after).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.lib.paths import results_dir  # noqa: E402
from bench.lib.provenance import header_lines, machine_record, with_load_after  # noqa: E402
from bench.lib.report import markdown_table, write_json  # noqa: E402

MODES = ("eager", "compiled_cold", "compiled_warm", "layer_cold", "layer_warm")


def _layer_step(h, cos, sin, kc, vc, slot0: int, mask, ln1, ln2, eps: float, wqkv, aqkv, bqkv, wo, ao, bo, wgu, agu,
                bgu, wd, ad, bd, n_heads: int, n_kv: int, hd: int, attend):
    """One Llama layer's step as FastDecoder._forward computes it over a bf16 base (RMSNorm, fused q|k|v and
    gate|up with the adapter added in float32, the engine's rotary, the cache write, the engine's attention
    `attend`, SiLU), all weights passed in."""
    import torch
    import torch.nn.functional as F

    from basis_lite.engines.fast_cpu import rope

    def rms(x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def lin(x, w, A, B):
        y = F.linear(x, w)
        return (y.float() + F.linear(F.linear(x.float(), A), B)).to(y.dtype)

    b, t, _ = h.shape
    nq, nk = n_heads * hd, n_kv * hd
    qkv = lin(rms(h, ln1), wqkv, aqkv, bqkv)
    q = qkv[..., :nq].view(b, t, n_heads, hd).transpose(1, 2)
    k = qkv[..., nq:nq + nk].view(b, t, n_kv, hd).transpose(1, 2)
    v = qkv[..., nq + nk:].view(b, t, n_kv, hd).transpose(1, 2)
    q, k = rope(q, k, cos, sin)
    kc[:b, :, slot0:slot0 + t] = k
    vc[:b, :, slot0:slot0 + t] = v
    a = attend(q, kc[:b, :, :slot0 + t], vc[:b, :, :slot0 + t], mask)
    h = h + lin(a.transpose(1, 2).reshape(b, t, nq), wo, ao, bo)
    gu = lin(rms(h, ln2), wgu, agu, bgu)
    inter = gu.shape[-1] // 2
    return h + lin(F.silu(gu[..., :inter]) * gu[..., inter:], wd, ad, bd)


def route_decode(dec, per_layer: bool, compile: bool = True) -> None:
    """Route the engine's decode forwards (one new token per row, no feature layer) through torch.compile: the whole
    forward, or `_layer_step` compiled once and called per layer. Prefills stay eager. `compile=False` runs the same
    routing uncompiled (the tests check `_layer_step` against the engine that way)."""
    import torch

    eager_forward = dec._forward
    fn = _layer_step if per_layer else eager_forward
    step = torch.compile(fn, dynamic=True) if compile else fn

    def layers_forward(ids, pos, cache, slot0, mask):
        h = dec.body.embed_tokens(ids).to(dec.dtype)
        cos, sin = dec.body.rotary_emb(h, pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for (kc, vc), e in zip(cache, dec.layers):
            if any(g.lora is None for g in e["groups"]):
                raise SystemExit("the per-layer step needs the adapter on every linear")
            lay, weights = e["layer"], [t for g in e["groups"] for t in (g.w, *g.lora)]
            h = step(h, cos, sin, kc, vc, slot0, mask, lay.input_layernorm.weight, lay.post_attention_layernorm.weight,
                     lay.input_layernorm.variance_epsilon, *weights, dec.n_heads, dec.n_kv, dec.head_dim, dec._attend)
        return dec.body.norm(h), None

    def forward(ids, pos, cache, slot0, mask, feature_layer=None):
        if ids.shape[1] != 1 or feature_layer is not None:
            return eager_forward(ids, pos, cache, slot0, mask, feature_layer)
        return layers_forward(ids, pos, cache, slot0, mask) if per_layer else step(ids, pos, cache, slot0, mask)

    dec._forward = forward


def child(preset: str, dtype_name: str, calls: int, mode: str, overrides: list[str]) -> dict:
    """One mode in this process: the timed calls, greedy tokens and dynamo's graph count."""
    import torch

    from basis_lite.config import load_config
    from basis_lite.data import PromptSampler, format_prompt, load_examples
    from basis_lite.engines.base import params_from_config
    from basis_lite.engines.hf import HFEngine
    from basis_lite.model.dtypes import resolve_device
    from basis_lite.model.loading import load_policy
    from basis_lite.runtime import seed_everything

    cfg = load_config(preset, [*overrides, f"model.dtype={dtype_name}"])
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    model, tok = load_policy(cfg, resolve_device("cpu"), getattr(torch, dtype_name))
    max_prompt = max(16, cfg.model.max_seq_length - cfg.generation.max_new_tokens)
    eng = HFEngine(model, tok, batch_size=cfg.generation.batch_size, max_prompt_tokens=max_prompt, fast_cpu="auto")
    batch = next(PromptSampler(load_examples(cfg.data, "train"), cfg.train.batch_size, seed=cfg.train.seed))
    prompts = [format_prompt(tok, ex.question, cfg.data) for ex in batch]
    eng.generate(prompts[:2], params_from_config(cfg.generation, max_new_tokens=2))
    dec = eng._fast
    if dec is None:
        raise SystemExit(f"fast path unavailable: {eng.fast_cpu_fallback}")
    if mode != "eager":
        if mode.startswith("layer") and dec.merged:
            raise SystemExit(f"{mode}: the per-layer step is written for a bf16/fp16 base (the adapter beside it)")
        route_decode(dec, per_layer=mode.startswith("layer"))
    params = params_from_config(cfg.generation, n=cfg.estimator.rollouts_per_prompt)
    runs = []
    for i in range(calls):
        seed_everything(i)
        t0 = time.perf_counter()
        rolls = eng.generate(prompts, params, with_features=True)
        runs.append({"seconds": time.perf_counter() - t0, "tokens": sum(len(r.completion_ids) for r in rolls)})
        print(f"  call {i}: {runs[-1]['seconds']:.2f} s, {runs[-1]['tokens']} tokens", file=sys.stderr, flush=True)
    greedy = eng.generate(prompts, params_from_config(cfg.generation, greedy=True))
    graphs = None
    if mode != "eager":
        from torch._dynamo.utils import counters

        graphs = counters["stats"].get("unique_graphs")
    return {"runs": runs, "greedy": [list(r.completion_ids) for r in greedy], "graphs": graphs,
            "rows": len(prompts), "max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
            "steps": cfg.train.steps, "threads": torch.get_num_threads()}


def run_mode(mode: str, a, cache_dir: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--preset", a.preset, "--dtype", a.dtype,
           "--calls", str(a.calls), *[x for o in a.overrides for x in ("--set", o)]]
    print(f"{mode} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed (exit {proc.returncode}); its stderr is above")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - t0
    return out


def summarize(modes: dict) -> dict:
    for m in modes.values():
        runs = m["runs"]
        m["first_s"] = runs[0]["seconds"]
        m["steady_ms_per_token"] = 1e3 * statistics.median(r["seconds"] / r["tokens"] for r in runs[1:])
    eager = modes["eager"]
    eager_tokens = statistics.mean(r["tokens"] for r in eager["runs"][1:])
    for name, m in modes.items():
        m["greedy_rows_equal"] = sum(a == b for a, b in zip(m["greedy"], eager["greedy"]))
        m["steady_vs_eager"] = m["steady_ms_per_token"] / eager["steady_ms_per_token"]
        if name != "eager":
            m["job_saved_s"] = eager["steps"] * eager_tokens * (eager["steady_ms_per_token"]
                                                                - m["steady_ms_per_token"]) / 1e3
            m["job_paid_s"] = m["first_s"] - m["runs"][0]["tokens"] * m["steady_ms_per_token"] / 1e3
            m["job_net_s"] = m["job_saved_s"] - m["job_paid_s"]
    return modes


def write(out_dir: Path, result: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "compiled_decode.json", result)
    m = result["machine"]
    modes = result["modes"]
    e = modes["eager"]
    lines = ["# A compiled decode step against the eager one (bench/compiled_decode.py)", "",
             *header_lines(m, result["command"], e["threads"], f", {result['dtype']}"),
             f"- batch: {e['rows']} rows, {e['max_new_tokens']} new tokens, T={e['temperature']}; "
             f"{len(e['runs'])} calls per mode; method in the script's docstring.", ""]
    rows = []
    for name, d in modes.items():
        rows.append([name, f"{d['first_s']:.2f}", f"{d['steady_ms_per_token']:.2f}", f"{d['steady_vs_eager']:.2f}x",
                     " / ".join(str(r["tokens"]) for r in d["runs"]), f"{d['greedy_rows_equal']}/{len(d['greedy'])}",
                     "-" if d["graphs"] is None else d["graphs"], f"{d['process_s']:.0f}"])
    lines += [markdown_table(("mode", "call 0 s", "steady ms per token (median of calls 1..)", "steady vs eager",
                              "tokens per call", "greedy rows equal to eager", "graphs compiled",
                              "process s"), rows), ""]
    lines += [f"Over one default job ({e['steps']} rollouts of this size, evals not counted):", ""]
    lines.append(markdown_table(("mode", "saved s", "paid s (compilation)", "net s"),
                                [[n, f"{d['job_saved_s']:.1f}", f"{d['job_paid_s']:.1f}", f"{d['job_net_s']:+.1f}"]
                                 for n, d in modes.items() if n != "eager"]))
    (out_dir / "compiled_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-smollm2-arith")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--calls", type=int, default=4, help="rollout calls per mode (call 0 carries the compilation)")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--out", default=str(results_dir("compiled_decode")), help="default bench/results/compiled_decode")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.calls < 2:
        ap.error(f"--calls {a.calls}: need at least 2 (call 0 carries the compilation, the rest give the steady time)")
    if a.child:
        print(json.dumps(child(a.preset, a.dtype, a.calls, a.child, a.overrides)))
        return 0
    machine = machine_record()
    modes = {}
    with tempfile.TemporaryDirectory(prefix="inductor-") as whole, \
            tempfile.TemporaryDirectory(prefix="inductor-") as per:
        for mode in MODES if a.dtype == "bfloat16" else MODES[:3]:
            modes[mode] = run_mode(mode, a, per if mode.startswith("layer") else whole)
    result = {"machine": with_load_after(machine), "dtype": a.dtype, "modes": summarize(modes),
              "command": "python bench/compiled_decode.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    write(Path(a.out), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
