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
skipped and why; `latest` is a hint for people, and garbage in it is reported and ignored. The trainer state
(`rl.state.checkpoint_state`) is JSON plus safetensors (optimizer moments, RNG states): no pickle, so a planted file
cannot run code on `--resume`.

Using: a checkpoint that matches its manifest can still be unusable (a manifest rewritten to match). What a resume
loads is checked before anything is used (`Unusable` names the problem and `rl.state.resume_from` falls back to the
next older intact checkpoint, as for a damaged file): the adapter's tensor names, shapes and dtypes against the
model built from the config, every tensor finite, state.json nested at most `safeio.MAX_JSON_DEPTH` deep, the step
equal to the folder's and within train.steps, the RNG states settable, the optimizer moments shaped like their
parameters.
`adapter_problem` checks an adapter folder the same way for `eval`, `export` and `eapo.prior_adapter`.

Pruning (`train.keep_last`) deletes a checkpoint only when no reader pins it: `eval` and `export` hold a shared
lock on the manifest of the checkpoint they load (`runs.saved.resolve_target`).
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..faults import maybe_kill
from ..safeio import (
    MAX_JSON_DEPTH,
    atomic_write_text,
    disk_full_error,
    fsync_tree,
    inside,
    is_disk_full,
    pack_state,
    read_json,
    sha256_file,
    try_exclusive,
    unpack_state,
)

log = logging.getLogger("basis_lite")

MANIFEST = "MANIFEST.json"
STATE_JSON, STATE_TENSORS = "state.json", "state.safetensors"
NAME = re.compile(r"^step-\d{6,}$")
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


class Unusable(ValueError):
    """A checkpoint (or adapter) whose files are intact but whose content cannot be used; the message says why."""


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
        files = read_json(folder / MANIFEST, MANIFEST)["files"]
        assert isinstance(files, dict) and all(isinstance(m, dict) for m in files.values())
    except (ValueError, KeyError, TypeError, AssertionError, OSError) as e:
        return f"unreadable {MANIFEST} ({type(e).__name__})"
    for need in (STATE_JSON, STATE_TENSORS, f"adapter/{ADAPTER_CONFIG}", f"adapter/{ADAPTER_WEIGHTS}"):
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


def intact_checkpoints(run_dir: Path, quiet: bool = False):
    """The intact checkpoints of a run, newest first (a generator: each is verified when reached); every newer one
    that fails verification is logged with the reason. Nothing when `checkpoints/` leads out of the run folder."""
    ckdir = Path(run_dir) / "checkpoints"
    if not ckdir.is_dir():
        return
    if not inside(run_dir, ckdir) or ckdir.is_symlink():
        log.warning("%s is a link out of the run folder; its checkpoints are not read", ckdir)
        return
    for cand in _candidates(ckdir):
        why = verify(cand)
        if why is None:
            yield cand
        elif not quiet:
            log.warning("skipping checkpoint %s: %s", cand, why)


def latest_checkpoint(run_dir: Path, quiet: bool = False) -> Path | None:
    """The newest intact checkpoint of a run; every newer one that fails verification is logged with the reason."""
    return next(intact_checkpoints(run_dir, quiet), None)


def load_state(ckpt: Path) -> dict:
    """The trainer state of an (already verified) checkpoint: JSON + safetensors, no pickle. Unusable when it
    cannot be read (too deeply nested, not JSON, a safetensors file that does not parse, a tensor it lacks)."""
    try:
        tree = read_json(ckpt / STATE_JSON, STATE_JSON, MAX_JSON_DEPTH)
        arrays = load_file(str(ckpt / STATE_TENSORS))
        return unpack_state(tree, arrays)
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        raise Unusable(f"the trainer state does not load ({type(e).__name__}: {str(e)[:200]})") from None
    except Exception as e:  # noqa: BLE001 - safetensors' own error type
        raise Unusable(f"{STATE_TENSORS} does not load ({type(e).__name__}: {str(e)[:200]})") from None


def step_of(ckpt: Path) -> int:
    return _step_of(ckpt)


# ----------------------------------------------------------------------------------------------------------------
# content checks: what a checkpoint or an adapter folder holds, before anything is used


def load_adapter_tensors(folder: Path) -> dict:
    """The tensors of `folder`/adapter_model.safetensors, each a finite floating tensor; Unusable otherwise (a
    missing file is never looked for on the hub)."""
    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise Unusable(f"no {ADAPTER_WEIGHTS} in {folder}")
    if not inside(folder, path):
        raise Unusable(f"{path} is a link out of {folder}")
    try:
        tensors = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors' own error type
        raise Unusable(f"{ADAPTER_WEIGHTS} does not load ({type(e).__name__}: {str(e)[:200]})") from None
    if not tensors:
        raise Unusable(f"{ADAPTER_WEIGHTS} holds no tensors")
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise Unusable(f"{ADAPTER_WEIGHTS}: {name} is {t.dtype}, not a floating-point tensor")
        if not bool(torch.isfinite(t).all()):
            raise Unusable(f"{ADAPTER_WEIGHTS}: {name} holds NaN or infinite values")
    return tensors


