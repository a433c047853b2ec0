"""Data: where training and eval questions come from, how they become prompts, and in which order they are drawn.

``load_examples(cfg.data, "train" | "eval") -> list[Example]`` reads ``data.dataset``: a built-in generated task
(``arithmetic``, ``algebra``, ``wordproblems``), a hub dataset (``gsm8k``, ``math``, ``hf:owner/name[:config]``) or a
local file in a registered format; any other value is a DataError that lists what is accepted.

    tasks.py     the built-in tasks: problem families, difficulty levels, the seeded draw, disjoint splits
    loading.py   local files and the hub, ``load_examples``
    formats.py   the local file formats by suffix: one reader each (``register_format``)
    rows.py      the rows of both: fields, gold-answer extraction, validation, bad-row accounting
    prompts.py   ``format_prompt``: the chat template, with the system prompt handled per template
    sampler.py   ``PromptSampler``: endless seeded batches, resumable from a checkpoint
    example.py   ``Example``, the record all of them share

The names below are the public API; import them from ``basis_lite.data``.
"""
from __future__ import annotations

from ..errors import DataError
from .example import Example
from .loading import HUB_DATASETS, SPLITS, load_examples
from .prompts import format_prompt
from .rows import GOLD_STYLES, gold_answer
from .sampler import PromptSampler
from .tasks import BUILTIN_TASKS, level_table

__all__ = [
    "BUILTIN_TASKS", "GOLD_STYLES", "HUB_DATASETS", "SPLITS", "DataError", "Example",
    "PromptSampler", "format_prompt", "gold_answer", "level_table", "load_examples",
]
