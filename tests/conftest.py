"""Shared test setup: a throw-away model/prior cache (never ~/.cache), the repo on sys.path, run helpers, fixtures.

Everything runs on the tiny random model (`builtin:tiny-random`, preset smoke) on the CPU. That model scores 0 on
arithmetic, so every advantage would be 0 and updates would be skipped; tests that need real gradient steps add
the deterministic, varied user reward `tests.reward_fns:char_sum_reward` (see VARIED).
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

# before anything imports basis_lite (and builds the tiny model into the cache)
REPO = Path(__file__).resolve().parent.parent
_CACHE = tempfile.mkdtemp(prefix="basis-lite-test-cache-")
os.environ["BASIS_LITE_CACHE"] = _CACHE
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("BASIS_LITE_KILL_AT", None)
atexit.register(shutil.rmtree, _CACHE, True)
# `tests.reward_fns` is imported by module path (a namespace package: tests/ has no __init__.py), in this process
# and in the spawned reward worker, which inherits sys.path
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pytest  # noqa: E402

CACHE_DIR = Path(_CACHE)
REWARD = "tests.reward_fns:char_sum_reward"
# small and fast: no BASIS prior, short generations, one torch thread (the same in a subprocess and in-process, so
# runs are bitwise comparable), float32 whatever the CPU (auto could pick bf16), user rewards in-process (reward.timeout_s=0: no worker to spawn)
FAST = ["model.dtype=float32", "estimator.prior_samples=0", "train.threads=1", "generation.max_new_tokens=8",
        "train.eval_max_new_tokens=4", "data.eval_size=4", "reward.timeout_s=0"]
VARIED = FAST + [f"reward.functions=[{REWARD}]"]
STEP_FIELDS = ("step", "reward_mean", "accuracy", "baseline_mean", "advantage_std", "explained_variance",
               "explained_variance_loo_ref", "kl", "entropy", "completion_len", "generation_s", "training_s",
               "tokens_per_s", "peak_memory_mb")


def bench_module(file: str, name: str | None = None):
    """bench/<file> imported as a module (default name bench_<stem>), registered in sys.modules so that its
    dataclasses resolve; a second name gives a fresh copy beside the first."""
    import importlib.util

    name = name or f"bench_{Path(file).stem}"
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def sets(overrides) -> list[str]:
    out = []
    for o in overrides:
        out += ["--set", o]
    return out


def subprocess_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("BASIS_LITE_KILL_AT", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def cli_cmd(*args) -> list[str]:
    return [sys.executable, str(REPO / "cli.py"), *args]


def run_cli_subprocess(*args, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """`python cli.py ARGS` in a fresh interpreter (cwd = repo); the result carries .wall (seconds)."""
    t0 = time.time()
    proc = subprocess.run(cli_cmd(*args), cwd=REPO, env=env or subprocess_env(), capture_output=True, text=True,
                          timeout=timeout)
    proc.wall = time.time() - t0
    return proc


def cli_main(*args) -> int:
    """`basis-lite ARGS` in this process (cheap: no interpreter start, no imports)."""
    import cli

    return cli.main(list(args))


def train_smoke(run_dir, *overrides: str, one_thread: bool = False) -> Path:
    """The one run factory: `basis-lite train --preset smoke` in this process, with `--set` overrides; asserts exit 0.

    one_thread: torch on 1 thread while it trains (a tiny model on a shared 2-core machine: faster and kinder),
    restored afterwards.
    """
    import torch

    threads = torch.get_num_threads()
    if one_thread:
        torch.set_num_threads(1)
    try:
        rc = cli_main("train", "--preset", "smoke", "--output", str(run_dir), "--no-progress", *sets(overrides))
    finally:
        torch.set_num_threads(threads)
    assert rc == 0, f"smoke training into {run_dir} exited {rc}"
    return Path(run_dir)


SMALL = ["estimator.prior_samples=0", "data.train_size=16", "data.eval_size=4", "train.threads=1",
         "reward.timeout_s=0", "generation.max_new_tokens=8"]


def read_lines(run_dir) -> list[dict]:
    return [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines() if line.strip()]


def step_records(run_dir) -> list[dict]:
    """The per-step metric records (eval lines carry an "event" key)."""
    return [r for r in read_lines(run_dir) if "event" not in r]


def adapter_weights(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "adapter_model.safetensors"))


def snapshot(folder) -> dict:
    """{relative path: sha1 of the content} of every file under `folder` (to prove nothing was written over)."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """train() applies train.threads process-wide; give the next test the thread count it started with."""
    torch = sys.modules.get("torch")  # never import it just for this
    n = torch.get_num_threads() if torch else None
    yield
    if n is not None:
        torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """`python cli.py train --preset smoke` run to the end in a subprocess: namespace(proc, run_dir, wall)."""
    run_dir = tmp_path_factory.mktemp("smoke") / "run"
    proc = run_cli_subprocess("train", "--preset", "smoke", "--output", str(run_dir), "--no-progress")
    assert proc.returncode == 0, f"smoke run failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return SimpleNamespace(proc=proc, run_dir=run_dir, wall=proc.wall)


def pytest_addoption(parser):
    parser.addoption("--golden-print", action="store_true", help="print the values tests/test_golden_curve.py pins")


def trainer_logprobs(model, tok, rolls, temperature):
    """The trainer's re-scoring of rollouts: each completion token's log-prob at `temperature` (a list of tensors),
    with the update's attention kernel (models.training_attention: eager for a bf16 model on the CPU)."""
    import torch

    from basis_lite.losses.policy import sequence_logprobs
    from basis_lite.model.loading import training_attention
    from basis_lite.rl.update import pack_sequences

    ids, attn, cmask = pack_sequences(rolls, 512, tok.pad_token_id)
    model.eval()
    with torch.no_grad(), training_attention(model):
        lp = sequence_logprobs(model, ids, attn, cmask, temperature=temperature).logprobs
    return [lp[i, len(r.prompt_ids) - 1:len(r.prompt_ids) - 1 + len(r.completion_ids)] for i, r in enumerate(rolls)]


def error_line(capsys) -> str:
    """The one `error: ...` line a command printed on stderr (no traceback, exactly one such line)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]
