"""Data-parallel training (issue 13) on real torch.distributed: gloo, 2 processes started by torchrun, the tiny model.

- a 2-rank run with global batch B gives the same prompts, rollouts, rewards, prior, baselines, advantages, metrics,
  eval and adapter as a 1-process run with batch B (both sample from per-prompt streams, generation.rng=per_prompt);
- only rank 0 writes into the run folder (every rank's writes recorded through audit hooks, tests/dist_entry.py);
- killing rank 1 mid-run stops rank 0 with a message that names rank 1 and the last good checkpoint, and `--resume`
  on 2 ranks ends with the uninterrupted run's adapter and metrics.

The two torchrun jobs (uninterrupted and killed) run at the same time, then the resume; the per-prompt sampler and
the data-parallel helpers have fast in-process tests below them.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, VARIED, adapter_weights, cli_main, sets, step_records, subprocess_env

STEPS = 3
# with a K=2 prior: each torchrun job has a cache of its own, so its ranks compute the prior (split between them);
# with the basis mix on 8 training prompts, so that its per-prompt tracker meets prompts again (every rank keeps
# the same tracker, probe buffer and mix losses from the gathered global batch, and the checkpoint restores them)
OVERRIDES = VARIED + [f"train.steps={STEPS}", "train.batch_size=4", "train.micro_batch_size=2", "train.save_every=2",
                      "estimator.prior_samples=2", "train.ppo_epochs=2",  # two passes: each pass's gradients summed
                      "estimator.options={mix: true, probe_min_rows: 4}", "data.train_size=8"]
KILL = "generation:3"  # after the checkpoint of step 2
COMPARED = ("reward_mean", "accuracy", "baseline_mean", "advantage_std", "explained_variance", "loss", "grad_norm",
            "entropy", "completion_len", "clipped_fraction", "lr", "clip_fraction", "update_norm", "mix_weight_loo", "mix_weight_tracker")


def _torchrun(log_dir: Path, run_dir: Path, args: list[str], **env) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "tests" / "dist_entry.py"), str(log_dir), str(run_dir), *args]
    # PYTHONFAULTHANDLER: a rank that aborts (SIGABRT, e.g. "terminate called without an active exception" from a
    # C++ thread torn down while joinable, seen once in a full suite run) prints every thread's Python stack, so the
    # failure message shows where it happened
    return subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(PYTHONFAULTHANDLER=1, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen, timeout: float = 240) -> SimpleNamespace:
    out, err = p.communicate(timeout=timeout)
    return SimpleNamespace(rc=p.returncode, stdout=out, stderr=err)


def _log(log_dir: Path, rank: int, kind: str) -> list[dict]:
    path = log_dir / f"rank-{rank}.jsonl"
    return [r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip())
            if r["kind"] == kind]


def _train_args(run_dir: Path) -> list[str]:
    return ["train", "--preset", "smoke", *sets(OVERRIDES), "--output", str(run_dir), "--no-progress"]


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """The 1-process run with per-prompt streams, in this process, its steps recorded like a rank's."""
    import dist_entry

    root = tmp_path_factory.mktemp("one")
    run = root / "run"
    rec = dist_entry.Recorder(root / "rank-0.jsonl", None)
    from basis_lite import trainer

    original = trainer.baselines
    try:
        rec.wrap_trainer()
        assert cli_main(*_train_args(run), "--set", "generation.rng=per_prompt") == 0
    finally:
        trainer.baselines = original
        rec.f.close()
    return SimpleNamespace(run=run, logs=root)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Two torchrun jobs side by side: uninterrupted, and killed at rank 1 then resumed on 2 ranks."""
    root = tmp_path_factory.mktemp("two")
    full, killed = root / "full", root / "killed"
    p_full = _torchrun(root / "logs-full", full, _train_args(full), BASIS_LITE_CACHE=root / "cache-full")
    p_killed = _torchrun(root / "logs-killed", killed, _train_args(killed), BASIS_LITE_KILL_AT=KILL,
                         BASIS_LITE_KILL_RANK=1, BASIS_LITE_CACHE=root / "cache-killed")
    res_full, res_killed = _finish(p_full), _finish(p_killed)
    assert res_full.rc == 0, f"2-rank run failed (rc {res_full.rc}):\n{res_full.stderr[-5000:]}"
    after_kill = {"adapter": (killed / "adapter").exists(),
                  "checkpoints": sorted(p.name for p in (killed / "checkpoints").glob("step-*"))}
    res_resume = _finish(_torchrun(root / "logs-resume", killed, ["train", "--resume", str(killed), "--no-progress"],
                                   BASIS_LITE_CACHE=root / "cache-killed"))
    return SimpleNamespace(full=full, killed=killed, logs=root / "logs-full", res_full=res_full,
                           res_killed=res_killed, after_kill=after_kill, res_resume=res_resume)


@pytest.mark.distributed
def test_two_ranks_equal_one_process(one, two):
    mine = _log(one.logs, 0, "step")
    r0, r1 = _log(two.logs, 0, "step"), _log(two.logs, 1, "step")
    assert [s["step"] for s in mine] == [s["step"] for s in r0] == [s["step"] for s in r1] == list(range(1, STEPS + 1))
    for a, b0, b1 in zip(mine, r0, r1):
        assert a["ids"] == b0["ids"] == b1["ids"]  # the same global batch on every rank
        assert a["texts"] == b0["texts"] + b1["texts"]  # rank r generated its contiguous half, the same completions
        assert a["rewards"] == b0["rewards"] == b1["rewards"]
        assert len(set(a["rewards"])) > 1  # rewards vary: real advantages, real updates
        for key in ("baselines", "advantages"):
            assert b0[key] == b1[key]  # every rank computed the same global baselines
            assert torch.allclose(torch.tensor(a[key]), torch.tensor(b0[key]), rtol=1e-5, atol=1e-6), key
    want, got = step_records(one.run), step_records(two.full)
    assert len(want) == len(got) == STEPS
    for w, g in zip(want, got):
        assert g["ranks"] == 2 and g["gather_s"] >= 0 and g["allreduce_s"] >= 0
        for k in COMPARED:
            assert math.isclose(w[k], g[k], rel_tol=1e-5, abs_tol=1e-7), f"step {w['step']}: {k} {w[k]} != {g[k]}"
    wa, ga = adapter_weights(one.run / "adapter"), adapter_weights(two.full / "adapter")
    assert wa.keys() == ga.keys()
    assert sum(float(v.abs().sum()) for k, v in ga.items() if "lora_B" in k) > 0  # it learned something
    for k in wa:
        assert torch.allclose(wa[k], ga[k], rtol=1e-5, atol=1e-7), k
    summary, single = (json.loads((r / "summary.json").read_text()) for r in (two.full, one.run))
    assert summary["ranks"] == 2 and summary["prior_cached"] is False  # the 2 ranks computed the prior
    assert summary["eval_after"] == single["eval_after"] and summary["eval_before"] == single["eval_before"]


@pytest.mark.distributed
def test_only_rank_0_writes_the_run_folder(two):
    w0, w1 = _log(two.logs, 0, "write"), _log(two.logs, 1, "write")
    assert w1 == [], f"rank 1 wrote into the run folder: {w1[:5]}"
    written = {Path(r["path"]).name for r in w0}
    assert {"metrics.jsonl", "config.yaml", "adapter"} <= written, written  # the hook sees rank 0's writes
    assert any(r["event"] == "os.rename" and "step-000002" in r["path"] for r in w0)  # the checkpoint publish
    assert "Loading weights" not in two.res_full.stdout  # one summary printed, by rank 0
    assert two.res_full.stdout.count("held-out accuracy") == 1


@pytest.mark.distributed
def test_killed_rank_stops_the_other_and_resume_finishes_the_run(two):
    res = two.res_killed
    assert res.rc != 0, "the launcher should report the killed rank"
    assert "rank 1 (pid" in res.stderr and "died" in res.stderr, res.stderr[-4000:]
    assert "step-000002" in res.stderr and "--resume" in res.stderr, res.stderr[-4000:]
    assert not two.after_kill["adapter"] and two.after_kill["checkpoints"] == ["step-000002"]
    assert two.res_resume.rc == 0, f"resume failed:\n{two.res_resume.stderr[-5000:]}"
    want, got = step_records(two.full), step_records(two.killed)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # one line per step after the truncation
    for w, g in zip(want, got):
        for k in COMPARED:
            assert w[k] == g[k], f"step {w['step']}: {k} {w[k]} != {g[k]}"
    wa, ga = adapter_weights(two.full / "adapter"), adapter_weights(two.killed / "adapter")
    for k in wa:
        assert torch.equal(wa[k], ga[k]), k


@pytest.mark.distributed
def test_rank_0_refuses_a_taken_folder_and_every_rank_stops(two, tmp_path):
    """Rank 0 claims the run folder (and takes its lock); its refusal of a folder that already holds a run reaches
    rank 1 too, so both stop at once with the reason instead of rank 1 waiting for a folder name."""
    before = sorted(p.name for p in two.full.iterdir())
    res = _finish(_torchrun(tmp_path / "logs", two.full, _train_args(two.full)), timeout=120)
    assert res.rc != 0
    assert res.stderr.count("already holds a run") >= 2, res.stderr[-4000:]  # rank 0's error and rank 1's
    assert "rank 0: output folder" in res.stderr, res.stderr[-4000:]
    assert sorted(p.name for p in two.full.iterdir()) == before  # nothing written, nothing removed


# ----------------------------------------------------------------------------------------------------------------
# in-process: the per-prompt sampler and the helpers


def test_sigterm_while_the_failure_message_is_written_keeps_the_checkpoint_good(tmp_path, monkeypatch):
    """torchrun SIGTERMs the ranks left once one died, often while the survivor checks its last checkpoint for the
    message. The handler must let that check finish: raised inside it, the exception made a good checkpoint read
    as damaged and the message said no checkpoint was written (seen in CI)."""
    import os
    import signal

    from basis_lite.rl.distributed import ProcessGroupRanks
    from basis_lite.runs import checkpoint

    ck = tmp_path / "checkpoints" / "step-000002"
    (ck / "adapter").mkdir(parents=True)
    for rel in (checkpoint.STATE_JSON, checkpoint.STATE_TENSORS, "config.yaml",
                f"adapter/{checkpoint.ADAPTER_CONFIG}", f"adapter/{checkpoint.ADAPTER_WEIGHTS}"):
        (ck / rel).write_text(rel)
    checkpoint.write_manifest(ck)
    ranks = object.__new__(ProcessGroupRanks)  # the failure handling alone: no process group
    ranks.rank, ranks.world, ranks.local_world, ranks.run_dir = 0, 2, 2, tmp_path
    ranks.peers, ranks._stopping = [(os.getpid(), 0), (2**22 + 1, 0)], False  # rank 1: a pid that is not running
    real_inside, sent = checkpoint.inside, []

    def inside_with_sigterm(base, path):
        if not sent:
            sent.append(signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # the launcher's SIGTERM, mid-check
        return real_inside(base, path)

    monkeypatch.setattr(checkpoint, "inside", inside_with_sigterm)
    old = signal.signal(signal.SIGTERM, ranks._on_sigterm)
    try:
        msg = ranks.failure_message("all_reduce failed: Connection closed by peer")
    finally:
        signal.signal(signal.SIGTERM, old)
    assert sent, "the SIGTERM was never sent: the check did not run"
    assert "rank 1 (pid" in msg and "died" in msg, msg
    assert f"last good checkpoint is {ck}" in msg and "--resume" in msg, msg


def test_exit_finished_rank_flushes_what_python_buffers_and_skips_teardown(tmp_path):
    """A finished torchrun rank leaves through os._exit: its printed lines and log records still arrive (the
    streams are pipes here, so Python buffers them), and nothing registered for the interpreter's teardown runs."""
    code = ("import atexit, logging, sys\n"
            "from basis_lite.rl.distributed import exit_finished_rank\n"
            "logging.basicConfig(filename=sys.argv[1], level=logging.INFO)\n"
            "atexit.register(print, 'teardown ran')\n"
            "print('result line', end='')\n"
            "print('to stderr', file=sys.stderr, end='')\n"
            "logging.getLogger('basis_lite').info('logged')\n"
            "exit_finished_rank(3)\n")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "log.txt")], capture_output=True, text=True,
                         env=subprocess_env(), cwd=REPO, timeout=120)
    assert res.returncode == 3, res.stderr[-2000:]
    assert res.stdout == "result line" and res.stderr.endswith("to stderr"), (res.stdout, res.stderr[-2000:])
    assert "logged" in (tmp_path / "log.txt").read_text()


