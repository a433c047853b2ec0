"""A GPU memory estimate by part for a preset, and a warning (with what to change) when it won't fit.

    plan_for(preset, overrides, gpu_memory) -> str   the table `basis-lite plan` prints for one preset
    build_plan(cfg, gpu_memory_gb) -> Plan           the parts, total, notes and problems
    estimate_memory(cfg) -> {part: GiB, "total": GiB}

    basis-lite plan --preset colab-t4-qwen2.5-1.5b-gsm8k            # card size from the preset header
    basis-lite plan --preset gpu-8gb --gpu-memory 6 --set train.micro_batch_size=2
    basis-lite plan --all                                           # every preset
    basis-lite plan --preset gpu-24gb --gpus 4                      # per card, data-parallel over 4 GPUs

Torch-free (it imports neither torch nor the model code), so `basis-lite plan` starts in a fraction of a second.

The estimate is arithmetic over the model's shape (read from a local config.json, the local Hugging Face cache, or
a small built-in table of known models: nothing is downloaded) and the config:

    CUDA context        ~0.5 GiB; on the CPU instead the runtime, ~0.44 GiB (interpreter, torch, transformers, peft)
    base weights        4-bit linears: params x ~0.52 B (NF4 + double-quantised absmax); embeddings and an untied
                        lm_head stay 16-bit. Without load_in_4bit: params x dtype bytes.
    LoRA                params + grads in fp32 (8 B/param), the optimizer's state (rl/optimizers.py: AdamW8bit
                        ~2 B/param, fp32 AdamW 8 B/param)
    activations         gradient checkpointing: micro_batch x seq x hidden x layers x dtype bytes (the saved layer
                        inputs) + one layer's full activations + one dequantised 16-bit weight; on the CPU a layer
                        also keeps its attention kernel's per-key tensors and, over a 16-bit base, peft's fp32
                        input copies (layer_activation_bytes), and the heap keeps freed buffers around them
                        (CPU_HEAP_FACTOR x the activations, the least that bounds the measured whole-job peaks)
    log-prob chunk      logprob_chunk_size x vocab x LOGPROB_BYTES_PER_LOGIT (fp32 logits and softmax; the frozen
                        head's gradient is found in the forward: bench/logprob_memory.py measures the factor)
    generation          by the memory model of the engine the run builds (EngineSpec.memory, engines/__init__.py):
                        kv_cache (hf): the KV cache of one generate() batch, 2 x layers x kv_heads x head_dim x bytes
                        x sequences x seq, the larger of a rollout batch and an eval batch (eval_batch_size greedy
                        rows of the prompt room + eval_max_new_tokens), plus the fast CPU path's weight copies
                        (fast_cpu); gpu_share (vLLM): its gpu_memory_utilization share of the card (Unsloth shares
                        the base weights with it; plain vLLM holds its own 16-bit copy of the base inside that share)

On the CPU, model.dtype auto is counted in float32; where the CPU reports native bf16 a note adds the bfloat16
total and the peak of auto's one-time dtype timing (dtype_probe_estimate).

Generation and training do not overlap in time, so the peak is the larger of the two phases, except that vLLM keeps
its share between rollouts (unless Unsloth's standby mode frees the KV cache while training).

With `--gpus N` (data-parallel, `torchrun --nproc_per_node N`) every card holds the whole model, adapter and
optimizer state and generates its share train.batch_size / N of the global batch; it adds a flat fp32 copy of the
LoRA gradients (the all-reduce buffer) and NCCL's communicator buffers.

CHECKED AGAINST ONE MEASURED GPU PEAK ONLY (bench/results/gpu_step: an H200, the hf backend and engine, a
Qwen2.5-1.5B-shaped model); the vLLM engine's share has never been measured on a GPU. The output says so.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from .config import Config, ConfigError, load_config, preset_path
from .config.keys import prompt_budget
from .engines import EngineSpec, select_engine
from .model.cpu import BF16_FLAGS_TEXT, STEP_PROBE, cpu_bf16_flags
from .model.shape import ModelShape, model_shape
from .rl.optimizers import OPTIMIZERS, resolve_optimizer

GIB = 2**30
CUDA_CONTEXT_GIB = 0.5
# the resident set of the interpreter after importing torch, transformers, peft and math-verify, before any model
# (bench/cpu_step.py's "process baseline", bench/results/cpu_step/)
CPU_RUNTIME_GIB = 0.44
# glibc keeps the update's freed buffers in the heap for reuse, so a CPU update peaks above its live tensors: this
# share of the activation estimate, the least (in tenths) that keeps the estimate at or above every measured
# whole-job peak in bench/results/ (scaling-wordproblems: 48-256 new tokens, 16-64 rollouts, 135M and 360M shapes;
# the comparison runs of default-dev, default-confirm and wordproblems-confirm, whose 320-token rows fill most of
# max_seq_length and whose peaks creep up over the 20 steps)
CPU_HEAP_FACTOR = 1.1
LOGPROB_BYTES_PER_LOGIT = 9  # one log-prob chunk's forward + backward per logit, rounded up (bench/results/logprob_memory)
VLLM_BUFFERS_GIB = 0.4  # vLLM's own activations / sampler / CUDA-graph pool when the card size is unknown
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit codes + 8-bit absmax per 64 + fp32 absmax per 256 blocks
NCCL_BUFFERS_GIB = 0.25  # NCCL's communicator buffers per card with several GPUs (rough: depends on NCCL_BUFFSIZE)


# ----------------------------------------------------------------------------------------------------------------
# the estimate


def _dtype_bytes(cfg: Config, cuda: bool) -> int:
    d = cfg.model.dtype
    if d == "auto":
        return 2 if cuda else 4
    return 4 if d == "float32" else 2


def _lora_params(shape: ModelShape, r: int, target_modules) -> int:
    lin = shape.linear_shapes
    names = list(lin) if target_modules == "all-linear" else [m for m in target_modules if m in lin]
    return shape.layers * sum(r * (lin[n][0] + lin[n][1]) for n in names)


def standby_utilization(card_gib: float) -> float:
    """The gpu_memory_utilization Unsloth forces under UNSLOTH_VLLM_STANDBY=1 (vLLM >= 0.11), by card size.

    Read from unsloth-zoo's load_vllm (a table on a tenth of the card's memory, times 0.95); override it there with
    UNSLOTH_VLLM_STANDBY_UTIL_OVERRIDE=1.
    """
    tenth = card_gib / 10
    for floor, util in ((4.0, 0.925), (2.5, 0.9), (2.0, 0.825), (1.4, 0.8), (1.0, 0.775)):
        if tenth >= floor:
            return util * 0.95
    return 0.75 * 0.95


def resolve_plan_backend(cfg: Config) -> str:
    """What the run will use on the GPU: backend auto means unsloth when it is installed there (assumed)."""
    b = cfg.model.backend
    return "unsloth" if b == "auto" else b


@dataclass
class Plan:
    parts: dict  # label -> GiB (an ordered table)
    total: float
    shape: ModelShape
    shape_source: str
    notes: list
    problems: list
    cuda: bool
    engine: str  # a one-line description of the rollout engine


@dataclass
class _Sizing:
    """What the steps of build_plan read (the config, the model's shape, the card, the engine) and fill in (the
    parts, notes and problems, in table order)."""

    cfg: Config
    shape: ModelShape
    cuda: bool
    db: int  # bytes per weight / activation element in the compute dtype
    gpus: int
    card: float | None  # GiB, or None when unknown
    engine: EngineSpec
    parts: dict = field(default_factory=dict)  # label -> GiB
    notes: list = field(default_factory=list)
    problems: list = field(default_factory=list)  # will not run at all, whatever the total says

    @property
    def seqs(self) -> int:
        """This card's sequences per step (its share of the global batch)."""
        return self.cfg.train.batch_size // self.gpus * self.cfg.estimator.rollouts_per_prompt


