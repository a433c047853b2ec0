"""The rollout guard (basis_lite/rl/guard.py): a run whose engine generates from the base or a stale adapter stops
at the first bad step with exit 2, a message naming the engine and the fix, and nothing of that step logged.

Each engine's weight hand-off is sabotaged with monkeypatch where the real code hands the adapter over:
`HFEngine.sync` (the engine keeps a copy of the model from an earlier step), the fast CPU path's `lora_parts`
(the merged weights get no adapter), and, for an engine without log-probs, the same with the log-probs dropped (the
periodic spot check). The vLLM engine's hand-off is tested in tests/engines/test_vllm.py (marker vllm). A control
run with the same settings and no sabotage goes through while its adapter moves as far.
"""
from __future__ import annotations

import copy

import pytest
from conftest import VARIED, cli_main, sets, step_records

from basis_lite.engines import fast_cpu
from basis_lite.engines.hf import HFEngine
from basis_lite.model.loading import decoder_layers
from basis_lite.rl.guard import ADAPTER_MOVED

# a learning rate that moves the tiny model's adapter clearly in one step (the guard needs a moved adapter to
# tell it from the base), 4 steps
SETTINGS = VARIED + ["train.steps=4", "train.lr=0.05", "train.warmup_steps=0", "train.save_every=1",
                     "estimator.name=reinforce_pp", "data.train_size=64"]


def _train(run_dir, *extra: str) -> int:
    return cli_main("train", "--preset", "smoke", "--output", str(run_dir), "--no-progress", *sets(SETTINGS + list(extra)))


def _steps(run_dir) -> list[int]:
    return [r["step"] for r in step_records(run_dir)]


