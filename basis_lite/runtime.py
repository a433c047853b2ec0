"""Setting up what every command needs: seeds, threads, device and dtype, and the policy with its rollout engine.

    device, dtype = setup_device(cfg)            # torch threads (train.threads), cpu/cuda, the compute dtype
    model, tok, engine = build_policy(cfg, device, dtype, adapter_path=None, training=False)
    decided = decide_run(cfg, ranks_active, stored)   # training: the run-time decisions, kept on resume

`train`, `eval`, `export` and `prior` all go through these, so a choice (threads, dtype auto) is made in one place.

A training run stores what was decided while it ran (`Decided`: the device, the compute dtype `model.dtype: auto`
chose, the backend `model.backend: auto` chose, the sampling streams `generation.rng: auto` chose, the thread
count `train.threads: 0` gave) in RUN_DIR/decided.json and in every checkpoint. A resume keeps those values instead
of deciding again (a timing under another CPU load, or another machine, could decide otherwise and the resumed run
would silently differ); when this machine cannot keep one (bf16 stored, a CPU without native bf16; cuda stored, no
GPU; unsloth stored, not installed), `decide_run` raises ConfigError saying so, and nothing is trained.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import random
import warnings

import numpy as np
import torch

from .config import Config
from .config.keys import prompt_budget
from .engines import select_engine
from .errors import ConfigError, ModelError
from .model.cpu import BF16_FLAGS_TEXT
from .model.dtypes import resolve_device, resolve_dtype

log = logging.getLogger("basis_lite")
DECIDED_FILE = "decided.json"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup_device(cfg: Config) -> tuple[torch.device, torch.dtype]:
    """Apply `train.threads` (0 = torch's default, all cores) and resolve `device` and `model.dtype`."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = resolve_device(cfg.device)
    return device, resolve_dtype(cfg.model.dtype, device)


@dataclasses.dataclass(frozen=True)
class Decided:
    """What a training run decided at run time (see the module docstring)."""

    device: str  # cpu | cuda
    dtype: str  # float32 | bfloat16 | float16
    backend: str  # hf | unsloth
    rng: str  # global | per_prompt
    threads: int  # torch CPU threads

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


_STORED = {"device": ("cpu", "cuda"), "dtype": ("float32", "bfloat16", "float16"), "backend": ("hf", "unsloth"),
           "rng": ("global", "per_prompt")}


def read_decided(data) -> dict | None:
    """The stored decisions in `data` (decided.json's object, or a checkpoint's "decided"), the values checked;
    None when there are none or they are not what a run writes."""
    if not isinstance(data, dict):
        return None
    out = {k: data.get(k) for k in _STORED if data.get(k) in _STORED[k]}
    t = data.get("threads")
    if isinstance(t, int) and not isinstance(t, bool) and 1 <= t <= 4096:
        out["threads"] = t
    return out or None


def cpu_native_bf16() -> bool:
    from .model.dtypes import cpu_bf16_flags

    return bool(cpu_bf16_flags())


def decide_run(cfg: Config, ranks_active: bool = False, stored: dict | None = None) -> Decided:
    """The run-time decisions of a training run: each `auto` value resolved here, or, with `stored` (a resume),
    the value the run decided when it started. ConfigError when this machine cannot keep a stored value.
    Applies the thread count."""
    stored = stored or {}
    source = stored.get("from", "the run's stored decisions")
    keep = []

    def kept(key: str, why: str):
        keep.append(f"{key}={stored[key]} ({why})")
        return stored[key]

    device = resolve_device(cfg.device) if not (cfg.device == "auto" and "device" in stored) else None
    if device is None:
        if stored["device"] == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"--resume: {source} records device=cuda (what device: auto chose when the run "
                              "started) and this machine has no CUDA GPU visible to torch; a resumed run keeps its "
                              "device: resume it where a GPU is visible, or start a new run")
        device = torch.device(kept("device", "device: auto"))
    if cfg.model.dtype == "auto" and "dtype" in stored:
        dtype = getattr(torch, kept("dtype", "model.dtype: auto"))
        said = f"--resume: {source} records dtype={stored['dtype']} (what model.dtype: auto chose when the run started)"
        if dtype == torch.float16 and device.type == "cpu":
            raise ConfigError(f"{said} on a {device.type}, where model.dtype: auto never chooses float16 (it chooses "
                              f"bfloat16 or float32); the record is not one a run writes: put the run's own "
                              f"{DECIDED_FILE} back, or start a new run")
        if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_native_bf16():
            raise ConfigError(f"{said}, and this CPU has no native bf16 (no {BF16_FLAGS_TEXT} flag), where bf16 "
                              "would be emulated and many times slower; a resumed run keeps its dtype, so it stops "
                              "here: resume it on a CPU with native bf16, or start a new run with model.dtype: "
                              "float32")
        if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError(f"{said}, and this GPU has no bf16; a resumed run keeps its dtype: resume it on a GPU "
                              "with bf16, or start a new run")
    else:
        dtype = resolve_dtype(cfg.model.dtype, device)
    backend = cfg.model.backend
    if backend == "auto" and "backend" in stored:
        backend = kept("backend", "model.backend: auto")
        if backend == "unsloth" and (device.type != "cuda" or importlib.util.find_spec("unsloth") is None):
            raise ConfigError(f"--resume: {source} records backend=unsloth (what model.backend: auto chose when "
                              "the run started), which is not installed here or needs a GPU; a resumed run keeps "
                              "its backend: resume it where unsloth runs, or start a new run")
    elif backend == "auto":
        backend = auto_backend(device)
    rng = cfg.generation.rng
    if rng == "auto" and "rng" in stored:
        rng = kept("rng", "generation.rng: auto")
        if rng == "global" and ranks_active:
            raise ConfigError(f"--resume: {source} records rng=global (torch's global RNG: generation.rng: auto, "
                              "one process); under torchrun it would need per-prompt streams and would not continue "
                              "the same run: resume it in one process (without torchrun), or start a new run")
    elif rng == "auto":
        rng = "per_prompt" if ranks_active else "global"
    threads = cfg.train.threads
    if not threads and "threads" in stored:
        threads = kept("threads", "train.threads: 0")
    if threads:
        torch.set_num_threads(threads)
    if keep:
        log.info("resume keeps what the run decided when it started (%s): %s", source, ", ".join(keep))
    return Decided(device=device.type, dtype=str(dtype).replace("torch.", ""), backend=backend, rng=rng,
                   threads=threads or torch.get_num_threads())