def build_plan(cfg: Config, gpu_memory_gb: float | None = None, shape: ModelShape | None = None,
               shape_source: str = "", gpus: int = 1) -> Plan:
    """The estimate for one card (with `gpus` > 1, one card of a data-parallel run over that many), in the steps of
    the module docstring: the parts held throughout (runtime, base weights, LoRA and its optimizer state,
    data-parallel buffers), the training phase, the generation phase by the engine's memory model (its EngineSpec,
    engines/__init__.py), then the peak over the phases and the notes."""
    check_gpus(cfg, gpus)
    if shape is None:
        shape, shape_source = model_shape(cfg.model.name, cfg.model.cache_dir)
    cuda = cfg.device != "cpu"
    backend = resolve_plan_backend(cfg) if cuda else "hf"
    s = _Sizing(cfg, shape, cuda, _dtype_bytes(cfg, cuda), gpus, gpu_memory_gb,
                select_engine(cfg, backend, "cuda" if cuda else "cpu"))
    weights = held_parts(s)
    held = sum(s.parts.values())
    train_phase = training_phase(s)
    gen_phase, keeps_share = GENERATION_PHASE[s.engine.memory](s, weights)
    total = peak(s, held, train_phase, gen_phase, keeps_share)
    general_notes(s, backend)
    if not cuda and cfg.model.dtype == "auto":
        cpu_auto_dtype_note(s)
    return Plan(parts=s.parts, total=total, shape=shape, shape_source=shape_source, notes=s.notes,
                problems=s.problems, cuda=cuda, engine=s.engine.description)


