"""Typed run configuration: one dataclass tree, loaded from a preset YAML, overridden with `--set a.b=c`, validated once.

Every key is declared once, in basis_lite/config/keys.py, as a field built by `setting` (config/fields.py): its type,
default, accepted values (a range for numbers, choices for names), its meaning and TRL's GRPOConfig name sit on one
line; this module reads them (`FIELDS`) to merge, check and print (`basis-lite config`: `describe_config`), then
runs the checks that read several keys (`CHECKS`, config/keys.py). TRL's names with the same meaning are read as their
key here; TRL names whose meaning differs are refused with what to write; unknown keys get a did-you-mean. Every
error names the bad key, the value and what would be accepted, and is raised as `ConfigError` (the CLI turns it
into exit code 2 before anything is written). Torch-free: the light commands (`config`, `plan`, `presets`) use it.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import logging
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError, brief
from .fields import Range, bool_names, choices_of, help_text, must_be_set, range_of, refused_names, trl_name
from .keys import (
    CHECKS,
    MAX_SEQUENCES,
    MIN_PROMPT_TOKENS,
    Config,
    DataConfig,
    EapoConfig,
    EstimatorConfig,
    GenerationConfig,
    LoraConfig,
    ModelConfig,
    RewardConfig,
    TrainConfig,
)

__all__ = ["Config", "ModelConfig", "LoraConfig", "DataConfig", "GenerationConfig", "RewardConfig", "EstimatorConfig",
           "TrainConfig", "EapoConfig", "ConfigError", "MIN_PROMPT_TOKENS", "Range", "FIELDS", "ALIASES", "REFUSED",
           "HELP", "RANGES", "CHOICES", "PRESET_DIR", "DEFAULT_PRESET", "cache_root", "all_keys", "get", "validate",
           "load_config", "load_config_file", "merge_trl_config", "from_dict", "to_dict", "save_config", "describe_config", "preset_path",
           "list_presets", "preset_summary", "read_yaml", "MAX_SEQUENCES"]

log = logging.getLogger(__name__)


def cache_root(cache_dir: str = "") -> Path:
    """Where built-in models and prior tables are cached: model.cache_dir, else $BASIS_LITE_CACHE, else
    $XDG_CACHE_HOME/basis-lite (~/.cache/basis-lite). Torch-free, so light commands (`plan`) can use it."""
    root = cache_dir or os.environ.get("BASIS_LITE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "basis-lite")
    return Path(root)


def _preset_dir() -> Path:
    """The presets: inside the installed package (a wheel ships the top-level presets/ as basis_lite/presets), or
    the checkout's top-level presets/ folder (source tree, editable install)."""
    packaged = Path(str(importlib.resources.files("basis_lite"))) / "presets"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "presets"


PRESET_DIR = _preset_dir()
DEFAULT_PRESET = "cpu-smollm2-arith"