def test_control_run_passes_the_guard_while_its_adapter_moves(tmp_path):
    run = tmp_path / "control"
    assert _train(run, "generation.fast_cpu=off") == 0
    recs = step_records(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(r["guard_mismatch"] < 1e-4 for r in recs)  # the same model, fp32: rounding only
    assert recs[0]["guard_adapter_shift"] == 0.0  # a fresh LoRA is the base
    assert all(r["guard_adapter_shift"] > 10 * ADAPTER_MOVED for r in recs[1:])  # moved, and still no stop


def _stale_sync(frozen_at: int):
    """HFEngine.sync that hands the engine a copy of the model taken at sync number `frozen_at` and keeps it."""
    def sync(self, model=None):
        self._syncs = getattr(self, "_syncs", 0) + 1
        if self._syncs == frozen_at:
            self.model = copy.deepcopy(self.model)
            self._layers = decoder_layers(self.model)
    return sync


@pytest.mark.parametrize("dropout", ["0.0", "0.1"])
def test_hf_engine_generating_from_the_base_stops_at_the_first_bad_step(tmp_path, monkeypatch, capsys, dropout):
    """The engine keeps the model of the first sync (a fresh adapter: the base); step 2 is the first step whose
    adapter differs from it. Without LoRA dropout the check runs inside the update from its first pass (can_defer);
    with it, before scoring with forwards of its own."""
    from basis_lite.rl import guard

    calls = []
    real = guard._scores
    monkeypatch.setattr(guard, "_scores", lambda *a, **k: calls.append(a[-1] is not None) or real(*a, **k))
    monkeypatch.setattr(HFEngine, "sync", _stale_sync(1))
    run = tmp_path / "hf"
    assert _train(run, "generation.fast_cpu=off", f"lora.dropout={dropout}") == 2
    assert calls == [dropout == "0.0"] * 2  # steps 1 and 2: the adapter's log-probs from the update, or computed
    err = capsys.readouterr().err
    assert "rollout guard, step 2: the hf engine generated from the BASE model" in err
    assert "Fix: the rollouts came from a model other than the one being trained" in err
    assert _steps(run) == [1]


def test_hf_engine_with_a_stale_adapter_stops_on_the_mismatch_bound(tmp_path, monkeypatch, capsys):
    """The engine keeps the model of the second sync (one update old, not the base): the mismatch bound catches it
    at step 3, the first step it serves a stale adapter."""
    monkeypatch.setattr(HFEngine, "sync", _stale_sync(2))
    run = tmp_path / "stale"
    assert _train(run, "generation.fast_cpu=off", "generation.guard_max_mismatch=0.002") == 2
    err = capsys.readouterr().err
    assert "rollout guard, step 3: the hf engine reports log-probs that differ from the trainer's by" in err
    assert "a stale one?" in err
    assert _steps(run) == [1, 2]


def _no_adapter_parts(monkeypatch):
    real = fast_cpu.lora_parts
    monkeypatch.setattr(fast_cpu, "lora_parts", lambda module: (real(module)[0], []))


def test_fast_cpu_path_without_the_adapter_stops_at_the_first_bad_step(tmp_path, monkeypatch, capsys):
    _no_adapter_parts(monkeypatch)
    run = tmp_path / "fast"
    assert _train(run, "generation.fast_cpu=auto") == 2
    err = capsys.readouterr().err
    assert "rollout guard, step 2: the fast_cpu engine generated from the BASE model" in err
    assert "Fix: set generation.fast_cpu=off" in err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1 and "Traceback" not in err
    assert _steps(run) == [1]


def _drop_logprobs(monkeypatch, sampled_only: bool):
    """The engine reports no log-probs: for sampled rollouts only (vLLM in its raw log-prob mode at a temperature
    other than 1), or never."""
    real_generate = HFEngine.generate

    def generate(self, prompts, params, *a, **k):
        rolls = real_generate(self, prompts, params, *a, **k)
        if params.temperature > 0 or not sampled_only:
            for r in rolls:
                r.logprobs = None
        return rolls

    monkeypatch.setattr(HFEngine, "generate", generate)


def test_engine_without_sampled_log_probs_is_caught_by_the_spot_check(tmp_path, monkeypatch, capsys):
    """No log-probs on the sampled rollouts and the base served: the spot check (every step here) decodes greedily,
    where the engine does report log-probs (temperature 1), and they sit at the base's."""
    _no_adapter_parts(monkeypatch)
    _drop_logprobs(monkeypatch, sampled_only=True)
    run = tmp_path / "spot"
    assert _train(run, "generation.fast_cpu=auto", "generation.guard_check_every=1", "generation.temperature=0.9") == 2
    err = capsys.readouterr().err
    assert "rollout guard, step 2: the fast_cpu engine generated from the BASE model, not the adapter being trained " \
           "(spot check, greedy tokens)" in err
    assert _steps(run) == [1]


def test_engine_without_any_log_probs_is_caught_by_the_greedy_tokens(tmp_path, monkeypatch, capsys):
    """No log-probs at all and the base served: the engine's greedy tokens follow the base's most likely tokens
    where base and adapter differ. Greedy choices change later than log-probs, so the adapter is moved harder here
    (train.lr 0.3) to make step 2 the first step they differ."""
    _no_adapter_parts(monkeypatch)
    _drop_logprobs(monkeypatch, sampled_only=False)
    run = tmp_path / "spot-argmax"
    assert _train(run, "generation.fast_cpu=auto", "generation.guard_check_every=1", "train.lr=0.3") == 2
    err = capsys.readouterr().err
    assert "rollout guard, step 2: the fast_cpu engine reports no log-probs, and its greedy tokens follow the BASE " \
           "model" in err
    assert _steps(run) == [1]


def test_spot_check_passes_an_engine_without_log_probs_that_uses_the_adapter(tmp_path, monkeypatch):
    _drop_logprobs(monkeypatch, sampled_only=False)
    run = tmp_path / "spot-ok"
    assert _train(run, "generation.fast_cpu=auto", "generation.guard_check_every=2", "train.lr=0.3") == 0
    recs = step_records(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert "guard_mismatch" not in recs[1] and "guard_spot_positions" not in recs[0]  # every 2nd step only
    checked = [recs[1], recs[3]]
    assert all(r["guard_spot_disagreement"] == 0.0 and r["guard_spot_positions"] > 0 for r in checked)
    # the adapter changed the most likely token at some positions, and the engine took the adapter's every time
    assert checked[1]["guard_spot_differing"] > 0 and checked[1]["guard_spot_base_share"] == 0.0


@pytest.mark.parametrize("value", ["-0.1", "x"])
def test_guard_settings_are_checked(value, capsys):
    assert cli_main("config", "--preset", "smoke", "--set", f"generation.guard_max_mismatch={value}") == 2
    assert "generation.guard_max_mismatch" in capsys.readouterr().err
