"""Runs nothing can corrupt (issue 15): one writer per run folder, no pickle loaded from a run folder, damaged
checkpoints skipped, a real full disk (a small tmpfs), a SIGTERM that says what it kept, resume of a finished run
and of an edited config. Real files, real signals, real filesystems."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, VARIED, cli_cmd, cli_main, read_lines, sets, step_records, subprocess_env

from basis_lite.runs import checkpoint as ckpt
from basis_lite.safeio import RunLock, pack_state, unpack_state

OVERRIDES = VARIED + ["train.steps=3", "train.save_every=1", "train.keep_last=3", "train.batch_size=4",
                      "train.micro_batch_size=2"]


def _train(run, *extra):
    return cli_main("train", "--preset", "smoke", *sets(OVERRIDES + list(extra)), "--output", str(run), "--no-progress")


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    run = tmp_path_factory.mktemp("safety") / "run"
    assert _train(run) == 0
    return run


def test_second_writer_is_refused_naming_the_holder(tmp_path, capsys):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from basis_lite.safeio import RunLock; "
                               f"RunLock({str(run)!r}).acquire(); print('held', flush=True); time.sleep(60)"],
                              cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert _train(run) == 2
        err = capsys.readouterr().err
        assert "in use by another basis-lite process" in err and f"pid {holder.pid}" in err
        assert not (run / "config.yaml").exists() and not (run / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder died: the kernel dropped its flock, so the next writer takes the stale lock over
    assert "pid" in (run / ".lock").read_text()
    with RunLock(run):
        assert f"pid {os.getpid()}" in (run / ".lock").read_text()


def test_default_folders_are_unique_within_one_second(tmp_path, monkeypatch):
    from basis_lite.config import load_config
    from basis_lite.runs.folder import claim_run_dir

    monkeypatch.chdir(tmp_path)
    cfg = load_config("smoke", OVERRIDES)
    dirs = {claim_run_dir(cfg, None, False)[0] for _ in range(3)}
    assert len(dirs) == 3 and all(d.is_dir() for d in dirs)


def test_pickle_is_never_loaded_and_latest_cannot_point_outside(finished, tmp_path, caplog):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    ck = run / "checkpoints"
    marker = tmp_path / "pwned"
    planted = ck / "step-000009"
    planted.mkdir()
    (planted / "state.pt").write_bytes(
        b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")  # a pickle that runs a shell command
    (ck / "latest").write_text("../../../../etc")
    assert ckpt.latest_checkpoint(run) == ck / "step-000003"
    assert "step-000009" in caplog.text and "pickle" in caplog.text and "not a checkpoint name" in caplog.text
    state = ckpt.load_state(ck / "step-000003")
    assert state["step"] == 3 and not marker.exists()


def test_state_round_trips_without_pickle():
    import numpy as np
    import torch

    state = {"step": 3, "rng": {"np": np.random.get_state(), "torch": torch.get_rng_state()},
             "opt": {0: {"m": torch.ones(2)}}, "pairs": (1, [2.5, None]), "__odd": "x"}
    tree, arrays = pack_state(state)
    json.dumps(tree)  # the structure is plain JSON
    back = unpack_state(json.loads(json.dumps(tree)), {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v)
                                                       for k, v in arrays.items()})
    assert back["step"] == 3 and back["pairs"] == (1, [2.5, None]) and back["__odd"] == "x"
    assert torch.equal(back["opt"][0]["m"], torch.ones(2)) and (back["rng"]["np"][1] == state["rng"]["np"][1]).all()


@pytest.mark.parametrize("damage", ["truncate", "delete", "flip"])
def test_damaged_newest_checkpoint_falls_back_and_resumes_exactly(finished, tmp_path, damage, caplog):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    for p in (run / "adapter", run / "summary.json"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()  # as if it stopped before the end
    newest = run / "checkpoints" / "step-000003"
    f = newest / "state.safetensors"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:100])
    elif damage == "delete":
        (newest / "adapter" / "adapter_model.safetensors").unlink()
    else:
        data = bytearray(f.read_bytes())
        data[-1] ^= 1
        f.write_bytes(bytes(data))
    assert ckpt.latest_checkpoint(run) == run / "checkpoints" / "step-000002"
    assert "skipping checkpoint" in caplog.text and "step-000003" in caplog.text
    assert cli_main("train", "--resume", str(run), "--no-progress") == 0
    ref, got = step_records(finished), step_records(run)
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(ref, got):
        assert a["reward_mean"] == pytest.approx(b["reward_mean"]) and a["loss"] == pytest.approx(b["loss"])


def test_resuming_a_finished_run_adds_nothing(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = (run / "metrics.jsonl").read_text()
    assert cli_main("train", "--resume", str(run), "--no-progress") == 0
    assert (run / "metrics.jsonl").read_text() == before
    assert [e["event"] for e in read_lines(run) if "event" in e].count("eval_final") == 1


def test_edited_config_is_refused_on_resume(finished, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    cfg = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(cfg.replace("steps: 3", "steps: 5"))
    assert cli_main("train", "--resume", str(run), "--no-progress") == 2
    assert "train.steps: 3 -> 5" in capsys.readouterr().err


def test_sigterm_names_the_folder_and_what_it_kept(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(cli_cmd("train", "--preset", "smoke", *sets(OVERRIDES + ["train.steps=200"]),
                                    "--output", str(run), "--no-progress"),
                            cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while ckpt.latest_checkpoint(run, quiet=True) is None and time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert "stopped by SIGTERM" in err and str(run) in err and "--resume" in err and "RUN_DIR" not in err
    assert ckpt.latest_checkpoint(run) is not None


def _mount_tmpfs(path, size):
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()})")


def test_real_full_disk_exits_2_and_keeps_what_was_good(tmp_path):
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "300k")  # room for the config, metrics and about one checkpoint of the tiny model
    try:
        run = disk / "run"
        proc = subprocess.run(cli_cmd("train", "--preset", "smoke", *sets(OVERRIDES + ["train.steps=30"]),
                                      "--output", str(run), "--no-progress"),
                              cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 2, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "no space left" in errors[0], proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        assert not list((run / "checkpoints").glob(".tmp-*")) if (run / "checkpoints").exists() else True
        assert not (run / ".tmp-adapter").exists()
        last = ckpt.latest_checkpoint(run)
        if last is not None:
            assert ckpt.verify(last) is None
        lines = (run / "metrics.jsonl").read_text().splitlines()
        assert all(json.loads(x) for x in lines)  # every line that is there is whole
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
