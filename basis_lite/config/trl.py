"""A `trl grpo --config grpo.yaml` file read as basis-lite settings (`basis-lite train --config grpo.yaml`).

A TRL config is one flat mapping of GRPOConfig, ModelConfig and script keys. `translate` turns it into basis-lite
keys, with TRL's meaning throughout:

- every key with a `trl=` alias on its field (config/keys.py: learning_rate, num_generations, loss_type, lora_r,
  model_name_or_path, ...) goes to that key unchanged;
- the keys below whose value needs converting (`CONVERTED`): the dataset name, the reward functions (TRL's own
  built-ins as `trl.rewards:<name>`, dotted paths as `module:function`; with reward_funcs the reward is theirs
  alone, as in TRL: reward.correctness_weight 0), the batch (TRL counts completions per device, basis-lite prompts
  per step), bf16 / fp16, use_vllm, warmup_ratio, the optimizer, evaluation, report_to, and cispo's cap (TRL's
  `epsilon_high` under `loss_type: cispo` is the cap itself; basis-lite's is 1 + train.clip_high);
- keys that are basis-lite's own (a section such as `train:`, or `output_dir`) pass through;
- anything else is refused, every such key in one message with the nearest basis-lite key, before any model loads.

Torch-free, and imports nothing of the config package: `config.load_config` calls it with the alias table and the
key list.
"""
from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any, Callable

from ..data.formats import format_suffixes
from ..errors import ConfigError

__all__ = ["translate", "TRL_BUILTIN_REWARDS", "CONVERTED"]

# the reward functions `trl grpo` knows by name (trl/scripts/grpo.py), run from the installed trl
TRL_BUILTIN_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward")


class _Refused(Exception):
    """A TRL key that cannot be honoured: the nearest basis-lite key and why."""

    def __init__(self, nearest: str, why: str):
        super().__init__(why)
        self.nearest, self.why = nearest, why


def _steps(data: dict) -> int:
    steps = data.get("max_steps", -1)
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else 0


def _dataset(value: Any, data: dict) -> dict:
    if not isinstance(value, str) or not value.strip():
        raise _Refused("data.dataset", f"expected a dataset name, got {value!r}")
    name = value.strip()
    if Path(name).suffix in format_suffixes() or Path(name).exists():
        return {"data.dataset": name}  # a local file or save_to_disk folder: as it is
    config = data.get("dataset_config")
    return {"data.dataset": f"hf:{name}" + (f":{config}" if config else "")}


def _dataset_config(value: Any, data: dict) -> dict:
    if "dataset_name" not in data:
        raise _Refused("data.dataset", "dataset_config without dataset_name")
    return {}  # part of data.dataset (hf:name:config)


def _reward_funcs(value: Any, data: dict) -> dict:
    names = value if isinstance(value, list) else [value]
    out = []
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise _Refused("reward.functions", f"expected names of reward functions, got {name!r}")
        name = name.strip()
        if name in TRL_BUILTIN_REWARDS:
            out.append(f"trl.rewards:{name}")
        elif "." in name and ":" not in name:
            module, _, fn = name.rpartition(".")
            out.append(f"{module}:{fn}")
        elif name.count(":") == 1:
            out.append(name)
        else:
            raise _Refused("reward.functions", f"{name!r} is neither one of TRL's built-in rewards "
                                               f"({', '.join(TRL_BUILTIN_REWARDS)}) nor a dotted import path such as "
                                               f"my_lib.rewards.custom_reward")
    return {"reward.functions": out, "reward.correctness_weight": 0.0}  # TRL's reward is its functions alone


