"""The RL loop end to end on the tiny random model: the CLI run, its metrics and adapter, gradient accumulation,
the KL term, the other estimators, and seed reproducibility."""
from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import (
    FAST,
    STEP_FIELDS,
    VARIED,
    adapter_weights,
    cli_cmd,
    cli_main,
    read_lines,
    sets,
    step_records,
    subprocess_env,
    train_smoke,
)

from basis_lite import trainer
from basis_lite.runs import checkpoint as ckpt

SMOKE_STEP_KEYS = {
    "accuracy", "advantage_std", "baseline_mean", "clip_fraction", "clipped_fraction", "completion_len",
    "engine_log_ratio_max",
    "engine_log_ratio_mean", "entropy", "explained_variance", "explained_variance_loo_ref", "format_rate",
    "generation_s", "grad_norm", "guard_adapter_shift", "guard_base_distance", "guard_mismatch", "kl", "loss", "lr",
    "nonfinite_rollouts", "peak_memory_mb", "reward_mean", "reward_warnings", "skipped",
    "step", "tokens_per_s", "trained_sequences", "training_s", "update_norm", "zero_update",
    "forward_s", "logprob_s", "backward_s", "optimizer_s", "prompt_tokens", "generated_tokens", "trained_tokens",
    "forward_only_tokens", "cum_prompt_tokens", "cum_generated_tokens", "cum_trained_tokens",
    "cum_forward_only_tokens", "cum_reference_tokens"}
COSTS = ("prompt_tokens", "generated_tokens", "trained_tokens", "forward_only_tokens")


def _train(tmp_path, name, overrides) -> Path:
    return train_smoke(tmp_path / name, *overrides)


# ---------------------------------------------------------------------------------------------------------------
# the CLI, end to end


def test_smoke_cli_end_to_end(smoke_run):
    from basis_lite.config import load_config

    proc, run = smoke_run.proc, smoke_run.run_dir
    cfg = load_config("smoke")
    summary = json.loads((run / "summary.json").read_text())

    # the report: accuracy before -> after, with the numbers of the eval lines, and the adapter path
    m = re.search(r"held-out accuracy \(greedy, n=(\d+)\): before ([\d.]+) -> after ([\d.]+)", proc.stdout)
    assert m, proc.stdout
    evals = [r for r in read_lines(run) if "event" in r]
    assert [e["event"] for e in evals] == ["eval", "eval_final"]
    assert int(m.group(1)) == evals[-1]["eval_n"] == cfg.data.eval_size
    assert float(m.group(2)) == pytest.approx(evals[0]["eval_accuracy"], abs=1e-3)
    assert float(m.group(3)) == pytest.approx(evals[-1]["eval_accuracy"], abs=1e-3)
    m = re.search(r"adapter saved to (\S+)", proc.stdout)
    assert m and Path(m.group(1)) == run / "adapter" and Path(summary["adapter"]) == run / "adapter"

    # one metrics line per step, each with every field, and sane values
    recs = step_records(run)
    # the exact key set of a one-process smoke run's step line (recorded before the step record, basis_lite.rl.step,
    # replaced gather_step / step_record: a key lost or added on the way fails here)
    assert all(set(r) == SMOKE_STEP_KEYS for r in recs), sorted(set(recs[0]) ^ SMOKE_STEP_KEYS)
    assert [r["step"] for r in recs] == list(range(1, cfg.train.steps + 1))
    for r in recs:
        missing = [f for f in STEP_FIELDS if f not in r]
        assert not missing, f"step {r['step']}: missing {missing}"
        for f in STEP_FIELDS:
            assert isinstance(r[f], (int, float)), (f, r[f])
            if f != "explained_variance":  # NaN when every reward is equal (the random model scores 0 throughout)
                assert math.isfinite(r[f]), (f, r[f])
        assert 0 < r["completion_len"] <= cfg.generation.max_new_tokens
        # a cut-off completion holds exactly the budget; the random model rarely samples its stop token
        assert 0 <= r["clipped_fraction"] <= 1
        assert r["clipped_fraction"] * cfg.generation.max_new_tokens <= r["completion_len"] + 1e-9
        assert r["generation_s"] > 0 and r["training_s"] > 0 and r["tokens_per_s"] > 0 and r["peak_memory_mb"] > 0
        assert r["entropy"] > 0 and 0 <= r["accuracy"] <= 1 and r["advantage_std"] >= 0
    assert "prior_cached" in summary  # smoke has prior_samples: 2, so the BASIS prior was loaded or computed

    # checkpoints every save_every steps and at the end, the newest keep_last of them kept, all complete
    t = cfg.train
    saved = [s for s in range(1, t.steps + 1) if s % t.save_every == 0 or s == t.steps][-t.keep_last:]
    ck = run / "checkpoints"
    assert sorted(p.name for p in ck.glob("step-*")) == [f"step-{s:06d}" for s in saved]
    assert all(ckpt.verify(ck / f"step-{s:06d}") is None for s in saved)
    assert (ck / "latest").read_text().strip() == f"step-{t.steps:06d}"