def adapter_problem(folder: Path) -> str | None:
    """None when `folder` is a usable peft LoRA adapter folder (its config a JSON object of a LoRA adapter, its
    weights finite floating tensors, both inside the folder), else why not (one line)."""
    folder = Path(folder)
    cfg_path = folder / ADAPTER_CONFIG
    if not cfg_path.is_file():
        return f"no {ADAPTER_CONFIG}"
    if not inside(folder, cfg_path):
        return f"{ADAPTER_CONFIG} is a link out of the folder"
    try:
        conf = read_json(cfg_path, ADAPTER_CONFIG)
    except ValueError as e:
        return str(e)
    if not isinstance(conf, dict) or conf.get("peft_type") != "LORA":
        return f"{ADAPTER_CONFIG} does not describe a LoRA adapter (peft_type LORA)"
    try:
        load_adapter_tensors(folder)
    except Unusable as e:
        return str(e)
    return None


def load_peft_adapter(base, path: str | Path, is_trainable: bool = False):
    """`PeftModel.from_pretrained(base, path)` for a local adapter folder, checked first (`adapter_problem`) and
    after (the loaded weights are exactly the file's tensors, none missing): ModelError naming the folder otherwise.
    peft takes a folder without weights for a hub id; this never reaches the network."""
    from peft import PeftModel, get_peft_model_state_dict

    from ..errors import ModelError

    folder = Path(path)
    why = adapter_problem(folder)
    if why is not None:
        raise ModelError(f"adapter {folder}: not usable ({why})")
    try:
        model = PeftModel.from_pretrained(base, str(folder), is_trainable=is_trainable)
        check_adapter_tensors(load_adapter_tensors(folder), get_peft_model_state_dict(model))
    except (Unusable, RuntimeError, ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        raise ModelError(f"adapter {folder}: does not load onto the base model ({type(e).__name__}: "
                         f"{str(e)[:300]}); it must be a LoRA adapter trained on the same base (model.name)") from None
    return model


def check_adapter_tensors(tensors: dict, expected: dict) -> None:
    """Unusable unless `tensors` has exactly the names of `expected` (a peft state dict of the model built from
    the config) with the same shapes."""
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        what = (f"lacks {len(missing)} tensor(s) the model has (first {missing[0]})" if missing
                else f"has {len(extra)} tensor(s) the model does not (first {extra[0]})")
        raise Unusable(f"the adapter {what}")
    for name, ref in expected.items():
        if tuple(tensors[name].shape) != tuple(ref.shape):
            raise Unusable(f"the adapter's {name} has shape {tuple(tensors[name].shape)}, the model's "
                           f"{tuple(ref.shape)}")


def check_rng_state(state) -> None:
    """Unusable unless the RNG states can be set (tried, then the current ones put back)."""
    before = rng_state()
    try:
        set_rng_state(state)
    except Exception as e:  # noqa: BLE001 - random, numpy and torch each raise their own types
        raise Unusable(f"the RNG state cannot be set ({type(e).__name__}: {str(e)[:160]})") from None
    finally:
        set_rng_state(before)


def check_optimizer_state(sd, params: list) -> None:
    """Unusable unless `sd` is an optimizer state dict over `params`: one group of their count, moments shaped
    like their parameter, every number finite."""
    if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict) or not isinstance(sd.get("param_groups"),
                                                                                            list):
        raise Unusable("the optimizer state is not a state dict")
    ids = [i for g in sd["param_groups"] if isinstance(g, dict) for i in (g.get("params") or [])]
    if sorted(ids) != list(range(len(params))):
        raise Unusable(f"the optimizer state covers {len(ids)} parameters, the model trains {len(params)}")
    for idx, st in sd["state"].items():
        if not isinstance(idx, int) or not 0 <= idx < len(params) or not isinstance(st, dict):
            raise Unusable(f"the optimizer state has an entry {idx!r} for no parameter")
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                if v.dim() > 0 and tuple(v.shape) != tuple(params[idx].shape):
                    raise Unusable(f"the optimizer's {key} of parameter {idx} has shape {tuple(v.shape)}, the "
                                   f"parameter {tuple(params[idx].shape)}")
                if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                    raise Unusable(f"the optimizer's {key} of parameter {idx} holds NaN or infinite values")
            elif isinstance(v, float) and not math.isfinite(v):
                raise Unusable(f"the optimizer's {key} of parameter {idx} is {v}")


def check_int(value, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise Unusable(f"{name} is {value!r}, expected an integer in [{lo}, {hi}]")
    return value
