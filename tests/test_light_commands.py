"""`basis-lite presets`, `config`, `--version`, `plan` and `plot` start without importing torch (nor anything that
imports it).

Each command runs in a fresh interpreter through `basis_lite.cli.main`, which then reports whether torch was
imported. The command must succeed and torch must not be in `sys.modules`: a config, plan or plot module that
imports torch (directly, or through models.py, runtime.py, trainer.py, ...) fails here. No training: the plot input
is a metrics.jsonl written by hand.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, subprocess_env

from basis_lite.config import list_presets

MARKER = "torch imported: "
PROBE = f"""
import sys
from basis_lite.cli import main
rc = main(sys.argv[1:])
print({MARKER!r} + str('torch' in sys.modules))
sys.exit(rc)
"""


def _run_light(*args: str, rc: int = 0) -> str:
    """Run `basis-lite ARGS` in a fresh interpreter; assert it exited with `rc` without importing torch; return
    stdout (and stderr after it)."""
    probe = PROBE.replace("rc = main(sys.argv[1:])", "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n"
                                                      "    rc = e.code")
    proc = subprocess.run([sys.executable, "-c", probe, *args], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == rc, f"basis-lite {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    lines = proc.stdout.splitlines()
    assert lines and lines[-1].startswith(MARKER), proc.stdout[-2000:]
    assert lines[-1] == MARKER + "False", f"basis-lite {' '.join(args)} imported torch"
    return proc.stdout + proc.stderr


def test_presets_does_not_import_torch():
    out = _run_light("presets")
    listed = [line.split()[0] for line in out.splitlines()[:-1] if line.strip()]
    assert listed == list_presets()


def test_plan_all_does_not_import_torch():
    out = _run_light("plan", "--all")
    assert out.count("total (estimated peak)") == len(list_presets())


def test_plot_does_not_import_torch(tmp_path):
    pytest.importorskip("matplotlib")  # `basis-lite plot` needs it (the test extra installs it)
    steps = [{"step": s, "reward_mean": 0.1 * s, "accuracy": 0.1 * s, "format_rate": 0.5, "explained_variance": 0.2,
              "generation_s": 1.5, "training_s": 2.0} for s in range(1, 4)]
    evals = [{"step": s, "event": "eval", "eval_accuracy": 0.2 + 0.1 * s, "eval_n": 4, "eval_accuracy_level1": 0.5}
             for s in (0, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps + evals))
    out = _run_light("plot", str(tmp_path))
    names = {"reward.png", "explained_variance.png", "step_time.png", "eval_accuracy.png"}
    assert {p.name for p in (tmp_path / "plots").iterdir()} == names
    assert all(str(tmp_path / "plots" / n) in out for n in names)


def test_config_prints_every_key_without_torch(tmp_path):
    import yaml

    from basis_lite.config import all_keys, load_config

    out = _run_light("config", "--preset", "smoke", "--set", "learning_rate=1e-5")
    text = out[:out.index(MARKER)]
    assert text.startswith("# basis-lite config: preset smoke with --set learning_rate=1e-5")
    assert load_config(data=yaml.safe_load(text)) == load_config("smoke", ["train.lr=1e-5"])
    assert all(f"{k.rsplit('.', 1)[-1]}:" in text for k in all_keys())
    (tmp_path / "mine.yaml").write_text(text)  # saved, it is a preset
    assert load_config(str(tmp_path / "mine.yaml")).train.lr == 1e-5
    err = _run_light("config", "--set", "train.stepz=1", rc=2)
    assert "error: unknown config key 'train.stepz' (did you mean train.steps?)" in err


def test_version_without_torch():
    import re

    out = _run_light("--version")
    declared = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert out.startswith(f"basis-lite {declared}"), out
    assert "torch " in out and "transformers " in out


@pytest.mark.parametrize("value", ["-5", "0", "nan"])
def test_plan_refuses_a_card_size_that_is_not_positive(value):
    err = _run_light("plan", "--gpu-memory", value, rc=2)
    assert f"error: --gpu-memory: must be the card's memory in GiB, a number > 0, got {value}" in err
