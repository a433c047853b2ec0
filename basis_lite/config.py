"""Typed run configuration: one dataclass tree, loaded from a preset YAML, overridden with `--set a.b=c`, validated once.

Every key is declared once, as a field built by `config_fields.setting`: its type, default, accepted values (a range
for numbers, choices for names), its meaning and TRL's GRPOConfig name for it sit on one line, and `basis-lite
config` (`describe_config`) prints them. The checks that read several keys sit after their section (`_check_<section>`)
and `validate` runs them after the per-key checks. TRL's names with the same meaning are read as their key here;
TRL names whose meaning differs are refused with what to write; unknown keys get a did-you-mean. Every error names
the bad key, the value and what would be accepted, and is raised as `ConfigError` (the CLI turns it into exit code
2 before anything is written). Torch-free: the light commands (`config`, `plan`, `presets`) use it.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import logging
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .config_fields import (
    ANY,
    AT_LEAST_1,
    NONNEG,
    POS,
    UNIT_OPEN,
    Range,
    choices_of,
    help_text,
    must_be_set,
    range_of,
    refused_names,
    setting,
    trl_name,
)
from .errors import ConfigError
from .estimators import estimator_names, get_estimator
from .loss_specs import LEVELS, aggregation_names, check_loss_config, loss_names

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
    return packaged if packaged.is_dir() else Path(__file__).resolve().parent.parent / "presets"


PRESET_DIR = _preset_dir()
DEFAULT_PRESET = "cpu-smollm2-arith"
MIN_PROMPT_TOKENS = 16  # runtime.make_engine leaves prompts at least this many of model.max_seq_length


@dataclass
class ModelConfig:
    name: str = setting("builtin:smollm2-135m-instruct", "the base model: builtin:smollm2-135m-instruct | "
                        "builtin:tiny-random (tests, built on the fly) | a Hugging Face hub id | a local folder",
                        nonempty=True)
    backend: str = setting("auto", "auto (unsloth on CUDA when it imports, else hf) | hf (transformers + peft) | "
                           "unsloth (GPU)", choices=("auto", "hf", "unsloth"))
    dtype: str = setting("auto", "compute dtype: auto (bf16 where supported and fast, fp16 on pre-Ampere GPUs, fp32 "
                         "otherwise) | float32 | bfloat16 | float16",
                         choices=("auto", "float32", "bfloat16", "float16"))
    load_in_4bit: bool = setting(False, "load the frozen base in bitsandbytes NF4 with double quantization (GPU "
                                 "presets)")
    max_seq_length: int = setting(512, "prompt + completion tokens; longer prompts lose their start", range=AT_LEAST_1)
    gradient_checkpointing: bool = setting(True, "recompute activations in the backward pass (less memory, more time); "
                                           "off while generating")
    fast_inference: bool = setting(True, "unsloth backend only: an in-process vLLM sharing the 4-bit weights")
    gpu_memory_utilization: float = setting(0.5, "unsloth / vLLM: the share of GPU memory vLLM may take for weights + "
                                            "KV cache", range=UNIT_OPEN)
    unsloth_standby: bool = setting(False, "unsloth: UNSLOTH_VLLM_STANDBY=1, vLLM frees its KV cache while training")
    cache_dir: str = setting("", "where built-in models and prior tables are cached; '' = $BASIS_LITE_CACHE, else "
                             "~/.cache/basis-lite")


@dataclass
class LoraConfig:
    r: int = setting(16, "LoRA rank", range=AT_LEAST_1)
    alpha: int = setting(32, "LoRA alpha; the adapter's output is scaled by alpha / r", range=POS)
    dropout: float = setting(0.0, "dropout on the LoRA input while training", range=Range(0, 1, hi_open=True))
    target_modules: Any = setting("all-linear", "'all-linear' or a list of module names such as [q_proj, v_proj]")


def _check_lora(cfg: Config) -> None:
    tm = cfg.lora.target_modules
    if not (tm == "all-linear" or (isinstance(tm, list) and tm and all(isinstance(x, str) for x in tm))):
        raise ConfigError(f"lora.target_modules: expected 'all-linear' or a list of module names, got {tm!r}")


@dataclass
class DataConfig:
    dataset: str = setting("arithmetic", "arithmetic | algebra | wordproblems (built in, generated, seeded) | gsm8k | "
                           "math (hub) | hf:owner/name[:config] (any hub dataset, with question_field / answer_field) "
                           "| a local .jsonl/.json/.csv/.parquet file", nonempty=True)
    levels: list = setting([1, 2], "built-in tasks: the difficulty levels to draw from")
    train_size: int = setting(2000, "training problems: a count for built-in tasks; a cap for hub datasets and files "
                              "(0 = all)", range=NONNEG)
    eval_size: int = setting(200, "held-out problems for eval (0 = no eval)", range=NONNEG)
    question_field: str = setting("question", "hf: datasets and files: the field holding the question", nonempty=True)
    answer_field: str = setting("answer", "hf: datasets and files: the field holding the answer (text after ####, or "
                                "the last \\boxed{}, is the gold answer)", nonempty=True)
    split_train: str = setting("train", "hub datasets: the training split", nonempty=True)
    split_eval: str = setting("test", "hub datasets: the eval split", nonempty=True)
    system_prompt: str = setting("", "system message; '' = none (a chat template's own default is removed too)")
    instruction: str = setting("Put the final answer in \\boxed{}.", "appended to every question")
    max_bad_fraction: float = setting(0.05, "stop loading when more than this share of rows is malformed (below it "
                                      "they are skipped and counted)", range=Range(0, 1))
    seed: int = setting(1234, "seed of the built-in tasks' draw and of the train/eval split of files", range=ANY)
    max_question_chars: int = setting(20000, "longer questions are cut to their last N characters when loaded, before "
                                      "tokenizing (0 = no limit); prompts keep at most model.max_seq_length tokens "
                                      "anyway", range=NONNEG)


_HF_DATASET = re.compile(r"hf:[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?")


def _check_data(cfg: Config) -> None:
    """What can be checked of data.* without reading data: the hf: form, built-in levels and sizes."""
    d = cfg.data
    name = str(d.dataset).strip()
    if name.startswith("hf:") and not _HF_DATASET.fullmatch(name):
        raise ConfigError(f"data.dataset: {name!r} is not accepted; expected hf:owner/name or hf:owner/name:config "
                          f"(e.g. hf:openai/gsm8k:main)")
    from .data.tasks import BUILTIN_TASKS, check_levels  # torch-free; only read for built-in tasks

    if name in BUILTIN_TASKS:
        try:
            check_levels(name, d.levels)
        except ValueError as err:  # DataError
            raise ConfigError(str(err)) from None
        if d.train_size == 0:
            raise ConfigError(f"data.train_size: must be >= 1 for the built-in task {name} (a count of generated "
                              f"problems; 0 means 'all' only for hub datasets and files), got 0")



@dataclass
class GenerationConfig:
    engine: str = setting("hf", "rollouts from: hf (the training model's generate) | vllm (in-process; through Unsloth "
                          "on a GPU)", choices=("hf", "vllm"))
    temperature: float = setting(1.0, "sampling temperature of the rollouts (the loss uses the same one)", range=POS)
    top_p: float = setting(1.0, "nucleus sampling (1 = off)", range=Range(0, 1, lo_open=True))
    top_k: int = setting(0, "top-k sampling (0 = off; -1 is read as 0, vLLM's and TRL's 'off')", range=Range(-1))
    max_new_tokens: int = setting(64, "completion tokens per rollout (TRL: max_completion_length)",
                                  range=AT_LEAST_1, trl="max_completion_length")
    batch_size: int = setting(64, "prompts per generate() call (per rank under torchrun)", range=AT_LEAST_1)
    rng: str = setting("auto", "where sampling randomness comes from: global (torch's RNG) | per_prompt (each prompt "
                       "of a step its own stream, so rollouts do not depend on batching or the number of ranks; "
                       "EAPO-injected rollouts still draw from torch's RNG) | auto (per_prompt under torchrun)",
                       choices=("auto", "global", "per_prompt"))


def _check_generation(cfg: Config) -> None:
    g = cfg.generation
    if g.top_k == -1:
        g.top_k = 0  # vLLM's and TRL's "off" is -1; here (and in transformers) it is 0
    if g.max_new_tokens > cfg.model.max_seq_length - MIN_PROMPT_TOKENS:
        raise ConfigError(f"generation.max_new_tokens: {g.max_new_tokens} leaves fewer than {MIN_PROMPT_TOKENS} "
                          f"prompt tokens of model.max_seq_length={cfg.model.max_seq_length} (prompt + completion); "
                          f"use at most {max(1, cfg.model.max_seq_length - MIN_PROMPT_TOKENS)} or raise "
                          f"model.max_seq_length")


@dataclass
class RewardConfig:
    correctness_weight: float = setting(1.0, "weight of the math-verify answer check (1 when the answer equals the "
                                        "gold one)", range=ANY)
    format_weight: float = setting(0.0, "weight of the format reward (1 for a non-empty \\boxed{})", range=ANY)
    require_boxed: bool = setting(True, "correctness reads only the last non-empty \\boxed{} (math-verify alone falls "
                                  "back to the last number)")
    functions: list = setting([], "your reward functions, 'module:function', run in a worker process (see README: Data "
                              "and rewards)")
    function_weights: list = setting([], "one weight per function (default 1.0 each)")
    timeout_s: float = setting(10.0, "per-batch limit of one reward function; past it the worker is restarted and the "
                               "batch scores 0 (0 = run them in the trainer process, no limit)", range=NONNEG)


def _check_reward(cfg: Config) -> None:
    r = cfg.reward
    if r.function_weights and len(r.function_weights) != len(r.functions):
        raise ConfigError(f"reward.function_weights: {len(r.function_weights)} weights for "
                          f"{len(r.functions)} functions; give one weight per function or none")
    for w in r.function_weights:
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ConfigError(f"reward.function_weights: {w!r} is not accepted; expected finite numbers, one per "
                              f"function")
    r.function_weights = [float(w) for w in r.function_weights]
    for fn in r.functions:
        if not isinstance(fn, str) or fn.count(":") != 1 or not all(p.strip() for p in fn.split(":")):
            raise ConfigError(f"reward.functions: {fn!r} is not of the form 'package.module:function'")
    weights = [r.correctness_weight, r.format_weight, *(r.function_weights or [1.0] * len(r.functions))]
    if not any(weights):
        raise ConfigError("reward: every reward weight is 0 (reward.correctness_weight, reward.format_weight, "
                          "reward.function_weights), so every reward and advantage is 0 and nothing is learned; "
                          "give one a non-zero weight")


def _estimator_help() -> str:
    return "advantage estimator: " + " | ".join(estimator_names())


def _rollouts_help() -> str:
    """G's meaning, with the estimators that need more than one rollout (read from the registry)."""
    by_min: dict[int, list] = {}
    for name in estimator_names():
        by_min.setdefault(get_estimator(name).min_rollouts, []).append(name)
    return "G, completions per prompt (TRL: num_generations)" + "".join(
        f"; {', '.join(names)} need G >= {n}" for n, names in sorted(by_min.items()) if n > 1)


