"""The HF rollout engine on the tiny random model: token bookkeeping and the prompt features BASIS pools by."""
from __future__ import annotations

import pytest
import torch

from basis_lite.config import load_config
from basis_lite.engines.base import SamplingParams
from basis_lite.engines.hf import HFEngine
from basis_lite.model.loading import load_policy


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(1)
    cfg = load_config("smoke")
    model, tok = load_policy(cfg, torch.device("cpu"), torch.float32)
    return model, tok


PROMPTS = ["<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nSolve for x: 3x + 4 = 19. Show work.<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]


def test_features_are_the_middle_layer_prefill_of_each_prompt(policy):
    model, tok = policy
    # layer 0: for the 2-layer tiny model the default middle layer (1) is the last, whose hidden_states entry has
    # the final norm applied, so it cannot be compared with a plain forward
    eng = HFEngine(model, tok, batch_size=16, feature_layer=0, feature_tokens=4)
    rolls = eng.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=4, n=2))
    assert len(rolls) == 6 and [r.prompt for r in rolls] == [p for p in PROMPTS for _ in range(2)]
    for i, prompt in enumerate(PROMPTS):
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        # hidden_states[0] is the embeddings, so decoder layer L's output is hidden_states[L + 1]
        want = hs[eng.feature_layer + 1][0, -4:].float().mean(0)
        for r in rolls[2 * i:2 * i + 2]:  # both samples of a prompt carry that prompt's feature
            assert r.prompt_ids == ids[0].tolist()
            torch.testing.assert_close(r.feature, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(rolls[0].feature, rolls[2].feature)


def test_completion_ids_stop_at_eos_and_decode_to_text(policy):
    model, tok = policy
    eng = HFEngine(model, tok, batch_size=2)  # chunking: 3 prompts in calls of 2
    rolls = eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=6), with_features=False)
    assert len(rolls) == 3
    for r in rolls:
        assert r.feature is None
        assert 1 <= len(r.completion_ids) <= 6
        assert r.finished == (r.completion_ids[-1] in eng.stop_ids)
        assert not set(r.completion_ids[:-1]) & set(eng.stop_ids)
        assert r.text == tok.decode(r.completion_ids, skip_special_tokens=True)
    # greedy decoding is deterministic and independent of the batch it ran in
    again = eng.generate(PROMPTS[1:2], SamplingParams(temperature=0.0, max_new_tokens=6), with_features=False)
    assert again[0].completion_ids == rolls[1].completion_ids