def held_parts(s: _Sizing) -> float:
    """The runtime, base weights, LoRA params + grads, optimizer state and data-parallel buffers; returns the base
    weights' GiB."""
    cfg, shape, db = s.cfg, s.shape, s.db
    if s.cuda:
        s.parts["CUDA context"] = CUDA_CONTEXT_GIB
    else:
        s.parts["runtime (interpreter, torch, transformers, peft)"] = CPU_RUNTIME_GIB
    if cfg.model.load_in_4bit:
        weights = (shape.linear_params * NF4_BYTES_PER_PARAM + shape.embedding_params * db) / GIB
        s.parts["base weights (4-bit linears, 16-bit embeddings)"] = weights
    else:
        weights = shape.params * db / GIB
        s.parts[f"base weights ({8 * db}-bit)"] = weights
    n_lora = _lora_params(shape, cfg.lora.r, cfg.lora.target_modules)
    s.parts[f"LoRA r={cfg.lora.r} params + grads (fp32)"] = n_lora * 8 / GIB
    opt = resolve_optimizer(cfg.train.optimizer, "cuda" if s.cuda else "cpu")
    s.parts[f"optimizer state ({opt})"] = n_lora * OPTIMIZERS[opt].state_bytes / GIB
    if s.gpus > 1:
        s.parts["data-parallel: flat fp32 LoRA gradients for the all-reduce"] = n_lora * 4 / GIB
        if s.cuda:
            s.parts["data-parallel: NCCL communicator buffers (rough)"] = NCCL_BUFFERS_GIB
    return weights