def test_close_names_a_failed_destroy_and_restores_sigterm(caplog):
    """A process group that fails to close is torn down at interpreter exit, where gloo can abort the process
    ("terminate called without an active exception"): close() says so in the log instead of hiding it, and gives
    SIGTERM back to the handler it replaced either way."""
    import signal

    from basis_lite.rl.distributed import ProcessGroupRanks

    def destroy():
        raise RuntimeError("Connection closed by peer")

    ranks = object.__new__(ProcessGroupRanks)  # close() alone: no process group
    ranks.rank, ranks._closed, ranks.dist = 1, False, SimpleNamespace(destroy_process_group=destroy)
    ranks._old_sigterm = old = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with caplog.at_level("WARNING", logger="basis_lite"):
            ranks.close()
        assert signal.getsignal(signal.SIGTERM) == old
    finally:
        signal.signal(signal.SIGTERM, old)
    assert "rank 1: destroy_process_group failed (RuntimeError: Connection closed by peer)" in caplog.text
    caplog.clear()
    ranks.close()  # a second close does nothing
    assert not caplog.text


def test_seeded_sampler_draws_from_the_warped_distribution():
    from basis_lite.engines.seeded import SeededSampler, stream_seed

    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])
    rows = 20000
    seeds = [stream_seed(7, "test", i) for i in range(rows)]
    for temperature, top_p, top_k in ((1.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 0.8, 0), (1.3, 1.0, 3)):
        sampler = SeededSampler(seeds, temperature=temperature, top_p=top_p, top_k=top_k)
        out = sampler(torch.zeros(rows, 1, dtype=torch.long), logits.expand(rows, -1).clone())
        assert bool(((out == 0).sum(dim=1) == 1).all()) and bool(torch.isinf(out).sum(dim=1).eq(4).all())
        freq = (out == 0).float().mean(dim=0)
        p = torch.softmax(logits / temperature, dim=0)
        if top_k:
            p[torch.argsort(p, descending=True)[top_k:]] = 0
        if top_p < 1:  # smallest prefix of the sorted probabilities reaching top_p, as transformers keeps it
            order = torch.argsort(p, descending=True)
            keep = torch.cumsum(p[order], 0) - p[order] < top_p
            p[order[~keep]] = 0
        p = p / p.sum()
        assert torch.allclose(freq, p, atol=0.015), (temperature, top_p, top_k, freq, p)


