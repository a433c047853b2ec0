"""Reliability, third round (issue 26): a run folder is data (a resume imports no code from it, and no link leads
out of it), settings decided at run time are kept on resume, what a checkpoint holds is checked before it is used
(with the fallback of a damaged file), bounds on every integer setting, plain user errors end in exit 2, and the
llama.cpp converter is fetched without running anything of it. Real runs of the tiny model, real files, real
mounts (read-only and full tmpfs, skipped where mounting is not allowed), a real loopback package index."""
from __future__ import annotations

import functools
import hashlib
import http.server
import io
import json
import logging
import math
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest
import torch
from conftest import FAST, VARIED, cli_main, error_line, sets, snapshot, step_records
from safetensors.torch import load_file, save_file

from basis_lite.runs import checkpoint as ckpt

STEPS = 3
OVERRIDES = VARIED + [f"train.steps={STEPS}", "train.save_every=1", "train.keep_last=3", "train.batch_size=4",
                      "train.micro_batch_size=2"]
COMPARED = ("reward_mean", "loss", "baseline_mean", "grad_norm", "lr")


def _train(run, *extra):
    return cli_main("train", "--preset", "smoke", *sets(OVERRIDES + list(extra)), "--output", str(run),
                    "--no-progress")


def _resume(run):
    return cli_main("train", "--resume", str(run), "--no-progress")


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    run = tmp_path_factory.mktemp("rel3") / "run"
    assert _train(run) == 0
    return run


def _unfinished_copy(finished, dest) -> Path:
    """A copy of the finished run as if it had stopped after its last checkpoint (no final adapter, no summary)."""
    shutil.copytree(finished, dest)
    shutil.rmtree(dest / "adapter")
    (dest / "summary.json").unlink()
    return dest


def _same_steps(ref_run, run, steps=range(1, STEPS + 1)):
    ref, got = step_records(ref_run), step_records(run)
    assert [r["step"] for r in got] == list(steps)
    for a, b in zip(ref, got):
        for k in COMPARED:
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9), (k, a["step"], a[k], b[k])


def _no_network(monkeypatch):
    """Any connection attempt from this process fails the test (a missing local file must never be looked up)."""
    def refuse(self, address):
        raise AssertionError(f"network access to {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: refuse(None, a[0] if a else None))


# ---------------------------------------------------------------------------------------------------------------
# 1. a run folder carries no code into a resume


@pytest.mark.parametrize("timeout_s", ["0", "10"])  # in the trainer process / in the spawned reward worker
def test_resume_never_imports_a_module_from_the_run_folder(tmp_path, monkeypatch, capsys, timeout_s):
    name = f"planted_rewards_{timeout_s}"
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / f"{name}.py").write_text("def f(completions, **kw):\n    return [len(c) % 3 / 2 for c in completions]\n")
    monkeypatch.syspath_prepend(str(lib))  # the spawned worker inherits sys.path
    run = tmp_path / "run"
    assert _train(run, f"reward.functions=[{name}:f]", f"reward.timeout_s={timeout_s}", "train.steps=2") == 0
    # the folder handed over: its module (named by its config.yaml) writes a marker when imported
    marker = tmp_path / "pwned"
    (run / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef f(completions, **kw):\n"
                                    f"    return [0.0] * len(completions)\n")
    shutil.rmtree(run / "adapter")
    (run / "summary.json").unlink()
    monkeypatch.syspath_prepend(str(run))  # even with the run folder on sys.path (PYTHONPATH=. in it) ...
    sys.path.remove(str(lib))
    sys.modules.pop(name, None)
    monkeypatch.chdir(run)  # ... and the working directory in it
    assert cli_main("train", "--resume", ".", "--no-progress") == 2
    err = error_line(capsys)
    assert name in err and "inside the run folder" in err and not marker.exists()