@dataclass
class EstimatorConfig:
    name: str = setting("basis", _estimator_help, choices=estimator_names)
    rollouts_per_prompt: int = setting(1, _rollouts_help, range=AT_LEAST_1, trl="num_generations")
    prior_samples: int = setting(0, "basis: K reference rollouts per training prompt before training for the offline "
                                 "prior (0 = none; cached)", range=NONNEG)
    use_features: bool = setting(True, "basis: pool other prompts' rewards by the similarity of the policy's prompt "
                                 "hidden states")
    history: bool = setting(False, "basis: refine the prior with this run's earlier rewards of the same prompt")
    options: dict = setting({}, "estimator options, checked at load (basis: see "
                            "basis_lite/estimators/basis_options.py)")
    normalize: bool = setting(False, "divide the advantages by their batch std (reinforce_pp always does)")


def _check_estimator(cfg: Config) -> None:
    """G against the estimator's minimum, its options, and a 'cv' bandwidth that a prior would make meaningless."""
    e = cfg.estimator
    spec = get_estimator(e.name)
    if e.rollouts_per_prompt < spec.min_rollouts:
        fits = [n for n in estimator_names() if get_estimator(n).min_rollouts <= e.rollouts_per_prompt]
        per = "one rollout" if e.rollouts_per_prompt == 1 else f"{e.rollouts_per_prompt} rollouts"
        raise ConfigError(f"estimator.name={e.name} needs estimator.rollouts_per_prompt >= {spec.min_rollouts} "
                          f"(got {e.rollouts_per_prompt}); use {' or '.join(fits)} for {per} per prompt")
    e.options = spec.validate_options(e.options)
    if spec.with_prior(e) and spec.uses_features and e.use_features \
            and e.options.get("combine", "toward_prior") == "toward_prior" \
            and "cv" in (e.options.get("bandwidth"), e.options.get("shrink")):
        raise ConfigError("estimator.options: bandwidth/shrink 'cv' cannot be combined with a prior "
                          "(estimator.prior_samples > 0 or estimator.history) under the default combine: "
                          "toward_prior; add combine: residual, or use fixed numbers")


