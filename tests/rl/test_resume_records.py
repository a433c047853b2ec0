"""Reliability, fourth round (issue 37), what a resume verifies: the run-time decisions come from the checkpoint's
own record (covered by its manifest), and a decided.json changed after the run started is refused naming the key;
a record no run writes (float16 on a CPU) is refused; the data fingerprint covers everything that reaches a prompt
(a conversation's system message too); `--preset` and `--output` cannot change a resumed run. Real runs of the tiny
model; nothing is written by a refused resume."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import FAST, SMALL, cli_main, error_line, sets, snapshot, step_records

OVERRIDES = FAST + ["train.steps=2", "train.save_every=1", "train.keep_last=2"]
# each stored decision, changed to another value a run could have stored
TAMPERED = {"dtype": "float16", "threads": 2, "rng": "per_prompt", "device": "cuda", "backend": "unsloth"}


def _unfinished(run):
    shutil.rmtree(run / "adapter")
    (run / "summary.json").unlink()
    return run


def _without_lock(snap: dict) -> dict:
    snap.pop(".lock", None)  # its holder line (pid, time) is rewritten by a resume that takes the lock
    return snap


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A 2-step run as if killed after its last checkpoint."""
    run = tmp_path_factory.mktemp("records") / "run"
    assert cli_main("train", "--preset", "smoke", *sets(OVERRIDES), "--output", str(run), "--no-progress") == 0
    return _unfinished(run)


@pytest.mark.parametrize("key", sorted(TAMPERED))
def test_a_decided_json_changed_after_the_start_is_refused_naming_the_key(stopped, tmp_path, capsys, key):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    decided = json.loads((run / "decided.json").read_text())
    assert decided[key] != TAMPERED[key]
    decided[key] = TAMPERED[key]
    (run / "decided.json").write_text(json.dumps(decided))
    before = _without_lock(snapshot(run))
    assert cli_main("train", "--resume", str(run), "--no-progress") == 2
    err = error_line(capsys)
    assert f"{key}={TAMPERED[key]}" in err and "step-000002" in err and "decided.json" in err
    assert _without_lock(snapshot(run)) == before


def test_without_decided_json_the_checkpoint_record_is_used(stopped, tmp_path, caplog):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    (run / "decided.json").unlink()
    shutil.rmtree(run / "checkpoints" / "step-000002")
    assert cli_main("train", "--resume", str(run), "--no-progress") == 0
    assert [r["step"] for r in step_records(run)] == [1, 2]
    assert json.loads((run / "decided.json").read_text())["dtype"] == "float32"


def test_a_record_no_run_writes_is_refused_without_a_checkpoint(tmp_path, monkeypatch, capsys):
    """float16 on a CPU: model.dtype auto never chooses it there. The run stopped before its first checkpoint, so
    decided.json is the only record."""
    import basis_lite.runtime as runtime

    monkeypatch.setattr(runtime, "resolve_dtype", lambda name, device: torch.float32 if name == "auto" else
                        getattr(torch, name))  # the timing behind auto (it depends on the CPU's load)
    run = tmp_path / "run"
    overrides = [o for o in OVERRIDES if not o.startswith("model.dtype")] + ["model.dtype=auto"]
    assert cli_main("train", "--preset", "smoke", *sets(overrides), "--output", str(run), "--no-progress") == 0
    _unfinished(run)
    shutil.rmtree(run / "checkpoints")
    decided = json.loads((run / "decided.json").read_text())
    (run / "decided.json").write_text(json.dumps({**decided, "dtype": "float16"}))
    before = _without_lock(snapshot(run))
    assert cli_main("train", "--resume", str(run), "--no-progress") == 2
    err = error_line(capsys)
    assert "decided.json records dtype=float16" in err and "cpu" in err
    assert _without_lock(snapshot(run)) == before




def _conversations(path, system: str):
    rows = [{"prompt": [{"role": "system", "content": system}, {"role": "user", "content": f"What is {i} + 3?"}],
             "solution": str(i + 3)} for i in range(24)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("what", ["system message", "question"])
def test_a_conversation_edited_between_kill_and_resume_is_refused(tmp_path, capsys, what):
    data = _conversations(tmp_path / "conv.jsonl", "You are a careful calculator.")
    run = tmp_path / "run"
    overrides = SMALL + ["model.dtype=float32", f"data.dataset={data}", "train.steps=2", "train.save_every=1"]
    assert cli_main("train", "--preset", "smoke", *sets(overrides), "--output", str(run), "--no-progress") == 0
    _unfinished(run)
    if what == "system message":
        _conversations(data, "You are a careless calculator.")
    else:
        data.write_text(data.read_text().replace(" + 3?", " plus 3?"))
    before = _without_lock(snapshot(run))
    assert cli_main("train", "--resume", str(run), "--no-progress") == 2
    err = error_line(capsys)
    assert str(data) in err and "changed since the checkpoint" in err
    assert _without_lock(snapshot(run)) == before


@pytest.mark.parametrize("option", ["--preset", "--output"])
def test_preset_and_output_cannot_change_a_resumed_run(stopped, tmp_path, capsys, option):
    before = snapshot(stopped)
    value = "smoke" if option == "--preset" else str(tmp_path / "elsewhere")
    assert cli_main("train", "--resume", str(stopped), option, value, "--no-progress") == 2
    err = error_line(capsys)
    assert option in err and "resumed run" in err
    assert snapshot(stopped) == before and not (tmp_path / "elsewhere").exists()
