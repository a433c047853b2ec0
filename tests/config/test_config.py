"""The typed configuration: presets, --set overrides (YAML values), errors that name the key, round trips."""
from __future__ import annotations

import dataclasses
import re

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
        with pytest.raises(ConfigError, match="train.lr: must be a number > 0, got -0.0015"):
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
    ("train.steps=0", ("train.steps", "[1, 10000000]", "got 0")),
    ("train.lr=-1.0", ("train.lr", "> 0", "-1.0")),
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


# ---------------------------------------------------------------------------------------------------------------
# every key: a range (numbers), a meaning, checked at load


def test_every_key_has_a_meaning_and_every_number_a_range():
    from basis_lite.config import HELP, RANGES, all_keys, get

    cfg = Config()
    keys = all_keys()
    assert sorted(HELP) == sorted(keys), set(HELP) ^ set(keys)
    numeric = [k for k in keys if isinstance(get(cfg, k), (int, float)) and not isinstance(get(cfg, k), bool)]
    assert sorted(RANGES) == sorted(numeric), set(RANGES) ^ set(numeric)
    for key, choices in CHOICES.items():  # a key with fixed values names them in its meaning
        assert all(c in HELP[key] for c in choices), key


def test_every_key_is_declared_once_beside_its_field():
    """Every leaf is a `config_fields.setting` field (help, range or choices, TRL name in its metadata); the tables
    the config reads (aliases, refused names, help, ranges, choices) are derived from those fields; the estimator
    help and G's minimums come from the registry."""
    from basis_lite.config import ALIASES, FIELDS, HELP, REFUSED, all_keys
    from basis_lite.estimators import estimator_names, get_estimator

    assert list(FIELDS) == all_keys()
    for key, f in FIELDS.items():
        assert set(f.metadata) >= {"help", "range", "choices", "trl", "refuse"}, key
    assert ALIASES == {f.metadata["trl"]: k for k, f in FIELDS.items() if f.metadata["trl"]}
    assert ALIASES["learning_rate"] == "train.lr" and ALIASES["loss_type"] == "train.loss_aggregation"
    assert set(REFUSED) == {"per_device_train_batch_size", "gradient_accumulation_steps"}
    assert all(n in HELP["estimator.name"] for n in estimator_names())
    for name in estimator_names():  # every estimator that needs G >= 2 is named in G's meaning
        assert (name in HELP["estimator.rollouts_per_prompt"]) == (get_estimator(name).min_rollouts > 1), name


@pytest.mark.parametrize("override,accepted", [
    ("train.max_grad_norm=-1", "a number > 0"),  # flipped every update
    ("train.max_grad_norm=0", "a number > 0"),  # left the adapter at zero
    ("lora.alpha=0", "an integer > 0"),  # LoRA output scaled by 0
    ("train.lr=.nan", "a number > 0"),
    ("train.lr=.inf", "a number > 0"),
    ("train.lr=0", "a number > 0"),
    ("lora.dropout=5", "a number in [0, 1)"),
    ("lora.dropout=1", "a number in [0, 1)"),
    ("generation.top_k=-2", "an integer in [-1, 10000000]"),
    ("train.logprob_chunk_size=0", "an integer in [1, 16777216]"),
    ("generation.temperature=0", "a number > 0"),
    ("train.seed=-1", "an integer in [0, 4294967295]"),
    ("train.clip_low=1", "a number in [0, 1)"),
    ("train.bpo_eps=0", "a number > 0"),
    ("train.bpo_cap=-1", "a number > 0"),
    ("reward.timeout_s=.inf", "a number in [0, 86400]"),
    ("reward.correctness_weight=.nan", "a finite number"),
    ("data.max_question_chars=-1", "an integer in [0, 100000000]"),
])
def test_out_of_range_numbers_are_refused_at_load(override, accepted):
    key, value = override.split("=")
    with pytest.raises(ConfigError) as e:
        load_config("smoke", [override])
    msg = str(e.value)
    assert msg.startswith(f"{key}: must be {accepted}, got "), msg


def test_every_range_is_enforced_at_its_bounds():
    """For every numeric key: the first value outside its range is refused naming the key, the bound inside is
    accepted (other keys at the smoke preset's values)."""
    from basis_lite.config import RANGES

    for key, rng in RANGES.items():
        integer = isinstance(getattr(getattr(Config(), key.split(".")[0]), key.split(".")[1]), int)
        step = 1 if integer else 1e-9
        for bound, open_, direction in ((rng.lo, rng.lo_open, -1), (rng.hi, rng.hi_open, +1)):
            if bound is None:
                continue
            outside = bound if open_ else bound + direction * step
            with pytest.raises(ConfigError, match=rf"^{key}: must be "):
                load_config("smoke", [f"{key}={outside!r}"])


def test_top_k_minus_one_means_off():
    """vLLM and TRL spell "no top-k" -1; transformers and basis-lite spell it 0. -1 is read as 0."""
    assert load_config("smoke", ["generation.top_k=-1"]).generation.top_k == 0
    assert load_config("smoke", ["generation.top_k=20"]).generation.top_k == 20