def test_a_module_outside_the_refused_folder_still_loads(tmp_path, monkeypatch):
    from basis_lite.rewards.worker import load_reward_function

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "outside_rewards.py").write_text("def g(completions, **kw):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    (tmp_path / "run").mkdir()
    assert load_reward_function("outside_rewards:g", refused_dirs=[tmp_path / "run"])(["x"]) == [1.0]


# ---------------------------------------------------------------------------------------------------------------
# 2. what was decided at run time is kept on resume


def _decide_dtype(monkeypatch, dtype):
    """model.dtype: auto decided by a timing; the timing is the boundary faked here (it depends on the CPU's load)."""
    import basis_lite.runtime as runtime

    monkeypatch.setattr(runtime, "resolve_dtype", lambda name, device: dtype if name == "auto" else
                        getattr(torch, name))


def test_resume_keeps_the_dtype_auto_chose(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, "basis_lite")
    ref = tmp_path / "ref"
    _decide_dtype(monkeypatch, torch.float32)
    assert _train(ref, "model.dtype=auto") == 0
    assert json.loads((ref / "decided.json").read_text())["dtype"] == "float32"
    run = _unfinished_copy(ref, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step-000003")
    _decide_dtype(monkeypatch, torch.bfloat16)  # the same machine under another load would now choose bf16
    assert _resume(run) == 0
    assert "model.dtype: auto" in caplog.text and "dtype=float32" in caplog.text
    _same_steps(ref, run)  # step 3 redone in float32, as the uninterrupted run did it


def test_resume_that_cannot_keep_bf16_stops(tmp_path, monkeypatch, capsys):
    import basis_lite.model.dtypes as dtypes

    run = tmp_path / "run"
    _decide_dtype(monkeypatch, torch.bfloat16)
    assert _train(run, "model.dtype=auto", "train.steps=2") == 0
    state = json.loads((run / "checkpoints" / "step-000002" / "state.json").read_text())
    assert state["decided"]["dtype"] == "bfloat16"
    shutil.rmtree(run / "adapter")
    (run / "summary.json").unlink()
    (run / "decided.json").unlink()  # the checkpoint's copy is enough
    before = snapshot(run)
    before.pop(".lock")  # the lock file names its holder (pid and time): a resume that takes the lock rewrites it
    monkeypatch.setattr(dtypes, "cpu_bf16_flags", lambda: ())  # a CPU without native bf16 (AVX2 only)
    assert _resume(run) == 2
    err = error_line(capsys)
    assert "bfloat16" in err and "no native bf16" in err
    after = snapshot(run)
    after.pop(".lock")
    assert after == before


# ---------------------------------------------------------------------------------------------------------------
# 3. nothing read or written leaves the run folder


def test_checkpoints_linked_into_another_run_are_refused(finished, tmp_path, capsys):
    other = _unfinished_copy(finished, tmp_path / "other")
    run = _unfinished_copy(finished, tmp_path / "run")
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").symlink_to(other / "checkpoints")
    before = snapshot(other)
    assert _resume(run) == 2
    assert "checkpoints" in error_line(capsys)
    assert snapshot(other) == before


def test_metrics_linked_out_of_the_run_is_refused(finished, tmp_path, capsys):
    run = _unfinished_copy(finished, tmp_path / "run")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(victim)
    assert _resume(run) == 2
    assert "metrics.jsonl" in error_line(capsys) and victim.read_text() == "keep me\n"


@pytest.mark.parametrize("command", ["eval", "export"])
@pytest.mark.parametrize("link", ["adapter", "weights"])
def test_eval_and_export_do_not_follow_links_out(finished, tmp_path, capsys, command, link):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    other = tmp_path / "elsewhere"
    shutil.copytree(finished / "adapter", other)
    if link == "adapter":
        shutil.rmtree(run / "adapter")
        (run / "adapter").symlink_to(other)
    else:
        (run / "adapter" / "adapter_model.safetensors").unlink()
        (run / "adapter" / "adapter_model.safetensors").symlink_to(other / "adapter_model.safetensors")
    args = ["eval", str(run), "--limit", "1"] if command == "eval" else ["export", str(run), "--out",
                                                                         str(tmp_path / "out")]
    assert cli_main(*args) == 2
    assert "outside the run folder" in error_line(capsys)
    assert not (tmp_path / "out").exists() and not (run / "eval.json").exists()


# ---------------------------------------------------------------------------------------------------------------
# 4. content that matches its manifest but cannot be used: checked, and the older checkpoint is used instead


def _tamper(step_dir: Path, how: str) -> None:
    ad = step_dir / "adapter" / "adapter_model.safetensors"
    st = step_dir / "state.safetensors"
    sj = step_dir / "state.json"
    if how in ("shape", "missing", "nan", "int"):
        t = load_file(str(ad))
        k = sorted(t)[0]
        if how == "shape":
            t[k] = torch.zeros(t[k].shape[0] + 1, *t[k].shape[1:])
        elif how == "missing":
            del t[k]
        elif how == "nan":
            t[k] = t[k].clone()
            t[k][0, 0] = math.nan
        else:
            t[k] = torch.zeros(t[k].shape, dtype=torch.int32)
        save_file(t, str(ad), metadata={"format": "pt"})
    elif how in ("rng", "moment"):
        t = load_file(str(st))
        if how == "rng":
            k = next(k for k in t if k.endswith("rng.torch"))
            t[k] = torch.zeros(7, dtype=torch.uint8)
        else:
            k = next(k for k in t if k.endswith("exp_avg"))
            t[k] = torch.zeros(t[k].numel() + 3)
        save_file(t, str(st))
    elif how == "deep":
        sj.write_text("[" * 100_000 + "]" * 100_000)
    elif how in ("step_big", "step_neg", "step_str"):
        tree = json.loads(sj.read_text())
        tree["step"] = {"step_big": 10**9, "step_neg": -5, "step_str": "3"}[how]
        sj.write_text(json.dumps(tree))
    elif how == "optimizer_params":
        tree = json.loads(sj.read_text())
        tree["optimizer"]["param_groups"][0]["params"] = [0]
        sj.write_text(json.dumps(tree))
    else:
        raise ValueError(how)
    ckpt.write_manifest(step_dir)  # the manifest rewritten to match: the files are "intact"
    assert ckpt.verify(step_dir) is None


@pytest.mark.parametrize("how", ["shape", "missing", "nan", "int", "rng", "moment", "deep", "step_big", "step_neg",
                                 "step_str", "optimizer_params"])
def test_unusable_newest_checkpoint_falls_back_and_resumes_exactly(finished, tmp_path, caplog, how):
    run = _unfinished_copy(finished, tmp_path / "run")
    _tamper(run / "checkpoints" / "step-000003", how)
    assert _resume(run) == 0
    assert "skipping checkpoint" in caplog.text and "step-000003" in caplog.text
    _same_steps(finished, run)  # resumed from step 2, step 3 redone exactly


def test_nan_in_the_final_adapter_is_not_evaluated(finished, tmp_path, capsys, caplog, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    t = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    k = sorted(t)[0]
    t[k] = torch.full_like(t[k], math.nan)
    save_file(t, str(run / "adapter" / "adapter_model.safetensors"))
    _no_network(monkeypatch)
    assert cli_main("eval", str(run), "--limit", "1") == 0
    assert "NaN" in caplog.text and "step-000003" in caplog.text
    assert "checkpoints/step-000003/adapter" in json.loads((run / "eval.json").read_text())["adapter"]


@pytest.mark.parametrize("how", ["no_weights", "truncated", "nan", "config", "deep_config", "other_base"])
def test_corrupt_eapo_prior_adapter_exits_2_naming_it(finished, tmp_path, capsys, monkeypatch, how):
    prior = tmp_path / "prior"
    shutil.copytree(finished / "adapter", prior)
    w = prior / "adapter_model.safetensors"
    if how == "no_weights":
        w.unlink()
    elif how == "truncated":
        w.write_bytes(w.read_bytes()[:200])
    elif how == "nan":
        t = load_file(str(w))
        t = {k: torch.full_like(v, math.nan) for k, v in t.items()}
        save_file(t, str(w))
    elif how == "config":
        (prior / "adapter_config.json").write_text("[1, 2]")
    elif how == "deep_config":
        (prior / "adapter_config.json").write_text("[" * 50_000 + "]" * 50_000)
    else:  # a LoRA of another rank: does not fit the trained adapter's shapes... of the base it claims
        t = load_file(str(w))
        save_file({k: torch.zeros(v.shape[0] + 1, *v.shape[1:]) for k, v in t.items()}, str(w))
    _no_network(monkeypatch)
    out = tmp_path / "new"
    assert cli_main("train", "--preset", "smoke", *sets(FAST + [f"eapo.prior_adapter={prior}", "train.steps=1"]),
                    "--output", str(out), "--no-progress") == 2
    assert "eapo.prior_adapter" in error_line(capsys)
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------------------
# 5. bounds and shapes of input


@pytest.mark.parametrize("setting", ["train.batch_size=99999999999999", "train.steps=99999999999",
                                     "train.ppo_epochs=100000", "estimator.rollouts_per_prompt=100000",
                                     "generation.max_new_tokens=99999999999", "data.train_size=99999999999",
                                     "train.keep_last=99999999", "lora.r=1000000", "reward.timeout_s=1e300",
                                     "data.seed=" + "9" * 400, "train.batch_size=4096"
                                     " --set estimator.rollouts_per_prompt=1024"])
def test_integer_settings_have_upper_bounds(tmp_path, capsys, setting):
    extra = setting.split(" --set ")
    assert cli_main("config", "--preset", "smoke", *sets(extra)) == 2
    key = extra[0].split("=")[0]
    assert key in error_line(capsys)
    out = tmp_path / "run"
    assert cli_main("train", "--preset", "smoke", *sets(extra), "--output", str(out)) == 2
    assert not out.exists()


def test_deeply_nested_jsonl_row_is_a_bad_row(tmp_path, caplog):
    from basis_lite.config import load_config
    from basis_lite.data import load_examples

    rows = [json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i)}) for i in range(60)]
    rows.insert(7, '{"question": ' + "[" * 100_000 + "]" * 100_000 + ', "answer": "1"}')
    f = tmp_path / "data.jsonl"
    f.write_text("\n".join(rows) + "\n")
    cfg = load_config("smoke", [f"data.dataset={f}", "data.eval_size=4", "data.max_bad_fraction=0.05"])
    train = load_examples(cfg.data, "train")
    assert len(train) + 4 == 60 and "line 8 (nested too deeply" in caplog.text


