"""The device and the compute dtype: `model.dtype: auto` on a GPU (bf16 where supported, else fp16) and on a CPU
(bf16 only with native bf16 flags AND a whole-step timing of the built-in model's shape that confirms it, cached
per machine in the cache folder). Read by runtime (every command) and the engines."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import logging
import os
import time
from pathlib import Path

import torch

from ..config import cache_root
from ..errors import ModelError
from ..safeio import atomic_write_text, read_json
from .cpu import BF16_FLAGS_TEXT, STEP_PROBE, cpu_bf16_flags
from .loading import contiguous_head_input, release_memory

log = logging.getLogger("basis_lite")


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelError("device: cuda was asked for but no CUDA GPU is visible to torch; use device: cpu "
                         "(or --set device=cpu) or a CPU preset such as cpu-smollm2-arith")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The compute dtype for `model.dtype` on this device; logs what `auto` chose and why.

    GPU: bf16 where supported, else fp16 (a T4). CPU: fp32 unless the processor runs bf16 natively (avx512_bf16 or
    amx_bf16 in its flags) AND a whole-step measurement says bf16 is faster (`cpu_bf16_check`: prefill, decode
    and a LoRA training forward+backward of the built-in model's shape, in both dtypes, once per machine, cached).
    Without native support bf16 matmuls are emulated and run many times slower; with it, a step can still be no
    faster (decode and the fp32 LoRA/log-prob parts gain little), which only a whole step shows. An explicit
    bfloat16 on a CPU without native bf16 runs, with a warning that names the slowdown measured here.
    """
    if name != "auto":
        dtype = getattr(torch, name)
        if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ModelError("model.dtype: bfloat16 is not supported on this GPU (pre-Ampere, e.g. a T4); "
                             "use float16 or auto")
        if dtype == torch.bfloat16 and device.type == "cpu":
            check = cpu_bf16_check()
            if not check.fast:
                log.warning("model.dtype=bfloat16 on a CPU %s: %s; model.dtype=auto would pick float32",
                            f"without native bf16 (no {BF16_FLAGS_TEXT} flag)" if not check.flags
                            else "whose bf16 measured slow", check.describe())
        return dtype
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if not cpu_bf16_flags():  # nothing to confirm: no timing
        dtype, why = torch.float32, f"this CPU has no native bf16 (no {BF16_FLAGS_TEXT} flag)"
    else:
        check = cpu_bf16_check()
        dtype = torch.bfloat16 if check.fast else torch.float32
        why = f"the CPU reports {'/'.join(check.flags)} and {check.describe()}"
    log.info("model.dtype=auto: %s on this CPU because %s", str(dtype).replace("torch.", ""), why)
    return dtype


BF16_MARGIN = 0.95  # bf16 is chosen only when its step takes less than this fraction of the fp32 step


@dataclasses.dataclass(frozen=True)
class Bf16Check:
    flags: tuple[str, ...]  # native bf16 flags the CPU reports (avx512_bf16, amx_bf16)
    bf16_ms: float  # the probe's time in bf16 (a whole step, or one linear layer on CPUs without the flags)
    fp32_ms: float
    probe: str = "linear"  # "step": STEP_PROBE (cpu_step_probe_pair); "linear": a 256x576 -> 1536 linear layer
    cached: bool = False  # read from the per-machine cache file instead of measured now

    @property
    def fast(self) -> bool:
        return bool(self.flags) and self.bf16_ms < BF16_MARGIN * self.fp32_ms

    def describe(self) -> str:
        what = ("a scaled-down default step (prefill, decode, LoRA training forward+backward of the built-in "
                "model's shape)" if self.probe == "step" else "a 256x576 -> 1536 linear layer")
        return (f"{what} took {self.bf16_ms:.1f} ms in bf16 vs {self.fp32_ms:.1f} ms in fp32 here "
                f"({self.bf16_ms / max(self.fp32_ms, 1e-9):.1f}x{', measured earlier on this machine' if self.cached else ''})")


