"""Every key of the run configuration, declared once: the dataclass tree (one class per section, `Config` at the top)
whose fields are built by `setting` (config/fields.py; type, default, range or choices, meaning, TRL name on one line),
and after each section the checks that read several of its keys (`_check_<section>`, run by `config.validate` in
the order of `CHECKS`). Loading, overrides, validation and the printout live in basis_lite/config/__init__.py, which
re-exports these names. Torch-free.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..data.formats import format_suffixes
from ..data.tasks import BUILTIN_TASKS, check_levels
from ..engines import engine_choices, get_engine
from ..errors import ConfigError, brief
from ..estimators import estimator_names, get_estimator
from ..losses import AUTO, LEVELS, LOSSES, aggregation_help, aggregation_names, check_loss_config, loss_help, loss_names
from ..rl.optimizers import optimizer_help, optimizer_names
from .fields import ANY, AT_LEAST_1, NONNEG, POS, UNIT_OPEN, Range, setting

# integer keys have an upper bound far beyond any run that fits one machine, so that a typo (an extra digit, a
# pasted number) is refused at load instead of running for ever
MAX_SEQUENCES = 65536  # sequences in one step (train.batch_size x estimator.rollouts_per_prompt), and batch sizes
MIN_PROMPT_TOKENS = 16  # prompts keep at least this many tokens of model.max_seq_length (prompt_budget)


def prompt_budget(cfg) -> int:
    """The prompt tokens every engine keeps (longer prompts lose their start): model.max_seq_length less
    generation.max_new_tokens, and at least MIN_PROMPT_TOKENS."""
    return max(MIN_PROMPT_TOKENS, cfg.model.max_seq_length - cfg.generation.max_new_tokens)


@dataclass
class ModelConfig:
    name: str = setting("builtin:smollm2-135m-instruct", "the base model: builtin:smollm2-135m-instruct | "
                        "builtin:tiny-random (tests, built on the fly) | a Hugging Face hub id | a local folder",
                        nonempty=True, trl="model_name_or_path")
    backend: str = setting("auto", "auto (unsloth on CUDA when it imports, else hf) | hf (transformers + peft) | "
                           "unsloth (GPU)", choices=("auto", "hf", "unsloth"))
    dtype: str = setting("auto", "compute dtype: auto (bf16 where supported and fast, fp16 on pre-Ampere GPUs, fp32 "
                         "otherwise) | float32 | bfloat16 | float16",
                         choices=("auto", "float32", "bfloat16", "float16"), trl="dtype")
    load_in_4bit: bool = setting(False, "load the frozen base in bitsandbytes NF4 with double quantization (GPU "
                                 "presets)", trl="load_in_4bit")
    max_seq_length: int = setting(512, "prompt + completion tokens; longer prompts lose their start",
                                  range=Range(1, 1 << 20))
    gradient_checkpointing: bool = setting(True, "recompute activations in the backward pass (less memory, more time); "
                                           "off while generating", trl="gradient_checkpointing")
    fast_inference: bool = setting(True, "unsloth backend only: an in-process vLLM sharing the 4-bit weights")
    gpu_memory_utilization: float = setting(0.5, "unsloth / vLLM: the share of GPU memory vLLM may take for weights + "
                                            "KV cache", range=UNIT_OPEN)
    unsloth_standby: bool = setting(False, "unsloth: UNSLOTH_VLLM_STANDBY=1, vLLM frees its KV cache while training")
    cache_dir: str = setting("", "where built-in models and prior tables are cached; '' = $BASIS_LITE_CACHE, else "
                             "~/.cache/basis-lite")


@dataclass
class LoraConfig:
    r: int = setting(16, "LoRA rank", range=Range(1, 4096), trl="lora_r")
    alpha: int = setting(32, "LoRA alpha; the adapter's output is scaled by alpha / r", range=POS, trl="lora_alpha")
    dropout: float = setting(0.0, "dropout on the LoRA input while training", range=Range(0, 1, hi_open=True),
                             trl="lora_dropout")
    target_modules: Any = setting("all-linear", "'all-linear' or a list of module names such as [q_proj, v_proj]",
                                  trl="lora_target_modules")


def _check_lora(cfg: Config) -> None:
    tm = cfg.lora.target_modules
    if not (tm == "all-linear" or (isinstance(tm, list) and tm and all(isinstance(x, str) for x in tm))):
        raise ConfigError(f"lora.target_modules: expected 'all-linear' or a list of module names, got {brief(tm)}")


def _dataset_help() -> str:
    return (f"{' | '.join(BUILTIN_TASKS)} (built in, generated, seeded) | gsm8k | math (hub) | "
            "hf:owner/name[:config] (any hub dataset, with question_field / answer_field) | a local "
            f"{'/'.join(format_suffixes())} file (data/formats.py) or a folder written by save_to_disk")


@dataclass
class DataConfig:
    dataset: str = setting("arithmetic", _dataset_help, nonempty=True)
    levels: list = setting([1, 2], "built-in tasks: the difficulty levels to draw from")
    train_size: int = setting(2000, "training problems: a count for built-in tasks; a cap for hub datasets and files "
                              "(0 = all)", range=Range(0, 10_000_000))
    revisit: bool = setting(True, "built-in tasks: a level that runs out of distinct questions before its share of the "
                            "training split is full revisits the ones it drew (true) or leaves its share to the other "
                            "levels (false)")
    value_sampling: float = setting(0.0, "prompt selection by value (SPO's prioritized sampling): a training prompt is "
                                    "skipped until the next epoch with probability s * (1 - 2 sqrt(v (1 - v))), v its "
                                    "tracked success rate (earlier rewards, decayed 0.9 per step, (s + 1) / (n + 2)); "
                                    "prompts whose value sits near 0 or 1 carry little gradient. 0 = off, 1 = "
                                    "strongest (keeps 2%)", range=Range(0, 1))
    eval_size: int = setting(200, "held-out problems for eval (0 = no eval)", range=Range(0, 1_000_000))
    eval_set: int = setting(0, "built-in tasks: the held-out set, 0 (development) or 1 (confirmation: drawn from "
                            "problems set 0 never holds; the training split then leaves out set 1 only)",
                            range=Range(0, 1))
    question_field: str = setting("question", "hf: datasets and files: the field holding the question", nonempty=True)
    answer_field: str = setting("answer", "hf: datasets and files: the field holding the answer (text after ####, or "
                                "the last \\boxed{}, is the gold answer)", nonempty=True)
    split_train: str = setting("train", "hub datasets: the training split", nonempty=True, trl="dataset_train_split")
    split_eval: str = setting("test", "hub datasets: the eval split", nonempty=True, trl="dataset_test_split")
    system_prompt: str = setting("", "system message; '' = none (a chat template's own default is removed too)")
    instruction: str = setting("Put the final answer in \\boxed{}.", "appended to every question")
    max_bad_fraction: float = setting(0.05, "stop loading when more than this share of rows is malformed (below it "
                                      "they are skipped and counted)", range=Range(0, 1))
    seed: int = setting(1234, "seed of the built-in tasks' draw and of the train/eval split of files",
                        range=Range(-(2**63), 2**63 - 1))
    max_question_chars: int = setting(20000, "longer questions are cut to their last N characters when loaded, before "
                                      "tokenizing (0 = no limit); prompts keep at most model.max_seq_length tokens "
                                      "anyway", range=Range(0, 100_000_000))


_HF_DATASET = re.compile(r"hf:[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?")


def _check_data(cfg: Config) -> None:
    """What can be checked of data.* without reading data: the hf: form, built-in levels and sizes."""
    d = cfg.data
    name = str(d.dataset).strip()
    if name.startswith("hf:") and not _HF_DATASET.fullmatch(name):
        raise ConfigError(f"data.dataset: {brief(name)} is not accepted; expected hf:owner/name or hf:owner/name:config "
                          f"(e.g. hf:openai/gsm8k:main)")
    if name in BUILTIN_TASKS:
        try:
            check_levels(name, d.levels)
        except ValueError as err:  # DataError
            raise ConfigError(str(err)) from None
        if d.train_size == 0:
            raise ConfigError(f"data.train_size: must be >= 1 for the built-in task {name} (a count of generated "
                              f"problems; 0 means 'all' only for hub datasets and files), got 0")
    elif d.eval_set != 0:
        raise ConfigError(f"data.eval_set: {d.eval_set} draws a second held-out set of a built-in task "
                          f"({', '.join(BUILTIN_TASKS)}); data.dataset={name} has one eval split: use data.eval_set=0")



def _engine_help() -> str:
    return "rollouts from: " + " | ".join(f"{n} ({get_engine(n).summary})" for n in engine_choices())


@dataclass
class GenerationConfig:
    engine: str = setting("hf", _engine_help, choices=engine_choices)
    temperature: float = setting(1.0, "sampling temperature of the rollouts (the loss uses the same one)", range=POS,
                                 trl="temperature")
    top_p: float = setting(1.0, "nucleus sampling (1 = off)", range=Range(0, 1, lo_open=True), trl="top_p")
    top_k: int = setting(0, "top-k sampling (0 = off; -1 is read as 0, vLLM's and TRL's 'off')",
                         range=Range(-1, 10_000_000), trl="top_k")
    max_new_tokens: int = setting(64, "completion tokens per rollout (TRL: max_completion_length)",
                                  range=Range(1, 1 << 20), trl="max_completion_length")
    batch_size: int = setting(64, "prompts per generate() call (per rank under torchrun)",
                              range=Range(1, MAX_SEQUENCES))
    rng: str = setting("auto", "where sampling randomness comes from: global (torch's RNG) | per_prompt (each prompt "
                       "of a step its own stream, so rollouts do not depend on batching or the number of ranks; "
                       "EAPO-injected rollouts still draw from torch's RNG) | auto (per_prompt under torchrun)",
                       choices=("auto", "global", "per_prompt"))
    fast_cpu: Any = setting("auto", "hf engine on the CPU: auto (rollouts and eval from merged weights, finished rows "
                            "dropped, the shared prompt prefix prefilled once; generate() for trajectory features, "
                            "EAPO injection and non-Llama models; also true) | off (transformers' generate(); also "
                            "false)", choices=("auto", "off"), bools=("auto", "off"))
    vllm_weight_sync: str = setting("auto", "engine vllm: how the trainer's adapter reaches vLLM after an update: lora "
                                    "(a new LoRA request each time) | merged (W + scale * B @ A of the LoRA-wrapped "
                                    "layers written into vLLM's weights, TRL colocate style; vLLM then runs without "
                                    "LoRA) | auto (merged on a CPU in float32, lora otherwise and always with "
                                    "Unsloth's engine)", choices=("auto", "lora", "merged"))
    guard_max_mismatch: float = setting(0.25, "rollout guard, every step: stop when the engine's log-probs differ "
                                        "from the trainer's by more than this (mean per token, nats), or sit at the "
                                        "base model's while the adapter has moved (docs/reliability.md); 0 = guard "
                                        "off", range=NONNEG)
    guard_check_every: int = setting(10, "rollout guard for an engine that reports no log-probs: a spot check every N "
                                     "steps (0 = never)", range=Range(0, 10_000_000))


def _check_generation(cfg: Config) -> None:
    g = cfg.generation
    if g.top_k == -1:
        g.top_k = 0  # vLLM's and TRL's "off" is -1; here (and in transformers) it is 0
    if cfg.device == "cpu" and get_engine(g.engine).needs_gpu:
        raise ConfigError(f"generation.engine: {g.engine} needs a CUDA GPU, and device is cpu; set device=auto or "
                          f"cuda, or choose one of {', '.join(n for n in engine_choices() if not get_engine(n).needs_gpu)}")
    if prompt_budget(cfg) + g.max_new_tokens > cfg.model.max_seq_length:
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
    function_weights: list = setting([], "one weight per function (default 1.0 each)", trl="reward_weights")
    timeout_s: float = setting(10.0, "per-batch limit of one reward function; past it the worker is restarted and the "
                               "batch scores 0 (0 = run them in the trainer process, no limit)", range=Range(0, 86_400))


def _check_reward(cfg: Config) -> None:
    r = cfg.reward
    if r.function_weights and len(r.function_weights) != len(r.functions):
        raise ConfigError(f"reward.function_weights: {len(r.function_weights)} weights for "
                          f"{len(r.functions)} functions; give one weight per function or none")
    for w in r.function_weights:
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ConfigError(f"reward.function_weights: {brief(w)} is not accepted; expected finite numbers, one per "
                              f"function")
    r.function_weights = [float(w) for w in r.function_weights]
    for fn in r.functions:
        if not isinstance(fn, str) or fn.count(":") != 1 or not all(p.strip() for p in fn.split(":")):
            raise ConfigError(f"reward.functions: {brief(fn)} is not of the form 'package.module:function'")
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
    rollouts_per_prompt: int = setting(1, _rollouts_help, range=Range(1, 1024), trl="num_generations")
    prior_samples: int = setting(0, "basis, astar, spo: K reference rollouts per training prompt before training (the "
                                 "offline prior; astar's V*; spo's initial counts), 0 = none; cached",
                                 range=Range(0, 1024))
    use_features: bool = setting(True, "basis: pool other prompts' rewards by the similarity of the policy's prompt "
                                 "hidden states")
    history: bool = setting(False, "basis: refine the prior with this run's earlier rewards of the same prompt")
    options: dict = setting({}, "estimator options, checked at load (basis: see "
                            "basis_lite/estimators/basis_options.py)")
    normalize: Any = setting("auto", "divide the advantages by their batch std: auto (on for basis, off for the "
                             "others) | always | never; true / false read as always / never (reinforce_pp whitens "
                             "its own)", choices=("auto", "always", "never"), bools=("always", "never"))


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
    if e.prior_samples < spec.min_reference:
        raise ConfigError(f"estimator.prior_samples: {e.name} needs K >= {spec.min_reference} reference samples per "
                          f"training prompt (drawn once before training and cached; A*-PO's paper and TRL use 8), got "
                          f"{e.prior_samples}; set estimator.prior_samples=8")
    if spec.picks_prompts is not None and spec.picks_prompts(e.options) and cfg.data.value_sampling > 0:
        raise ConfigError(f"data.value_sampling: {cfg.data.value_sampling} would choose the training prompts, which "
                          f"estimator.name={e.name} does itself (its options); set data.value_sampling=0")
    if spec.with_prior(e) and spec.uses_features and e.use_features \
            and e.options.get("combine", "toward_prior") == "toward_prior" \
            and "cv" in (e.options.get("bandwidth"), e.options.get("shrink")):
        raise ConfigError("estimator.options: bandwidth/shrink 'cv' cannot be combined with a prior "
                          "(estimator.prior_samples > 0 or estimator.history) under the default combine: "
                          "toward_prior; add combine: residual, or use fixed numbers")


def _aggregations_with_trl() -> tuple:
    return (AUTO, *aggregation_names(with_trl=True))


def _losses() -> tuple:
    return (AUTO, *loss_names())


def _mismatch_help() -> str:
    on = [n for n in engine_choices() if get_engine(n).mismatch_correction]
    return ("truncated importance weights between the engine's and the trainer's log-probs: auto (on for "
            f"generation.engine {' and '.join(on) or 'none'}) | always | never")


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
    steps: int = setting(40, "optimizer steps (TRL: max_steps)", range=Range(1, 10_000_000), trl="max_steps")
    batch_size: int = setting(32, "PROMPTS per step; each gets estimator.rollouts_per_prompt completions (TRL's "
                              "per_device_train_batch_size counts completions)",
                              range=Range(1, MAX_SEQUENCES), refuse=_REFUSE_BATCH)
    micro_batch_size: int = setting(8, "sequences per forward/backward; gradient accumulation covers the rest",
                                    range=Range(1, MAX_SEQUENCES), refuse=_REFUSE_ACCUMULATION)
    micro_batch_tokens: int = setting(0, "at most this many padded tokens (rows x the longest row) per "
                                      "micro-batch, so long rollouts train in smaller micro-batches than short ones "
                                      "(a row longer than this trains alone); 0 = train.micro_batch_size alone",
                                      range=Range(0, 10_000_000))
    lr: float = setting(2e-4, "peak learning rate (TRL: learning_rate)", range=POS, trl="learning_rate")
    weight_decay: float = setting(0.0, "AdamW weight decay", range=NONNEG, trl="weight_decay")
    warmup_steps: int = setting(2, "linear warmup steps", range=Range(0, 10_000_000), trl="warmup_steps")
    schedule: str = setting("cosine", "learning-rate schedule after warmup: cosine (down to 10%) | constant",
                            choices=("cosine", "constant"))
    max_grad_norm: float = setting(1.0, "the gradient norm is clipped to this value", range=POS, trl="max_grad_norm")
    optimizer: str = setting("auto", optimizer_help, choices=optimizer_names)
    loss: str = setting("auto", loss_help, choices=_losses)
    loss_aggregation: str = setting("auto", aggregation_help, choices=_aggregations_with_trl, trl="loss_type")
    importance_sampling_level: str = setting("token", "the importance ratio per token | per sequence (GSPO: exp of the "
                                             "mean log-ratio of the sequence); ppo_clip, cispo and sapo",
                                             choices=LEVELS, trl="importance_sampling_level")
    clip_low: float = setting(0.2, "PPO clip: the ratio's lower bound is 1 - clip_low (TRL: epsilon)",
                              range=Range(0, 1, hi_open=True), trl="epsilon")
    clip_high: float = setting(0.28, "PPO clip: the ratio's upper bound is 1 + clip_high (TRL: epsilon_high)",
                               range=NONNEG, trl="epsilon_high")
    bpo_cap: float = setting(5.0, "BPO: cap C on the complementary-probability weight", range=POS)
    bpo_eps: float = setting(0.1, "BPO: smoothing epsilon of the weight (1 + eps - mu) / (1 + eps - pi)", range=POS)
    sapo_temperature_pos: float = setting(1.0, "SAPO: gate temperature for tokens with a positive advantage",
                                          range=POS, trl="sapo_temperature_pos")
    sapo_temperature_neg: float = setting(1.05, "SAPO: gate temperature for tokens with a non-positive advantage",
                                          range=POS, trl="sapo_temperature_neg")
    vespo_k_pos: float = setting(2.0, "VESPO: power k of the gamma weight where A >= 0", range=NONNEG,
                                 trl="vespo_k_pos")
    vespo_lambda_pos: float = setting(3.0, "VESPO: decay lambda of the gamma weight where A >= 0", range=POS,
                                      trl="vespo_lambda_pos")
    vespo_k_neg: float = setting(3.0, "VESPO: power k of the gamma weight where A < 0", range=NONNEG,
                                 trl="vespo_k_neg")
    vespo_lambda_neg: float = setting(2.0, "VESPO: decay lambda of the gamma weight where A < 0", range=POS,
                                      trl="vespo_lambda_neg")
    astar_beta: float = setting(1e-3, "A*-PO loss: beta of the implicit reward beta * sum_t log(pi / pi_ref) that is "
                                "regressed onto r - V*(x) (TRL A2PO: beta2)", range=POS)
    kl_coef: float = setting(0.0, "k3 KL to the reference (the base, adapter disabled); 0 = off, no extra forward "
                             "(TRL: beta)", range=NONNEG, trl="beta")
    ppo_epochs: int = setting(1, "optimizer steps (passes) over each batch of rollouts; > 1 reuses them and the clip "
                              "acts", range=Range(1, 100))
    mismatch_correction: Any = setting("auto", _mismatch_help, choices=("auto", "always", "never"),
                                       bools=("always", "never"))
    mismatch_cap: float = setting(3.0, "cap of those importance weights (>= 1)", range=AT_LEAST_1)
    shared_prefix: Any = setting("auto", "log-prob passes run the token prefix all sequences of a micro-batch share "
                                 "(system prompt, chat template) once instead of once per sequence: auto (on the CPU, "
                                 "without gradient checkpointing) | always | never", choices=("auto", "always", "never"),
                                 bools=("always", "never"))
    logprob_chunk_size: int = setting(1024, "tokens per chunk of the lm_head + log-softmax (never the full [B, T, V] "
                                      "fp32 tensor)", range=Range(1, 1 << 24))
    eval_every: int = setting(0, "greedy held-out eval every N steps (0 = only before and after training)",
                              range=Range(0, 10_000_000))
    eval_batch_size: int = setting(64, "prompts per generate() call in eval", range=Range(1, MAX_SEQUENCES))
    eval_max_new_tokens: int = setting(64, "completion tokens in eval", range=Range(1, 1 << 20))
    save_every: int = setting(10, "checkpoint every N steps (and at the end)", range=Range(1, 10_000_000),
                              trl="save_steps")
    keep_last: int = setting(2, "checkpoints kept", range=Range(1, 10_000))
    max_bad_steps: int = setting(3, "abort after this many non-finite losses in a row (each one is skipped)",
                                 range=Range(1, 10_000_000))
    seed: int = setting(0, "seed of sampling, prompt order and the LoRA init", range=Range(0, 2**32 - 1), trl="seed")
    threads: int = setting(0, "torch CPU threads (0 = all cores)", range=Range(0, 4096))
    report_to: list = setting([], "extra loggers besides metrics.jsonl: [tensorboard, wandb]")
    wandb_project: str = setting("", "W&B project ('' = $WANDB_PROJECT, else basis-lite)")


def _check_train(cfg: Config) -> None:
    """The loss, its aggregation and level together (TRL names read as ours), the mismatch correction against the
    engine, the loggers, and the micro-batch capped at the step's sequence count."""
    t, e = cfg.train, cfg.estimator
    check_loss_config(t, get_estimator(e.name).loss)
    needs = LOSSES[t.loss].estimator
    if needs and e.name != needs:
        raise ConfigError(f"train.loss: {t.loss} regresses onto the advantages of estimator {needs} (r - V*(x) from its "
                          f"reference samples), not {e.name}'s; set estimator.name={needs} or train.loss=auto")
    if needs and get_estimator(e.name).normalizes(e.normalize):
        raise ConfigError(f"estimator.normalize: always would divide the regression target of train.loss={t.loss} "
                          f"(r - V*(x), in reward units) by the batch std; use auto or never")
    if t.mismatch_correction == "always" and not get_engine(cfg.generation.engine).behaviour_logprobs:
        raise ConfigError(f"train.mismatch_correction: always needs the engine's log-probs, which "
                          f"generation.engine={cfg.generation.engine} does not give; use auto or never")
    if t.shared_prefix == "always" and cfg.model.gradient_checkpointing:
        raise ConfigError("train.shared_prefix: always needs model.gradient_checkpointing=false (under checkpointing "
                          "the model keeps no keys and values to share); use auto or never")
    if t.batch_size * e.rollouts_per_prompt > MAX_SEQUENCES:
        raise ConfigError(f"train.batch_size x estimator.rollouts_per_prompt: {t.batch_size} x {e.rollouts_per_prompt} "
                          f"= {t.batch_size * e.rollouts_per_prompt} sequences per step; at most {MAX_SEQUENCES} are "
                          f"accepted")
    bad = [x for x in t.report_to if x not in ("tensorboard", "wandb")]
    if bad:
        raise ConfigError(f"train.report_to: {brief(bad)} not accepted; choose from tensorboard, wandb")
    t.micro_batch_size = min(t.micro_batch_size, t.batch_size * e.rollouts_per_prompt)


@dataclass
class EapoConfig:
    """EAPO experience injection (basis_lite/engines/eapo.py): HF engine only. The default threshold is the 90th
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
    if not get_engine(cfg.generation.engine).eapo:
        can = [n for n in engine_choices() if get_engine(n).eapo]
        raise ConfigError(f"eapo.prior_adapter: experience injection runs on generation.engine={' or '.join(can)} only, "
                          f"not {cfg.generation.engine!r}; set generation.engine={can[0]} or eapo.prior_adapter=''")
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



# the cross-key checks, in the order config.validate runs them (after every key's own type, range and choices)
CHECKS = (_check_generation, _check_estimator, _check_train, _check_data, _check_lora, _check_reward, _check_eapo)
