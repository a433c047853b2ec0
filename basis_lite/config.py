"""Typed run configuration: one dataclass tree, loaded from a preset YAML, overridden with `--set a.b=c`, validated once.

Every error names the bad key and what would be accepted, and is raised as `ConfigError` (the CLI turns it into
exit code 2 before anything is written).
"""
from __future__ import annotations

import dataclasses
import importlib.resources
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .estimators import estimator_names, get_estimator


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
    return packaged if packaged.is_dir() else Path(__file__).resolve().parent.parent / "presets"


PRESET_DIR = _preset_dir()
DEFAULT_PRESET = "cpu-smollm2-arith"


@dataclass
class ModelConfig:
    # builtin:smollm2-135m-instruct | builtin:tiny-random (tests, built on the fly) | a hub id | a local folder
    name: str = "builtin:smollm2-135m-instruct"
    backend: str = "auto"  # auto (unsloth when CUDA and unsloth import, else hf) | hf | unsloth
    dtype: str = "auto"  # auto (bf16 where supported, fp16 on pre-Ampere GPUs, fp32 otherwise) | float32 | bfloat16 | float16
    load_in_4bit: bool = False  # bitsandbytes NF4 with double quantization; the base stays frozen
    max_seq_length: int = 512  # prompt + completion tokens; longer prompts are truncated from the left
    gradient_checkpointing: bool = True  # on while training, off (KV cache on) while generating
    fast_inference: bool = True  # unsloth backend only: in-process vLLM sharing the 4-bit weights
    gpu_memory_utilization: float = 0.5  # unsloth/vLLM: the share of GPU memory vLLM may take for weights + KV cache
    unsloth_standby: bool = False  # unsloth: UNSLOTH_VLLM_STANDBY=1, vLLM frees its KV cache while training
    cache_dir: str = ""  # where the builtin model is converted; default ~/.cache/basis-lite


@dataclass
class LoraConfig:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: Any = "all-linear"  # "all-linear" or a list of module names such as [q_proj, v_proj]


@dataclass
class DataConfig:
    # arithmetic | algebra | wordproblems (built in, generated, seeded) | gsm8k | math (hub, through `datasets`) |
    # a local .jsonl/.json/.csv/.parquet file
    dataset: str = "arithmetic"
    levels: list = field(default_factory=lambda: [1, 2])  # built-in tasks: difficulty levels to draw from
    train_size: int = 2000  # built-in tasks: number of training problems (hub/local: cap, 0 = all)
    eval_size: int = 200  # held-out problems for eval
    question_field: str = "question"
    answer_field: str = "answer"
    split_train: str = "train"  # hub datasets: split names
    split_eval: str = "test"
    system_prompt: str = ""  # "" = no system message (shorter prompts); the chat template's default is not used
    instruction: str = "Put the final answer in \\boxed{}."
    max_bad_fraction: float = 0.05  # abort when more than this share of rows is malformed
    seed: int = 1234


@dataclass
class GenerationConfig:
    engine: str = "hf"  # hf (the training model's generate) | vllm (in-process; through Unsloth on a GPU)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    batch_size: int = 64  # prompts per generate() call (chunking); per rank under torchrun
    # where sampling randomness comes from: global (torch's RNG, advanced by every draw of the batch) | per_prompt
    # (each prompt of a step its own stream, so rollouts do not depend on batching or the number of ranks) |
    # auto (per_prompt under torchrun, global otherwise)
    rng: str = "auto"


@dataclass
class RewardConfig:
    correctness_weight: float = 1.0  # math-verify against the gold answer
    format_weight: float = 0.0  # a non-empty \boxed{...} in the completion
    require_boxed: bool = True  # correctness only counts an answer inside \boxed{} (math-verify alone falls back to the last number)
    functions: list = field(default_factory=list)  # user rewards: ["package.module:function", ...]
    function_weights: list = field(default_factory=list)  # one weight per function (default 1.0 each)
    timeout_s: float = 10.0  # per-batch limit for one user reward function; a hang yields 0 and a warning


@dataclass
class EstimatorConfig:
    name: str = "basis"  # a name registered in basis_lite.estimators: basis | reinforce_pp | grpo | dr_grpo | rloo
    rollouts_per_prompt: int = 1  # G; at least the estimator's min_rollouts (grpo, dr_grpo and rloo need G >= 2)
    prior_samples: int = 0  # offline prior: K reference rollouts per training prompt before training (0 = none)
    use_features: bool = True  # pool other prompts' rewards by similarity of the policy's prompt hidden states
    history: bool = False  # refine the prior with this run's earlier rewards for the same prompt
    # (the three above apply to estimators that use features / a prior / the history: basis)
    options: dict = field(default_factory=dict)  # checked at load; basis: estimators/basis_options.py
    normalize: bool = False  # divide advantages by the batch std (REINFORCE++ always does)


