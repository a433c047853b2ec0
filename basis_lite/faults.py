"""Test-only fault injection: `BASIS_LITE_KILL_AT=point:step` makes the process SIGKILL itself at that point.

Points: `generation` (rollouts done, before the update), `optimizer` (gradients accumulated, before
optimizer.step), `checkpoint` (checkpoint files written to the temporary folder, before the rename). The
kill-and-resume tests use it to prove that a run killed anywhere resumes to the same weights. Under torchrun,
`BASIS_LITE_KILL_RANK=r` limits the kill to rank r (every rank otherwise). Unset, it costs one environment lookup per
call.
"""
from __future__ import annotations

import os
import signal


def maybe_kill(point: str, step: int) -> None:
    if os.environ.get("BASIS_LITE_KILL_AT") == f"{point}:{step}":
        rank = os.environ.get("BASIS_LITE_KILL_RANK")
        if rank is None or rank == os.environ.get("RANK", "0"):
            os.kill(os.getpid(), signal.SIGKILL)
