"""`basis-lite train --config grpo.yaml`: a `trl grpo --config` file read with TRL's meaning (config/trl.py): every
key basis-lite knows is mapped, the rest refused in one message with the nearest basis-lite key, exit 2, before any
model loads; and a short real run from a TRL config with a TRL reward file (sync and async functions)."""
from __future__ import annotations

import pytest
import yaml
from conftest import cli_main, step_records

from basis_lite.config import load_config
from basis_lite.errors import ConfigError

GRPO_YAML = {  # the shape of TRL's own `trl grpo` example configs
    "model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct",
    "dataset_name": "trl-lib/DeepMath-103K",
    "dataset_train_split": "train",
    "output_dir": "runs/from-trl",
    "learning_rate": 1.0e-6,
    "lr_scheduler_type": "cosine",
    "warmup_ratio": 0.1,
    "max_steps": 20,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 2,
    "num_generations": 4,
    "max_completion_length": 128,
    "temperature": 0.9,
    "loss_type": "dr_grpo",
    "importance_sampling_level": "sequence",
    "beta": 0.04,
    "epsilon": 0.2,
    "epsilon_high": 0.28,
    "bf16": True,
    "gradient_checkpointing": True,
    "use_peft": True,
    "lora_r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.05,
    "lora_target_modules": ["q_proj", "v_proj"],
    "reward_funcs": ["accuracy_reward", "my_lib.rewards.custom_reward"],
    "reward_weights": [1.0, 0.5],
    "seed": 7,
    "save_steps": 5,
    "save_total_limit": 3,
    "report_to": "none",
    "optim": "adamw_torch_fused",
}


