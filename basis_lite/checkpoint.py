"""Verified checkpoints, exact resume, and nothing loaded that can run code.

Layout of a run folder:

    RUN_DIR/.lock                    held (flock) by the one training process writing the folder
    RUN_DIR/config.yaml              resolved config
    RUN_DIR/metrics.jsonl            one line per step (and eval lines)
    RUN_DIR/checkpoints/step-000010/ adapter/ (peft), state.json + state.safetensors, config.yaml, MANIFEST.json
    RUN_DIR/checkpoints/latest       name of the newest checkpoint
    RUN_DIR/adapter/                 the final adapter (peft format)

Writing: everything goes into `checkpoints/.tmp-step-N`, every file is fsynced, `MANIFEST.json` (size and sha256
of every other file) is written last, then the folder is renamed into place and `latest` replaced atomically.

Reading: a checkpoint counts only when its manifest is there and every file matches it. `latest_checkpoint` returns
the newest intact checkpoint inside `checkpoints/` (symlinks out of it are not followed), logging each newer one it
skipped and why; `latest` is a hint for people, and garbage in it is reported and ignored. The trainer state is JSON plus safetensors (optimizer moments,
RNG states): no pickle, so a planted file cannot run code on `--resume`.

Pruning (`train.keep_last`) deletes a checkpoint only when no reader pins it: `eval` and `export` hold a shared
lock on the manifest of the checkpoint they load (`runs.resolve_target`).
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .faults import maybe_kill
from .safeio import (
    atomic_write_text,
    disk_full_error,
    fsync_tree,
    inside,
    is_disk_full,
    pack_state,
    sha256_file,
    try_exclusive,
    unpack_state,
)

log = logging.getLogger("basis_lite")

MANIFEST = "MANIFEST.json"
STATE_JSON, STATE_TENSORS = "state.json", "state.safetensors"
NAME = re.compile(r"^step-\d{6,}$")


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files}
    atomic_write_text(folder / MANIFEST, json.dumps({"files": entries}, indent=1))


def verify(folder: Path) -> str | None:
    """None when `folder` is an intact checkpoint, else why not (one line)."""
    if not folder.is_dir():
        return "missing"
    if not (folder / MANIFEST).is_file():
        if (folder / "state.pt").exists():
            return "written by an older basis-lite (state.pt is a pickle, which is never loaded)"
        return f"no {MANIFEST} (the write did not finish)"
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        assert isinstance(files, dict)
    except (ValueError, KeyError, TypeError, AssertionError, OSError) as e:
        return f"unreadable {MANIFEST} ({type(e).__name__})"
    for need in (STATE_JSON, STATE_TENSORS, "adapter/adapter_config.json"):
        if need not in files:
            return f"{MANIFEST} does not list {need}"
    for rel, meta in files.items():
        p = folder / rel
        if ".." in Path(rel).parts or not inside(folder, p):
            return f"{MANIFEST} names a path outside the checkpoint: {rel!r}"
        if not p.is_file():
            return f"{rel} is missing"
        size = p.stat().st_size
        if size != meta.get("bytes"):
            return f"{rel} has {size} bytes, the manifest says {meta.get('bytes')}"
        if sha256_file(p) != meta.get("sha256"):
            return f"{rel} does not match its sha256 in the manifest"
    return None


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
        tree, arrays = pack_state(state)
        save_file({k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in arrays.items()},
                  tmp / STATE_TENSORS)
        (tmp / STATE_JSON).write_text(json.dumps(tree))
        (tmp / "config.yaml").write_text(config_text)
        fsync_tree(tmp)
        maybe_kill("checkpoint", step)
        write_manifest(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(ckdir / "latest", name)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # frees the space; the previous checkpoint is untouched
        if is_disk_full(e, ckdir):
            prev = latest_checkpoint(run_dir, quiet=True)
            kept = (f"The last good checkpoint {prev.name} is kept" if prev is not None
                    else "There is no earlier checkpoint")
            raise disk_full_error(f"checkpoint {name}", ckdir, e,
                                  f"{kept}. Free some space, then continue with `basis-lite train --resume "
                                  f"{run_dir}`") from e
        raise
    prune(ckdir, keep_last)
    return final


def prune(ckdir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints, except those a reader has pinned."""
    complete = sorted((p for p in ckdir.glob("step-*") if NAME.match(p.name) and (p / MANIFEST).exists()),
                      key=_step_of)
    for old in complete[:-keep_last] if keep_last > 0 else []:
        fd = try_exclusive(old / MANIFEST)
        if fd is None:
            log.info("checkpoint %s is being read by another process; it is removed at a later save", old.name)
            continue
        try:
            shutil.rmtree(old, ignore_errors=True)
        finally:
            if fd >= 0:
                os.close(fd)


def _step_of(p: Path) -> int:
    return int(p.name.split("-", 1)[1])


def _candidates(ckdir: Path) -> list[Path]:
    """Checkpoint folders inside `checkpoints/`, newest first. `latest` is a hint for people and older readers:
    the newest intact folder wins whatever it says, and garbage in it is reported and ignored."""
    latest = ckdir / "latest"
    if latest.is_file():
        text = latest.read_text(errors="replace").strip()
        if not (NAME.match(text) and inside(ckdir, ckdir / text)):
            log.warning("%s holds %r, not a checkpoint name; ignored", latest, text[:80])
    return sorted((p for p in ckdir.glob("step-*") if NAME.match(p.name) and p.is_dir() and inside(ckdir, p)),
                  key=_step_of, reverse=True)


def latest_checkpoint(run_dir: Path, quiet: bool = False) -> Path | None:
    """The newest intact checkpoint of a run; every newer one that fails verification is logged with the reason."""
    ckdir = Path(run_dir) / "checkpoints"
    if not ckdir.is_dir():
        return None
    for cand in _candidates(ckdir):
        why = verify(cand)
        if why is None:
            return cand
        if not quiet:
            log.warning("skipping checkpoint %s: %s", cand, why)
    return None


def load_state(ckpt: Path) -> dict:
    """The trainer state of an (already verified) checkpoint: JSON + safetensors, no pickle."""
    tree = json.loads((ckpt / STATE_JSON).read_text())
    return unpack_state(tree, load_file(str(ckpt / STATE_TENSORS)))