def _aggregations_with_trl() -> tuple:
    return aggregation_names(with_trl=True)


_REFUSE_BATCH = {"per_device_train_batch_size": (
    "TRL's per_device_train_batch_size counts COMPLETIONS per device; basis-lite's train.batch_size counts "
    "PROMPTS per step, each with estimator.rollouts_per_prompt completions (TRL: num_generations). For the same "
    "step, set train.batch_size = per_device_train_batch_size x gradient_accumulation_steps x devices / "
    "num_generations")}
_REFUSE_ACCUMULATION = {"gradient_accumulation_steps": (
    "basis-lite accumulates gradients by itself: train.batch_size prompts per step, split into micro-batches "
    "of train.micro_batch_size sequences")}


@dataclass
class TrainConfig:
    steps: int = setting(40, "optimizer steps (TRL: max_steps)", range=AT_LEAST_1, trl="max_steps")
    batch_size: int = setting(32, "PROMPTS per step; each gets estimator.rollouts_per_prompt completions (TRL's "
                              "per_device_train_batch_size counts completions)", range=AT_LEAST_1, refuse=_REFUSE_BATCH)
    micro_batch_size: int = setting(8, "sequences per forward/backward; gradient accumulation covers the rest",
                                    range=AT_LEAST_1, refuse=_REFUSE_ACCUMULATION)
    lr: float = setting(2e-4, "peak learning rate (TRL: learning_rate)", range=POS, trl="learning_rate")
    weight_decay: float = setting(0.0, "AdamW weight decay", range=NONNEG)
    warmup_steps: int = setting(2, "linear warmup steps", range=NONNEG)
    schedule: str = setting("cosine", "learning-rate schedule after warmup: cosine (down to 10%) | constant",
                            choices=("cosine", "constant"))
    max_grad_norm: float = setting(1.0, "the gradient norm is clipped to this value", range=POS)
    optimizer: str = setting("auto", "auto (bitsandbytes AdamW8bit on CUDA, torch AdamW elsewhere) | adamw | adamw8bit",
                             choices=("auto", "adamw", "adamw8bit"))
    loss: str = setting("ppo_clip", "ppo_clip (clip-higher PPO surrogate) | bpo (complementary-probability weight) | "
                        "cispo (REINFORCE with the importance weight capped at 1 + clip_high, detached; TRL: loss_type "
                        "cispo)", choices=loss_names)
    loss_aggregation: str = setting("token-mean", "how per-token losses become the step's loss: token-mean (TRL: dapo) "
                                    "| seq-mean-token-mean (grpo) | local-token-mean (bnpo) | seq-mean-token-sum-norm "
                                    "(dr_grpo); TRL: loss_type, whose cispo means train.loss=cispo with token-mean",
                                    choices=_aggregations_with_trl, trl="loss_type")
    importance_sampling_level: str = setting("token", "the importance ratio per token | per sequence (GSPO: exp of the "
                                             "mean log-ratio of the sequence); ppo_clip and cispo",
                                             choices=LEVELS, trl="importance_sampling_level")
    clip_low: float = setting(0.2, "PPO clip: the ratio's lower bound is 1 - clip_low (TRL: epsilon)",
                              range=Range(0, 1, hi_open=True), trl="epsilon")
    clip_high: float = setting(0.28, "PPO clip: the ratio's upper bound is 1 + clip_high (TRL: epsilon_high)",
                               range=NONNEG, trl="epsilon_high")
    bpo_cap: float = setting(5.0, "BPO: cap C on the complementary-probability weight", range=POS)
    bpo_eps: float = setting(0.1, "BPO: smoothing epsilon of the weight (1 + eps - mu) / (1 + eps - pi)", range=POS)
    kl_coef: float = setting(0.0, "k3 KL to the reference (the base, adapter disabled); 0 = off, no extra forward "
                             "(TRL: beta)", range=NONNEG, trl="beta")
    ppo_epochs: int = setting(1, "optimizer steps (passes) over each batch of rollouts; > 1 reuses them and the clip "
                              "acts", range=AT_LEAST_1)
    mismatch_correction: Any = setting("auto", "truncated importance weights between the engine's and the trainer's "
                                       "log-probs: auto (on for vLLM engines) | always | never",
                                       choices=("auto", "always", "never"))
    mismatch_cap: float = setting(3.0, "cap of those importance weights (>= 1)", range=AT_LEAST_1)
    logprob_chunk_size: int = setting(1024, "tokens per chunk of the lm_head + log-softmax (never the full [B, T, V] "
                                      "fp32 tensor)", range=AT_LEAST_1)
    eval_every: int = setting(0, "greedy held-out eval every N steps (0 = only before and after training)",
                              range=NONNEG)
    eval_batch_size: int = setting(64, "prompts per generate() call in eval", range=AT_LEAST_1)
    eval_max_new_tokens: int = setting(64, "completion tokens in eval", range=AT_LEAST_1)
    save_every: int = setting(10, "checkpoint every N steps (and at the end)", range=AT_LEAST_1)
    keep_last: int = setting(2, "checkpoints kept", range=AT_LEAST_1)
    max_bad_steps: int = setting(3, "abort after this many non-finite losses in a row (each one is skipped)",
                                 range=AT_LEAST_1)
    seed: int = setting(0, "seed of sampling, prompt order and the LoRA init", range=Range(0, 2**32 - 1))
    threads: int = setting(0, "torch CPU threads (0 = all cores)", range=NONNEG)
    report_to: list = setting([], "extra loggers besides metrics.jsonl: [tensorboard, wandb]")
    wandb_project: str = setting("", "W&B project ('' = $WANDB_PROJECT, else basis-lite)")