def test_reward_function_returning_a_dict_is_refused(tmp_path, monkeypatch):
    from basis_lite.config import RewardConfig
    from basis_lite.errors import RewardError
    from basis_lite.rewards.scorer import RewardScorer

    (tmp_path / "dict_rewards.py").write_text("def f(completions, **kw):\n"
                                              "    return {i: 1.0 for i in range(len(completions))}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with RewardScorer(RewardConfig(functions=["dict_rewards:f"], timeout_s=0)) as scorer:
        with pytest.raises(RewardError, match="returned a dict"):
            scorer(["p", "q"], ["a", "b"], ["1", "2"])


# ---------------------------------------------------------------------------------------------------------------
# 6. plain user errors: exit 2 with a message, nothing reached for on the network


def test_output_naming_an_existing_file(tmp_path, capsys):
    f = tmp_path / "results.txt"
    f.write_text("mine\n")
    assert cli_main("train", "--preset", "smoke", *sets(FAST), "--output", str(f), "--no-progress") == 2
    assert "a file of that name exists" in error_line(capsys) and f.read_text() == "mine\n"


@pytest.mark.parametrize("content", [bytes(range(256)) * 4, b"\x00\x01\x02PK\x03\x04", b"a:\n" + b"- " * 0 +
                                     b"[" * 20000 + b"]" * 20000])
def test_binary_or_deep_config_file(tmp_path, capsys, content):
    f = tmp_path / "preset.yaml"
    f.write_bytes(content)
    assert cli_main("train", "--preset", str(f), "--output", str(tmp_path / "run")) == 2
    assert str(f) in error_line(capsys) and not (tmp_path / "run").exists()


def test_binary_config_in_a_run_folder(finished, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / "config.yaml").write_bytes(os.urandom(4096))
    assert cli_main("eval", str(run), "--limit", "1") == 2
    assert "config.yaml" in error_line(capsys)
    assert _resume(run) == 2
    assert "config.yaml" in error_line(capsys)


@pytest.mark.parametrize("change", ["more_rows", "same_count"])
def test_dataset_changed_between_kill_and_resume(tmp_path, capsys, change):
    data = tmp_path / "data.jsonl"
    rows = [{"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)} for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    assert _train(run, f"data.dataset={data}", "train.steps=2") == 0
    shutil.rmtree(run / "adapter")
    (run / "summary.json").unlink()
    shutil.rmtree(run / "checkpoints" / "step-000002")
    if change == "more_rows":
        rows += [{"question": f"What is {i} - 1?", "answer": str(i - 1)} for i in range(100, 110)]
    else:
        rows = [{**r, "answer": str(int(r["answer"]) + 1)} for r in rows]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _resume(run) == 2
    err = error_line(capsys)
    assert "changed since the checkpoint" in err and str(data) in err


def test_eval_with_final_weights_missing_stays_local(finished, tmp_path, capsys, caplog, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / "adapter" / "adapter_model.safetensors").unlink()
    _no_network(monkeypatch)
    assert cli_main("eval", str(run), "--limit", "1") == 0  # the newest checkpoint, with a warning
    assert "adapter_model.safetensors" in caplog.text
    shutil.rmtree(run / "checkpoints")
    assert cli_main("eval", str(run), "--limit", "1") == 2
    assert "adapter_model.safetensors" in error_line(capsys)
    assert cli_main("eval", str(run / "adapter"), "--limit", "1") == 2  # the adapter folder itself
    assert "adapter_model.safetensors" in error_line(capsys)
    assert cli_main("export", str(run), "--out", str(tmp_path / "exp")) == 2
    assert "adapter_model.safetensors" in error_line(capsys)


def _mount_tmpfs(path, opts):
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()})")


def test_eval_into_a_read_only_folder_fails_before_evaluating(finished, tmp_path, capsys, monkeypatch):
    import basis_lite.rl.evaluate as evaluate_mod

    ro = tmp_path / "ro"
    _mount_tmpfs(ro, "ro,size=1m")
    try:
        monkeypatch.setattr(evaluate_mod, "evaluate", lambda *a, **k: pytest.fail("evaluated before the check"))
        assert cli_main("eval", str(finished), "--limit", "1", "--out", str(ro / "eval.json")) == 2
        assert "cannot write" in error_line(capsys)
        assert cli_main("eval", str(finished), "--limit", "1", "--out", str(tmp_path)) == 2  # a folder
        assert "is a folder" in error_line(capsys)
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)