def _batch(value: Any, data: dict) -> dict:
    """TRL: per_device_train_batch_size completions per device and micro-step, gradient_accumulation_steps micro-
    steps per optimizer step, num_generations completions per prompt. One process here."""
    per_device = data.get("per_device_train_batch_size", 8)  # TRL's defaults where the file sets one of them
    accumulation = data.get("gradient_accumulation_steps", 1)
    generations = data.get("num_generations", 8)
    for key, v in (("per_device_train_batch_size", per_device), ("gradient_accumulation_steps", accumulation),
                   ("num_generations", generations)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise _Refused("train.batch_size", f"{key} must be a positive integer, got {v!r}")
    completions = per_device * accumulation
    if completions % generations:
        raise _Refused("train.batch_size", f"per_device_train_batch_size x gradient_accumulation_steps = {completions} "
                                           f"completions per step is not a multiple of num_generations={generations}")
    out = {"train.batch_size": completions // generations, "train.micro_batch_size": per_device}
    if "num_generations" not in data:
        out["estimator.rollouts_per_prompt"] = generations
    return out


def _precision(value: Any, data: dict) -> dict:
    if data.get("bf16") is True:
        return {"model.dtype": "bfloat16"}
    if data.get("fp16") is True:
        return {"model.dtype": "float16"}
    return {"model.dtype": "float32"} if value is False else {}


def _use_vllm(value: Any, data: dict) -> dict:
    return {"generation.engine": "vllm" if value else "hf"}


def _use_peft(value: Any, data: dict) -> dict:
    if value is False:
        raise _Refused("lora.r", "basis-lite always trains a LoRA adapter (no full fine-tuning); drop use_peft: false")
    return {}


def _warmup_ratio(value: Any, data: dict) -> dict:
    steps = _steps(data)
    if not steps or isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise _Refused("train.warmup_steps", "warmup_ratio needs max_steps > 0 and a ratio in [0, 1]")
    return {"train.warmup_steps": int(math.ceil(value * steps))}


_OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "adamw_8bit": "adamw8bit",
               "adamw_bnb_8bit": "adamw8bit", "paged_adamw_8bit": "adamw8bit"}


def _optim(value: Any, data: dict) -> dict:
    if value not in _OPTIMIZERS:
        raise _Refused("train.optimizer", f"optim {value!r} has no basis-lite equivalent; accepted: "
                                          f"{', '.join(_OPTIMIZERS)}")
    return {"train.optimizer": _OPTIMIZERS[value]}


def _lr_scheduler(value: Any, data: dict) -> dict:
    if value in ("constant", "constant_with_warmup"):
        return {"train.schedule": "constant"}
    if value == "cosine":
        return {"train.schedule": "cosine"}
    raise _Refused("train.schedule", f"lr_scheduler_type {value!r}: basis-lite has cosine (down to 10% of the peak) "
                                     f"and constant, each after a linear warmup")


def _eval(value: Any, data: dict) -> dict:
    strategy = data.get("eval_strategy", "no")
    if strategy == "no":
        return {"train.eval_every": 0}
    if strategy == "steps" and isinstance(data.get("eval_steps"), int) and data["eval_steps"] >= 1:
        return {"train.eval_every": data["eval_steps"]}
    raise _Refused("train.eval_every", f"eval_strategy {strategy!r} with eval_steps {data.get('eval_steps')!r}: "
                                       f"basis-lite evaluates every N steps (eval_strategy: steps and eval_steps: N)")


def _save_strategy(value: Any, data: dict) -> dict:
    if value != "steps":
        raise _Refused("train.save_every", f"save_strategy {value!r}: basis-lite checkpoints every train.save_every "
                                           f"steps (save_strategy: steps)")
    return {}


def _report_to(value: Any, data: dict) -> dict:
    names = value if isinstance(value, list) else [value]
    if names in (["none"], [None], []):
        return {"train.report_to": []}
    if "all" in names:
        names = ["tensorboard", "wandb"]
    return {"train.report_to": names}


def _save_total_limit(value: Any, data: dict) -> dict:
    return {} if value is None else {"train.keep_last": value}


def _epsilon_high(value: Any, data: dict) -> dict:
    if data.get("loss_type") == "cispo":  # TRL's cispo caps the ratio at epsilon_high itself
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1:
            raise _Refused("train.clip_high", f"loss_type cispo caps the importance weight at epsilon_high; "
                                              f"expected a cap >= 1 (TRL recommends 5.0), got {value!r}")
        return {"train.clip_high": float(value) - 1.0}
    return {"train.clip_high": value}


def _num_train_epochs(value: Any, data: dict) -> dict:
    if not _steps(data):
        raise _Refused("train.steps", "basis-lite counts optimizer steps, not epochs: set max_steps")
    return {}  # ignored, as TRL ignores it when max_steps > 0


def _cispo_without_cap(data: dict) -> None:
    if data.get("loss_type") == "cispo" and "epsilon_high" not in data:
        raise ConfigError("loss_type cispo: TRL caps the importance weight at epsilon_high, which is not set here "
                          "(TRL then caps it at epsilon, 0.2, below 1); set epsilon_high (TRL recommends 5.0)")


# TRL key -> fn(value, the whole file) -> {basis-lite key: value}; may raise _Refused
CONVERTED: dict[str, Callable[[Any, dict], dict]] = {
    "dataset_name": _dataset, "dataset_config": _dataset_config, "reward_funcs": _reward_funcs,
    "per_device_train_batch_size": _batch, "gradient_accumulation_steps": _batch, "bf16": _precision,
    "fp16": _precision, "use_vllm": _use_vllm, "use_peft": _use_peft, "warmup_ratio": _warmup_ratio,
    "optim": _optim, "lr_scheduler_type": _lr_scheduler, "eval_strategy": _eval, "eval_steps": _eval,
    "save_strategy": _save_strategy, "report_to": _report_to, "save_total_limit": _save_total_limit,
    "epsilon_high": _epsilon_high, "num_train_epochs": _num_train_epochs,
}

# what to say for TRL keys people often set that have no basis-lite counterpart
_HINTS = {
    "logging_steps": ("train.report_to", "basis-lite logs every step to metrics.jsonl"),
    "reward_model_name_or_path": ("reward.functions", "basis-lite scores with reward functions, not a reward model"),
    "push_to_hub": ("output_dir", "basis-lite writes a run folder; `basis-lite export` makes an adapter, a merged "
                                  "model or a GGUF to upload"),
}


def _nearest(key: str, keys: list[str]) -> str:
    """The basis-lite key whose name is closest to `key` (its last part first)."""
    leaf_of: dict[str, str] = {}
    for k in keys:
        leaf_of.setdefault(k.rsplit(".", 1)[-1], k)
    close = difflib.get_close_matches(key, list(leaf_of), n=1, cutoff=0.0)
    return leaf_of[close[0]] if close else keys[0]


def translate(data: Any, aliases: dict[str, str], keys: list[str], sections: set[str],
              source: str = "TRL config") -> list[tuple[str, str, Any]]:
    """The settings of a `trl grpo` config mapping, as [(TRL key, basis-lite key, value)] in the file's order
    (basis-lite's own keys and sections pass through as (key, key, value)). `aliases`: TRL name -> basis-lite key
    (the fields' `trl=`); `keys`: every basis-lite key; `sections`: the names a basis-lite config has at its top
    level. ConfigError naming every key it cannot map, each with the nearest basis-lite key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of TRL's GRPOConfig keys (as `trl grpo --config` reads), got "
                          f"{type(data).__name__}")
    _cispo_without_cap(data)
    out: list[tuple[str, str, Any]] = []
    refused: list[str] = []
    done: set = set()
    for key, value in data.items():
        key = str(key)
        if key in CONVERTED:
            fn = CONVERTED[key]
            if fn in done:  # one function reads several keys (the batch, the precision, evaluation)
                continue
            done.add(fn)
            try:
                out += [(key, k, v) for k, v in fn(value, data).items()]
            except _Refused as e:
                refused.append(f"{key} ({e.why}; nearest basis-lite key: {e.nearest})")
        elif key in aliases:
            out.append((key, aliases[key], value))
        elif key in sections:
            out.append((key, key, value))
        elif key in _HINTS:
            nearest, why = _HINTS[key]
            refused.append(f"{key} ({why}; nearest basis-lite key: {nearest})")
        else:
            refused.append(f"{key} (nearest basis-lite key: {_nearest(key, keys)})")
    if refused:
        raise ConfigError(f"{source}: {len(refused)} TRL key{'s' if len(refused) > 1 else ''} basis-lite cannot "
                          f"map: {'; '.join(refused)}. Remove {'them' if len(refused) > 1 else 'it'} or write the "
                          f"basis-lite key (`basis-lite config` lists every key)")
    return out