@dataclass
class TrainConfig:
    steps: int = 40
    batch_size: int = 32  # prompts per step (each gets rollouts_per_prompt completions); under torchrun the global batch
    micro_batch_size: int = 8  # sequences per forward/backward (per rank); gradient accumulation covers the rest
    lr: float = 2e-4
    weight_decay: float = 0.0
    warmup_steps: int = 2
    schedule: str = "cosine"  # cosine | constant
    max_grad_norm: float = 1.0
    optimizer: str = "auto"  # auto (bitsandbytes AdamW8bit on CUDA, torch AdamW elsewhere) | adamw | adamw8bit
    loss: str = "ppo_clip"  # ppo_clip | bpo
    clip_low: float = 0.2
    clip_high: float = 0.28
    bpo_cap: float = 5.0  # BPO: cap C on the complementary-probability weight
    bpo_eps: float = 0.1  # BPO: smoothing epsilon
    kl_coef: float = 0.0  # KL to the reference (the base with the adapter disabled); 0 = off, no extra forward
    logprob_chunk_size: int = 1024  # tokens per chunk of the lm_head + log-softmax (never the full [B, T, V] fp32 tensor)
    eval_every: int = 0  # greedy held-out eval every N steps (0 = only before and after training)
    eval_batch_size: int = 64
    eval_max_new_tokens: int = 64
    save_every: int = 10  # checkpoint every N steps (and at the end)
    keep_last: int = 2  # checkpoints kept
    max_bad_steps: int = 3  # abort after this many NaN/inf losses in a row (each one is skipped with a warning)
    seed: int = 0
    threads: int = 0  # torch CPU threads (0 = all cores)
    report_to: list = field(default_factory=list)  # extra loggers: tensorboard, wandb (metrics.jsonl always)


@dataclass
class Config:
    preset: str = ""  # name or path this config came from (informational)
    output_dir: str = ""  # run folder; default runs/<preset>-<time>
    device: str = "auto"  # auto | cpu | cuda
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


CHOICES = {
    "device": ("auto", "cpu", "cuda"),
    "model.backend": ("auto", "hf", "unsloth"),
    "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "generation.engine": ("hf", "vllm"),
    "generation.rng": ("auto", "global", "per_prompt"),
    "estimator.name": estimator_names(),  # the registry (validate() reads it again, for names registered later)
    "train.schedule": ("cosine", "constant"),
    "train.optimizer": ("auto", "adamw", "adamw8bit"),
    "train.loss": ("ppo_clip", "bpo"),
}
POSITIVE = ("train.steps", "train.batch_size", "train.micro_batch_size", "generation.max_new_tokens",
            "generation.batch_size", "estimator.rollouts_per_prompt", "lora.r", "model.max_seq_length",
            "train.eval_batch_size", "train.eval_max_new_tokens", "train.save_every", "train.keep_last",
            "train.max_bad_steps")
NON_NEGATIVE = ("train.lr", "train.weight_decay", "train.warmup_steps", "train.kl_coef", "train.eval_every",
                "estimator.prior_samples", "data.eval_size", "data.train_size", "generation.temperature",
                "reward.timeout_s", "train.threads", "train.clip_low", "train.clip_high")


_SCI_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _coerce(value: Any, typ: Any, key: str) -> Any:
    """Check/convert one leaf value against its annotated type, naming the key on failure."""
    if typ is Any:
        return value
    origin = typing.get_origin(typ)
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if typ is float:
        if isinstance(value, str) and _SCI_FLOAT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 (PyYAML) reads 1e-5 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if typ is str:
        if value is None:
            return ""
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if typ is list or origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list such as [a, b], got {value!r}")
        return value
    if typ is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping such as {{a: 1}}, got {value!r}")
        return value
    if isinstance(typ, types.UnionType) or origin is typing.Union:
        return value
    return value