def test_smoke_adapter_loads_with_peft(smoke_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from basis_lite.model.loading import resolve_model_path

    run = smoke_run.run_dir
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:tiny-random"), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(run / "adapter"))
    saved = adapter_weights(run / "adapter")
    loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert saved and len(loaded) == len(saved)
    for name, t in saved.items():
        key = name.replace(".weight", ".default.weight")
        assert torch.equal(loaded[key], t), name
    # the final adapter is the last checkpoint's
    last = adapter_weights(run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip() / "adapter")
    assert all(torch.equal(last[k], saved[k]) for k in saved)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[1, 2, 3]]))
    assert torch.isfinite(out.logits).all()


def test_presets_and_help(capsys):
    assert cli_main("presets") == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert "smoke" in names and "cpu-smollm2-arith" in names
    with pytest.raises(SystemExit) as e:
        cli_main("train", "--help")
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--preset", "--set", "--output", "--resume"):
        assert flag in text, flag


# ---------------------------------------------------------------------------------------------------------------
# invariants of the update


def test_gradient_accumulation_matches_full_batch(tmp_path):
    """TRL-style: batch 8 in one micro-batch of 8 == 8 micro-batches of 1 (same seed): the same adapter and the
    same loss trajectory. Needs real updates, hence the varied user reward."""
    common = VARIED + ["train.steps=2", "train.save_every=100", "train.batch_size=8"]
    full = _train(tmp_path, "mb8", common + ["train.micro_batch_size=8"])
    acc = _train(tmp_path, "mb1", common + ["train.micro_batch_size=1"])
    rf, ra = step_records(full), step_records(acc)
    assert len(rf) == len(ra) == 2
    for a, b in zip(rf, ra):
        assert not a["skipped"] and not b["skipped"]
        assert not a["zero_update"] and a["update_norm"] > 0  # reported as a real update
        assert a["reward_mean"] == b["reward_mean"]  # same rollouts
        assert a["advantage_std"] > 0  # updates really happen
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)
    wf, wa = adapter_weights(full / "adapter"), adapter_weights(acc / "adapter")
    assert wf.keys() == wa.keys()
    for k in wf:
        torch.testing.assert_close(wf[k], wa[k], atol=1e-6, rtol=1e-4, msg=k)
    assert any(t.abs().max() > 1e-4 for k, t in wf.items() if "lora_B" in k)  # the adapter moved


def test_kl_to_reference_is_zero_at_start_and_positive_after_an_update(tmp_path):
    run = _train(tmp_path, "kl", VARIED + ["train.steps=2", "train.save_every=100", "train.kl_coef=0.1"])
    recs = step_records(run)
    # step 1: a fresh LoRA (B = 0) is the reference model itself; step 2 follows one update
    assert recs[0]["kl"] == pytest.approx(0.0, abs=1e-9)
    assert recs[1]["kl"] > 0 and math.isfinite(recs[1]["kl"])


@pytest.mark.parametrize("estimator,extra", [("reinforce_pp", []), ("grpo", ["estimator.rollouts_per_prompt=2"]),
                                             ("rloo", ["estimator.rollouts_per_prompt=2", "estimator.normalize=always"])])