def test_seeded_rows_do_not_depend_on_the_batch():
    from basis_lite.engines.seeded import SeededSampler

    torch.manual_seed(0)
    steps = [torch.randn(6, 50) for _ in range(4)]
    ids = torch.zeros(6, 1, dtype=torch.long)
    whole = SeededSampler(list(range(6)))
    halves = [SeededSampler([0, 1, 2]), SeededSampler([3, 4, 5])]
    for s in steps:
        a = whole(ids, s).argmax(dim=1)
        b = torch.cat([halves[0](ids[:3], s[:3]), halves[1](ids[3:], s[3:])]).argmax(dim=1)
        assert torch.equal(a, b)


def test_hf_engine_per_prompt_streams_ignore_chunking():
    """The same prompts and seeds give the same completions in one generate() call or in chunks of one prompt,
    with several samples per prompt; other seeds give other completions."""
    from basis_lite.config import load_config
    from basis_lite.engines.base import params_from_config
    from basis_lite.engines.seeded import stream_seed
    from basis_lite.runtime import build_policy, setup_device

    cfg = load_config("smoke", [*VARIED])
    device, dtype = setup_device(cfg)
    model, tok, engine = build_policy(cfg, device, dtype)
    prompts = [f"What is {i} + {i + 3}?" for i in range(4)]
    params = params_from_config(cfg.generation, n=2, max_new_tokens=6)
    params.seeds = [stream_seed(0, "t", i) for i in range(4)]
    engine.batch_size = 8
    together = [r.completion_ids for r in engine.generate(prompts, params, with_features=False)]
    engine.batch_size = 2
    torch.manual_seed(123)  # the global RNG plays no part
    chunked = [r.completion_ids for r in engine.generate(prompts, params, with_features=False)]
    assert together == chunked
    assert together[0] != together[1]  # two samples of one prompt differ
    params.seeds = [stream_seed(1, "t", i) for i in range(4)]
    assert [r.completion_ids for r in engine.generate(prompts, params, with_features=False)] != together


