"""Reliability, fourth round (issue 37), special files where a regular file is expected: a FIFO, a character device
or a folder in place of a data file, a config, or a run folder's config.yaml, decided.json or metrics.jsonl. Each
command (`train`, `train --resume`, `eval`, `config`) ends in exit 2 with one line naming the file and what it is,
never blocks (FIFO) or reads for ever (device), and writes nothing.

A FIFO gets a watchdog that opens its other end after a while: code that blocks on it then fails the test
instead of hanging the suite. The devices made here are /dev/null-like (nothing to read, so a regression shows as
a wrong message, not an exhausted machine); /dev/zero itself (endless) is read only in a child process held to a
memory limit."""
from __future__ import annotations

import os
import resource
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import FAST, REPO, cli_main, error_line, sets, snapshot, subprocess_env

KINDS = ["fifo", "device", "folder"]
WHAT = {"fifo": "FIFO", "device": "character device", "folder": "a folder"}


@pytest.fixture
def special():
    """make(path, kind): put a special file of `kind` at `path` (replacing what is there)."""
    done = threading.Event()

    def unblock(path: Path):
        if not done.wait(30):  # still waited on: open both ends, so a blocked reader or writer goes on
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
            os.close(fd)

    def make(path: Path, kind: str) -> Path:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        if kind == "fifo":
            os.mkfifo(path)
            threading.Thread(target=unblock, args=(path,), daemon=True).start()
        elif kind == "device":
            try:
                os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # what /dev/null is
            except PermissionError:
                pytest.skip("creating a device node needs CAP_MKNOD")
        else:
            path.mkdir()
        return path

    yield make
    done.set()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run stopped after its checkpoint of step 1 (no final adapter, no summary)."""
    path = tmp_path_factory.mktemp("special") / "run"
    assert cli_main("train", "--preset", "smoke", *sets(FAST + ["train.steps=2", "train.save_every=1"]),
                    "--output", str(path), "--no-progress") == 0
    shutil.rmtree(path / "adapter")
    (path / "summary.json").unlink()
    shutil.rmtree(path / "checkpoints" / "step-000002")
    return path


# ---------------------------------------------------------------------------------------------------------------
# data files and configs


@pytest.mark.parametrize("kind", KINDS)
def test_a_special_data_file_is_refused_by_train(tmp_path, capsys, special, kind):
    data = special(tmp_path / "data.jsonl", kind)
    out = tmp_path / "run"
    rc = cli_main("train", "--preset", "smoke", *sets(FAST + [f"data.dataset={data}"]), "--output", str(out),
                  "--no-progress")
    assert rc == 2
    err = error_line(capsys)
    assert str(data) in err and (WHAT[kind] in err or "directory" in err)
    assert not out.exists()


@pytest.mark.parametrize("kind", KINDS)
def test_a_special_data_file_is_refused_by_eval(run, tmp_path, capsys, special, kind):
    data = special(tmp_path / "data.jsonl", kind)
    before = snapshot(run)
    assert cli_main("eval", str(run), "--dataset", str(data), "--limit", "1") == 2
    err = error_line(capsys)
    assert str(data) in err and (WHAT[kind] in err or "directory" in err)
    assert snapshot(run) == before


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_a_fifo_as_parquet_or_arrow_data_is_refused(tmp_path, capsys, special, suffix):
    data = special(tmp_path / f"data{suffix}", "fifo")
    rc = cli_main("train", "--preset", "smoke", *sets(FAST + [f"data.dataset={data}"]), "--output",
                  str(tmp_path / "run"), "--no-progress")
    assert rc == 2 and "FIFO" in error_line(capsys)


def test_a_data_file_linked_to_dev_zero_is_refused_within_a_memory_limit(tmp_path):
    """The issue's case: an endless device behind a data file's name, read in a child process held to 2 GiB."""
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    data = tmp_path / "data.jsonl"
    data.symlink_to("/dev/zero")
    code = ("import sys; from basis_lite.config import load_config; from basis_lite.data import load_examples\n"
            "from basis_lite.errors import DataError\n"
            f"cfg = load_config('smoke', ['data.dataset={data}'])\n"
            "try:\n    load_examples(cfg.data, 'train')\nexcept DataError as e:\n    print(e); sys.exit(2)\n")

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=120, preexec_fn=limit)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "character device" in proc.stdout


@pytest.mark.parametrize("kind", KINDS)
def test_a_special_config_file_is_refused(tmp_path, capsys, special, kind):
    cfg = special(tmp_path / "my.yaml", kind)
    for command in (["config"], ["train", "--output", str(tmp_path / "run")]):
        assert cli_main(*command, "--preset", str(cfg)) == 2
        assert str(cfg) in error_line(capsys)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------------------
# a run folder's own files, on resume


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["config.yaml", "decided.json", "metrics.jsonl"])
def test_a_special_file_in_a_run_folder_stops_a_resume(run, tmp_path, capsys, special, name, kind):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    special(copy / name, kind)
    before = snapshot(copy)
    before.pop(".lock")  # its holder line (pid, time) is rewritten by a resume that takes the lock
    assert cli_main("train", "--resume", str(copy), "--no-progress") == 2
    err = error_line(capsys)
    assert name in err and WHAT[kind] in err and "not a regular file" in err
    after = snapshot(copy)
    after.pop(".lock", None)
    assert after == before
    assert (copy / name).is_dir() if kind == "folder" else not (copy / name).is_file()
