"""Typed run configuration: one dataclass tree, loaded from a preset YAML, overridden with `--set a.b=c`, validated once.

Every key has a meaning (HELP) and every numeric key a range (RANGES), both printed by `basis-lite config`
(`describe_config`); `validate` checks types, ranges, choices, the estimator's options and the combinations. TRL's
GRPOConfig names with the same meaning are read as their key here (ALIASES); names whose meaning differs are
refused with what to write (REFUSED); unknown keys get a did-you-mean. Every error names the bad key, the value and
what would be accepted, and is raised as `ConfigError` (the CLI turns it into exit code 2 before anything is
written). Torch-free: the light commands (`config`, `plan`, `presets`) use it.
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
    revisit: bool = True  # built-in tasks: a level that runs out of questions repeats its own, keeping its share
    value_sampling: float = 0.0  # prompt selection by tracked value (SPO): skip prompts near 0 or 1 (0 = off)
    eval_size: int = 200  # held-out problems for eval
    question_field: str = "question"
    answer_field: str = "answer"
    split_train: str = "train"  # hub datasets: split names
    split_eval: str = "test"
    system_prompt: str = ""  # "" = no system message (shorter prompts); the chat template's default is not used
    instruction: str = "Put the final answer in \\boxed{}."
    max_bad_fraction: float = 0.05  # abort when more than this share of rows is malformed
    seed: int = 1234
    max_question_chars: int = 20000  # longer questions are cut to their last N characters when loaded (0 = no limit)


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
    # hf engine on the CPU: auto (rollouts and eval through engines/fast_cpu.py where the model is supported) | off
    # (transformers' generate(), as on a GPU); YAML's true/false (also on/off) read as auto/off
    fast_cpu: Any = "auto"


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
    loss: str = "ppo_clip"  # a policy loss of loss_specs.LOSSES: ppo_clip | bpo | cispo
    loss_aggregation: str = "token-mean"  # loss_specs.AGGREGATIONS, or TRL's loss_type name (dapo, grpo, bnpo, dr_grpo)
    importance_sampling_level: str = "token"  # token | sequence (GSPO): the importance ratio per token or per sequence
    clip_low: float = 0.2
    clip_high: float = 0.28
    bpo_cap: float = 5.0  # BPO: cap C on the complementary-probability weight
    bpo_eps: float = 0.1  # BPO: smoothing epsilon
    kl_coef: float = 0.0  # KL to the reference (the base with the adapter disabled); 0 = off, no extra forward
    ppo_epochs: int = 1  # optimizer steps (passes) per batch of rollouts; > 1 reuses them and the clip acts
    # truncated importance weights min(pi_trainer / pi_engine, mismatch_cap) on every token, for the engine's
    # numerics differing from the trainer's: auto (on for vllm engines, off for hf) | always | never (YAML's
    # true/on and false/off read as always and never)
    mismatch_correction: Any = "auto"
    mismatch_cap: float = 3.0  # >= 1: the truncation of those weights
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
    wandb_project: str = ""  # W&B project ("" = $WANDB_PROJECT, else basis-lite)


@dataclass
class EapoConfig:
    """EAPO experience injection (basis_lite/eapo.py): HF engine only. The default threshold is the 90th
    percentile of the default model's next-token entropy in bench/results/eapo_entropy.md; rate and cap are
    choices, not measurements."""

    prior_adapter: str = ""  # a peft adapter folder trained on the same base (an earlier run's adapter/); "" = off
    entropy_threshold: float = 2.0  # critical point: the policy's next-token entropy (nats, at the sampling T) >= this
    injection_rate: float = 0.5  # in [0, 1]: probability that the prior samples the token at a critical point
    weight_cap: float = 2.0  # >= 1: importance weights pi/prior are truncated at this
    is_level: str = "sequence"  # sequence (product over the injected tokens, every token) | token (injected ones)


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
    eapo: EapoConfig = field(default_factory=EapoConfig)


CHOICES = {
    "device": ("auto", "cpu", "cuda"),
    "model.backend": ("auto", "hf", "unsloth"),
    "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "generation.engine": ("hf", "vllm"),
    "generation.rng": ("auto", "global", "per_prompt"),
    "generation.fast_cpu": ("auto", "off"),
    "estimator.name": estimator_names(),  # the registry (validate() reads it again, for names registered later)
    "train.schedule": ("cosine", "constant"),
    "train.optimizer": ("auto", "adamw", "adamw8bit"),
    "train.loss": loss_names(),
    "train.loss_aggregation": aggregation_names(with_trl=True),
    "train.importance_sampling_level": LEVELS,
    "train.mismatch_correction": ("auto", "always", "never"),
    "eapo.is_level": ("sequence", "token"),
}


@dataclass(frozen=True)
class Range:
    """The accepted values of one numeric key: finite, between lo and hi (open or closed ends; None = unbounded)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def contains(self, v: float) -> bool:
        try:
            if not math.isfinite(v):
                return False
        except OverflowError:  # an int too large for a float
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return not (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi))

    def describe(self, integer: bool) -> str:
        kind = "an integer" if integer else "a number"

        def num(x: float) -> str:
            return str(int(x)) if float(x).is_integer() else f"{x:g}"

        if self.lo is None and self.hi is None:
            return f"{kind}" if integer else "a finite number"
        if self.hi is None:
            return f"{kind} {'>' if self.lo_open else '>='} {num(self.lo)}"
        if self.lo is None:
            return f"{kind} {'<' if self.hi_open else '<='} {num(self.hi)}"
        return f"{kind} in {'(' if self.lo_open else '['}{num(self.lo)}, {num(self.hi)}{')' if self.hi_open else ']'}"