def training_phase(s: _Sizing) -> float:
    """The activations of one micro-batch and the log-prob chunk; returns their GiB."""
    m, t, shape, db = s.cfg.model, s.cfg.train, s.shape, s.db
    T, mb = m.max_seq_length, t.micro_batch_size
    tokens = mb * T  # the largest micro-batch's padded tokens: train.micro_batch_tokens caps them (one row at least)
    if t.micro_batch_tokens:
        tokens = min(tokens, max(T, t.micro_batch_tokens))
    one_layer = tokens * layer_activation_bytes(shape, db, T, s.cuda)
    dequant = shape.hidden * shape.intermediate * db if m.load_in_4bit else 0  # one dequantised weight at a time
    if m.gradient_checkpointing:
        act = tokens * shape.hidden * shape.layers * db + one_layer + dequant
        how = "checkpointed"
    else:
        act = shape.layers * one_layer + dequant
        how = "no checkpointing"
    if t.kl_coef > 0:
        s.notes.append("kl_coef > 0 adds one no-grad reference forward per micro-batch (small: not counted)")
    size = f"micro-batch {mb} x {T} tokens" if tokens == mb * T else f"micro-batch of {tokens} padded tokens"
    s.parts[f"activations ({how}, {size})"] = act / GIB
    heap = 0.0
    if not s.cuda:
        heap = CPU_HEAP_FACTOR * act / GIB
        s.parts[f"freed buffers the CPU heap keeps during the update ({CPU_HEAP_FACTOR:g} x activations)"] = heap
    rows = max(1, tokens // T)
    chunk = min(t.logprob_chunk_size, rows * min(T, s.cfg.generation.max_new_tokens))  # completion tokens only
    logprob = chunk * shape.vocab * LOGPROB_BYTES_PER_LOGIT / GIB
    s.parts[f"log-prob chunk ({chunk} tokens x vocab {shape.vocab} x {LOGPROB_BYTES_PER_LOGIT} B)"] = logprob
    return act / GIB + heap + logprob


def layer_activation_bytes(shape: ModelShape, db: int, T: int, cuda: bool) -> float:
    """The bytes one layer saves for the backward per token of a T-token sequence, without checkpointing: q, k, v,
    o, norms, residuals and MLP in the compute dtype; on the CPU also what its attention kernel keeps, and over a
    16-bit base the adapters' inputs, one 16-bit tensor per distinct input (model/lora.py: the q|k|v input, o's,
    the gate|up input, down's; tests/test_plan.py measures these against autograd's saved tensors)."""
    n = (10 * shape.hidden + 4 * shape.intermediate) * db
    if cuda:
        return n  # flash / memory-efficient attention: nothing per key
    if db == 4:
        return n + shape.heads * T  # scaled_dot_product_attention: the padding mask, one bool per head and key
    # transformers' eager attention (model.loading.training_attention): the fp32 softmax and its 16-bit copy
    return n + (3 * shape.hidden + shape.intermediate) * db + shape.heads * T * 6


def kv_cache_phase(s: _Sizing, weights: float) -> tuple[float, bool]:
    """Memory model kv_cache: the larger of a rollout generate() call's and an eval generate() call's KV cache and
    last-position logits (the eval decodes min(train.eval_batch_size, data.eval_size) greedy rows of the prompt
    room plus train.eval_max_new_tokens), and for the fast CPU path its weight copies, freed before the update.
    Returns (GiB, kept while training: False)."""
    cfg, shape, T = s.cfg, s.shape, s.cfg.model.max_seq_length
    g = cfg.estimator.rollouts_per_prompt
    per_call = min(max(1, cfg.generation.batch_size // max(1, g)) * g, s.seqs)
    rows = per_call * (2 if cfg.eapo.prior_adapter else 1)  # EAPO decodes policy and prior rows together

    def kv_and_logits(n: int, tokens: int) -> float:
        return (n * tokens * shape.kv_bytes_per_token(s.db) + n * shape.vocab * 4 * 2) / GIB  # logits + sampling copy

    eapo = " x 2 rows for EAPO" if rows != per_call else ""
    gen = kv_and_logits(rows, T)
    s.parts[f"generation: HF KV cache ({per_call} sequences{eapo} x {T} tokens)"] = gen
    eval_rows = min(cfg.train.eval_batch_size, cfg.data.eval_size)
    if eval_rows:
        t_eval = prompt_budget(cfg) + cfg.train.eval_max_new_tokens
        ev = kv_and_logits(eval_rows, t_eval)
        s.parts[f"eval: HF KV cache ({eval_rows} greedy sequences x {t_eval} tokens, between steps)"] = ev
        if ev > gen:
            s.notes.append(f"the eval's generate() batch ({eval_rows} x {t_eval} tokens, {ev:.2f} GiB) holds more than "
                           f"a rollout batch's ({gen:.2f} GiB); a smaller train.eval_batch_size lowers it")
        gen = max(gen, ev)
    if s.engine.weight_copies:
        copies, how = fast_cpu_copies(shape, s.db, cfg.lora.r, cfg.lora.target_modules)
        s.parts[f"generation: fast CPU path's weight copies ({how})"] = copies / GIB
        gen += copies / GIB
    return gen, False


def fast_cpu_copies(shape: ModelShape, db: int, r: int, target_modules) -> tuple[float, str]:
    """(bytes, what) of the weight copies engines/fast_cpu.py builds for a rollout: over a float32 base every
    linear merged with its adapter, fused per layer, and a oneDNN copy of the output head; over a 16-bit base the
    fused groups (q|k|v, gate|up) in the base dtype (o and down run on the base's own tensors) and each group's LoRA
    factors in float32 beside them."""
    if db == 4:
        return (shape.linear_params + shape.vocab * shape.hidden) * 4.0, "merged fp32 linears + output head"
    lin = shape.linear_shapes
    names = set(lin) if target_modules == "all-linear" else set(target_modules) & set(lin)
    lora = fused = 0
    for group in (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)):
        rank = r * len(names.intersection(group))  # [A; A; ...] [rank, in] and block-diagonal B [out, rank]
        lora += rank * (lin[group[0]][0] + sum(lin[n][1] for n in group)) * 4
        if len(group) > 1:
            fused += sum(lin[n][0] * lin[n][1] for n in group) * db
    return shape.layers * (fused + lora), f"fused {8 * db}-bit q|k|v, gate|up + fp32 LoRA"


def gpu_share_phase(s: _Sizing, weights: float) -> tuple[float, bool]:
    """Memory model gpu_share: vLLM's model.gpu_memory_utilization share of the card (its own 16-bit base inside it,
    for an engine with own_base_copy), kept while training unless the engine's standby frees it. Returns (GiB,
    kept while training)."""
    m, shape, T, card = s.cfg.model, s.shape, s.cfg.model.max_seq_length, s.card
    standby = s.engine.standby and m.unsloth_standby
    util = m.gpu_memory_utilization
    if standby and card:
        util = standby_utilization(card)
        s.notes.append(f"UNSLOTH_VLLM_STANDBY=1: Unsloth overrides gpu_memory_utilization to {util:.2f} for a "
                       f"{card:g} GiB card and frees the KV cache while training")
    kv_tok = shape.kv_bytes_per_token(s.db)
    kv_need = min(s.seqs, 256) * T * kv_tok / GIB + VLLM_BUFFERS_GIB
    own = shape.params * s.db / GIB if s.engine.own_base_copy else 0.0  # plain vLLM: its own unquantised copy
    if card:
        share = util * card
        kv_share = max(share - (own if s.engine.own_base_copy else weights), 0.0)
        one_seq = T * kv_tok / GIB + VLLM_BUFFERS_GIB
        if kv_share < one_seq:
            s.problems.append(f"vLLM's share ({util:.2f} x {card:g} GiB = {share:.2f} GiB) leaves {kv_share:.2f} GiB "
                              f"after the weights, less than one {T}-token sequence needs ({one_seq:.2f} GiB with "
                              "buffers): vLLM will refuse to start; raise model.gpu_memory_utilization or lower "
                              "model.max_seq_length")
        elif kv_share < kv_need:
            s.notes.append(f"vLLM's share ({util:.2f} x {card:g} GiB) leaves {kv_share:.2f} GiB for the KV cache; "
                           f"{kv_need:.2f} GiB would hold all {min(s.seqs, 256)} sequences at once (vLLM then runs "
                           "them in waves: slower, not an error, unless it is below one sequence)")
        how = f"gpu_memory_utilization {util:.2f} x {card:g} GiB"
    else:
        kv_share = kv_need
        how = f"{min(s.seqs, 256)} sequences x {T} tokens; card size unknown"
    if s.engine.own_base_copy:
        s.parts[f"generation: vLLM's own {8 * s.db}-bit base weights"] = own
        if m.load_in_4bit:
            s.notes.append(f"plain vLLM cannot load bitsandbytes 4-bit (moved out of vLLM's tree in 0.28): it holds "
                           f"the base in {8 * s.db}-bit, {own:.2f} GiB besides the 4-bit training copy; backend "
                           "unsloth with fast_inference shares one 4-bit copy instead")
    s.parts[f"generation: vLLM KV cache + buffers ({how})"] = kv_share
    return kv_share + own, not standby


# the generation phase of each engine memory model (EngineSpec.memory)
GENERATION_PHASE = {"kv_cache": kv_cache_phase, "gpu_share": gpu_share_phase}


def peak(s: _Sizing, held: float, train_phase: float, gen_phase: float, keeps_share: bool) -> float:
    """The total: the `held` parts plus the larger phase, or both phases when generation keeps its memory."""
    if not keeps_share:
        s.notes.append(f"generation ({gen_phase:.2f} GiB) and training ({train_phase:.2f} GiB) do not overlap: the "
                       "peak counts the larger phase only")
        return held + max(train_phase, gen_phase)
    s.notes.append("vLLM keeps its share while training (set model.unsloth_standby=true to free the KV cache "
                   "between rollouts): both phases are counted")
    return held + train_phase + gen_phase


def general_notes(s: _Sizing, backend: str) -> None:
    """Notes on the GPU count, Unsloth's checkpointing and the backend auto assumed."""
    cfg = s.cfg
    if s.gpus > 1 and s.cuda:
        s.notes.append(f"{s.gpus} GPUs: per-card figures; the nccl path has not run on real GPUs yet (the gloo path "
                       "is tested on CPUs), and Unsloth's in-process vLLM under torchrun is unverified")
    if backend == "unsloth" and s.cuda:
        s.notes.append("backend unsloth: Unsloth's own buffers are not in this estimate, and on the one GPU "
                       "measured (bench/results/gpu_step: Qwen2.5-1.5B shape, 64 x 256 tokens, H200) the job peaked "
                       "at about twice what the hf backend did: leave headroom")
    if cfg.model.backend == "auto" and s.cuda:
        fallback = select_engine(cfg, "hf", "cuda")
        s.notes.append("backend auto: assumed unsloth is installed on the GPU machine (else hf"
                       + (f", and the {fallback.name} engine then loads its own 16-bit base"
                          if fallback.own_base_copy else "") + ")")


def cpu_auto_dtype_note(s: _Sizing) -> None:
    """model.dtype auto on the CPU is counted in float32, the larger. When the CPU running the plan reports native
    bf16, auto trains in bf16 if a one-time timing of both dtypes (cached per machine) finds it faster: the note
    gives that total too, and the timing's own peak, which comes before a machine's first job."""
    flags = cpu_bf16_flags()
    if not flags:
        s.notes.append(f"model.dtype auto: float32 on this CPU, which reports no native bf16 (no {BF16_FLAGS_TEXT} "
                       "flag)")
        return
    bf16 = build_plan(dataclasses.replace(s.cfg, model=dataclasses.replace(s.cfg.model, dtype="bfloat16")),
                      s.card, s.shape, gpus=s.gpus).total
    probe = dtype_probe_estimate()
    s.notes.append(f"model.dtype auto: counted in float32, the larger. This CPU reports {'/'.join(flags)}: auto "
                   f"trains in bfloat16 if a one-time timing of both dtypes (cached per machine) finds it faster, "
                   f"about {bf16:.2f} GiB then (--set model.dtype=bfloat16 prints that table). The timing runs "
                   f"before a machine's first job and peaks at about {probe:.2f} GiB (a float32 model of the "
                   f"built-in model's shape training one micro-batch)")


def dtype_probe_estimate() -> float:
    """GiB at the peak of model.dtype auto's bf16/fp32 timing (model/cpu.py STEP_PROBE, model/dtypes.py): the
    runtime and its float32 model (the built-in model's shape, LoRA on every linear) training one micro-batch, by
    the same arithmetic as a job's update. Its bf16 model, built after the float32 one is freed, is smaller."""
    p = STEP_PROBE
    shape = ModelShape("dtype probe", p["hidden"], p["layers"], p["heads"], p["kv_heads"], p["hidden"] // p["heads"],
                       p["intermediate"], p["vocab"], True)
    rows, tokens = p["train"]
    cfg = load_config(None, ["model.dtype=float32", f"model.max_seq_length={tokens}", "train.micro_batch_tokens=0",
                             f"train.micro_batch_size={rows}", "train.logprob_chunk_size=1024",
                             f"generation.max_new_tokens={p['completion']}", f"lora.r={p['lora_r']}",
                             "lora.target_modules=all-linear", "model.load_in_4bit=false", "device=cpu"])
    s = _Sizing(cfg, shape, False, 4, 1, None, select_engine(cfg, "hf", "cpu"))
    held_parts(s)
    held = sum(s.parts.values())
    return held + training_phase(s)


def check_gpus(cfg: Config, gpus: int) -> None:
    if gpus < 1:
        raise ConfigError(f"--gpus: expected N >= 1, got {gpus}")
    if cfg.train.batch_size % gpus:
        raise ConfigError(f"--gpus {gpus}: train.batch_size={cfg.train.batch_size} is the global batch and must divide "
                          f"by the number of GPUs; use --set train.batch_size={gpus * max(1, cfg.train.batch_size // gpus)}")


def estimate_memory(cfg: Config, gpu_memory_gb: float | None = None, gpus: int = 1) -> dict:
    """{part: GiB} for this config (insertion order = table order), plus 'total' (the estimated peak)."""
    p = build_plan(cfg, gpu_memory_gb, gpus=gpus)
    return {**p.parts, "total": p.total}


# ----------------------------------------------------------------------------------------------------------------
# the printed plan


def header_gpu_memory(preset: str | None) -> float | None:
    """The `# gpu_memory_gb: N` comment of a preset file's header, if any."""
    if not preset:
        return None
    try:
        text = preset_path(preset).read_text()
    except ConfigError:
        return None
    m = re.search(r"^#\s*gpu_memory_gb:\s*([0-9.]+)", text, flags=re.M)
    return float(m.group(1)) if m else None


def _suggestions(cfg: Config, card: float, overrides: list[str], gpus: int = 1) -> list[str]:
    """Single changes that bring the estimate under the card, each with its new total."""
    from .config import get

    out: list[str] = []

    def total_with(extra: list[str]) -> float | None:
        try:
            c = load_config(cfg.preset or None, overrides + extra) if cfg.preset else None
        except ConfigError:
            return None
        if c is None:
            return None
        try:
            p = build_plan(c, card, gpus=gpus)
        except ConfigError:
            return None
        return None if p.problems else p.total

    def first_fit(key: str, values) -> None:
        for v in values:
            tot = total_with([f"{key}={v}"])
            if tot is not None and tot <= card:
                out.append(f"--set {key}={v}  -> {tot:.2f} GiB")
                return

    mb = cfg.train.micro_batch_size
    first_fit("train.micro_batch_size", [v for v in (mb // 2, mb // 4, 2, 1) if 0 < v < mb])
    seq, new = cfg.model.max_seq_length, cfg.generation.max_new_tokens
    for frac in (0.75, 0.5):  # fewer new tokens, same room for the prompt
        n = int(new * frac)
        s = seq - (new - n)
        tot = total_with([f"model.max_seq_length={s}", f"generation.max_new_tokens={n}"])
        if tot is not None and tot <= card:
            out.append(f"--set generation.max_new_tokens={n} --set model.max_seq_length={s}  -> {tot:.2f} GiB")
            break
    spec = select_engine(cfg, resolve_plan_backend(cfg), "cuda" if cfg.device != "cpu" else "cpu")
    if spec.memory == "gpu_share":
        u = get(cfg, "model.gpu_memory_utilization")
        first_fit("model.gpu_memory_utilization", [round(u - d, 2) for d in (0.1, 0.2, 0.3) if u - d > 0.05])
        if spec.standby and not cfg.model.unsloth_standby:
            first_fit("model.unsloth_standby", ["true"])
    else:
        gb = cfg.generation.batch_size
        first_fit("generation.batch_size", [v for v in (gb // 2, gb // 4) if v > 0])
    if not cfg.model.load_in_4bit:
        first_fit("model.load_in_4bit", ["true"])
    return out


def format_plan(name: str, cfg: Config, plan: Plan, card: float | None, card_source: str,
                overrides: list[str] | None = None, gpus: int = 1) -> str:
    where = "GPU" if plan.cuda else "RAM (CPU preset)"
    if gpus > 1:
        where = f"per-{'card' if plan.cuda else 'process'} ({gpus} data-parallel ranks) {where}"
    lines = [f"== {name}: {cfg.model.name} ({plan.shape.describe()}; shape from {plan.shape_source})",
             f"   {where} estimate; engine {plan.engine}; "
             f"{'4-bit NF4' if cfg.model.load_in_4bit else cfg.model.dtype + ' weights'}, dtype {cfg.model.dtype}, "
             f"{cfg.train.batch_size} prompts x {cfg.estimator.rollouts_per_prompt} rollout(s), "
             f"max_new_tokens {cfg.generation.max_new_tokens}, max_seq_length {cfg.model.max_seq_length}"]
    if gpus > 1:
        lines.append(f"   global batch {cfg.train.batch_size} prompts = {gpus} ranks x {cfg.train.batch_size // gpus} "
                     f"prompts each (x {cfg.estimator.rollouts_per_prompt} rollout(s)); BASIS pools over all "
                     f"{cfg.train.batch_size}; launch: torchrun --nproc_per_node {gpus} -m basis_lite train ...")
    width = max(len(k) for k in plan.parts) + 2
    lines.append(f"   {'part':<{width}}{'GiB':>8}")
    for k, v in plan.parts.items():
        lines.append(f"   {k:<{width}}{v:>8.2f}")
    lines.append(f"   {'total (estimated peak)':<{width}}{plan.total:>8.2f}")
    if card:
        head = card - plan.total
        lines.append(f"   card: {card:g} GiB ({card_source}); "
                     + (f"fits with {head:.2f} GiB to spare" if head >= 0 else f"over by {-head:.2f} GiB"))
        if head < 0:
            lines.append(f"   WARNING: {name} is estimated at {plan.total:.2f} GiB, more than the {card:g} GiB card. "
                         "Try one of:")
            sugg = _suggestions(cfg, card, overrides or [], gpus) if cfg.preset else []
            lines += [f"     {s}" for s in sugg] or [
                "     a smaller train.micro_batch_size, generation.max_new_tokens / model.max_seq_length, or "
                "model.gpu_memory_utilization (vLLM), or a smaller model"]
        elif head < 0.1 * card:
            lines.append("   note: less than 10% headroom; fragmentation can push the real peak over the card")
    elif plan.cuda:
        lines.append("   card: unknown (pass --gpu-memory GB, or add a '# gpu_memory_gb: N' line to the preset header)")
    for p in plan.problems:
        lines.append(f"   WARNING: {p}")
    for n in plan.notes:
        lines.append(f"   - {n}")
    return "\n".join(lines)


PLAN_FOOTER = ("Estimates come from the model shape and the config (see basis_lite/plan.py). On a GPU they are checked "
               "against ONE measured run only (bench/results/gpu_step: an H200, hf backend and engine, Qwen2.5-1.5B "
               "shape); the vLLM engine's share is NOT YET CHECKED on a GPU. bench/gpu_step.py measures more. On the "
               "CPU a test keeps them between 1x and 1.8x the whole-job peaks measured in "
               "bench/results/ (scaling-wordproblems and the comparison runs).")


def plan_for(preset: str | None = None, overrides: Sequence[str] = (), gpu_memory: float | None = None,
             gpus: int = 1, trl_config: str | None = None) -> str:
    """The memory plan of one preset (default: the default preset) with `overrides`, as printed by `basis-lite plan`.

    The card size is `gpu_memory` (GiB) or else the preset header's `# gpu_memory_gb: N`; `gpus` > 1 gives one card
    of a data-parallel run over that many; `trl_config` a `trl grpo` config file read on top of the preset.
    """
    overrides = list(overrides)
    if gpu_memory is not None and not (math.isfinite(gpu_memory) and gpu_memory > 0):
        raise ConfigError(f"--gpu-memory: must be the card's memory in GiB, a number > 0, got {gpu_memory:g}")
    cfg = load_config(preset, overrides, trl_config=trl_config)
    label = preset or cfg.preset
    card, source = gpu_memory, "--gpu-memory"
    if card is None:
        card, source = header_gpu_memory(label), "preset header"
    return format_plan(label, cfg, build_plan(cfg, card, gpus=gpus), card, source, overrides, gpus)