def _check_train(cfg: Config) -> None:
    """The loss, its aggregation and level together (TRL names read as ours), the loggers, and the micro-batch capped
    at the step's sequence count."""
    t = cfg.train
    check_loss_config(t)
    bad = [x for x in t.report_to if x not in ("tensorboard", "wandb")]
    if bad:
        raise ConfigError(f"train.report_to: {bad} not accepted; choose from tensorboard, wandb")
    t.micro_batch_size = min(t.micro_batch_size, t.batch_size * cfg.estimator.rollouts_per_prompt)


@dataclass
class EapoConfig:
    """EAPO experience injection (basis_lite/eapo.py): HF engine only. The default threshold is the 90th
    percentile of the default model's next-token entropy in bench/results/eapo_entropy.md; rate and cap are
    choices, not measurements."""

    prior_adapter: str = setting("", "EAPO: a peft adapter from an earlier run on the same base, sampled at critical "
                                 "decision points ('' = off; HF engine only)")
    entropy_threshold: float = setting(2.0, "EAPO: the policy's next-token entropy (nats) at or above which a position "
                                       "may be injected", range=NONNEG)
    injection_rate: float = setting(0.5, "EAPO: probability that such a position takes the prior's token",
                                    range=Range(0, 1))
    weight_cap: float = setting(2.0, "EAPO: cap of the importance weight at injected positions (>= 1)",
                                range=AT_LEAST_1)
    is_level: str = setting("sequence", "EAPO: importance weights per sequence (unbiased before the cap) | token",
                            choices=("sequence", "token"))