ANY = Range()
POS = Range(0, lo_open=True)  # > 0
NONNEG = Range(0)  # >= 0
AT_LEAST_1 = Range(1)
UNIT_OPEN = Range(0, 1, lo_open=True, hi_open=True)  # (0, 1)

MAX_SEQUENCES = 65536  # sequences in one step (train.batch_size x estimator.rollouts_per_prompt), and batch sizes
# every int and float key and its accepted values, checked at load (tests/test_config.py checks none is missing);
# integer keys have an upper bound far beyond any run that fits one machine, so that a typo (an extra digit, a
# pasted number) is refused at load instead of running for ever
RANGES: dict[str, Range] = {
    "model.max_seq_length": Range(1, 1 << 20),
    "model.gpu_memory_utilization": UNIT_OPEN,
    "lora.r": Range(1, 4096),
    "lora.alpha": POS,
    "lora.dropout": Range(0, 1, hi_open=True),
    "data.train_size": Range(0, 10_000_000),
    "data.eval_size": Range(0, 1_000_000),
    "data.value_sampling": Range(0, 1),
    "data.max_bad_fraction": Range(0, 1),
    "data.seed": Range(-(2**63), 2**63 - 1),
    "data.max_question_chars": Range(0, 100_000_000),
    "generation.temperature": POS,
    "generation.top_p": Range(0, 1, lo_open=True),
    "generation.top_k": Range(-1, 10_000_000),
    "generation.max_new_tokens": Range(1, 1 << 20),
    "generation.batch_size": Range(1, MAX_SEQUENCES),
    "reward.correctness_weight": ANY,
    "reward.format_weight": ANY,
    "reward.timeout_s": Range(0, 86_400),
    "estimator.rollouts_per_prompt": Range(1, 1024),
    "estimator.prior_samples": Range(0, 1024),
    "train.steps": Range(1, 10_000_000),
    "train.batch_size": Range(1, MAX_SEQUENCES),
    "train.micro_batch_size": Range(1, MAX_SEQUENCES),
    "train.lr": POS,
    "train.weight_decay": NONNEG,
    "train.warmup_steps": Range(0, 10_000_000),
    "train.max_grad_norm": POS,
    "train.clip_low": Range(0, 1, hi_open=True),
    "train.clip_high": NONNEG,
    "train.bpo_cap": POS,
    "train.bpo_eps": POS,
    "train.kl_coef": NONNEG,
    "train.logprob_chunk_size": Range(1, 1 << 24),
    "train.eval_every": Range(0, 10_000_000),
    "train.eval_batch_size": Range(1, MAX_SEQUENCES),
    "train.eval_max_new_tokens": Range(1, 1 << 20),
    "train.save_every": Range(1, 10_000_000),
    "train.keep_last": Range(1, 10_000),
    "train.max_bad_steps": Range(1, 10_000_000),
    "train.seed": Range(0, 2**32 - 1),  # numpy's seed range
    "train.threads": Range(0, 4096),
    "train.ppo_epochs": Range(1, 100),
    "train.mismatch_cap": Range(1),
    "eapo.entropy_threshold": NONNEG,
    "eapo.injection_rate": Range(0, 1),
    "eapo.weight_cap": Range(1),
}
MIN_PROMPT_TOKENS = 16  # runtime.make_engine leaves prompts at least this many of model.max_seq_length

