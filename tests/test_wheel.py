"""basis-lite installs as a package: a built wheel, installed into a fresh folder, runs from another directory.

The wheel is built from this checkout (`pip wheel --no-build-isolation`: setuptools comes from the test extra, no
download), installed with `pip install --no-deps --target` into an empty folder, and its `basis-lite` console
script is run with only that folder on PYTHONPATH (torch and the other dependencies come from this environment), in
a working directory that is neither the checkout nor the install folder. It must list the presets (shipped inside
the package), plan every preset, and train the smoke preset end to end. No top-level `cli` module may be installed.
"""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("wheel")
    dist, target, work = root / "dist", root / "site", root / "elsewhere"
    work.mkdir()
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(dist), str(REPO)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next(dist.glob("basis_lite-*.whl"))
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stderr[-3000:]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(target)  # not the checkout
    env["TOKENIZERS_PARALLELISM"] = "false"
    return wheel, target, work, env


def _run(installed, *args, timeout=300):
    wheel, target, work, env = installed
    return subprocess.run([sys.executable, str(target / "bin" / "basis-lite"), *args], cwd=work, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_wheel_ships_presets_and_no_top_level_cli(installed):
    wheel, target, _, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    presets = sorted(Path(n).stem for n in names if n.startswith("basis_lite/presets/") and n.endswith(".yaml"))
    assert presets == sorted(p.stem for p in (REPO / "presets").glob("*.yaml"))
    assert not [n for n in names if "/" not in n], f"top-level files installed: {[n for n in names if '/' not in n]}"
    assert not (target / "cli.py").exists()
    assert (target / "bin" / "basis-lite").exists()
    # export --gguf runs the converter driver as a file of the installed package
    assert {"basis_lite/export/converter.py", "basis_lite/export/gguf.py", "basis_lite/model/downloads.py"} <= set(names)


def test_installed_cli_lists_and_plans_presets_from_elsewhere(installed):
    _, target, _, env = installed
    where = subprocess.run([sys.executable, "-c", "import basis_lite; print(basis_lite.__file__)"],
                           cwd=installed[2], env=env, capture_output=True, text=True)
    assert where.stdout.strip().startswith(str(target)), where.stdout + where.stderr
    proc = _run(installed, "presets")
    assert proc.returncode == 0, proc.stderr[-3000:]
    listed = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    assert set(listed) == {p.stem for p in (REPO / "presets").glob("*.yaml")}
    plan = _run(installed, "plan", "--all")
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert plan.stdout.count("total (estimated peak)") == len(listed), plan.stdout[-2000:]


def test_installed_cli_trains_the_smoke_preset_from_elsewhere(installed):
    _, _, work, _ = installed
    proc = _run(installed, "train", "--preset", "smoke", "--output", "run", "--no-progress",
                "--set", "train.threads=1", "--set", "reward.timeout_s=0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "held-out accuracy" in proc.stdout
    assert (work / "run" / "adapter" / "adapter_config.json").exists()
    assert (work / "run" / "metrics.jsonl").read_text().count('"step"') >= 3