def _check_eapo(cfg: Config) -> None:
    """Experience injection runs on the HF engine and backend, samples, and captures no trajectory features."""
    if not cfg.eapo.prior_adapter:
        return
    if cfg.generation.engine != "hf":
        raise ConfigError(f"eapo.prior_adapter: experience injection runs on generation.engine=hf only, not "
                          f"{cfg.generation.engine!r}; set generation.engine=hf or eapo.prior_adapter=''")
    if cfg.model.backend == "unsloth":
        raise ConfigError("eapo.prior_adapter: experience injection needs model.backend hf (or auto on a machine "
                          "without Unsloth), not unsloth; or set eapo.prior_adapter=''")
    if cfg.generation.temperature <= 0:
        raise ConfigError("eapo.prior_adapter: experience injection samples; generation.temperature must be > 0")
    if get_estimator(cfg.estimator.name).uses_trajectory:
        raise ConfigError(f"eapo.prior_adapter: experience injection does not capture trajectory features, which "
                          f"estimator.name={cfg.estimator.name} needs; use another estimator or set "
                          f"eapo.prior_adapter=''")


@dataclass
class Config:
    preset: str = setting("", "name or path of the preset this config came from (informational)")
    output_dir: str = setting("", "run folder; '' = runs/<preset>-<time> (train --output overrides it)")
    device: str = setting("auto", "where to train: auto (cuda when available, else cpu) | cpu | cuda",
                          choices=("auto", "cpu", "cuda"))
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eapo: EapoConfig = field(default_factory=EapoConfig)