# What every key means (`basis-lite config` prints it above the key; tests/test_config.py checks none is missing)
HELP: dict[str, str] = {
    "preset": "name or path of the preset this config came from (informational)",
    "output_dir": "run folder; '' = runs/<preset>-<time> (train --output overrides it)",
    "device": "where to train: auto (cuda when available, else cpu) | cpu | cuda",
    "model.name": "the base model: builtin:smollm2-135m-instruct | builtin:tiny-random (tests, built on the fly) | "
                  "a Hugging Face hub id | a local folder",
    "model.backend": "auto (unsloth on CUDA when it imports, else hf) | hf (transformers + peft) | unsloth (GPU)",
    "model.dtype": "compute dtype: auto (bf16 where supported and fast, fp16 on pre-Ampere GPUs, fp32 otherwise) | "
                   "float32 | bfloat16 | float16",
    "model.load_in_4bit": "load the frozen base in bitsandbytes NF4 with double quantization (GPU presets)",
    "model.max_seq_length": "prompt + completion tokens; longer prompts lose their start",
    "model.gradient_checkpointing": "recompute activations in the backward pass (less memory, more time); off "
                                    "while generating",
    "model.fast_inference": "unsloth backend only: an in-process vLLM sharing the 4-bit weights",
    "model.gpu_memory_utilization": "unsloth / vLLM: the share of GPU memory vLLM may take for weights + KV cache",
    "model.unsloth_standby": "unsloth: UNSLOTH_VLLM_STANDBY=1, vLLM frees its KV cache while training",
    "model.cache_dir": "where built-in models and prior tables are cached; '' = $BASIS_LITE_CACHE, else "
                       "~/.cache/basis-lite",
    "lora.r": "LoRA rank",
    "lora.alpha": "LoRA alpha; the adapter's output is scaled by alpha / r",
    "lora.dropout": "dropout on the LoRA input while training",
    "lora.target_modules": "'all-linear' or a list of module names such as [q_proj, v_proj]",
    "data.dataset": "arithmetic | algebra | wordproblems (built in, generated, seeded) | gsm8k | math (hub) | "
                    "hf:owner/name[:config] (any hub dataset, with question_field / answer_field) | a local "
                    ".jsonl/.json/.csv/.parquet file",
    "data.levels": "built-in tasks: the difficulty levels to draw from",
    "data.train_size": "training problems: a count for built-in tasks; a cap for hub datasets and files (0 = all)",
    "data.value_sampling": "prompt selection by value (SPO's prioritized sampling): a training prompt is skipped "
                           "until the next epoch with probability s * (1 - 2 sqrt(v (1 - v))), v its tracked "
                           "success rate (earlier rewards, decayed 0.9 per step, (s + 1) / (n + 2)); prompts whose "
                           "value sits near 0 or 1 carry little gradient. 0 = off, 1 = strongest (keeps 2%)",
    "data.revisit": "built-in tasks: a level that runs out of distinct questions before its share of the training "
                    "split is full revisits the ones it drew (true) or leaves its share to the other levels (false)",
    "data.eval_size": "held-out problems for eval (0 = no eval)",
    "data.question_field": "hf: datasets and files: the field holding the question",
    "data.answer_field": "hf: datasets and files: the field holding the answer (text after ####, or the last "
                         "\\boxed{}, is the gold answer)",
    "data.split_train": "hub datasets: the training split",
    "data.split_eval": "hub datasets: the eval split",
    "data.system_prompt": "system message; '' = none (a chat template's own default is removed too)",
    "data.instruction": "appended to every question",
    "data.max_bad_fraction": "stop loading when more than this share of rows is malformed (below it they are "
                             "skipped and counted)",
    "data.seed": "seed of the built-in tasks' draw and of the train/eval split of files",
    "data.max_question_chars": "longer questions are cut to their last N characters when loaded, before "
                               "tokenizing (0 = no limit); prompts keep at most model.max_seq_length tokens anyway",
    "generation.engine": "rollouts from: hf (the training model's generate) | vllm (in-process; through Unsloth "
                         "on a GPU)",
    "generation.temperature": "sampling temperature of the rollouts (the loss uses the same one)",
    "generation.top_p": "nucleus sampling (1 = off)",
    "generation.top_k": "top-k sampling (0 = off; -1 is read as 0, vLLM's and TRL's 'off')",
    "generation.max_new_tokens": "completion tokens per rollout (TRL: max_completion_length)",
    "generation.batch_size": "prompts per generate() call (per rank under torchrun)",
    "generation.rng": "where sampling randomness comes from: global (torch's RNG) | per_prompt (each prompt of a step "
                      "its own stream, so rollouts do not depend on batching or the number of ranks; EAPO-injected "
                      "rollouts still draw from torch's RNG) | auto (per_prompt under torchrun)",
    "generation.fast_cpu": "hf engine on the CPU: auto (rollouts and eval from merged weights, finished rows dropped, "
                           "the shared prompt prefix prefilled once; generate() for trajectory features, EAPO "
                           "injection and non-Llama models; also true) | off (transformers' generate(); also false)",
    "reward.correctness_weight": "weight of the math-verify answer check (1 when the answer equals the gold one)",
    "reward.format_weight": "weight of the format reward (1 for a non-empty \\boxed{})",
    "reward.require_boxed": "correctness reads only the last non-empty \\boxed{} (math-verify alone falls back "
                            "to the last number)",
    "reward.functions": "your reward functions, 'module:function', run in a worker process (see README: Data "
                        "and rewards)",
    "reward.function_weights": "one weight per function (default 1.0 each)",
    "reward.timeout_s": "per-batch limit of one reward function; past it the worker is restarted and the batch "
                        "scores 0 (0 = run them in the trainer process, no limit)",
    "estimator.name": "advantage estimator: basis | reinforce_pp | grpo | dr_grpo | rloo | basis_probe | poise",
    "estimator.rollouts_per_prompt": "G, completions per prompt (TRL: num_generations); grpo, dr_grpo and rloo "
                                     "need G >= 2",
    "estimator.prior_samples": "basis: K reference rollouts per training prompt before training for the offline "
                               "prior (0 = none; cached)",
    "estimator.use_features": "basis: pool other prompts' rewards by the similarity of the policy's prompt "
                              "hidden states",
    "estimator.history": "basis: refine the prior with this run's earlier rewards of the same prompt",
    "estimator.options": "estimator options, checked at load (basis: see basis_lite/estimators/basis_options.py)",
    "estimator.normalize": "divide the advantages by their batch std (reinforce_pp always does)",
    "train.steps": "optimizer steps (TRL: max_steps)",
    "train.batch_size": "PROMPTS per step; each gets estimator.rollouts_per_prompt completions (TRL's "
                        "per_device_train_batch_size counts completions)",
    "train.micro_batch_size": "sequences per forward/backward; gradient accumulation covers the rest",
    "train.lr": "peak learning rate (TRL: learning_rate)",
    "train.weight_decay": "AdamW weight decay",
    "train.warmup_steps": "linear warmup steps",
    "train.schedule": "learning-rate schedule after warmup: cosine (down to 10%) | constant",
    "train.max_grad_norm": "the gradient norm is clipped to this value",
    "train.optimizer": "auto (bitsandbytes AdamW8bit on CUDA, torch AdamW elsewhere) | adamw | adamw8bit",
    "train.loss": "ppo_clip (clip-higher PPO surrogate) | bpo (complementary-probability weight) | cispo (REINFORCE "
                  "with the importance weight capped at 1 + clip_high, detached; TRL: loss_type cispo)",
    "train.loss_aggregation": "how per-token losses become the step's loss: token-mean (TRL: dapo) | "
                              "seq-mean-token-mean (grpo) | local-token-mean (bnpo) | seq-mean-token-sum-norm "
                              "(dr_grpo); TRL: loss_type, whose cispo means train.loss=cispo with token-mean",
    "train.importance_sampling_level": "the importance ratio per token | per sequence (GSPO: exp of the mean "
                                       "log-ratio of the sequence); ppo_clip and cispo",
    "train.clip_low": "PPO clip: the ratio's lower bound is 1 - clip_low (TRL: epsilon)",
    "train.clip_high": "PPO clip: the ratio's upper bound is 1 + clip_high (TRL: epsilon_high)",
    "train.bpo_cap": "BPO: cap C on the complementary-probability weight",
    "train.bpo_eps": "BPO: smoothing epsilon of the weight (1 + eps - mu) / (1 + eps - pi)",
    "train.kl_coef": "k3 KL to the reference (the base, adapter disabled); 0 = off, no extra forward (TRL: beta)",
    "train.logprob_chunk_size": "tokens per chunk of the lm_head + log-softmax (never the full [B, T, V] fp32 "
                                "tensor)",
    "train.eval_every": "greedy held-out eval every N steps (0 = only before and after training)",
    "train.eval_batch_size": "prompts per generate() call in eval",
    "train.eval_max_new_tokens": "completion tokens in eval",
    "train.save_every": "checkpoint every N steps (and at the end)",
    "train.keep_last": "checkpoints kept",
    "train.max_bad_steps": "abort after this many non-finite losses in a row (each one is skipped)",
    "train.seed": "seed of sampling, prompt order and the LoRA init",
    "train.threads": "torch CPU threads (0 = all cores)",
    "train.report_to": "extra loggers besides metrics.jsonl: [tensorboard, wandb]",
    "train.wandb_project": "W&B project ('' = $WANDB_PROJECT, else basis-lite)",
    "train.ppo_epochs": "optimizer steps (passes) over each batch of rollouts; > 1 reuses them and the clip acts",
    "train.mismatch_correction": "truncated importance weights between the engine's and the trainer's log-probs: "
                                 "auto (on for vLLM engines) | always | never",
    "train.mismatch_cap": "cap of those importance weights (>= 1)",
    "eapo.prior_adapter": "EAPO: a peft adapter from an earlier run on the same base, sampled at critical decision "
                          "points ('' = off; HF engine only)",
    "eapo.entropy_threshold": "EAPO: the policy's next-token entropy (nats) at or above which a position may be "
                              "injected",
    "eapo.injection_rate": "EAPO: probability that such a position takes the prior's token",
    "eapo.weight_cap": "EAPO: cap of the importance weight at injected positions (>= 1)",
    "eapo.is_level": "EAPO: importance weights per sequence (unbiased before the cap) | token",
}