def test_full_disk_eval_names_the_target_and_leaves_no_temp(finished, tmp_path, capsys):
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "size=64k")
    try:
        with open(disk / "filler", "wb", buffering=0) as f:  # fill it to the last byte
            try:
                while True:
                    f.write(b"x" * 4096)
            except OSError:
                pass
        assert cli_main("eval", str(finished), "--limit", "1", "--out", str(disk / "eval.json")) == 2
        err = error_line(capsys)
        assert "no space left" in err and str(disk / "eval.json") in err and str(Path.cwd()) + ";" not in err
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


# ---------------------------------------------------------------------------------------------------------------
# 7. the converter's source distribution is fetched without running anything of it


def _sdist(tmp_path, marker: Path) -> bytes:
    """A source distribution whose in-tree build backend writes `marker` when pip runs it."""
    backend = (f"open({str(marker)!r}, 'w').close()\n"
               "def get_requires_for_build_wheel(config_settings=None):\n    return []\n"
               "def prepare_metadata_for_build_wheel(d, config_settings=None):\n    raise SystemExit(1)\n"
               "def build_wheel(d, config_settings=None, metadata_directory=None):\n    raise SystemExit(1)\n"
               "def build_sdist(d, config_settings=None):\n    raise SystemExit(1)\n")
    files = {"pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
             "backend.py": backend, "PKG-INFO": "Metadata-Version: 2.1\nName: evil-pkg\nVersion: 1.0\n"}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"evil_pkg-1.0/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """A PEP 503 simple index on a loopback http.server, the only index pip is configured with."""
    root = tmp_path / "index"
    (root / "simple" / "evil-pkg").mkdir(parents=True)
    (root / "files").mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/simple"
    for k in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", url)
    monkeypatch.setenv("PIP_NO_BUILD_ISOLATION", "0")

    def publish(data: bytes, stated_sha: str | None = None):
        (root / "files" / "evil_pkg-1.0.tar.gz").write_bytes(data)
        frag = f"#sha256={stated_sha}" if stated_sha else ""
        (root / "simple" / "evil-pkg" / "index.html").write_text(
            f'<html><body><a href="../../files/evil_pkg-1.0.tar.gz{frag}">evil_pkg-1.0.tar.gz</a></body></html>')

    yield publish
    server.shutdown()


def test_sdist_is_fetched_and_checked_without_running_its_backend(tmp_path, local_index):
    from basis_lite.model.downloads import Pinned, pip_download

    marker = tmp_path / "backend-ran"
    data = _sdist(tmp_path, marker)
    sha = hashlib.sha256(data).hexdigest()
    local_index(data, sha)
    pinned = Pinned("evil-pkg==1.0", "evil_pkg-1.0.tar.gz", sha, "a test sdist", sdist=True)
    path = pip_download(pinned, tmp_path / "dl")
    assert path.read_bytes() == data and not marker.exists()


def test_sdist_with_another_hash_is_deleted_unread(tmp_path, local_index):
    from basis_lite.errors import ModelError
    from basis_lite.model.downloads import Pinned, pip_download

    marker = tmp_path / "backend-ran"
    data = _sdist(tmp_path, marker)
    local_index(data)  # the index states no hash; the file is not the pinned one
    pinned = Pinned("evil-pkg==1.0", "evil_pkg-1.0.tar.gz", "0" * 64, "a test sdist", sdist=True)
    with pytest.raises(ModelError, match="does not match the pinned"):
        pip_download(pinned, tmp_path / "dl")
    assert not marker.exists() and not any((tmp_path / "dl").iterdir())