def test_other_estimators_run(tmp_path, estimator, extra):
    run = _train(tmp_path, estimator, VARIED + ["train.steps=1", "train.save_every=100", "train.batch_size=4",
                                                f"estimator.name={estimator}"] + extra)
    (r,) = step_records(run)
    assert not r["skipped"] and math.isfinite(r["loss"]) and r["grad_norm"] > 0
    # both use the batch (reinforce_pp) or group (grpo) mean as baseline: its mean is the mean reward
    assert r["baseline_mean"] == pytest.approx(r["reward_mean"], abs=1e-6)
    if estimator == "reinforce_pp" or "estimator.normalize=always" in extra:  # global whitening; RLOO / batch std
        assert r["advantage_std"] == pytest.approx(1.0, rel=1e-3)
    assert (run / "adapter" / "adapter_model.safetensors").exists()


def test_costs_and_time_split_per_step_in_total_and_in_the_summary(tmp_path):
    """Each step line counts what the step processed, independent of the machine (prompt tokens of every rollout,
    generated tokens, tokens trained forward + backward, forward-only tokens of the reference's log-probs for the KL
    term), the running totals (cum_*, the K=2 reference samples' tokens included), and splits the update's time;
    summary.json holds the totals."""
    run = _train(tmp_path, "costs", VARIED + ["train.steps=2", "train.save_every=100", "train.kl_coef=0.1",
                                             "estimator.prior_samples=2"])
    recs = step_records(run)
    summary = json.loads((run / "summary.json").read_text())
    for i, r in enumerate(recs):
        n = r["trained_sequences"]
        assert n == 8  # every rollout trained (varied rewards, BASIS normalized): all of its tokens went through
        assert r["generated_tokens"] == round(r["completion_len"] * 8) > 0
        assert r["trained_tokens"] == r["prompt_tokens"] + r["generated_tokens"] == r["forward_only_tokens"]
        for k in COSTS:
            assert r[f"cum_{k}"] == sum(x[k] for x in recs[:i + 1])
        assert r["cum_reference_tokens"] == summary["reference_tokens"] > 0
        parts = r["forward_s"] + r["logprob_s"] + r["backward_s"] + r["optimizer_s"]
        assert all(r[k] > 0 for k in ("forward_s", "logprob_s", "backward_s", "optimizer_s"))
        assert parts <= r["training_s"]
    assert summary["reference_prompt_tokens"] > 0
    for k in COSTS:
        assert summary[k] == recs[-1][f"cum_{k}"]
    for k in ("generation_s", "training_s", "forward_s", "logprob_s", "backward_s", "optimizer_s"):
        assert summary[k] == pytest.approx(sum(r[k] for r in recs), rel=1e-9)
    assert "(fwd " in trainer.step_line(recs[0]) and " logp " in trainer.step_line(recs[0])


def test_the_reported_peak_is_the_whole_jobs(tmp_path, monkeypatch):
    """No step resets the kernel's resident-set high-water mark any more: a job whose first phase (here, the eval
    before training) allocates far more than its steps reports that first peak in every later step line and in
    summary.json, as `time -v` and ru_maxrss would (the trainer used to clear it at each step's start through
    /proc/self/clear_refs, which hid the first phase and reset what those tools report)."""
    if not Path("/proc/self/status").exists():
        pytest.skip("reads VmRSS and VmHWM from /proc (Linux)")

    def rss_mb(field):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        raise AssertionError(field)

    real, seen = trainer.run_eval, {}

    def eval_with_a_big_phase(run, desc):
        if not seen:
            seen["rss"] = rss_mb("VmRSS")
            big = torch.ones(100 * 2**20, dtype=torch.uint8)  # 100 MiB written, so resident, then freed
            seen["during"] = rss_mb("VmRSS")
            del big
        return real(run, desc)

    monkeypatch.setattr(trainer, "run_eval", eval_with_a_big_phase)
    run = _train(tmp_path, "peak", VARIED + ["train.steps=2", "train.save_every=100"])
    assert seen["during"] - seen["rss"] > 90  # the allocation really was resident
    summary = json.loads((run / "summary.json").read_text())
    recs = step_records(run)
    assert all(r["peak_memory_mb"] >= seen["during"] - 1 for r in recs)
    assert summary["peak_memory_mb"] >= seen["during"] - 1
    assert summary["peak_memory_mb"] == pytest.approx(rss_mb("VmHWM"), abs=50)