# TRL GRPOConfig names accepted as aliases (same meaning), at the top level or inside the section they belong to
ALIASES: dict[str, str] = {
    "learning_rate": "train.lr",
    "num_generations": "estimator.rollouts_per_prompt",
    "max_completion_length": "generation.max_new_tokens",
    "beta": "train.kl_coef",
    "epsilon": "train.clip_low",
    "epsilon_high": "train.clip_high",
    "loss_type": "train.loss_aggregation",
    "importance_sampling_level": "train.importance_sampling_level",
    "max_steps": "train.steps",
}
# TRL names whose meaning differs here: refused, with what to write instead
REFUSED: dict[str, str] = {
    "per_device_train_batch_size": (
        "TRL's per_device_train_batch_size counts COMPLETIONS per device; basis-lite's train.batch_size counts "
        "PROMPTS per step, each with estimator.rollouts_per_prompt completions (TRL: num_generations). For the same "
        "step, set train.batch_size = per_device_train_batch_size x gradient_accumulation_steps x devices / "
        "num_generations"),
    "gradient_accumulation_steps": (
        "basis-lite accumulates gradients by itself: train.batch_size prompts per step, split into micro-batches "
        "of train.micro_batch_size sequences"),
}


def all_keys() -> list[str]:
    """Every leaf key of the config tree, dotted ("train.lr"), in declaration order."""
    out: list[str] = []

    def walk(cls, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            sub = _hints(cls)[f.name]
            if dataclasses.is_dataclass(sub):
                walk(sub, f"{prefix}{f.name}.")
            else:
                out.append(prefix + f.name)

    walk(Config, "")
    return out


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


def load_config(preset: str | None = None, overrides: list[str] | None = None, data: dict | None = None) -> Config:
    """Build a validated Config from a preset (name or path), a raw mapping and `key=value` overrides."""
    cfg = Config()
    if data is None:
        name = preset or DEFAULT_PRESET
        path = preset_path(name)
        data = read_yaml(path, "preset") or {}
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
    meaning = HELP.get(key)
    return ConfigError(f"{key}: must be {expected}, got {value!r}" + (f". Meaning: {meaning}" if meaning else ""))


def validate(cfg: Config) -> None:
    """Check every key (type, accepted values, ranges) and the combinations; ConfigError naming the key, the value
    and what is accepted. Normalises in place: generation.top_k -1 -> 0, estimator options read as numbers,
    train.micro_batch_size capped at the step's sequence count."""
    for key in all_keys():  # types again: a Config built or changed in code skips _merge's checks
        section, _, leaf = key.rpartition(".")
        obj = get(cfg, section) if section else cfg
        setattr(obj, leaf, _coerce(getattr(obj, leaf), _hints(type(obj))[leaf], key))
    if isinstance(cfg.train.mismatch_correction, bool):
        cfg.train.mismatch_correction = "always" if cfg.train.mismatch_correction else "never"
    if isinstance(cfg.generation.fast_cpu, bool):
        cfg.generation.fast_cpu = "auto" if cfg.generation.fast_cpu else "off"
    for key, choices in CHOICES.items():
        if key == "estimator.name":
            choices = estimator_names()
        if get(cfg, key) not in choices:
            raise ConfigError(f"{key}: {get(cfg, key)!r} is not accepted; choose one of {', '.join(choices)}")
    for key, rng in RANGES.items():
        value = get(cfg, key)
        if not rng.contains(value):
            raise _bad_value(key, value, rng.describe(isinstance(value, int)))
    if cfg.generation.top_k == -1:
        cfg.generation.top_k = 0  # vLLM's and TRL's "off" is -1; here (and in transformers) it is 0
    for key in ("model.name", "data.dataset", "data.question_field", "data.answer_field", "data.split_train",
                "data.split_eval"):
        if not str(get(cfg, key)).strip():
            raise _bad_value(key, get(cfg, key), "a non-empty string")
    t, e, d, g = cfg.train, cfg.estimator, cfg.data, cfg.generation
    spec = get_estimator(e.name)
    if e.rollouts_per_prompt < spec.min_rollouts:
        fits = [n for n in estimator_names() if get_estimator(n).min_rollouts <= e.rollouts_per_prompt]
        per = "one rollout" if e.rollouts_per_prompt == 1 else f"{e.rollouts_per_prompt} rollouts"
        raise ConfigError(f"estimator.name={e.name} needs estimator.rollouts_per_prompt >= {spec.min_rollouts} "
                          f"(got {e.rollouts_per_prompt}); use {' or '.join(fits)} for {per} per prompt")
    e.options = spec.validate_options(e.options)
    check_loss_config(t)
    with_prior = spec.uses_prior and (e.prior_samples > 0 or e.history) and e.options.get("use_prior", True)
    if with_prior and spec.uses_features and e.use_features and e.options.get("combine", "toward_prior") == "toward_prior" \
            and "cv" in (e.options.get("bandwidth"), e.options.get("shrink")):
        raise ConfigError("estimator.options: bandwidth/shrink 'cv' cannot be combined with a prior "
                          "(estimator.prior_samples > 0 or estimator.history) under the default combine: "
                          "toward_prior; add combine: residual, or use fixed numbers")
    if t.batch_size * e.rollouts_per_prompt > MAX_SEQUENCES:
        raise ConfigError(f"train.batch_size x estimator.rollouts_per_prompt: {t.batch_size} x {e.rollouts_per_prompt} "
                          f"= {t.batch_size * e.rollouts_per_prompt} sequences per step; at most {MAX_SEQUENCES} are "
                          f"accepted")
    if g.max_new_tokens > cfg.model.max_seq_length - MIN_PROMPT_TOKENS:
        raise ConfigError(f"generation.max_new_tokens: {g.max_new_tokens} leaves fewer than {MIN_PROMPT_TOKENS} "
                          f"prompt tokens of model.max_seq_length={cfg.model.max_seq_length} (prompt + completion); "
                          f"use at most {max(1, cfg.model.max_seq_length - MIN_PROMPT_TOKENS)} or raise "
                          f"model.max_seq_length")
    _check_dataset(d)
    tm = cfg.lora.target_modules
    if not (tm == "all-linear" or (isinstance(tm, list) and tm and all(isinstance(x, str) for x in tm))):
        raise ConfigError(f"lora.target_modules: expected 'all-linear' or a list of module names, got {tm!r}")
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
    for key in ("train.mismatch_cap", "eapo.weight_cap"):
        if get(cfg, key) < 1:
            raise ConfigError(f"{key}: must be >= 1 (importance weights are truncated at it), got {get(cfg, key)!r}")
    if not 0 <= cfg.eapo.injection_rate <= 1:
        raise ConfigError(f"eapo.injection_rate: must be in [0, 1], got {cfg.eapo.injection_rate}")
    if cfg.eapo.prior_adapter:
        if cfg.generation.engine != "hf":
            raise ConfigError(f"eapo.prior_adapter: experience injection runs on generation.engine=hf only, not "
                              f"{cfg.generation.engine!r}; set generation.engine=hf or eapo.prior_adapter=''")
        if cfg.model.backend == "unsloth":
            raise ConfigError("eapo.prior_adapter: experience injection needs model.backend hf (or auto on a machine "
                              "without Unsloth), not unsloth; or set eapo.prior_adapter=''")
        if cfg.generation.temperature <= 0:
            raise ConfigError("eapo.prior_adapter: experience injection samples; generation.temperature must be > 0")
        if get_estimator(e.name).uses_trajectory:
            raise ConfigError(f"eapo.prior_adapter: experience injection does not capture trajectory features, which "
                              f"estimator.name={e.name} needs; use another estimator or set eapo.prior_adapter=''")
    bad = [x for x in t.report_to if x not in ("tensorboard", "wandb")]
    if bad:
        raise ConfigError(f"train.report_to: {bad} not accepted; choose from tensorboard, wandb")
    if t.micro_batch_size > t.batch_size * e.rollouts_per_prompt:
        t.micro_batch_size = t.batch_size * e.rollouts_per_prompt


_HF_DATASET = re.compile(r"hf:[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?")


def _check_dataset(d: DataConfig) -> None:
    """What can be checked of data.* without reading data: the hf: form, built-in levels and sizes."""
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
        value = get(cfg, key)
        note = HELP.get(key, "")
        if key == "estimator.name":  # the registry, with estimators registered after import
            note = "advantage estimator: " + " | ".join(estimator_names())
        if key in RANGES:  # (the meaning of a key in CHOICES lists its values)
            note += f" [{RANGES[key].describe(isinstance(value, int))}]"
        if value != get(default, key) and key != "preset":
            note += f" (default {_yaml_value(get(default, key))})"
        lines += textwrap.wrap(note.strip(), width=width, initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# ")
        lines.append(f"{indent}{leaf}: {_yaml_value(value)}")
    return "\n".join(lines) + "\n"


MAX_CONFIG_BYTES = 1 << 20


def read_yaml(path: Path, what: str = "") -> Any:
    """The YAML in a config or preset file; ConfigError naming the file when it cannot be read, is larger than
    MAX_CONFIG_BYTES, is not UTF-8 text (a binary file), is not YAML or is nested past the parser's limit."""
    name = f"{what} {path}".strip()
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{name}: larger than {MAX_CONFIG_BYTES >> 20} MiB; a config file is a short YAML text")
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{name}: cannot be read ({type(e).__name__}: {e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{name}: not a text file (not UTF-8); a config file is YAML text such as the output "
                          f"of `basis-lite config`") from None
    if "\x00" in text:
        raise ConfigError(f"{name}: not a text file (it holds NUL bytes); a config file is YAML text")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{name}: not valid YAML ({e})") from None
    except RecursionError:
        raise ConfigError(f"{name}: nested too deeply to be a config") from None


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