PROBE_ROUNDS = 3  # timed rounds per dtype, after one warm-up each; the two dtypes' rounds alternate


def _step_probe(dtype: torch.dtype, probe: dict):
    """A scaled-down training step in `dtype` (random weights, built with the global RNG forked): returns a
    function that runs it once and gives its parts' seconds (prefill, decode, train) as a dict."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..losses.policy import sequence_logprobs

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=probe["vocab"], hidden_size=probe["hidden"],
                             intermediate_size=probe["intermediate"], num_hidden_layers=probe["layers"],
                             num_attention_heads=probe["heads"], num_key_value_heads=probe["kv_heads"],
                             max_position_embeddings=1024, tie_word_embeddings=True)
        model = LlamaForCausalLM(config).to(dtype)
        for p in model.parameters():
            p.requires_grad_(False)
        model = get_peft_model(model, LoraConfig(r=probe["lora_r"], lora_alpha=2 * probe["lora_r"],
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        contiguous_head_input(model)
        base = model.get_base_model()
        rows, plen = probe["prefill"]
        prompt = torch.randint(0, probe["vocab"], (rows, plen))
        b, t = probe["train"]
        ids = torch.randint(0, probe["vocab"], (b, t))
        attn = torch.ones_like(ids)
        comp = torch.zeros_like(ids)
        comp[:, t - probe["completion"]:] = 1

    def one_round() -> dict:
        model.eval()
        with torch.no_grad():
            t0 = time.perf_counter()
            out = base(input_ids=prompt, use_cache=True, logits_to_keep=1)
            t1 = time.perf_counter()
            cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            for _ in range(probe["decode_steps"]):
                out = base(input_ids=nxt, past_key_values=cache, use_cache=True)
                cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            t2 = time.perf_counter()
        model.train()
        out = sequence_logprobs(model, ids, attn, comp, temperature=0.7, with_entropy=True)
        (out.logprobs.sum() / out.mask.sum()).backward()
        model.zero_grad(set_to_none=True)
        return {"prefill": t1 - t0, "decode": t2 - t1, "train": time.perf_counter() - t2}

    return one_round


def cpu_step_probe_pair(dtypes: tuple = (torch.float32, torch.bfloat16), probe: dict = STEP_PROBE,
                        rounds: int = PROBE_ROUNDS) -> dict:
    """{dtype name: milliseconds of each part of the scaled-down step, and their weighted sum under "total"}.

    The parts: a prefill of [rows, tokens] prompts (one lm_head row each), `decode_steps` single-token steps with
    the KV cache, and one LoRA micro-batch forward+backward through `sequence_logprobs` (the trainer's chunked
    log-prob head) with the last `completion` positions scored. The timed rounds alternate between the dtypes and
    each part keeps its best round: a burst of load from elsewhere on the machine slows one round of each, not one
    dtype's whole measurement. Only one probe model is alive at a time: every round builds each dtype's model in
    turn and frees it after timing it (both models alive together, with their buffers, made the probe the peak of a
    user's first job); each dtype's first build is warmed up once before it is timed (kernel selection, allocator).
    The float32 model goes first: the heap its larger buffers leave behind holds the bf16 model's. The global RNG is
    left as it was."""
    best: dict = {str(d).replace("torch.", ""): {} for d in dtypes}
    warmed: set = set()
    for _ in range(rounds):
        for d in dtypes:
            name = str(d).replace("torch.", "")
            run = _step_probe(d, probe)
            if name not in warmed:
                run()
                warmed.add(name)
            for part, sec in run().items():
                best[name][part] = min(best[name].get(part, float("inf")), sec)
            del run
            gc.collect()  # the model goes before the next one is built
    out = {}
    for name, parts in best.items():
        ms = {k: 1e3 * v for k, v in parts.items()}
        ms["total"] = sum(probe["weights"][k] * ms[k] for k in ("prefill", "decode", "train"))
        out[name] = ms
    return out


def _probe_cache_key(flags: tuple[str, ...]) -> str:
    import platform

    model = ""
    with contextlib.suppress(OSError):
        model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name")), "")
    # Kernel-ISA caps (set to emulate an older CPU, or by a user working around a kernel bug) change which
    # kernels run, so a timing taken without them does not hold with them.
    caps = ",".join(f"{k}={os.environ[k]}" for k in ISA_CAP_VARS if os.environ.get(k))
    return (f"{model or platform.processor()}|{'/'.join(flags)}|{os.cpu_count()} cpus|{torch.get_num_threads()} "
            f"threads|torch {torch.__version__}|probe v{STEP_PROBE['version']}" + (f"|{caps}" if caps else ""))


ISA_CAP_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


DTYPE_CHECK_FILE = "cpu-dtype-check.json"  # in the cache folder: one whole-step measurement per machine key


@functools.lru_cache(maxsize=1)
def cpu_bf16_check() -> Bf16Check:
    """Native-bf16 flags and the timing that confirms them (once per process; with the flags, once per machine).

    With avx512_bf16/amx_bf16: one linear layer in each dtype first; if bf16 is over SLOW_LINEAR times slower (its
    matmuls are emulated after all), that decides; otherwise `cpu_step_probe_pair` times the step in bf16 and fp32,
    their rounds alternating (seconds, the first time). Either is stored in the cache
    folder's cpu-dtype-check.json under a key of CPU model, flags, core and thread counts and torch version, and
    read from there afterwards. Without the flags bf16 is never picked: one linear layer in each dtype (well under a
    second) only sizes the slowdown an explicit bfloat16 is warned about.
    """

    flags = cpu_bf16_flags()
    if not flags:
        return Bf16Check(flags=flags, bf16_ms=_linear_ms(torch.bfloat16), fp32_ms=_linear_ms(torch.float32))
    path = cache_root() / DTYPE_CHECK_FILE
    key = _probe_cache_key(flags)
    stored: dict = {}
    with contextlib.suppress(ValueError):
        stored = read_json(path)
    stored = stored if isinstance(stored, dict) else {}
    if isinstance(stored.get(key), dict) and {"bfloat16", "float32"} <= set(stored[key]):
        rec = stored[key]
        return Bf16Check(flags, float(rec["bfloat16"]["total"]), float(rec["float32"]["total"]),
                         "linear" if rec.get("probe") == "linear" else "step", True)
    lin_bf16, lin_fp32 = _linear_ms(torch.bfloat16), _linear_ms(torch.float32)
    if lin_bf16 > SLOW_LINEAR * lin_fp32:
        # bf16 matmuls run emulated here despite the flag (kernel-ISA caps, a hypervisor hiding the instructions):
        # the whole step cannot be faster, and timing it in bf16 would take minutes
        rec = {"bfloat16": {"total": lin_bf16}, "float32": {"total": lin_fp32}, "probe": "linear"}
    else:
        log.info("model.dtype=auto: timing a scaled-down training step in bf16 and fp32 on this CPU (once per machine)")
        rec = cpu_step_probe_pair()
        release_memory()  # the probe models' buffers: training never reuses them
    stored[key] = rec
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(stored, indent=1))
    return Bf16Check(flags, rec["bfloat16"]["total"], rec["float32"]["total"], rec.get("probe", "step"), False)


SLOW_LINEAR = 2.0  # a bf16 linear layer this many times slower than fp32 means emulated bf16: no whole-step timing


def _linear_ms(dtype: torch.dtype) -> float:
    """Best of two x @ W.T ([256 x 576] input, [1536 x 576] weight, as nn.Linear runs it) after a warm-up."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 576, generator=g).to(dtype)
    w = torch.randn(1536, 576, generator=g).to(dtype)
    torch.nn.functional.linear(x, w)
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3
