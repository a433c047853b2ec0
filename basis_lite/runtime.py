"""Setting up what every command needs: seeds, threads, device and dtype, and the policy with its rollout engine.

    device, dtype = setup_device(cfg)            # torch threads (train.threads), cpu/cuda, the compute dtype
    model, tok, engine = build_policy(cfg, device, dtype, adapter_path=None, training=False)

`train`, `eval`, `export` and `prior` all go through these, so a choice (threads, dtype auto) is made in one place.
"""
from __future__ import annotations

import importlib.util
import random
import warnings

import numpy as np
import torch

from .config import Config
from .dtypes import resolve_device, resolve_dtype


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


def build_policy(cfg: Config, device, dtype, adapter_path=None, training: bool = False):
    """(model, tokenizer, engine) for the configured backend and engine; for training, with the EAPO prior adapter
    (eapo.prior_adapter) loaded beside the trained one and the engine set to inject it."""
    backend = cfg.model.backend
    if backend == "auto":
        backend = "unsloth" if device.type == "cuda" and importlib.util.find_spec("unsloth") is not None else "hf"
    if backend == "unsloth":
        from .unsloth_backend import load_unsloth_policy

        model, tok = load_unsloth_policy(cfg, device, dtype, adapter_path)
    else:
        from .models import load_policy

        model, tok = load_policy(cfg, device, dtype, adapter_path)
    with_prior = training and bool(cfg.eapo.prior_adapter)
    if with_prior:
        if backend != "hf":
            from .errors import ModelError

            raise ModelError("eapo.prior_adapter: experience injection needs model.backend hf; auto picked unsloth "
                             "here, so set model.backend=hf")
        from .eapo import load_prior_adapter

        load_prior_adapter(model, cfg.eapo.prior_adapter)
    set_portable_base_name(model, cfg.model.name)
    return model, tok, make_engine(cfg, model, tok, backend, with_prior=with_prior)


def set_portable_base_name(model, name: str) -> None:
    """Record `model.name` as given (a hub id, a local folder, or `builtin:...`, which
    `basis_lite.models.resolve_model_path` turns into the local folder) as the adapter's `base_model_name_or_path`,
    instead of the folder the base was loaded from (for a built-in model, this machine's cache)."""
    for peft_cfg in (getattr(model, "peft_config", None) or {}).values():
        peft_cfg.base_model_name_or_path = name


# peft's save_pretrained looks for the base's config.json under that name to see whether the vocabulary was resized;
# for a `builtin:` name it finds none, warns, and saves no embedding layers, as it would after finding an unchanged
# vocabulary (LoRA here never resizes or trains embeddings)
warnings.filterwarnings("ignore", message=r"Could not find a config file in builtin:", category=UserWarning)


def make_engine(cfg: Config, model, tok, backend: str = "hf", with_prior: bool = False):
    max_prompt = max(16, cfg.model.max_seq_length - cfg.generation.max_new_tokens)
    if cfg.generation.engine == "hf":
        from .engines.hf import HFEngine

        return HFEngine(model, tok, batch_size=cfg.generation.batch_size, max_prompt_tokens=max_prompt,
                        eapo=cfg.eapo if with_prior else None)
    from .engines.vllm import make_vllm_engine

    return make_vllm_engine(cfg, model, tok, backend)