def _merge(obj: Any, data: dict, prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = _hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key '{full}'; accepted keys here: {', '.join(names)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _merge(current, value, full + ".")
        else:
            setattr(obj, key, _coerce(value, hints[key], full))


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set train.steps=10")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _nest(key: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def preset_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
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


def load_config(preset: str | None = None, overrides: list[str] | None = None, data: dict | None = None) -> Config:
    """Build a validated Config from a preset (name or path), a raw mapping and `key=value` overrides."""
    cfg = Config()
    if data is None:
        name = preset or DEFAULT_PRESET
        path = preset_path(name)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"preset {path}: not valid YAML ({e})") from None
        cfg.preset = name
    _merge(cfg, data)
    for item in overrides or []:
        key, value = _parse_override(item)
        _merge(cfg, _nest(key, value))
    validate(cfg)
    return cfg


def get(cfg: Config, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: Config) -> None:
    for key, choices in CHOICES.items():
        if key == "estimator.name":
            choices = estimator_names()
        if get(cfg, key) not in choices:
            raise ConfigError(f"{key}: {get(cfg, key)!r} is not accepted; choose one of {', '.join(choices)}")
    for key in POSITIVE:
        if get(cfg, key) <= 0:
            raise ConfigError(f"{key}: must be > 0, got {get(cfg, key)!r}")
    for key in NON_NEGATIVE:
        if get(cfg, key) < 0:
            raise ConfigError(f"{key}: must be >= 0, got {get(cfg, key)!r}")
    t, e = cfg.train, cfg.estimator
    spec = get_estimator(e.name)
    if e.rollouts_per_prompt < spec.min_rollouts:
        fits = [n for n in estimator_names() if get_estimator(n).min_rollouts <= e.rollouts_per_prompt]
        per = "one rollout" if e.rollouts_per_prompt == 1 else f"{e.rollouts_per_prompt} rollouts"
        raise ConfigError(f"estimator.name={e.name} needs estimator.rollouts_per_prompt >= {spec.min_rollouts} "
                          f"(got {e.rollouts_per_prompt}); use {' or '.join(fits)} for {per} per prompt")
    e.options = spec.validate_options(e.options)
    with_prior = spec.uses_prior and (e.prior_samples > 0 or e.history) and e.options.get("use_prior", True)
    if with_prior and spec.uses_features and e.use_features and e.options.get("combine", "toward_prior") == "toward_prior" \
            and "cv" in (e.options.get("bandwidth"), e.options.get("shrink")):
        raise ConfigError("estimator.options: bandwidth/shrink 'cv' cannot be combined with a prior "
                          "(estimator.prior_samples > 0 or estimator.history) under the default combine: "
                          "toward_prior; add combine: residual, or use fixed numbers")
    if not 0 <= cfg.data.max_bad_fraction <= 1:
        raise ConfigError(f"data.max_bad_fraction: must be in [0, 1], got {cfg.data.max_bad_fraction}")
    if not 0 < cfg.generation.top_p <= 1:
        raise ConfigError(f"generation.top_p: must be in (0, 1], got {cfg.generation.top_p}")
    if not 0 < cfg.model.gpu_memory_utilization < 1:
        raise ConfigError(f"model.gpu_memory_utilization: must be in (0, 1), got {cfg.model.gpu_memory_utilization}")
    tm = cfg.lora.target_modules
    if not (tm == "all-linear" or (isinstance(tm, list) and tm and all(isinstance(x, str) for x in tm))):
        raise ConfigError(f"lora.target_modules: expected 'all-linear' or a list of module names, got {tm!r}")
    if cfg.reward.function_weights and len(cfg.reward.function_weights) != len(cfg.reward.functions):
        raise ConfigError(f"reward.function_weights: {len(cfg.reward.function_weights)} weights for "
                          f"{len(cfg.reward.functions)} functions; give one weight per function or none")
    for fn in cfg.reward.functions:
        if not isinstance(fn, str) or ":" not in fn:
            raise ConfigError(f"reward.functions: {fn!r} is not of the form 'package.module:function'")
    bad = [r for r in t.report_to if r not in ("tensorboard", "wandb")]
    if bad:
        raise ConfigError(f"train.report_to: {bad} not accepted; choose from tensorboard, wandb")
    if t.micro_batch_size > t.batch_size * e.rollouts_per_prompt:
        t.micro_batch_size = t.batch_size * e.rollouts_per_prompt


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def load_config_file(path: str | os.PathLike) -> Config:
    """A resolved config saved by a run (RUN_DIR/config.yaml, adapter/basis_lite_config.yaml), validated."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config sections, got {type(data).__name__}")
    return from_dict(data)


def from_dict(data: dict) -> Config:
    cfg = Config()
    _merge(cfg, data)
    validate(cfg)
    return cfg