def auto_backend(device) -> str:
    return "unsloth" if device.type == "cuda" and importlib.util.find_spec("unsloth") is not None else "hf"


def build_policy(cfg: Config, device, dtype, adapter_path=None, training: bool = False, backend: str | None = None):
    """(model, tokenizer, engine) for the configured backend and engine; for training, with the EAPO prior adapter
    (eapo.prior_adapter) loaded beside the trained one and the engine set to inject it."""
    backend = backend or cfg.model.backend
    if backend == "auto":
        backend = auto_backend(device)
    if backend == "unsloth":
        from .model.unsloth import load_unsloth_policy

        model, tok = load_unsloth_policy(cfg, device, dtype, adapter_path)
    else:
        from .model.loading import load_policy

        model, tok = load_policy(cfg, device, dtype, adapter_path)
    with_prior = training and bool(cfg.eapo.prior_adapter)
    if with_prior:
        if backend != "hf":
            raise ModelError("eapo.prior_adapter: experience injection needs model.backend hf; auto picked unsloth "
                             "here, so set model.backend=hf")
        from .engines.eapo import load_prior_adapter

        load_prior_adapter(model, cfg.eapo.prior_adapter)
    set_portable_base_name(model, cfg.model.name)
    return model, tok, make_engine(cfg, model, tok, backend, with_prior=with_prior)


def set_portable_base_name(model, name: str) -> None:
    """Record `model.name` as given (a hub id, a local folder, or `builtin:...`, which
    `basis_lite.model.loading.resolve_model_path` turns into the local folder) as the adapter's `base_model_name_or_path`,
    instead of the folder the base was loaded from (for a built-in model, this machine's cache)."""
    for peft_cfg in (getattr(model, "peft_config", None) or {}).values():
        peft_cfg.base_model_name_or_path = name


# peft's save_pretrained looks for the base's config.json under that name to see whether the vocabulary was resized;
# for a `builtin:` name it finds none, warns, and saves no embedding layers, as it would after finding an unchanged
# vocabulary (LoRA here never resizes or trains embeddings)
warnings.filterwarnings("ignore", message=r"Could not find a config file in builtin:", category=UserWarning)


def make_engine(cfg: Config, model, tok, backend: str = "hf", with_prior: bool = False):
    """The rollout engine `generation.engine` selects on this backend and the model's device (engines/__init__.py),
    built over the model; prompts keep `prompt_budget(cfg)` tokens."""
    from .engines import hf, vllm  # noqa: F401  (their @engine lines bind the factories)

    spec = select_engine(cfg, backend, next(model.parameters()).device.type)
    return spec.build(cfg, model, tok, max_prompt_tokens=prompt_budget(cfg), backend=backend, with_prior=with_prior)
