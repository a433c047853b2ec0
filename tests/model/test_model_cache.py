"""Reliability, fourth round (issue 37), the model cache heals: a built-in model's converted folder is checked
against the manifest its conversion wrote (sizes, sha256); a damaged one (truncated weights, other shapes, a deleted
config, a truncated tokenizer, an unknown model type, a conversion that did not finish) is built again, and a cache
that cannot be written (a file in its place, a read-only mount) is exit 2 naming it. On builtin:tiny-random, whose
rebuild is instant; SmolLM2's conversion goes through the same `cached_model`."""
from __future__ import annotations

import json
import logging
import subprocess

import pytest
import torch
from conftest import FAST, cli_main, error_line, sets
from safetensors.torch import load_file, save_file

from basis_lite.config import load_config
from basis_lite.model.loading import CACHE_MANIFEST, builtin_tiny_random_dir, cache_problem, load_policy


def _truncate(folder, name):
    data = (folder / name).read_bytes()
    (folder / name).write_bytes(data[: len(data) // 3])


def _other_shapes(folder, name):
    tensors = load_file(str(folder / name))
    save_file({k: t[..., : max(1, t.shape[-1] // 2)].contiguous() for k, t in tensors.items()}, str(folder / name))


def _edit_config(folder, name):
    cfg = json.loads((folder / name).read_text())
    cfg["model_type"] = "no_such_model_type"
    (folder / name).write_text(json.dumps(cfg))


DAMAGE = {
    "truncated weights": ("model.safetensors", _truncate),
    "other shapes": ("model.safetensors", _other_shapes),
    "deleted config": ("config.json", lambda folder, name: (folder / name).unlink()),
    "truncated tokenizer": ("tokenizer.json", _truncate),
    "unknown model type": ("config.json", _edit_config),
    "unfinished conversion": (CACHE_MANIFEST, lambda folder, name: (folder / name).unlink()),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_cached_model_is_built_again(tmp_path, caplog, damage):
    folder = builtin_tiny_random_dir(str(tmp_path))
    weights = {k: t.clone() for k, t in load_file(str(folder / "model.safetensors")).items()}  # copies: the file is rewritten in place
    name, hurt = DAMAGE[damage]
    hurt(folder, name)
    assert cache_problem(folder) is not None
    cfg = load_config("smoke", [f"model.cache_dir={tmp_path}", "model.dtype=float32"])
    with caplog.at_level(logging.WARNING, "basis_lite"):
        model, tok = load_policy(cfg, torch.device("cpu"), torch.float32)  # what every command loads
    assert "damaged" in caplog.text and str(folder) in caplog.text
    assert cache_problem(folder) is None
    again = load_file(str(folder / "model.safetensors"))
    assert again.keys() == weights.keys() and all(torch.equal(again[k], weights[k]) for k in weights)
    assert tok("What is 1 + 1?").input_ids
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary or damaged copy left


def test_a_copied_cache_is_hashed_once_then_trusted(tmp_path):
    """A folder whose files were touched (copied without their times) is checked by content, and its manifest
    takes the new times, so later loads check sizes only."""
    folder = builtin_tiny_random_dir(str(tmp_path))
    for p in folder.iterdir():
        p.touch()
    assert cache_problem(folder) is None
    files = json.loads((folder / CACHE_MANIFEST).read_text())["files"]
    assert all(files[p.name]["mtime_ns"] == p.stat().st_mtime_ns for p in folder.iterdir() if p.name in files)


def test_a_cache_path_that_is_a_file_is_exit_2_naming_it(tmp_path, capsys):
    cache = tmp_path / "cache"
    cache.write_text("not a folder")
    assert cli_main("train", "--preset", "smoke", *sets(FAST + [f"model.cache_dir={cache}"]), "--output",
                    str(tmp_path / "run"), "--no-progress") == 2
    err = error_line(capsys)
    assert str(cache) in err and "model.cache_dir" in err
    assert not (tmp_path / "run").exists()


def test_a_read_only_cache_is_exit_2_naming_it(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()})")
    try:
        assert cli_main("train", "--preset", "smoke", *sets(FAST + [f"model.cache_dir={ro}"]), "--output",
                        str(tmp_path / "run"), "--no-progress") == 2
        err = error_line(capsys)
        assert str(ro) in err and "Read-only" in err
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)
    assert not (tmp_path / "run").exists()
