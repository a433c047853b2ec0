"""Reliability, fourth round (issue 37), configs: YAML aliases that expand without bound (a few hundred bytes
standing for billions of values) or hold themselves, under every key, from a file or `--set`; error messages that
print a value cut short; a key given under TRL's name and its own in one source. Each ends in exit 2 with one line
naming the source, before anything is loaded or written."""
from __future__ import annotations

import json
import resource
import subprocess

import pytest
from conftest import REPO, cli_cmd, cli_main, subprocess_env

from basis_lite.config import ALIASES, CHOICES, FIELDS, MAX_CONFIG_VALUES, RANGES, load_config
from basis_lite.errors import ConfigError

# every leaf key, an unknown key, and a TRL name: a bomb is refused whatever key holds it
BOMB_KEYS = [*FIELDS, "train.no_such_key", "no_such_section", *ALIASES]
CONTAINER_KEYS = [k for k, f in FIELDS.items() if f.type in ("list", "dict", "Any")]


def bomb(levels: int = 6, width: int = 10) -> str:
    """A flow YAML list whose aliases expand to width ** levels values (10 ** 6 here: past the bound, yet small
    enough that code without the bound would only be slow, never exhaust the machine)."""
    parts = ["&a0 [" + ", ".join(["lol"] * width) + "]"]
    parts += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "[" + ", ".join(parts) + "]"


def yaml_at(key: str, value: str) -> str:
    section, _, leaf = key.rpartition(".")
    return f"{section}:\n  {leaf}: {value}\n" if section else f"{leaf}: {value}\n"


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err[-3000:]
    assert len(lines[0]) < 600, f"an error line of {len(lines[0])} characters"
    return lines[0]


def _refused(*args) -> str:
    """The ConfigError of load_config(*args) (the CLI prints it as one line, exit 2), checked to be short."""
    with pytest.raises(ConfigError) as e:
        load_config(*args)
    assert len(str(e.value)) < 600, f"an error of {len(str(e.value))} characters"
    return str(e.value)


@pytest.mark.parametrize("key", BOMB_KEYS)
def test_an_alias_bomb_is_refused_whatever_key_holds_it_in_a_file_or_a_set(tmp_path, key):
    path = tmp_path / "bomb.yaml"
    path.write_text(yaml_at(key, bomb()))
    err = _refused(str(path))
    assert str(path) in err and "expand" in err and str(MAX_CONFIG_VALUES) in err
    err = _refused("smoke", [f"{key}={bomb()}"])
    assert "--set" in err and key in err and "expand" in err


@pytest.mark.parametrize("source", ["file", "set"])
def test_the_config_command_refuses_a_bomb_with_exit_2(tmp_path, capsys, source):
    path = tmp_path / "bomb.yaml"
    path.write_text(yaml_at("lora.target_modules", bomb()))
    args = ["--preset", str(path)] if source == "file" else ["--set", f"lora.target_modules={bomb()}"]
    assert cli_main("config", *args) == 2
    assert "expand" in _error(capsys)


@pytest.mark.parametrize("key", CONTAINER_KEYS)
def test_a_value_that_holds_itself_is_refused_in_a_file_or_a_set(tmp_path, key):
    """`&a [x, *a]`: PyYAML builds a list that contains itself; walking it would never end."""
    value = "&a [x, *a]" if "options" not in key else "&a {x: *a}"
    path = tmp_path / "self.yaml"
    path.write_text(yaml_at(key, value))
    assert "contains it" in _refused(str(path))
    assert "contains it" in _refused("smoke", [f"{key}={value}"])


@pytest.mark.parametrize("command", ["plan", "train"])
def test_plan_and_train_refuse_a_bomb_before_anything_is_loaded_or_written(tmp_path, capsys, command):
    path = tmp_path / "bomb.yaml"
    path.write_text("train:\n  report_to: " + bomb() + "\n")
    out = tmp_path / "run"
    extra = ["--output", str(out)] if command == "train" else []
    assert cli_main(command, "--preset", str(path), *extra) == 2
    assert "expand" in _error(capsys) and not out.exists()