def test_start_checks_the_global_batch_before_any_connection(monkeypatch):
    from basis_lite.config import load_config
    from basis_lite.errors import ConfigError
    from basis_lite.rl import distributed

    for k, v in {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match="train.batch_size=8 is the global batch"):
        distributed.start(load_config("smoke"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="generation.rng: global"):
        distributed.start(load_config("smoke", ["generation.rng=global"]))


def _gather_inputs(rank: int, b: int = 2, G: int = 2, D: int = 3, Dt: int = 5):
    """One rank's made-up step: rollouts with prompt and trajectory features, rewards, scores."""
    from basis_lite.engines.base import Rollout

    g = torch.Generator().manual_seed(100 + rank)
    rolls = [Rollout(prompt="p", prompt_ids=[1], completion_ids=[1] * (rank + i + 1), text="t", finished=True,
                     feature=torch.randn(D, generator=g), trajectory=torch.randn(Dt, generator=g))
             for i in range(b * G)]
    rewards = torch.rand(b, G, generator=g)
    scored = SimpleNamespace(correct=[float(i % 2) for i in range(b * G)], format=[1.0] * (b * G))
    return rolls, rewards, scored


def _rank_step(rank: int, generation_s: float = 0.0, warnings: int = 0):
    """One rank's Step record of the made-up step (features and trajectories read from its rollouts)."""
    from basis_lite.rl.step import Step

    rolls, rewards, scored = _gather_inputs(rank)
    return Step.of_rank(1, [], [], rolls, rewards, scored, uses_features=True, uses_trajectory=True,
                        generation_s=generation_s, reward_warnings=warnings)


def _gather_worker(rank: int, world: int, port: int, out: str):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from basis_lite.rl.distributed import ProcessGroupRanks

    ranks = ProcessGroupRanks(rank, world, rank, world, torch.device("cpu"))
    data = _rank_step(rank, 1.0 + rank, rank).gathered(ranks)
    Path(out, f"rank-{rank}.json").write_text(json.dumps({
        "rewards": data.rewards.tolist(), "features": data.features.tolist(), "trajectory": data.trajectory.tolist(),
        "lens": data.completion_lens, "generation_s": data.generation_s, "warnings": data.reward_warnings}))
    ranks.close()


@pytest.mark.distributed
def test_gather_step_delivers_the_global_features_and_trajectories(tmp_path):
    """Two gloo processes: every rank gets the global batch's rewards, prompt features and per-rollout trajectory
    features (what poise and basis_probe need), in rank order, the same on both ranks."""
    import socket

    import torch.multiprocessing as mp

    from basis_lite.rl.distributed import Ranks

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    mp.spawn(_gather_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert got[0] == got[1]
    parts = [_rank_step(r).gathered(Ranks()) for r in (0, 1)]  # one process: the same path, nothing sent
    want_traj = torch.cat([p.trajectory for p in parts])
    assert want_traj.shape == (4, 2, 5)
    assert torch.allclose(torch.tensor(got[0]["trajectory"]), want_traj)
    assert torch.allclose(torch.tensor(got[0]["features"]), torch.cat([p.features for p in parts]))
    assert torch.allclose(torch.tensor(got[0]["rewards"]), torch.cat([p.rewards for p in parts]))
    assert got[0]["lens"] == parts[0].completion_lens + parts[1].completion_lens
    assert got[0]["generation_s"] == 2.0 and got[0]["warnings"] == 1  # the slowest rank's time; warnings summed


def test_single_process_ranks_are_identities():
    from basis_lite.rl.distributed import Ranks

    r = Ranks()
    assert not r.active and r.is_main and r.bounds(7) == (0, 7) and r.shard([1, 2, 3]) == [1, 2, 3]
    t = torch.arange(6.0).view(3, 2)
    assert r.gather_rows(t) is t and r.sum([1.0, 2.0]) == [1.0, 2.0]


def test_bounds_split_evenly_and_cover_everything():
    from basis_lite.rl.distributed import Ranks

    for n in (0, 1, 5, 8, 13):
        for world in (1, 2, 3, 4):
            spans = []
            for rank in range(world):
                r = Ranks()
                r.rank, r.world = rank, world
                spans.append(r.bounds(n))
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert max(hi - lo for lo, hi in spans) - min(hi - lo for lo, hi in spans) <= 1


def test_plan_per_card_with_several_gpus():
    from basis_lite.config import load_config
    from basis_lite.errors import ConfigError
    from basis_lite.plan import build_plan, plan_for

    cfg = load_config("gpu-24gb")
    one, four = build_plan(cfg, 24), build_plan(cfg, 24, gpus=4)
    assert any("all-reduce" in k for k in four.parts) and not any("all-reduce" in k for k in one.parts)
    text = plan_for("gpu-24gb", gpus=4)
    assert f"global batch {cfg.train.batch_size} prompts = 4 ranks x {cfg.train.batch_size // 4}" in text
    hf = load_config("gpu-24gb", ["generation.engine=hf"])  # the HF KV cache scales with the per-card batch
    kv1 = next(v for k, v in build_plan(hf, 24).parts.items() if k.startswith("generation"))
    kv4 = next(v for k, v in build_plan(hf, 24, gpus=4).parts.items() if k.startswith("generation"))
    assert kv4 < kv1
    with pytest.raises(ConfigError, match="--gpus 5"):
        plan_for("gpu-24gb", gpus=5)


def test_other_commands_refuse_to_run_under_torchrun(monkeypatch, capsys):
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    assert cli_main("presets") == 2
    assert "only `train` runs under torchrun" in capsys.readouterr().err
