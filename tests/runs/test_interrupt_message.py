"""Reliability, fourth round (issue 37): a run stopped by SIGTERM while setting up a new folder says the folder is
removed (it is), instead of pointing at it for a resume."""
from __future__ import annotations

import os
import signal

from conftest import FAST, cli_main, sets


def test_sigterm_while_setting_up_a_new_run_says_its_folder_is_removed(tmp_path, capsys, monkeypatch):
    import basis_lite.trainer as trainer

    def build_policy(*args, **kwargs):  # a real SIGTERM, delivered while the model would load
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(trainer, "build_policy", build_policy)
    handler = signal.getsignal(signal.SIGTERM)
    run = tmp_path / "run"
    try:
        rc = cli_main("train", "--preset", "smoke", *sets(FAST), "--output", str(run), "--no-progress")
    finally:
        signal.signal(signal.SIGTERM, handler)
    err = capsys.readouterr().err
    assert rc == 143, err[-2000:]
    assert "SIGTERM" in err and "removed" in err and "--resume" not in err
    assert not run.exists()
