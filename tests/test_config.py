"""The typed configuration: presets, --set overrides (YAML values), errors that name the key, round trips."""
from __future__ import annotations

import dataclasses

import pytest
import yaml

from basis_lite.config import (
    CHOICES,
    Config,
    ConfigError,
    TrainConfig,
    from_dict,
    list_presets,
    load_config,
    preset_path,
    save_config,
    to_dict,
)


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_loads_and_round_trips(name, tmp_path):
    cfg = load_config(name)
    assert isinstance(cfg, Config) and cfg.preset == name
    assert cfg.train.micro_batch_size <= cfg.train.batch_size * cfg.estimator.rollouts_per_prompt
    # every key the preset file sets is what the config holds
    raw = yaml.safe_load(preset_path(name).read_text())
    for section, values in raw.items():
        if isinstance(values, dict):
            for k, v in values.items():
                assert getattr(getattr(cfg, section), k) == v, f"{section}.{k}"
        else:
            assert getattr(cfg, section) == values, section
    assert from_dict(to_dict(cfg)) == cfg
    save_config(cfg, tmp_path / "c.yaml")
    assert from_dict(yaml.safe_load((tmp_path / "c.yaml").read_text())) == cfg


def test_presets_include_the_documented_ones():
    assert {"smoke", "cpu-smollm2-arith"} <= set(list_presets())


def test_overrides_are_parsed_as_yaml():
    cfg = load_config("smoke", [
        "train.steps=7", "train.lr=0.5", "model.load_in_4bit=true", "data.levels=[1, 3]",
        "reward.functions=[tests.reward_fns:char_sum_reward]", "data.system_prompt='Be brief: answer.'",
        "estimator.options={bandwidth: 0.5, shrink: 4}", "lora.target_modules=[q_proj, v_proj]",
        "data.instruction=",
    ])
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.train.lr == 0.5 and cfg.model.load_in_4bit is True
    assert cfg.data.levels == [1, 3]
    assert cfg.reward.functions == ["tests.reward_fns:char_sum_reward"]
    assert cfg.data.system_prompt == "Be brief: answer."
    assert cfg.estimator.options == {"bandwidth": 0.5, "shrink": 4}
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.data.instruction == ""
    # the last override of a key wins; an int is accepted where a float is expected
    cfg = load_config("smoke", ["train.steps=2", "train.steps=5", "train.kl_coef=1"])
    assert cfg.train.steps == 5 and cfg.train.kl_coef == 1.0 and isinstance(cfg.train.kl_coef, float)


@pytest.mark.parametrize("text,value", [("1e-5", 1e-5), ("2E-4", 2e-4), ("3e2", 300.0), ("-1.5e-3", None)])
def test_scientific_notation_for_floats(text, value):
    """YAML 1.1 (PyYAML) reads 1e-5 as a string; `--set train.lr=1e-5` is what everybody types."""
    if value is None:  # parsed fine, rejected by the range check with the key named
        with pytest.raises(ConfigError, match="train.lr: must be >= 0"):
            load_config("smoke", [f"train.lr={text}"])
        return
    assert load_config("smoke", [f"train.lr={text}"]).train.lr == pytest.approx(value)


def test_unknown_nested_key_lists_accepted_keys():
    with pytest.raises(ConfigError) as e:
        load_config("smoke", ["train.stepz=3"])
    msg = str(e.value)
    assert "train.stepz" in msg
    assert all(f.name in msg for f in dataclasses.fields(TrainConfig))
    with pytest.raises(ConfigError) as e:
        load_config("smoke", ["trian.steps=3"])
    assert "trian" in str(e.value) and all(f.name in str(e.value) for f in dataclasses.fields(Config))


@pytest.mark.parametrize("override,words", [
    ("train.steps=abc", ("train.steps", "integer")),
    ("train.steps=2.5", ("train.steps", "integer")),
    ("model.load_in_4bit=maybe", ("model.load_in_4bit", "true or false")),
    ("data.levels=3", ("data.levels", "list")),
    ("train=3", ("train", "mapping")),
    ("train.steps", ("key=value",)),
    ("train.steps=0", ("train.steps", "> 0")),
    ("train.lr=-1.0", ("train.lr", ">= 0")),
    ("generation.top_p=1.5", ("generation.top_p",)),
    ("reward.functions=[not_a_spec]", ("package.module:function",)),
    ("reward.function_weights=[1.0]", ("function_weights",)),
    ("estimator.name=rloo", ("rollouts_per_prompt",)),
    # estimator options are checked when the config loads, not at the first step
    ("estimator.options={pool: similarity, lam: 2}", ("estimator.options.lam", "pool", "accepted options", "bandwidth")),
    ("estimator.options={bandwidth: -1}", ("estimator.options.bandwidth", "-1", "positive number")),
])
def test_bad_values_name_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        load_config("smoke", [override])
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_bad_choice_lists_the_accepted_values():
    for key, choices in CHOICES.items():
        with pytest.raises(ConfigError) as e:
            load_config("smoke", [f"{key}=nonsense"])
        assert key in str(e.value) and all(c in str(e.value) for c in choices)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="smoke"):
        load_config("no-such-preset")


def test_round_trip_keeps_every_override():
    cfg = load_config("smoke", ["train.steps=9", "estimator.name=grpo", "estimator.rollouts_per_prompt=4",
                                "reward.functions=[a.b:c]", "reward.function_weights=[0.5]", "data.levels=[2]"])
    d = to_dict(cfg)
    assert d["train"]["steps"] == 9 and d["estimator"]["rollouts_per_prompt"] == 4
    back = from_dict(d)
    assert back == cfg and to_dict(back) == d
    # a mapping with an unknown key is refused on the way back in, naming it
    d["train"]["stepz"] = 1
    with pytest.raises(ConfigError, match="train.stepz"):
        from_dict(d)


def test_cv_bandwidth_with_a_prior_is_rejected_at_load_not_at_step_1():
    bad = ["estimator.prior_samples=2", "estimator.options={bandwidth: cv, shrink: cv}"]
    with pytest.raises(ConfigError, match="combine: residual"):
        load_config("smoke", bad)
    load_config("smoke", bad[:1] + ["estimator.options={bandwidth: cv, shrink: cv, combine: residual}"])
    load_config("smoke", ["estimator.prior_samples=0", "estimator.options={bandwidth: cv, shrink: cv}"])  # no prior