def test_combinations_are_checked_at_load():
    with pytest.raises(ConfigError, match="generation.max_new_tokens: 120 leaves fewer than 16 prompt tokens"):
        load_config("smoke", ["generation.max_new_tokens=120"])  # smoke: max_seq_length 128
    with pytest.raises(ConfigError, match="every reward weight is 0"):
        load_config("smoke", ["reward.correctness_weight=0"])
    load_config("smoke", ["reward.correctness_weight=0", "reward.functions=[a.b:c]"])  # a user reward is enough
    with pytest.raises(ConfigError, match=r"data.levels: \[9\] not accepted for data.dataset=arithmetic"):
        load_config("smoke", ["data.levels=[9]"])
    with pytest.raises(ConfigError, match="data.train_size: must be >= 1 for the built-in task arithmetic"):
        load_config("smoke", ["data.train_size=0"])
    with pytest.raises(ConfigError, match="hf:owner/name"):
        load_config("smoke", ["data.dataset=hf:gsm8k"])
    assert load_config("smoke", ["data.dataset=hf:openai/gsm8k:main"]).data.dataset == "hf:openai/gsm8k:main"
    with pytest.raises(ConfigError, match="reward.function_weights: .*finite"):
        load_config("smoke", ["reward.functions=[a.b:c]", "reward.function_weights=[.nan]"])


def test_options_for_an_estimator_that_takes_none_are_refused():
    with pytest.raises(ConfigError, match="rloo takes no options; got \\['bandwidth'\\]. Remove estimator.options"):
        load_config("smoke", ["estimator.name=rloo", "estimator.rollouts_per_prompt=2",
                              "estimator.options={bandwidth: 0.3}"])


def test_validate_checks_a_config_changed_in_code():
    """train() validates again, so a Config built in code cannot skip the checks."""
    from basis_lite.config import validate

    cfg = load_config("smoke")
    cfg.train.max_grad_norm = -1.0
    with pytest.raises(ConfigError, match="train.max_grad_norm"):
        validate(cfg)
    cfg = load_config("smoke")
    cfg.train.steps = "3"
    with pytest.raises(ConfigError, match="train.steps: expected an integer"):
        validate(cfg)


# ---------------------------------------------------------------------------------------------------------------
# names people reach for: did-you-mean, TRL's names


@pytest.mark.parametrize("override,suggestion", [
    ("train.stepz=3", "did you mean train.steps?"),
    ("train.learning_rat=1e-5", "did you mean train.lr?"),
    ("train.temperature=0.5", "did you mean generation.temperature?"),
    ("lr=1e-4", "did you mean train.lr?"),
    ("modle.name=x", "did you mean model?"),
    ("estimator.options={bandwith: 0.3}", "did you mean bandwidth?"),
])
def test_did_you_mean(override, suggestion):
    with pytest.raises(ConfigError) as e:
        load_config("smoke", [override])
    assert suggestion in str(e.value), str(e.value)


@pytest.mark.parametrize("alias,key,value", [
    ("learning_rate", "train.lr", 1e-5), ("num_generations", "estimator.rollouts_per_prompt", 4),
    ("max_completion_length", "generation.max_new_tokens", 24), ("beta", "train.kl_coef", 0.04),
    ("epsilon", "train.clip_low", 0.1), ("epsilon_high", "train.clip_high", 0.3), ("max_steps", "train.steps", 7),
    ("temperature", "generation.temperature", 0.5), ("lora_r", "lora.r", 8), ("seed", "train.seed", 5),
    ("save_steps", "train.save_every", 3), ("sapo_temperature_neg", "train.sapo_temperature_neg", 1.2),
])
def test_trl_names_are_aliases(alias, key, value):
    from basis_lite.config import get

    extra = ["estimator.name=grpo"] if alias == "num_generations" else []
    section = key.split(".")[0]
    for name in (alias, f"{section}.{alias}"):  # at the top level, or in the section it belongs to
        cfg = load_config("smoke", extra + [f"{name}={value}"])
        assert get(cfg, key) == value
    if alias != key.rsplit(".", 1)[1]:
        saved = yaml.safe_dump(to_dict(cfg))
        assert not re.search(rf"^\s*{alias}:", saved, re.M)  # saved under basis-lite's own name
    cfg = load_config(data={"preset": "x", alias: value, **({"estimator": {"name": "grpo"}} if extra else {})})
    assert get(cfg, key) == value


def test_per_device_train_batch_size_is_refused_with_what_to_write():
    """TRL counts completions per device, basis-lite prompts per step: not the same number, so no alias."""
    with pytest.raises(ConfigError) as e:
        load_config("smoke", ["per_device_train_batch_size=16"])
    msg = str(e.value)
    assert "COMPLETIONS" in msg and "PROMPTS" in msg and "train.batch_size" in msg and "num_generations" in msg


# ---------------------------------------------------------------------------------------------------------------
# `basis-lite config`


@pytest.mark.parametrize("name", list_presets())
def test_described_config_shows_every_key_and_loads_back(name):
    from basis_lite.config import HELP, all_keys, describe_config

    cfg = load_config(name, ["train.steps=3", "learning_rate=1e-5"])
    text = describe_config(cfg)
    assert load_config(data=yaml.safe_load(text)) == cfg  # the printout is a preset
    comments = " ".join(line.strip().lstrip("# ") for line in text.splitlines() if line.strip().startswith("#"))
    for key in all_keys():
        leaf = key.rsplit(".", 1)[-1]
        assert any(line.strip().startswith(f"{leaf}:") for line in text.splitlines()), key
        assert " ".join(HELP[key].split()[:4]) in comments, key
    assert "(default 40)" in text and "[a number > 0]" in text  # train.steps differs from its default; lr's range
