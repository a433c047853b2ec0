"""The Unsloth backend (CUDA only): 4-bit base + LoRA through `FastLanguageModel`, optionally with vLLM sharing weights.

    load_unsloth_policy(cfg, device, dtype, adapter_path=None) -> (peft model, tokenizer)

What it does, in the order Unsloth needs:
  1. UNSLOTH_VLLM_STANDBY=1 goes into the environment BEFORE `import unsloth` when model.unsloth_standby is set
     (unsloth_zoo reads it at import time to choose the allocator settings: standby is incompatible with
     expandable segments, which it otherwise turns on).
  2. `import unsloth` happens here, lazily: it patches transformers/peft/trl on import, so the CPU path and the
     tests never pay for it (or get patched). Imported after transformers, Unsloth warns that some optimisations
     may be missing; basis-lite does not import transformers before the model is built.
  3. FastLanguageModel.from_pretrained(model_name, max_seq_length, dtype, load_in_4bit, fast_inference,
     max_lora_rank, gpu_memory_utilization, random_state). With fast_inference and vllm installed, Unsloth starts
     an in-process vLLM first and builds the training model on vLLM's weight tensors (one 4-bit copy); without
     vllm it prints a notice and carries on with its own generate().
  4. FastLanguageModel.get_peft_model(r, lora_alpha, lora_dropout, target_modules, use_gradient_checkpointing=
     "unsloth", random_state). "all-linear" becomes the seven Llama/Qwen projections, as Unsloth's notebooks use.
  5. Resume: the saved adapter's tensors are loaded into the fresh LoRA modules (peft's set_peft_model_state_dict),
     after checking that its r / alpha / targets match the config, so Unsloth's patched LoRA layers stay in place
     (PeftModel.from_pretrained would bypass them).
LoRA weights are kept in fp32 (as the hf backend does); Unsloth's LoRA kernels cast A/B to the activation dtype.

Unverified here: written against unsloth 2026.10.9 / unsloth-zoo 2026.10.9 source and never run on a GPU from this
repo yet (no GPU was available); bench/gpu_step.py exercises it on one.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

import torch

from ..engines import get_engine, select_engine
from .loading import ModelError, resolve_model_path

log = logging.getLogger("basis_lite")

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
INSTALL = "pip install 'basis-lite[unsloth]'"


def lora_target_modules(target_modules) -> list[str]:
    return list(ALL_LINEAR) if target_modules == "all-linear" else list(target_modules)


def check_unsloth_available(device: torch.device) -> None:
    if importlib.util.find_spec("unsloth") is None:
        raise ModelError(f"model.backend: unsloth is not installed; {INSTALL} (on a CUDA machine), or set "
                         "model.backend=hf")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ModelError("model.backend: unsloth needs a CUDA GPU (found none); use model.backend=hf, which runs the "
                         "same training on a CPU")


def import_unsloth(standby: bool):
    """`import unsloth` with the standby switch set first; returns FastLanguageModel."""
    if standby:
        if "unsloth" in sys.modules and os.environ.get("UNSLOTH_VLLM_STANDBY", "0") != "1":
            log.warning("model.unsloth_standby: unsloth was already imported without UNSLOTH_VLLM_STANDBY=1, so "
                        "standby cannot take effect in this process; export UNSLOTH_VLLM_STANDBY=1 before starting")
        else:
            os.environ["UNSLOTH_VLLM_STANDBY"] = "1"
    try:
        import unsloth  # noqa: F401  (patches transformers / peft / trl on import)
        from unsloth import FastLanguageModel
    except ImportError as e:
        raise ModelError(f"model.backend: importing unsloth failed ({e}); {INSTALL}. A CUDA-linked torchvision "
                         "that does not match torch also breaks it: pip uninstall -y torchvision") from None
    return FastLanguageModel


def _check_adapter_matches(cfg, adapter_path: str) -> None:
    conf_path = Path(adapter_path) / "adapter_config.json"
    if not conf_path.exists():
        raise ModelError(f"resume: {adapter_path} has no adapter_config.json")
    saved = json.loads(conf_path.read_text())
    want_targets = sorted(lora_target_modules(cfg.lora.target_modules))
    saved_targets = saved.get("target_modules")
    saved_targets = sorted(saved_targets) if isinstance(saved_targets, list) else saved_targets
    diffs = []
    if saved.get("r") != cfg.lora.r:
        diffs.append(f"r {saved.get('r')} vs lora.r {cfg.lora.r}")
    if saved.get("lora_alpha") != cfg.lora.alpha:
        diffs.append(f"alpha {saved.get('lora_alpha')} vs lora.alpha {cfg.lora.alpha}")
    if isinstance(saved_targets, list) and saved_targets != want_targets:
        diffs.append(f"target_modules {saved_targets} vs {want_targets}")
    if diffs:
        raise ModelError(f"resume: the adapter in {adapter_path} does not match the config ({'; '.join(diffs)})")


def load_adapter_weights(model, adapter_path: str) -> None:
    """Copy a saved peft adapter's tensors into the model's (same-shaped) LoRA modules; fail on any mismatch."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    device = next(p for p in model.parameters() if p.requires_grad).device
    weights = load_peft_weights(adapter_path, device=str(device))
    result = set_peft_model_state_dict(model, weights)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    missing = [k for k in (getattr(result, "missing_keys", []) or []) if "lora_" in k]
    if unexpected or missing:
        raise ModelError(f"resume: adapter {adapter_path} does not fit the model (unexpected {unexpected[:4]}, "
                         f"missing {missing[:4]})")


def load_unsloth_policy(cfg, device: torch.device, dtype: torch.dtype, adapter_path: str | None = None):
    """(peft model, tokenizer) from Unsloth; the model carries `vllm_engine`/`fast_generate`/`load_lora` when
    fast_inference took effect."""
    check_unsloth_available(device)
    get_engine(cfg.generation.engine).check_installed()  # before minutes of model loading, not after
    if adapter_path:
        _check_adapter_matches(cfg, adapter_path)
    FastLanguageModel = import_unsloth(cfg.model.unsloth_standby and cfg.model.fast_inference)
    path = resolve_model_path(cfg.model.name, cfg.model.cache_dir)
    try:
        model, tok = FastLanguageModel.from_pretrained(
            model_name=path, max_seq_length=cfg.model.max_seq_length, dtype=dtype,
            load_in_4bit=cfg.model.load_in_4bit, fast_inference=cfg.model.fast_inference,
            max_lora_rank=cfg.lora.r, gpu_memory_utilization=cfg.model.gpu_memory_utilization,
            random_state=cfg.train.seed)
    except OSError as e:
        raise ModelError(f"model.name: Unsloth cannot load {cfg.model.name!r} ({e}); give a hub id or a local folder "
                         "with config.json and weights") from None
    if cfg.model.fast_inference and getattr(model, "vllm_engine", None) is None:
        log.warning("Unsloth started without vLLM (not installed, or the GPU is older than sm70): rollouts use %s",
                    select_engine(cfg, "hf", device.type).description)
    model = FastLanguageModel.get_peft_model(
        model, r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
        target_modules=lora_target_modules(cfg.lora.target_modules), bias="none",
        use_gradient_checkpointing="unsloth" if cfg.model.gradient_checkpointing else False,
        random_state=cfg.train.seed)
    if adapter_path:
        load_adapter_weights(model, adapter_path)
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    if not hasattr(tok, "pad_token") and hasattr(tok, "tokenizer"):  # a processor (multimodal checkpoints)
        tok = tok.tokenizer
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return model, tok
