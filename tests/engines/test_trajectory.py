"""Trajectory features (engines/trajectory.py) on the tiny random model: what the HF engine captures while it decodes
equals what a teacher-forced forward of the finished rollouts gives, sampling is unchanged by the capture, and the
pieces the vLLM path uses (early-exit forward, top-k stats) agree with it."""
from __future__ import annotations

import math

import pytest
import torch

from basis_lite.config import load_config
from basis_lite.engines.base import Engine, SamplingParams
from basis_lite.engines.hf import HFEngine
from basis_lite.engines.trajectory import (
    N_STATS,
    STATS,
    answer_span,
    completion_hidden_states,
    split,
    stats_from_topk,
    stats_vector,
)
from basis_lite.model.loading import load_policy

PROMPTS = ["<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nSolve for x: 3x + 4 = 19. Show work.<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def policy():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = load_config("smoke")
    model, tok = load_policy(cfg, torch.device("cpu"), torch.float32)
    yield model, tok
    torch.set_num_threads(n)


def _teacher_forced(model, tok, r, temperature):
    """Per-token entropies and sampled-token log-probs of one rollout from a plain full forward."""
    ids = torch.tensor([r.prompt_ids + r.completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    P, L = len(r.prompt_ids), len(r.completion_ids)
    logp = torch.log_softmax(logits[P - 1:P + L - 1] / temperature, -1)
    ent = -(logp.exp() * logp).sum(-1)
    lp = logp.gather(1, torch.tensor(r.completion_ids)[:, None])[:, 0]
    return ent, lp


def _stop_on_a_sampled_token(eng, params, seed):
    """The random model never samples its EOS: make a token it does sample mid-way a stop token, so that rows stop
    at different steps (and others run to max_new_tokens) under the same seed."""
    torch.manual_seed(seed)
    plain = eng.generate(PROMPTS, params, with_features=False)
    counts: dict = {}
    for r in plain:
        for t in set(r.completion_ids[1:-2]):
            counts[t] = counts.get(t, 0) + 1
    stop = max(counts, key=lambda t: (counts[t] < len(plain), counts[t]))  # in many rows, not in all
    eng.stop_ids = [stop]


@pytest.mark.parametrize("layer", [0, 1])
def test_captured_features_equal_a_teacher_forced_forward(policy, layer):
    model, tok = policy
    # generate(), where trajectory features are captured (the fast CPU path falls back to it for them)
    eng = HFEngine(model, tok, batch_size=16, feature_layer=layer, trajectory_tokens=3, fast_cpu="off")
    T = 0.9
    params = SamplingParams(temperature=T, max_new_tokens=10, n=2)
    _stop_on_a_sampled_token(eng, params, seed=3)
    torch.manual_seed(3)
    rolls = eng.generate(PROMPTS, params, with_trajectory=True)
    assert len(rolls) == 6
    # rows that stopped early (while others went on decoding) and rows cut at max_new_tokens
    assert len({len(r.completion_ids) for r in rolls if r.finished}) >= 2 and not all(r.finished for r in rolls)
    hid = completion_hidden_states(model, [r.prompt_ids for r in rolls], [r.completion_ids for r in rolls],
                                   tok.pad_token_id, layer_index=layer, tokens=3)
    for i, r in enumerate(rolls):
        assert r.trajectory is not None and r.trajectory.shape == (model.config.hidden_size + N_STATS,)
        h, st = split(r.trajectory)
        torch.testing.assert_close(h, hid[i], atol=2e-4, rtol=2e-4)
        ent, lp = _teacher_forced(model, tok, r, T)
        span = answer_span(tok.convert_ids_to_tokens(r.completion_ids))
        want = stats_vector(ent, lp, span, r.finished)
        torch.testing.assert_close(st, want.float(), atol=2e-4, rtol=2e-4)
        L = len(r.completion_ids)
        assert st[STATS.index("log_length")] == pytest.approx(math.log1p(L))
        assert st[STATS.index("finished")] == float(r.finished)
    # two samples of one prompt differ in their trajectory, not in their prompt feature
    assert not torch.equal(rolls[0].trajectory, rolls[1].trajectory) or rolls[0].completion_ids == rolls[1].completion_ids
    torch.testing.assert_close(rolls[0].feature, rolls[1].feature)
    assert isinstance(eng, Engine) and eng.trajectory_seconds > 0


def test_capture_changes_no_sampled_token_and_costs_nothing_when_off(policy):
    model, tok = policy
    # chunks: 3 prompts x 2 in calls of 2 prompts; generate() both times (the fast CPU path has no capture)
    eng = HFEngine(model, tok, batch_size=4, fast_cpu="off")
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2)
    torch.manual_seed(11)
    plain = eng.generate(PROMPTS, params)
    state_after_plain = torch.get_rng_state()
    torch.manual_seed(11)
    traj = eng.generate(PROMPTS, params, with_trajectory=True)
    assert torch.equal(torch.get_rng_state(), state_after_plain)  # the capture draws no random numbers
    assert [r.completion_ids for r in plain] == [r.completion_ids for r in traj]
    for a, b in zip(plain, traj):
        torch.testing.assert_close(a.feature, b.feature)
    assert all(r.trajectory is None for r in plain) and all(r.trajectory is not None for r in traj)
    # without trajectory features no hook stays behind on any layer
    from basis_lite.model.loading import decoder_layers

    assert all(not layer._forward_hooks for layer in decoder_layers(model))


def test_answer_span_and_stats_by_hand():
    assert answer_span(["The", " sum", " is", " 1", "5", "3", ".", "<eos>"]) == (3, 6)
    assert answer_span(["12", " +", " 3", " =", " 1", "5"]) == (4, 6)
    assert answer_span(["no", " digits"]) == (1, 2)
    assert answer_span(["7"]) == (0, 1)
    e = torch.tensor([1.0, 3.0, 2.0, 0.5])
    lp = torch.tensor([-1.0, -2.0, -0.5, -0.1])
    st = stats_vector(e, lp, (1, 3), True)
    want = [1.625, 3.0, 2.5, -1.25, -0.9, math.log(5.0), 1.0]
    torch.testing.assert_close(st, torch.tensor(want, dtype=st.dtype))
    assert stats_vector(torch.zeros(0), torch.zeros(0), (0, 0), False).tolist() == [0.0] * N_STATS
    assert stats_vector(e, lp, (1, 3), True, length=9)[STATS.index("log_length")] == pytest.approx(math.log(10.0))


def test_stats_from_topk_is_the_truncated_distribution_at_temperature():
    # one step with 3 candidates (raw log-probs), temperature 0.5: renormalised softmax(2 * raw) over the three
    raw = {5: math.log(0.6), 7: math.log(0.3), 9: math.log(0.1)}

    class LP:  # vLLM's Logprob objects carry .logprob
        def __init__(self, v):
            self.logprob = v

    steps = [raw, {k: LP(v) for k, v in raw.items()}]
    st = stats_from_topk(steps, [7, 5], ["4", "2"], finished=False, temperature=0.5)
    p = torch.tensor([0.36, 0.09, 0.01], dtype=torch.float64)
    p = p / p.sum()
    h = float(-(p * p.log()).sum())
    lp7, lp5 = math.log(p[1]), math.log(p[0])
    want = [h, h, h, (lp7 + lp5) / 2, (lp7 + lp5) / 2, math.log(3.0), 0.0]
    torch.testing.assert_close(st, torch.tensor(want, dtype=torch.float32))


def test_vllm_engine_trajectories_with_a_fake_llm(policy, monkeypatch):
    """The plain vLLM engine (a fake vllm.LLM at the boundary, as in test_gpu_fakes.py): asks for top-k log-probs
    only with trajectory features, and builds them from an early-exit forward plus those log-probs."""
    import sys
    import types

    from basis_lite.engines.vllm import TRAJECTORY_TOPK, PlainVLLMEngine

    model, tok = policy
    vllm = types.ModuleType("vllm")

    class FakeSP:  # stands in for vllm.SamplingParams
        def __init__(self, **kw):
            self.kw = kw
            for k, v in kw.items():
                setattr(self, k, v)

    vllm.SamplingParams = FakeSP
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = lambda lora_name, lora_int_id, lora_path="": types.SimpleNamespace(
        lora_name=lora_name, lora_int_id=lora_int_id, lora_path=lora_path)
    vllm.lora, lora.request = lora, request
    for name, mod in (("vllm", vllm), ("vllm.lora", lora), ("vllm.lora.request", request)):
        monkeypatch.setitem(sys.modules, name, mod)

    class FakeLLM:  # stands in for vllm.LLM: completion k of prompt p is [65 + p, 48 + k] then EOS or the length cap
        def __init__(self):
            self.params = []

        def generate(self, inputs, sampling_params=None, lora_request=None, use_tqdm=True):
            self.params.append(sampling_params)
            outs = []
            for p, sp in enumerate(sampling_params):
                comps = []
                for k in range(sp.n):
                    ids = [65 + p, 48 + k] + ([tok.eos_token_id] if k == 0 else [])
                    lps = None
                    if getattr(sp, "logprobs", None):
                        lps = [{t: -0.1, t + 1: -2.5, t + 2: -3.0} for t in ids]
                    comps.append(types.SimpleNamespace(index=k, token_ids=ids, logprobs=lps, text="",
                                                       finish_reason="stop" if k == 0 else "length",
                                                       stop_reason=None))
                outs.append(types.SimpleNamespace(outputs=comps))
            return outs

    llm = FakeLLM()
    eng = PlainVLLMEngine(model, tok, llm, max_prompt_tokens=40)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, n=2)
    plain = eng.generate(PROMPTS[:2], params)
    assert all(r.trajectory is None for r in plain)
    assert isinstance(eng, Engine) and eng.trajectory_seconds == 0.0  # nothing captured without with_trajectory
    assert all(sp.kw["logprobs"] == 0 for sp in llm.params[-1])  # by default only the sampled token's log-prob
    rolls = eng.generate(PROMPTS[:2], params, with_trajectory=True)
    assert all(sp.kw["logprobs"] == TRAJECTORY_TOPK for sp in llm.params[-1])
    hid = completion_hidden_states(model, [r.prompt_ids for r in rolls], [r.completion_ids for r in rolls],
                                   tok.pad_token_id, tokens=eng.feature_tokens)
    p = torch.softmax(torch.tensor([-0.1, -2.5, -3.0], dtype=torch.float64), 0)
    h = float(-(p * p.log()).sum())
    for i, r in enumerate(rolls):
        hh, st = split(r.trajectory)
        torch.testing.assert_close(hh, hid[i])
        assert st[STATS.index("entropy_mean")] == pytest.approx(h, rel=1e-5)
        assert st[STATS.index("answer_logprob")] == pytest.approx(math.log(p[0]), rel=1e-5)
        assert st[STATS.index("log_length")] == pytest.approx(math.log1p(len(r.completion_ids)))
        assert st[STATS.index("finished")] == float(r.finished)
    assert eng.trajectory_seconds > 0