def _walk(cls, prefix: str = "") -> dict[str, dataclasses.Field]:
    out: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(cls):
        sub = _hints(cls)[f.name]
        if dataclasses.is_dataclass(sub):
            out.update(_walk(sub, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = f
    return out


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


FIELDS: dict[str, dataclasses.Field] = _walk(Config)  # every leaf key, dotted ("train.lr"), in declaration order
ALIASES: dict[str, str] = {trl_name(f): k for k, f in FIELDS.items() if trl_name(f)}  # TRL name -> key
REFUSED: dict[str, str] = {name: why for f in FIELDS.values() for name, why in refused_names(f).items()}
# read-only views of the fields' declarations, for code and tests outside this module (help and choices as of now;
# validate and describe_config read the fields, so estimators registered later are seen there)
HELP: dict[str, str] = {k: help_text(f) for k, f in FIELDS.items()}
RANGES: dict[str, Range] = {k: range_of(f) for k, f in FIELDS.items() if range_of(f) is not None}
CHOICES: dict[str, tuple] = {k: choices_of(f) for k, f in FIELDS.items() if choices_of(f) is not None}


def all_keys() -> list[str]:
    """Every leaf key of the config tree, dotted ("train.lr"), in declaration order."""
    return list(FIELDS)



def _did_you_mean(prefix: str, key: str, names: list[str]) -> str:
    """' (did you mean X?)' for an unknown key close to an accepted one in its section or to any key's last part
    anywhere in the tree (train keys first: TRL's flat names are mostly training settings), else ''."""
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
    if close:
        return f" (did you mean {prefix}{close[0]}?)"
    close = difflib.get_close_matches(key, list(ALIASES), n=1, cutoff=0.75)  # a TRL name, misspelt
    if close:
        return f" (did you mean {ALIASES[close[0]]}?)"
    leaf_of: dict[str, str] = {}
    for k in sorted(all_keys(), key=lambda k: not k.startswith("train.")):
        leaf_of.setdefault(k.rsplit(".", 1)[-1], k)
    close = difflib.get_close_matches(key, list(leaf_of), n=1, cutoff=0.75)
    return f" (did you mean {leaf_of[close[0]]}?)" if close else ""


_SCI_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(value: Any, typ: Any, key: str) -> Any:
    """Check/convert one leaf value against its annotated type, naming the key on failure."""
    if typ is Any:
        return value
    origin = typing.get_origin(typ)
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {brief(value)}")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}: expected an integer, got {brief(value)}")
        return value
    if typ is float:
        if isinstance(value, str) and _SCI_FLOAT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 (PyYAML) reads 1e-5 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {brief(value)}")
        return float(value)
    if typ is str:
        if value is None:
            return ""
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {brief(value)}")
        return value
    if typ is list or origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list such as [a, b], got {brief(value)}")
        return value
    if typ is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping such as {{a: 1}}, got {brief(value)}")
        return value
    if isinstance(typ, types.UnionType) or origin is typing.Union:
        return value
    return value


def _merge(root: Config, data: dict, prefix: str = "", seen: dict | None = None, spelled: str = "") -> None:
    """Set the keys of `data` (one config source: a preset file, a run's config, one --set; a mapping for the
    section `prefix`) on `root`; TRL aliases are read as their basis-lite key, unknown keys raise ConfigError with a
    did-you-mean and the keys accepted there. One source sets a key once: the same key given twice in it (TRL's
    name and basis-lite's, or TRL's name at the top and in its section) with different values is ConfigError
    naming both, whatever their order (`seen`: key -> (the name it was given by, its value) in this source)."""
    seen = {} if seen is None else seen
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {brief(data)}")
    obj = get(root, prefix.rstrip(".")) if prefix else root
    hints = _hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            if key in ALIASES and (not prefix or ALIASES[key].startswith(prefix)):
                log.info("%s: TRL's name for %s", full, ALIASES[key])
                _merge(root, _nest(ALIASES[key], value), seen=seen, spelled=full)
                continue
            if key in REFUSED:
                raise ConfigError(f"{brief(full)}: not accepted. {REFUSED[key]}")
            raise ConfigError(f"unknown config key {brief(full)}{_did_you_mean(prefix, str(key)[:200], names)}; "
                              f"accepted keys here: {', '.join(names)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _merge(root, value, full + ".", seen, spelled)
            continue
        value = _coerce(value, hints[key], full)
        said = spelled or full
        if full in seen and seen[full][1] != value:
            first, before = seen[full]
            raise ConfigError(f"{first}={brief(before)} and {said}={brief(value)} both set {full} in one config "
                              f"source; give the key once (TRL's name or basis-lite's, not both)")
        seen[full] = (said, value)
        setattr(obj, key, value)


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"--set {brief(item)}: expected key=value, e.g. --set train.steps=10")
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    except (ValueError, RecursionError) as e:  # an integer past Python's digit limit; nesting past the parser's
        raise ConfigError(f"--set {brief(key)}: the value cannot be read ({type(e).__name__}: "
                          f"{str(e)[:120]})") from None
    check_size(value, f"--set {brief(key)}")
    return key, value


def _nest(key: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def preset_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
        if not p.is_file():
            raise ConfigError(f"preset {name_or_path!r} is not a file; give a .yaml file or a preset name")
        return p
    cand = PRESET_DIR / f"{name_or_path}.yaml"
    if cand.exists():
        return cand
    raise ConfigError(f"preset {name_or_path!r} not found; accepted: a path to a .yaml file or one of "
                      f"{', '.join(list_presets())}")


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_summary(name: str) -> str:
    """First comment line of a preset file after the title: its one-line description."""
    for line in preset_path(name).read_text().splitlines():
        if line.startswith("# ") and not line.startswith("# Launch") and not line.startswith("#   "):
            return line[2:].strip()
    return ""


def load_config(preset: str | None = None, overrides: list[str] | None = None, data: dict | None = None,
                trl_config: str | os.PathLike | None = None) -> Config:
    """Build a validated Config from a preset (name or path), a raw mapping, a `trl grpo` config file
    (`trl_config`, read with TRL's meaning: config/trl.py) and `key=value` overrides, in that order."""
    cfg = Config()
    if data is None:
        name = preset or DEFAULT_PRESET
        path = preset_path(name)
        data = read_yaml(path, "preset") or {}
        cfg.preset = name
    _merge(cfg, data)
    if trl_config is not None:
        merge_trl_config(cfg, trl_config)
    for item in overrides or []:
        key, value = _parse_override(item)
        _merge(cfg, _nest(key, value))
    validate(cfg)
    return cfg


def merge_trl_config(cfg: Config, path: str | os.PathLike) -> None:
    """Set the keys of a `trl grpo --config` YAML file on `cfg` (config/trl.py maps them); ConfigError naming the
    file and the TRL key for anything it cannot map or a value its basis-lite key refuses."""
    from .trl import translate

    path = Path(path)
    if not path.exists():
        raise ConfigError(f"--config {path}: no such file; expected the YAML file of a `trl grpo --config` run")
    sections = {f.name for f in dataclasses.fields(Config)}
    seen: dict = {}  # the file is one source: a key it sets twice with different values is refused (`_merge`)
    for trl_key, key, value in translate(read_yaml(path, "TRL config") or {}, ALIASES, all_keys(), sections,
                                         source=f"TRL config {path}"):
        try:
            _merge(cfg, _nest(key, value) if trl_key != key else {key: value}, seen=seen,
                   spelled=trl_key if trl_key != key else "")
        except ConfigError as e:
            raise ConfigError(f"TRL config {path}: {trl_key}" + (f" (read as {key})" if trl_key != key else "")
                              + f": {e}") from None


def get(cfg: Config, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _bad_value(key: str, value: Any, expected: str) -> ConfigError:
    meaning = help_text(FIELDS[key])
    return ConfigError(f"{key}: must be {expected}, got {brief(value)}" + (f". Meaning: {meaning}" if meaning else ""))


def validate(cfg: Config) -> None:
    """Check every key (its type, range or choices, non-empty where it must be), then the checks that read several
    keys (`CHECKS`, one per section, in config/keys.py); ConfigError naming the key, the value and what is accepted.
    Normalises in place: YAML's true/false become the names of a key declared with `bools` (generation.fast_cpu,
    estimator.normalize, train.mismatch_correction); the section checks turn generation.top_k -1 into 0, read the
    estimator options as numbers and TRL's loss_type names as ours, and cap train.micro_batch_size at the step's
    sequence count."""
    for key, f in FIELDS.items():  # types again: a Config built or changed in code skips _merge's checks
        section, _, leaf = key.rpartition(".")
        obj = get(cfg, section) if section else cfg
        setattr(obj, leaf, _coerce(getattr(obj, leaf), _hints(type(obj))[leaf], key))
    for key, f in FIELDS.items():
        value, choices, rng = get(cfg, key), choices_of(f), range_of(f)
        if isinstance(value, bool) and bool_names(f):  # YAML's true / false (also on / off) for a key of names
            section, _, leaf = key.rpartition(".")
            value = bool_names(f)[0] if value else bool_names(f)[1]
            setattr(get(cfg, section) if section else cfg, leaf, value)
        if choices is not None and value not in choices:
            raise ConfigError(f"{key}: {brief(value)} is not accepted; choose one of {', '.join(choices)}")
        if rng is not None and not rng.contains(value):
            raise _bad_value(key, value, rng.describe(isinstance(value, int)))
        if must_be_set(f) and not str(value).strip():
            raise _bad_value(key, value, "a non-empty string")
    for check in CHECKS:
        check(cfg)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    from ..safeio import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def _yaml_value(value: Any) -> str:
    """One value as it would be written in a preset: flow style, one line."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6, allow_unicode=True).strip()
    return text[:-3].strip() if text.endswith("\n...") else text


def describe_config(cfg: Config, width: int = 116) -> str:
    """The resolved config as a commented YAML preset: every key with its value, above it what it means and the
    values it accepts, and its default when it differs. `basis-lite config` prints it; the text loads back as a
    preset (`basis-lite train --preset FILE.yaml`) into the same config."""
    import textwrap

    default = Config()
    lines: list[str] = []
    section = None
    for key in all_keys():
        head, _, leaf = key.rpartition(".")
        indent = "  " if head else ""
        if head != section and head:
            lines += ["", f"{head}:"]
        elif not head and lines:
            lines.append("")
        section = head
        value, f = get(cfg, key), FIELDS[key]
        note = help_text(f)
        if range_of(f) is not None:  # (the meaning of a key with choices lists its values)
            note += f" [{range_of(f).describe(isinstance(value, int))}]"
        if value != get(default, key) and key != "preset":
            note += f" (default {_yaml_value(get(default, key))})"
        lines += textwrap.wrap(note.strip(), width=width, initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# ")
        lines.append(f"{indent}{leaf}: {_yaml_value(value)}")
    return "\n".join(lines) + "\n"


MAX_CONFIG_BYTES = 1 << 20
# what one config source (a file, or one --set value) may expand to once its YAML aliases are followed: YAML lets
# a few hundred bytes stand for billions of values (each alias repeats what its anchor holds)
MAX_CONFIG_VALUES = 10_000  # values: every number, text, list and mapping counted where it appears
MAX_CONFIG_CHARS = 1 << 20  # characters of text (keys included)


def check_size(data: Any, where: str) -> None:
    """ConfigError naming `where` when `data` (parsed YAML) holds more than MAX_CONFIG_VALUES values or
    MAX_CONFIG_CHARS characters once expanded, or holds itself (an alias inside its own anchor). Counted without
    expanding anything: a list or mapping that appears many times is sized once and its size reused."""
    sizes: dict[int, tuple[int, int]] = {}
    open_ids: set[int] = set()

    def too_big(n: int, c: int) -> bool:
        return n > MAX_CONFIG_VALUES or c > MAX_CONFIG_CHARS

    def size(x) -> tuple[int, int]:
        if isinstance(x, str):
            return 1, len(x)
        if not isinstance(x, (list, dict, set, tuple)):
            return 1, 0
        if id(x) in sizes:
            return sizes[id(x)]
        if id(x) in open_ids:
            raise ConfigError(f"{where}: a YAML alias refers to a value that contains it, so the value would hold "
                              f"itself without end; a config holds plain values: write them out")
        open_ids.add(id(x))
        n, c = 1, 0
        for item in (y for kv in x.items() for y in kv) if isinstance(x, dict) else x:
            dn, dc = size(item)
            n, c = n + dn, c + dc
            if too_big(n, c):
                raise ConfigError(f"{where}: its YAML aliases expand to more than {MAX_CONFIG_VALUES} values or "
                                  f"{MAX_CONFIG_CHARS >> 20} MiB of text; a config is a few hundred plain values: "
                                  f"write them out without anchors (&) and aliases (*) that repeat them")
        open_ids.discard(id(x))
        sizes[id(x)] = (n, c)
        return n, c

    try:
        size(data)
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to be a config") from None


def read_yaml(path: Path, what: str = "") -> Any:
    """The YAML in a config or preset file; ConfigError naming the file when it cannot be read, is not a regular
    file (a FIFO, a device, a folder), is larger than MAX_CONFIG_BYTES, is not UTF-8 text (a binary file), is not
    YAML, is nested past the parser's limit or expands past `check_size`'s bounds."""
    from ..safeio import read_regular

    name = f"{what} {path}".strip()
    try:
        raw = read_regular(path, MAX_CONFIG_BYTES, name)
    except ValueError as e:
        raise ConfigError(f"{e}; a config file is a short YAML text") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{name}: not a text file (not UTF-8); a config file is YAML text such as the output "
                          f"of `basis-lite config`") from None
    if "\x00" in text:
        raise ConfigError(f"{name}: not a text file (it holds NUL bytes); a config file is YAML text")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{name}: not valid YAML ({str(e)[:300]})") from None
    except RecursionError:
        raise ConfigError(f"{name}: nested too deeply to be a config") from None
    except ValueError as e:  # an integer past Python's digit limit for int()
        raise ConfigError(f"{name}: a value cannot be read ({str(e)[:120]})") from None
    check_size(data, name)
    return data


def load_config_file(path: str | os.PathLike) -> Config:
    """A resolved config saved by a run (RUN_DIR/config.yaml, adapter/basis_lite_config.yaml), validated."""
    path = Path(path)
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config sections, got {type(data).__name__}")
    return from_dict(data)


def from_dict(data: dict) -> Config:
    cfg = Config()
    _merge(cfg, data)
    validate(cfg)
    return cfg
