"""Atomic checkpoints and exact resume.

Layout of a run folder:

    RUN_DIR/config.yaml              resolved config
    RUN_DIR/metrics.jsonl            one line per step (and eval lines)
    RUN_DIR/checkpoints/step-000010/ adapter/ (peft), state.pt, config.yaml, COMPLETE
    RUN_DIR/checkpoints/latest       name of the newest complete checkpoint
    RUN_DIR/adapter/                 the final adapter (peft format)

A checkpoint is written into `checkpoints/.tmp-step-N`, every file fsynced, the `COMPLETE` marker written last,
then the folder is renamed into place and `latest` replaced atomically. A crash (SIGKILL, full disk) at any point
leaves the previous checkpoint valid: a half-written folder never has the name or the marker a reader looks for.
"""
from __future__ import annotations

import errno
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from .errors import DiskFullError
from .faults import maybe_kill

MARKER = "COMPLETE"


def fsync_dir(path: Path) -> None:
    """fsync a folder entry (best effort: some filesystems refuse it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file and folder below `path`, so a rename that publishes it is durable."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(run_dir: Path, step: int, model, state: dict, config_text: str, keep_last: int = 2) -> Path:
    """Write checkpoint `step` atomically; `state` holds optimizer/scheduler/rng/data/estimator state."""
    ckdir = Path(run_dir) / "checkpoints"
    ckdir.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    tmp = ckdir / f".tmp-{name}"
    final = ckdir / name
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        model.save_pretrained(tmp / "adapter")
        torch.save(state, tmp / "state.pt")
        (tmp / "config.yaml").write_text(config_text)
        fsync_tree(tmp)
        maybe_kill("checkpoint", step)
        atomic_write_text(tmp / MARKER, str(step))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(ckdir / "latest", name)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # frees the space; the previous checkpoint is untouched
        if _is_disk_full(e):

            prev = latest_checkpoint(run_dir)
            kept = (f"the last good checkpoint {prev.name} is kept" if prev is not None
                    else "there is no earlier checkpoint")
            raise DiskFullError(f"no space left on the disk while writing checkpoint {name} in {ckdir} ({e}); "
                                f"{kept}. Free some space, then continue with `basis-lite train --resume "
                                f"{run_dir}`") from e
        raise
    complete = sorted(p for p in ckdir.glob("step-*") if (p / MARKER).exists())
    for old in complete[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _is_disk_full(e: BaseException) -> bool:
    """ENOSPC/EDQUOT, also when wrapped (safetensors and torch's zip writer re-raise it as their own errors)."""
    for _ in range(8):  # a bounded walk down the cause chain
        if e is None:
            return False
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(s in str(e) for s in ("No space left on device", "StorageFull", "Disk quota exceeded")):
            return True
        e = e.__cause__ or e.__context__
    return False


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run (falls back to scanning when `latest` is missing or stale)."""
    ckdir = Path(run_dir) / "checkpoints"
    latest = ckdir / "latest"
    if latest.exists():
        cand = ckdir / latest.read_text().strip()
        if (cand / MARKER).exists():
            return cand
    complete = sorted(p for p in ckdir.glob("step-*") if (p / MARKER).exists())
    return complete[-1] if complete else None


def load_state(ckpt: Path) -> dict:
    return torch.load(ckpt / "state.pt", map_location="cpu", weights_only=False)