# the cross-key checks, in the order validate runs them (after every key's own type, range and choices)
_CHECKS = (_check_generation, _check_estimator, _check_train, _check_data, _check_lora, _check_reward, _check_eapo)


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


def _merge(root: Config, data: dict, prefix: str = "") -> None:
    """Set the keys of `data` (a mapping for the section `prefix`) on `root`; TRL aliases are read as their
    basis-lite key, unknown keys raise ConfigError with a did-you-mean and the keys accepted there."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    obj = get(root, prefix.rstrip(".")) if prefix else root
    hints = _hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            if key in ALIASES and (not prefix or ALIASES[key].startswith(prefix)):
                log.info("%s: TRL's name for %s", full, ALIASES[key])
                _merge(root, _nest(ALIASES[key], value))
                continue
            if key in REFUSED:
                raise ConfigError(f"{full}: not accepted. {REFUSED[key]}")
            raise ConfigError(f"unknown config key '{full}'{_did_you_mean(prefix, str(key), names)}; accepted keys "
                              f"here: {', '.join(names)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _merge(root, value, full + ".")
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


def _bad_value(key: str, value: Any, expected: str) -> ConfigError:
    meaning = help_text(FIELDS[key])
    return ConfigError(f"{key}: must be {expected}, got {value!r}" + (f". Meaning: {meaning}" if meaning else ""))


def validate(cfg: Config) -> None:
    """Check every key (its type, range or choices, non-empty where it must be), then the combinations (`_CHECKS`);
    ConfigError naming the key, the value and what is accepted. Normalises in place: generation.top_k -1 -> 0,
    train.mismatch_correction true/false -> always/never, estimator options read as numbers, TRL's loss_type names
    as ours, train.micro_batch_size capped at the step's sequence count."""
    for key, f in FIELDS.items():  # types again: a Config built or changed in code skips _merge's checks
        section, _, leaf = key.rpartition(".")
        obj = get(cfg, section) if section else cfg
        setattr(obj, leaf, _coerce(getattr(obj, leaf), _hints(type(obj))[leaf], key))
    if isinstance(cfg.train.mismatch_correction, bool):
        cfg.train.mismatch_correction = "always" if cfg.train.mismatch_correction else "never"
    for key, f in FIELDS.items():
        value, choices, rng = get(cfg, key), choices_of(f), range_of(f)
        if choices is not None and value not in choices:
            raise ConfigError(f"{key}: {value!r} is not accepted; choose one of {', '.join(choices)}")
        if rng is not None and not rng.contains(value):
            raise _bad_value(key, value, rng.describe(isinstance(value, int)))
        if must_be_set(f) and not str(value).strip():
            raise _bad_value(key, value, "a non-empty string")
    for check in _CHECKS:
        check(cfg)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    from .safeio import atomic_write_text

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
