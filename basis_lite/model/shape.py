"""A model's shape (hidden size, layers, heads, vocabulary, ...) without loading it or downloading anything: from a
local config.json, the local Hugging Face cache, or a small table of the models the presets and README name.
Torch-free; read by `basis-lite plan` (plan.py) and the vLLM engine.

    shape, source = model_shape(model_name, cache_dir)
    shape = shape_from_config_json(path)
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError, cache_root
from ..safeio import read_json
from .downloads import SMOLLM2_CACHE_DIR


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    @property
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each per-layer linear, by the usual Llama/Qwen2 module name."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def linear_params(self) -> int:
        return self.layers * sum(a * b for a, b in self.linear_shapes.values())

    @property
    def embedding_params(self) -> int:  # input embeddings + an untied lm_head
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def params(self) -> int:
        return self.linear_params + self.embedding_params

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def describe(self) -> str:
        return (f"{self.params / 1e9:.2f}B params, {self.layers} layers, hidden {self.hidden}, "
                f"{self.heads}/{self.kv_heads} q/kv heads, vocab {self.vocab}")


def _shape(name, hidden, layers, heads, kv_heads, intermediate, vocab, tied, head_dim=None) -> ModelShape:
    return ModelShape(name, hidden, layers, heads, kv_heads, head_dim or hidden // heads, intermediate, vocab, tied)


# Public config.json values of the models the presets and README name (keys: lower-case, without "-instruct").
KNOWN_SHAPES = {s.name.lower(): s for s in [
    _shape("Qwen2.5-0.5B", 896, 24, 14, 2, 4864, 151936, True),
    _shape("Qwen2.5-1.5B", 1536, 28, 12, 2, 8960, 151936, True),
    _shape("Qwen2.5-3B", 2048, 36, 16, 2, 11008, 151936, True),
    _shape("Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064, False),
    _shape("Llama-3.2-1B", 2048, 16, 32, 8, 8192, 128256, True),
    _shape("Llama-3.2-3B", 3072, 28, 24, 8, 8192, 128256, True),
    _shape("SmolLM2-135M", 576, 30, 9, 3, 1536, 49152, True),
    _shape("SmolLM2-360M", 960, 32, 15, 5, 2560, 49152, True),
    _shape("SmolLM2-1.7B", 2048, 24, 32, 32, 8192, 49152, True),
    _shape("tiny-random", 64, 2, 4, 2, 128, 259, True),  # builtin:tiny-random (tests)
]}
BUILTIN_ALIASES = {"builtin:smollm2-135m-instruct": "smollm2-135m", "builtin:tiny-random": "tiny-random"}


def shape_from_config(c, name: str = "") -> ModelShape:
    """The shape in a config.json mapping or a transformers config object (a multimodal one's text_config)."""
    if not isinstance(c, dict):
        c = c.to_dict()
    c = c.get("text_config") or c
    heads = int(c["num_attention_heads"])
    return ModelShape(name, int(c["hidden_size"]), int(c["num_hidden_layers"]), heads,
                      int(c.get("num_key_value_heads") or heads),
                      int(c.get("head_dim") or c["hidden_size"] // heads), int(c["intermediate_size"]),
                      int(c["vocab_size"]), bool(c.get("tie_word_embeddings", False)))


def shape_from_config_json(path: str | os.PathLike, name: str = "") -> ModelShape:
    try:
        c = read_json(path)  # a regular file only: a FIFO or a device there never blocks plan
    except ValueError as e:
        raise ConfigError(f"{e}; a model's config.json is a small JSON file") from None
    return shape_from_config(c, name or str(path))


def _table_key(name: str) -> str:
    key = name.rstrip("/").split("/")[-1].lower()
    for suffix in ("-unsloth-bnb-4bit", "-bnb-4bit", "-instruct"):
        key = key.removesuffix(suffix)
    return key


def model_shape(model_name: str, cache_dir: str = "") -> tuple[ModelShape, str]:
    """(shape, where it came from) without downloading anything."""
    if model_name in BUILTIN_ALIASES:
        if model_name == "builtin:smollm2-135m-instruct":
            local = cache_root(cache_dir) / SMOLLM2_CACHE_DIR / "config.json"
            if local.exists():
                return shape_from_config_json(local, "SmolLM2-135M-Instruct"), f"config.json in {local.parent}"
        return KNOWN_SHAPES[BUILTIN_ALIASES[model_name]], "built-in table"
    if (Path(model_name) / "config.json").exists():
        return shape_from_config_json(Path(model_name) / "config.json", Path(model_name).name), \
            f"config.json in {model_name}"
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
    cached = sorted(glob.glob(os.path.join(hub, "models--" + model_name.replace("/", "--"), "snapshots", "*",
                                           "config.json")))
    if cached:
        return shape_from_config_json(cached[-1], model_name), "config.json in the local Hugging Face cache"
    key = _table_key(model_name)
    if key in KNOWN_SHAPES:
        return KNOWN_SHAPES[key], "built-in table"
    known = ", ".join(s.name for s in KNOWN_SHAPES.values() if s.name != "tiny-random")
    raise ConfigError(f"plan: no shape known for model.name={model_name!r} (no local config.json, not in the Hugging "
                      f"Face cache, not one of {known}); point model.name at a local folder with a config.json")
