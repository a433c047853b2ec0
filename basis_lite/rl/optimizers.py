"""Optimizers by name: the torch-free table that `train.optimizer` and `basis-lite plan` read. Imports no torch.

Each optimizer's function sits in rl/update.py under ``@optimizer("name")``, which binds it to its row here; the
config's choices are ``auto`` and these names, and ``auto`` is decided by ``resolve_optimizer`` only.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OptimizerSpec", "OPTIMIZERS", "optimizer_names", "resolve_optimizer", "optimizer_help"]


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer: its name, what it is, and its state in bytes per trainable parameter (for the plan)."""

    name: str
    description: str
    state_bytes: float


OPTIMIZERS = {s.name: s for s in (
    OptimizerSpec("adamw", "torch AdamW", 8.0),  # two fp32 moments
    OptimizerSpec("adamw8bit", "bitsandbytes AdamW8bit", 2.0),  # two 8-bit moments (+ a negligible per-block scale)
)}


def optimizer_names() -> tuple:
    """The values train.optimizer accepts."""
    return ("auto", *OPTIMIZERS)


def resolve_optimizer(name: str, device_type: str) -> str:
    """train.optimizer with auto decided: adamw8bit on CUDA, adamw elsewhere."""
    if name != "auto":
        return name
    return "adamw8bit" if device_type == "cuda" else "adamw"


def optimizer_help() -> str:
    cuda, other = (OPTIMIZERS[resolve_optimizer("auto", d)].description for d in ("cuda", "cpu"))
    return f"auto ({cuda} on CUDA, {other} elsewhere) | " + " | ".join(OPTIMIZERS)