def test_a_billion_value_bomb_is_refused_at_once_within_a_memory_limit(tmp_path):
    """The issue's case at full size (10 ** 9 values): in a child process held to 2 GiB of address space and a
    time limit (a guard against a hang, not a timing), the command answers exit 2."""
    path = tmp_path / "bomb.yaml"
    path.write_text(yaml_at("lora.target_modules", bomb(levels=9)))

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    proc = subprocess.run(cli_cmd("config", "--preset", str(path)), cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "expand" in proc.stderr and "Traceback" not in proc.stderr


LONG_LIST, LONG_TEXT = json.dumps([[1, 2]] * 300), "z" * 20_000
LONG = {"train.steps": LONG_LIST, "train.lr": LONG_LIST, "lora.target_modules": LONG_LIST,
        "estimator.options": LONG_LIST, "data.dataset": "hf:" + LONG_TEXT, "reward.function_weights": LONG_LIST,
        "estimator.name": LONG_TEXT, "train.report_to": LONG_LIST}


@pytest.mark.parametrize("key", sorted(LONG))
def test_an_error_prints_a_long_value_cut_short(tmp_path, key):
    """A value under the bound but long (300 items, or 20,000 characters) is named in a short line."""
    path = tmp_path / "long.yaml"
    path.write_text(yaml_at(key, LONG[key]))
    assert key.split(".")[0] in _refused(str(path))


def test_a_huge_integer_is_an_error_not_a_traceback(tmp_path, capsys):
    path = tmp_path / "int.yaml"
    path.write_text(yaml_at("train.steps", "1" * 5000))
    assert cli_main("config", "--preset", str(path)) == 2
    _error(capsys)
    assert cli_main("config", "--set", "train.steps=" + "1" * 5000) == 2
    _error(capsys)


# ---------------------------------------------------------------------------------------------------------------
# TRL's names and basis-lite's in one source


# what another key must hold for these values to be valid together
NEEDS = {"reward.function_weights": ["reward.functions=[my_rewards:f]"]}


def _two_values(key: str) -> tuple:
    """Two different valid values of `key`."""
    kind = FIELDS[key].type
    if key in CHOICES:
        return CHOICES[key][0], CHOICES[key][1]
    if kind == "bool":
        return True, False
    if kind == "int":
        lo = int(RANGES[key].lo or 0)
        return lo + 1, lo + 2
    if kind == "float":
        return 0.1, 0.2
    if kind == "str":
        return "first", "second"
    if key == "reward.function_weights":
        return [1.0], [2.0]
    return ["q_proj"], ["v_proj"]  # lists of names (lora.target_modules)


@pytest.mark.parametrize("trl_first", [True, False])
@pytest.mark.parametrize("trl", sorted(ALIASES))
def test_a_trl_name_and_its_own_name_that_disagree_are_refused_in_either_order(tmp_path, trl, trl_first):
    key = ALIASES[trl]
    a, b = _two_values(key)
    lines = [f"{trl}: {json.dumps(a)}", yaml_at(key, json.dumps(b)).rstrip("\n")]
    path = tmp_path / "both.yaml"
    path.write_text("\n".join(lines if trl_first else lines[::-1]) + "\n")
    err = _refused(str(path))
    assert trl in err and key in err and "give the key once" in err
    # the same value under both names is one setting, not a conflict
    path.write_text(f"{trl}: {json.dumps(a)}\n" + yaml_at(key, json.dumps(a)))
    load_config(str(path), NEEDS.get(key, []))


def test_trl_loss_type_cispo_is_never_dropped_silently(tmp_path, capsys):
    path = tmp_path / "cispo.yaml"
    path.write_text("train:\n  loss_aggregation: token-mean\nloss_type: cispo\n")
    assert cli_main("config", "--preset", str(path)) == 2
    assert "loss_type='cispo'" in _error(capsys)
    path.write_text("loss_type: cispo\n")
    assert load_config(str(path)).train.loss == "cispo"


@pytest.mark.parametrize("trl", sorted(ALIASES))
def test_repeated_sets_apply_in_order_whichever_name_they_use(trl):
    """Each --set is a source of its own, applied after the preset in command-line order: the last one wins."""
    key = ALIASES[trl]
    a, b = _two_values(key)
    section, _, leaf = key.rpartition(".")

    def value(cfg):
        return getattr(getattr(cfg, section), leaf)

    need = NEEDS.get(key, [])
    assert value(load_config("smoke", [*need, f"{trl}={json.dumps(a)}", f"{key}={json.dumps(b)}"])) == b
    assert value(load_config("smoke", [*need, f"{key}={json.dumps(a)}", f"{trl}={json.dumps(b)}"])) == b


def test_a_trl_config_file_is_one_source(tmp_path):
    """`--config grpo.yaml` (a `trl grpo` config): its TRL name and a basis-lite section disagreeing are refused."""
    path = tmp_path / "grpo.yaml"
    path.write_text("learning_rate: 1.0e-5\ntrain:\n  lr: 2.0e-4\n")
    with pytest.raises(ConfigError, match="learning_rate.*train.lr.*give the key once"):
        load_config(None, [], trl_config=path)
    path.write_text("learning_rate: 1.0e-5\n")
    assert load_config(None, ["train.lr=3e-4"], trl_config=path).train.lr == 3e-4  # a later --set still wins
