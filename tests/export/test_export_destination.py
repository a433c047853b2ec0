"""Reliability, fourth round (issue 37), export destinations checked before any work: a symbolic link, a read-only
place, or a place that cannot exist (under a regular file) given as `--out` is exit 2 naming it, before the run's
config is read, the model loaded or a merge started, for every kind of export."""
from __future__ import annotations

import subprocess

import pytest
from conftest import FAST, cli_main, sets

MODES = {"adapter": [], "merged": ["--merged"], "gguf": ["--gguf", "q8_0"]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("dest") / "run"
    assert cli_main("train", "--preset", "smoke", *sets(FAST + ["train.steps=1"]), "--output", str(path),
                    "--no-progress") == 0
    return path


def _destination(tmp_path, kind):
    if kind == "link to an empty folder":
        (tmp_path / "real").mkdir()
        (tmp_path / "out").symlink_to(tmp_path / "real")
        return tmp_path / "out", "symbolic link"
    if kind == "dangling link":
        (tmp_path / "out").symlink_to(tmp_path / "nowhere")
        return tmp_path / "out", "symbolic link"
    if kind == "under a file":
        (tmp_path / "file").write_text("x")
        return tmp_path / "file" / "out", "cannot write there"
    ro = tmp_path / "ro"
    ro.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()})")
    return ro / "out", "Read-only"


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kind", ["link to an empty folder", "dangling link", "under a file", "read-only"])
def test_a_bad_destination_is_refused_before_any_work(run, tmp_path, capsys, monkeypatch, kind, mode):
    import basis_lite.export.hf as export_hf

    monkeypatch.setattr(export_hf, "load_run_config", lambda *a, **k: pytest.fail("the export started"))
    out, words = _destination(tmp_path, kind)
    try:
        assert cli_main("export", str(run), "--out", str(out), *MODES[mode]) == 2
    finally:
        if kind == "read-only":
            subprocess.run(["umount", str(tmp_path / "ro")], capture_output=True)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
    assert "--out" in line and str(out) in line and words in line
    if kind == "link to an empty folder":
        assert list((tmp_path / "real").iterdir()) == []
