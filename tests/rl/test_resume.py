"""Exact resume on the CPU (issue 3 item 2): a run SIGKILLed anywhere and resumed with `train --resume` ends with
the same adapter and the same per-step metrics as an uninterrupted run, one metrics line per step."""
from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
from conftest import (
    REPO,
    VARIED,
    adapter_weights,
    cli_cmd,
    cli_main,
    read_lines,
    sets,
    snapshot,
    step_records,
    subprocess_env,
)

STEPS = 4
KEEP = 2
OVERRIDES = VARIED + [f"train.steps={STEPS}", "train.save_every=1", f"train.keep_last={KEEP}", "train.batch_size=4",
                      "train.micro_batch_size=2"]
KILL_POINTS = ["generation:1", "generation:3", "optimizer:3", "checkpoint:2"]
COMPARED = ("reward_mean", "loss", "baseline_mean", "accuracy", "completion_len", "advantage_std", "grad_norm", "lr")


def _train_args(run):
    return ["train", "--preset", "smoke", *sets(OVERRIDES), "--output", str(run), "--no-progress"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (in-process)."""
    run = tmp_path_factory.mktemp("reference") / "run"
    assert cli_main(*_train_args(run)) == 0
    return run


@pytest.fixture(scope="module")
def killed(tmp_path_factory, reference):
    """One run per kill point, started together in subprocesses, each SIGKILLing itself: {point: (run, proc)}."""
    root = tmp_path_factory.mktemp("killed")
    procs = {}
    for point in KILL_POINTS:
        run = root / point.replace(":", "-")
        procs[point] = (run, subprocess.Popen(cli_cmd(*_train_args(run)), cwd=REPO,
                                              env=subprocess_env(BASIS_LITE_KILL_AT=point),
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = {}
    for point, (run, p) in procs.items():
        stdout, stderr = p.communicate(timeout=240)
        out[point] = (run, p.returncode, stderr)
    return out


def test_reference_run_keeps_last_k_checkpoints(reference):
    recs = step_records(reference)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert all(not r["skipped"] and r["advantage_std"] > 0 for r in recs)  # real updates at every step
    ck = reference / "checkpoints"
    kept = sorted(p.name for p in ck.iterdir() if p.name.startswith("step-"))
    assert kept == [f"step-{s:06d}" for s in range(STEPS - KEEP + 1, STEPS + 1)]
    assert all((ck / k / "MANIFEST.json").exists() for k in kept)
    assert not list(ck.glob(".tmp-*"))


@pytest.mark.parametrize("point", KILL_POINTS)
def test_killed_run_resumes_exactly(reference, killed, point, capsys):
    from basis_lite.runs import checkpoint as ckpt

    run, rc, stderr = killed[point]
    assert rc == -9, f"expected SIGKILL at {point}, got rc {rc}:\n{stderr[-3000:]}"
    where, step = point.split(":")
    step = int(step)
    assert not (run / "adapter").exists()  # it really died before the end
    last = ckpt.latest_checkpoint(run)
    ck = run / "checkpoints"
    if where == "checkpoint":
        # killed between writing the files and the manifest: a half-written folder, not a checkpoint
        tmp = ck / f".tmp-step-{step:06d}"
        assert tmp.is_dir() and (tmp / "state.safetensors").exists() and not (tmp / "MANIFEST.json").exists()
        assert not (ck / f"step-{step:06d}").exists()
        assert last.name == f"step-{step - 1:06d}"
    elif step == 1:
        assert last is None  # stopped before the first checkpoint: resuming starts it again from step 0
    else:
        assert last.name == f"step-{step - 1:06d}"
    # the metrics of the steps after the checkpoint are in the file now and must not stay twice after resuming
    assert max((r["step"] for r in step_records(run)), default=0) >= (last_step(last) if last else 0)

    assert cli_main("train", "--resume", str(run), "--no-progress") == 0
    assert "adapter saved to" in capsys.readouterr().out

    ref, got = step_records(reference), step_records(run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # exactly one line per step
    for a, b in zip(ref, got):
        for k in COMPARED:
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9), (a["step"], k, a[k], b[k])
    assert [e["event"] for e in read_lines(run) if "event" in e] == ["eval", "eval_final"]
    wr, wg = adapter_weights(reference / "adapter"), adapter_weights(run / "adapter")
    assert wr.keys() == wg.keys()
    for k in wr:
        torch.testing.assert_close(wg[k], wr[k], atol=1e-6, rtol=0, msg=k)
    assert not list(ck.glob(".tmp-*"))  # the half-written folder was replaced by the redone checkpoint
    assert sorted(p.name for p in ck.glob("step-*")) == [f"step-{s:06d}" for s in range(STEPS - KEEP + 1, STEPS + 1)]


def last_step(ck_path) -> int:
    return int(ck_path.name.split("-")[1])


def test_latest_pointer_missing_or_stale_falls_back_to_scanning(reference, tmp_path):
    from basis_lite.runs import checkpoint as ckpt

    run = tmp_path / "copy"
    shutil.copytree(reference, run)
    ck = run / "checkpoints"
    (ck / "latest").write_text("step-000099\n")  # stale
    assert ckpt.latest_checkpoint(run) == ck / f"step-{STEPS:06d}"
    (ck / "latest").unlink()
    (ck / f"step-{STEPS:06d}" / "MANIFEST.json").unlink()  # an incomplete newest folder is not a checkpoint
    assert ckpt.latest_checkpoint(run) == ck / f"step-{STEPS - 1:06d}"


def test_resume_of_a_folder_that_is_no_run_is_a_user_error(tmp_path, capsys):
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    assert cli_main("train", "--resume", str(empty)) == 2
    assert "no config.yaml" in capsys.readouterr().err
    assert list(empty.iterdir()) == []


def test_resume_refuses_overrides(reference, tmp_path, capsys):
    run = tmp_path / "copy"
    shutil.copytree(reference, run)
    before = snapshot(run)
    assert cli_main("train", "--resume", str(run), "--set", "train.steps=9") == 2
    assert "--set cannot change a resumed run" in capsys.readouterr().err
    assert snapshot(run) == before