def test_same_seed_same_run_whether_or_not_the_prior_is_cached(tmp_path):
    """The BASIS prior samples K rollouts per prompt when it is not cached yet and nothing when it is: the training
    run after it must not depend on which (a fresh cache vs a warm one, same seed -> same run)."""
    overrides = [o for o in VARIED if not o.startswith("estimator.prior_samples")] + [
        "estimator.prior_samples=2", "data.train_size=16", "data.seed=77", "train.steps=1", "train.save_every=100"]
    cold = _train(tmp_path, "cold", overrides)
    warm = _train(tmp_path, "warm", overrides)
    assert json.loads((cold / "summary.json").read_text())["prior_cached"] is False
    assert json.loads((warm / "summary.json").read_text())["prior_cached"] is True
    a, b = step_records(cold)[0], step_records(warm)[0]
    for k in ("reward_mean", "baseline_mean", "loss", "entropy", "completion_len"):
        assert a[k] == b[k], k
    wc, ww = adapter_weights(cold / "adapter"), adapter_weights(warm / "adapter")
    assert all(torch.equal(wc[k], ww[k]) for k in wc)


# ---------------------------------------------------------------------------------------------------------------
# what a run reports


def test_no_progress_still_prints_step_lines_and_a_zero_update_says_so(capsys, tmp_path):
    """--no-progress (logs, schedulers) still prints one line per step. The random tiny model scores 0 on every
    rollout, so every advantage is 0 and the adapter does not move: the metrics and the line say so. With
    data.eval_size=0 there is no held-out accuracy, and none is reported as 0.000."""
    run = tmp_path / "run"
    rc = cli_main("train", "--preset", "smoke", *sets(FAST + ["train.steps=2", "data.eval_size=0"]),
                  "--output", str(run), "--no-progress")
    out = capsys.readouterr().out
    assert rc == 0
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split("|")[0].strip() for line in lines] == ["step    1", "step    2"], out
    assert all(line.endswith("| NO UPDATE (every advantage is 0)") for line in lines), lines
    recs = step_records(run)
    assert all(r["zero_update"] is True and r["update_norm"] == 0.0 and r["trained_sequences"] == 0 for r in recs)
    # the leave-one-out mean's explained variance beside the baseline's: 1 - (B/(B-1))^2 at B = 8 prompts x 1
    assert all(r["explained_variance_loo_ref"] == pytest.approx(1 - (8 / 7) ** 2) for r in recs)
    assert all("(LOO -0.31)" in line for line in lines), lines
    assert not [r for r in read_lines(run) if "event" in r]  # no eval lines
    assert "no held-out accuracy: the eval split is empty (data.eval_size=0)" in out
    assert "0.000 ->" not in out and "accuracy 0.000" not in out


def test_trl_style_reward_beside_the_working_directory_trains(tmp_path):
    """A reward module next to where the user runs `basis-lite` (no PYTHONPATH=. ), written in TRL's convention
    (data columns `answer` and `level` by name, no `answers`), run in the reward worker: it trains the adapter."""
    (tmp_path / "my_trl_rewards.py").write_text(
        "def varied(completions, answer, level, completion_ids, **kwargs):\n"
        "    assert len(answer) == len(level) == len(completion_ids) == len(completions)\n"
        "    return [(sum(map(ord, c)) % 7) / 6 + 0.0 * lv for c, lv in zip(completions, level)]\n")
    over = [o for o in FAST if not o.startswith("reward.timeout_s")] + [
        "reward.functions=[my_trl_rewards:varied]", "reward.timeout_s=30", "train.steps=2", "train.save_every=100"]
    env = subprocess_env()
    assert str(tmp_path) not in env["PYTHONPATH"]
    proc = subprocess.run(cli_cmd("train", "--preset", "smoke", "--output", "run", "--no-progress", *sets(over)),
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = step_records(tmp_path / "run")
    assert len(recs) == 2 and all(r["reward_mean"] > 0 and r["reward_warnings"] == 0 for r in recs)
    assert all(not r["zero_update"] and r["update_norm"] > 0 for r in recs)
    w = adapter_weights(tmp_path / "run" / "adapter")
    assert any(t.abs().max() > 0 for k, t in w.items() if "lora_B" in k)  # B starts at 0: the adapter learned
