"""Reliability, fourth round (issue 37), divergence: an update that blows the adapter up (finite but huge weights,
so that its logits are NaN or inf) is never checkpointed, exported or resumed from; the steps whose model outputs
are not finite are skipped like a non-finite loss, and `train.max_bad_steps` of them stop the run with exit 2
naming the last checkpoint (whose outputs are finite); a step logged "skipped" did not move the adapter.

Divergence is real here: AdamW with train.lr x train.weight_decay = 100 multiplies every weight by -99 per step, so
the adapter grows until the forward overflows (a few steps); train.lr = 1e30 does it in one. Per CPU engine: the
HF engine's generate() (generation.fast_cpu=off) and the fast CPU decoder (auto)."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import VARIED, cli_main, error_line, sets, snapshot, step_records

from basis_lite.runs import checkpoint as ckpt

BASE = VARIED + ["train.batch_size=4", "train.micro_batch_size=4", "train.save_every=1", "train.keep_last=20"]
GROWING = ["train.lr=1", "train.weight_decay=100", "train.steps=12", "train.max_bad_steps=2"]
ENGINES = {"hf": "generation.fast_cpu=off", "fast_cpu": "generation.fast_cpu=auto"}


def _train(run, *extra) -> int:
    return cli_main("train", "--preset", "smoke", *sets(BASE + list(extra)), "--output", str(run), "--no-progress")


def _outputs_finite(run: Path, adapter: Path) -> bool:
    """Load the run's base with `adapter` and run the check the trainer runs, on the run's own prompts."""
    from basis_lite.config import load_config_file
    from basis_lite.data import format_prompt, load_examples
    from basis_lite.model.loading import load_policy, outputs_finite

    cfg = load_config_file(run / "config.yaml")
    model, tok = load_policy(cfg, torch.device("cpu"), torch.float32, adapter_path=str(adapter))
    texts = [format_prompt(tok, ex.prompt, cfg.data) for ex in load_examples(cfg.data, "train")[:2]]
    return outputs_finite(model, tok, texts)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_diverging_run_stops_naming_its_last_finite_checkpoint(tmp_path, capsys, engine):
    run = tmp_path / "run"
    assert _train(run, *GROWING, ENGINES[engine]) == 2
    err = error_line(capsys)
    assert "non-finite model outputs" in err and "train.weight_decay" in err
    named = re.search(r"checkpoints/(step-\d+)", err)
    assert named, err
    kept = [p.name for p in ckpt.intact_checkpoints(run)]
    assert kept[0] == named.group(1)  # the newest checkpoint is the one named
    assert _outputs_finite(run, run / "checkpoints" / kept[0] / "adapter")
    assert not (run / "adapter").exists() and not (run / "summary.json").exists()
    records = step_records(run)
    skipped = [r for r in records if r["skipped"]]
    assert skipped and all(r["nonfinite_rollouts"] > 0 and r["update_norm"] == 0.0 for r in skipped)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    if engine == "fast_cpu":  # a resume repeats the same steps and stops the same way, without a traceback
        before = snapshot(run / "checkpoints")
        assert cli_main("train", "--resume", str(run), "--no-progress") == 2
        assert named.group(1) in error_line(capsys)
        assert snapshot(run / "checkpoints") == before


@pytest.mark.parametrize("estimator", ["basis", "reinforce_pp"])
def test_an_adapter_blown_up_by_the_last_step_is_not_saved(tmp_path, capsys, estimator):
    run = tmp_path / "run"
    assert _train(run, "train.lr=1e30", "train.steps=1", f"estimator.name={estimator}") == 2
    err = error_line(capsys)
    assert "non-finite outputs" in err and "not saved" in err and "No checkpoint was written" in err
    assert not (run / "adapter").exists() and not (run / "checkpoints").exists()


def test_a_step_logged_skipped_did_not_move_the_adapter(tmp_path, capsys):
    """Two passes per batch: the first blows the adapter up, the second's loss is NaN; the step is skipped as a
    whole (weights and optimizer state put back), so the checkpoints hold the initial adapter."""
    run = tmp_path / "run"
    assert _train(run, "train.lr=1e30", "train.ppo_epochs=2", "train.steps=3", "train.max_bad_steps=2") == 2
    assert "non-finite loss" in error_line(capsys)
    (record,) = step_records(run)
    assert record["skipped"] and record["update_norm"] == 0.0 and record["zero_update"]
    weights = ckpt.load_adapter_tensors(run / "checkpoints" / "step-000001" / "adapter")
    assert all(float(t.abs().max()) < 10 for t in weights.values())
    assert all(float(t.abs().max()) == 0 for k, t in weights.items() if "lora_B" in k)  # as initialised


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    run = tmp_path_factory.mktemp("diverged") / "run"
    assert _train(run, "train.steps=2") == 0
    return run


def _blow_up(adapter: Path) -> None:
    """Finite but huge weights, as a diverged update of an older basis-lite left them (its manifest rewritten)."""
    from safetensors.torch import save_file

    tensors = ckpt.load_adapter_tensors(adapter)
    save_file({k: torch.full_like(t, 1e30) for k, t in tensors.items()}, str(adapter / ckpt.ADAPTER_WEIGHTS))
    if (adapter.parent / ckpt.MANIFEST).exists():
        ckpt.write_manifest(adapter.parent)


def test_a_resume_skips_a_checkpoint_whose_outputs_are_not_finite(finished, tmp_path, caplog):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    shutil.rmtree(run / "adapter")
    (run / "summary.json").unlink()
    _blow_up(run / "checkpoints" / "step-000002" / "adapter")
    assert ckpt.verify(run / "checkpoints" / "step-000002") is None  # intact: only its content is wrong
    assert cli_main("train", "--resume", str(run), "--no-progress") == 0
    assert "skipping checkpoint" in caplog.text and "non-finite outputs" in caplog.text
    assert [r["step"] for r in step_records(run)] == [1, 2]
    assert _outputs_finite(run, run / "adapter")


def test_an_adapter_whose_outputs_are_not_finite_is_not_exported(finished, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    _blow_up(run / "adapter")
    out = tmp_path / "export"
    assert cli_main("export", str(run), "--out", str(out)) == 2
    assert "non-finite" in error_line(capsys) and not out.exists()


def test_a_kl_term_that_overflows_is_named_not_the_learning_rate(tmp_path, capsys):
    """train.kl_coef = 1e300: the KL is 0 at the first step (the adapter starts as the base), then finite and
    small; times the coefficient it is inf, every later step is skipped, and the message names kl_coef."""
    run = tmp_path / "run"
    assert _train(run, "train.kl_coef=1e300", "train.steps=4", "train.max_bad_steps=2") == 2
    err = error_line(capsys)
    assert "train.kl_coef" in err and "Lower train.lr" not in err and "non-finite loss" in err