def _write(tmp_path, data: dict, name: str = "grpo.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_trl_grpo_config_maps_every_key(tmp_path):
    cfg = load_config(None, [], trl_config=_write(tmp_path, GRPO_YAML))
    m, lo, d, g, r, t, e = cfg.model, cfg.lora, cfg.data, cfg.generation, cfg.reward, cfg.train, cfg.estimator
    assert (m.name, m.dtype, m.gradient_checkpointing) == ("Qwen/Qwen2.5-0.5B-Instruct", "bfloat16", True)
    assert (d.dataset, d.split_train, cfg.output_dir) == ("hf:trl-lib/DeepMath-103K", "train", "runs/from-trl")
    assert (t.lr, t.schedule, t.warmup_steps, t.steps, t.seed, t.save_every, t.keep_last) == (
        1e-6, "cosine", 2, 20, 7, 5, 3)
    # 8 completions per device x 2 accumulation steps = 16 completions = 4 prompts x 4 generations
    assert (t.batch_size, e.rollouts_per_prompt, t.micro_batch_size) == (4, 4, 8)
    assert (g.max_new_tokens, g.temperature) == (128, 0.9)
    assert (t.loss, t.loss_aggregation, t.importance_sampling_level) == ("ppo_clip", "seq-mean-token-sum-norm",
                                                                         "sequence")
    assert (t.kl_coef, t.clip_low, t.clip_high, t.optimizer, t.report_to) == (0.04, 0.2, 0.28, "adamw", [])
    assert (lo.r, lo.alpha, lo.dropout, lo.target_modules) == (8, 16, 0.05, ["q_proj", "v_proj"])
    # TRL's reward is its functions alone: its built-in accuracy_reward from trl, a dotted path as module:function
    assert r.functions == ["trl.rewards:accuracy_reward", "my_lib.rewards:custom_reward"]
    assert (r.function_weights, r.correctness_weight) == ([1.0, 0.5], 0.0)
    # --set applies after the TRL file
    assert load_config(None, ["train.lr=3e-4"], trl_config=tmp_path / "grpo.yaml").train.lr == 3e-4


def test_cispo_cap_is_trls(tmp_path):
    """TRL's cispo caps the weight at epsilon_high itself (basis-lite at 1 + clip_high); unset, TRL's cap would be
    epsilon (0.2), so the file is refused."""
    cfg = load_config(None, [], trl_config=_write(tmp_path, {"loss_type": "cispo", "epsilon_high": 5.0}))
    assert (cfg.train.loss, cfg.train.clip_high) == ("cispo", 4.0)
    with pytest.raises(ConfigError, match="loss_type cispo: TRL caps the importance weight at epsilon_high, which "
                                          "is not set here"):
        load_config(None, [], trl_config=_write(tmp_path, {"loss_type": "cispo"}, "c.yaml"))


@pytest.mark.parametrize("extra,fragment", [
    ({"per_device_train_batch_size": 6, "num_generations": 4},
     "per_device_train_batch_size (per_device_train_batch_size x gradient_accumulation_steps = 6 completions per "
     "step is not a multiple of num_generations=4; nearest basis-lite key: train.batch_size)"),
    ({"lr_scheduler_type": "linear"}, "lr_scheduler_type (lr_scheduler_type 'linear': basis-lite has cosine"),
    ({"use_peft": False}, "use_peft (basis-lite always trains a LoRA adapter"),
    ({"learning_rate": "fast"}, "learning_rate (read as train.lr): train.lr: expected a number, got 'fast'"),
])
def test_values_basis_lite_cannot_honour_name_the_trl_key(tmp_path, extra, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(None, [], trl_config=_write(tmp_path, extra))
    assert fragment in str(e.value)


def test_unmapped_keys_exit_2_before_any_model_loads(tmp_path, capsys, monkeypatch):
    """Every key basis-lite cannot map, in one line with the nearest basis-lite key; exit 2; no run folder, no
    model load."""
    import basis_lite.trainer as trainer

    def no_model(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(trainer, "build_policy", no_model)
    bad = dict(GRPO_YAML, logging_steps=10, num_train_epochs=1, vllm_mode="colocate", mask_truncated_completions=True)
    del bad["max_steps"]
    out = tmp_path / "run"
    rc = cli_main("train", "--config", str(_write(tmp_path, bad)), "--output", str(out), "--no-progress")
    err = capsys.readouterr().err.strip()
    assert rc == 2 and not out.exists()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "5 TRL keys basis-lite cannot map" in err
    assert "warmup_ratio (warmup_ratio needs max_steps > 0" in err
    assert "logging_steps (basis-lite logs every step to metrics.jsonl; nearest basis-lite key: train.report_to)" in err
    assert "num_train_epochs (basis-lite counts optimizer steps, not epochs: set max_steps; nearest basis-lite key: " \
           "train.steps)" in err
    assert "vllm_mode (nearest basis-lite key: " in err and "mask_truncated_completions (nearest basis-lite key: " in err
    assert cli_main("train", "--config", str(tmp_path / "missing.yaml")) == 2
    assert "no such file" in capsys.readouterr().err


def test_config_prints_a_trl_file(tmp_path, capsys):
    assert cli_main("config", "--config", str(_write(tmp_path, {"learning_rate": 5e-5, "num_generations": 2}))) == 0
    text = capsys.readouterr().out
    assert "with the TRL config" in text and "  lr: 5.0e-05" in text and "  rollouts_per_prompt: 2" in text


def test_training_from_a_trl_config_with_a_trl_reward_file(tmp_path):
    """A short real run on the tiny model from a TRL config whose reward functions are a TRL reward file's
    (tests/reward_fns_trl.py: sync, trainer_state + log_metric, and two async judges awaited together in the
    reward worker)."""
    trl_file = _write(tmp_path, {
        "max_steps": 2, "learning_rate": 1e-3, "num_generations": 2, "per_device_train_batch_size": 4,
        "max_completion_length": 8, "loss_type": "grpo", "save_steps": 2, "report_to": "none",
        "reward_funcs": [f"tests.reward_fns_trl.{f}" for f in ("reward_len", "warmup_weighted", "judge_a", "judge_b")],
        "reward_weights": [0.1, 1.0, 1.0, 0.0]})
    run = tmp_path / "run"
    rc = cli_main("train", "--preset", "smoke", "--config", str(trl_file), "--output", str(run), "--no-progress",
                  "--set", "data.eval_size=4", "--set", "train.eval_max_new_tokens=4", "--set", "model.dtype=float32",
                  "--set", "train.threads=1")
    assert rc == 0
    recs = step_records(run)
    assert [r["step"] for r in recs] == [1, 2]
    assert [r["reward/warmup_scale"] for r in recs] == [0.5, 1.0]  # trainer_state.global_step, via log_metric
    assert all(r["reward_warnings"] == 0 and r["trained_sequences"] > 0 for r in recs)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["train"]["loss_aggregation"] == "seq-mean-token-mean" and saved["train"]["batch_size"] == 2
    assert saved["reward"]["correctness_weight"] == 0.0
