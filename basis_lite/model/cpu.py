"""What model.dtype auto reads about the CPU, without importing torch (so `basis-lite plan` can read it too).

    cpu_bf16_flags() -> ("avx512_bf16", ...)   the native-bf16 flags /proc/cpuinfo lists (empty: none, or no Linux)
    BF16_FLAGS, BF16_FLAGS_TEXT                the flags it looks for, and "avx512_bf16/amx_bf16" for messages
    STEP_PROBE                                 the shape and batch of auto's one-time bf16/fp32 step timing
                                               (model/dtypes.py: cpu_step_probe_pair)
"""
from __future__ import annotations

from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
BF16_FLAGS_TEXT = "/".join(BF16_FLAGS)  # how messages name them

# The dtype probe: the built-in SmolLM2-135M's shape (all 30 layers, its vocabulary), LoRA r=16 on every linear,
# and the default step's parts at a reduced batch, each weighted by how often the default step runs it.
STEP_PROBE = {"hidden": 576, "intermediate": 1536, "layers": 30, "heads": 9, "kv_heads": 3, "vocab": 49152,
              "lora_r": 16, "prefill": (16, 48), "decode_steps": 4, "train": (4, 96), "completion": 48,
              "weights": {"prefill": 2.0, "decode": 47 / 4 * 2.0, "train": 8.0}, "version": 2}


def cpu_bf16_flags() -> tuple[str, ...]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return tuple(f for f in BF16_FLAGS if f in flags)
