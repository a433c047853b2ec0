"""Behaviour log-probs from the HF engine, several passes over a batch (`train.ppo_epochs`) and the truncated
importance weights between the engine's and the trainer's log-probs (`train.mismatch_correction`), on the tiny model.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import VARIED, adapter_weights, step_records, train_smoke, trainer_logprobs

from basis_lite.config import load_config
from basis_lite.engines.base import SamplingParams
from basis_lite.engines.hf import HFEngine
from basis_lite.errors import ConfigError
from basis_lite.losses.policy import sequence_logprobs
from basis_lite.model.loading import load_policy
from basis_lite.rl.update import (
    behaviour_weights,
    make_optimizer,
    mismatch_correction_on,
    pack_sequences,
    policy_update,
)

CPU = torch.device("cpu")
PROMPTS = ["<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nSolve for x: 3x + 4 = 19. Show work.<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(1)
    cfg = load_config("smoke", ["model.dtype=float32"])
    model, tok = load_policy(cfg, CPU, torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # move the adapter off zero, so policy and base differ
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return cfg, model, tok




@pytest.mark.parametrize("temperature,top_k,per_prompt", [(0.7, 0, False), (1.3, 5, False), (0.0, 0, False),
                                                          (0.7, 0, True), (1.3, 5, True)])
def test_hf_logprobs_equal_a_separate_forward_at_the_sampling_temperature(policy, temperature, top_k, per_prompt):
    """The engine's log-prob of every completion token is log softmax(logits / T) of a separate forward pass over
    the whole sequence (T = 1 when greedy; top-k does not change it: the trainer scores the full distribution), to
    fp32 rounding: KV-cached decoding runs matmuls of other shapes than the full forward. Also with per-prompt
    sampling streams (generation.rng=per_prompt, the default under torchrun), whose sampler turns the scores into
    a one-hot row: the recorded log-probs must still be the model's."""
    from basis_lite.engines.seeded import stream_seed

    _, model, tok = policy
    torch.manual_seed(0)
    eng = HFEngine(model, tok, batch_size=4)  # 6 sequences in chunks: left padding differs between calls
    params = SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=10, n=2 if temperature else 1,
                            seeds=[stream_seed(0, "t", i) for i in range(len(PROMPTS))] if per_prompt else None)
    rolls = eng.generate(PROMPTS, params)
    scale = temperature or 1.0
    want = trainer_logprobs(model, tok, rolls, scale)
    other = trainer_logprobs(model, tok, rolls, 2.0 * scale)
    for r, w, o in zip(rolls, want, other):
        assert len(r.logprobs) == len(r.completion_ids) > 0
        got = torch.tensor(r.logprobs)
        assert (got - w).abs().max().item() <= 1e-5, (got, w)
        assert (got - o).abs().max().item() > 1e-2  # the temperature matters: the check can tell
        assert r.behaviour_logprobs() == r.logprobs  # no injection: sampled from the policy everywhere


# ---------------------------------------------------------------------------------------------------------------
# ppo_epochs


def _update(cfg, model, rolls, adv, tok, overrides=()):
    cfg = load_config("smoke", ["model.dtype=float32", *overrides])
    m = copy.deepcopy(model)
    opt = make_optimizer(cfg, m, CPU)
    stats, ok = policy_update(cfg, m, opt, rolls, adv, tok.pad_token_id, CPU)
    assert ok
    lora = {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}
    return stats, lora, opt


@pytest.fixture(scope="module")
def batch(policy):
    _, model, tok = policy
    torch.manual_seed(3)
    rolls = HFEngine(model, tok).generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=10, n=3))
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 0.8, -0.8, 0.0])
    return rolls, adv


def test_ppo_epochs_two_steps_twice_and_clips(policy, batch):
    cfg, model, tok = policy
    rolls, adv = batch
    s1, w1, opt1 = _update(cfg, model, rolls, adv, tok, ["train.lr=0.05"])
    s2, w2, opt2 = _update(cfg, model, rolls, adv, tok, ["train.lr=0.05", "train.ppo_epochs=2"])
    s3, w3, _ = _update(cfg, model, rolls, adv, tok, ["train.lr=0.05", "train.ppo_epochs=3"])
    first = next(iter(opt1.state.values()))
    assert int(first["step"]) == 1 and int(next(iter(opt2.state.values()))["step"]) == 2
    assert s1["clip_fraction"] == 0.0  # one pass: ratio 1
    assert s2["clip_fraction"] > 0.0 and s3["clip_fraction"] > s2["clip_fraction"]
    diff = sum(float((w2[n] - w1[n]).abs().sum()) for n in w1)
    assert diff > 1e-3  # a second step moved the adapter further
    # the second pass is NOT a fresh on-policy step from the new weights: with old fixed at the sampling policy, its
    # clipped tokens give no gradient; a plain second update on the same rollouts (old = current) differs
    cfg1 = load_config("smoke", ["model.dtype=float32", "train.lr=0.05"])
    m = copy.deepcopy(model)
    opt = make_optimizer(cfg1, m, CPU)
    policy_update(cfg1, m, opt, rolls, adv, tok.pad_token_id, CPU)
    policy_update(cfg1, m, opt, rolls, adv, tok.pad_token_id, CPU)
    twice = {n: p.detach() for n, p in m.named_parameters() if p.requires_grad}
    assert sum(float((twice[n] - w2[n]).abs().sum()) for n in w2) > 1e-4


def test_ppo_epochs_bpo_clips_too(policy, batch):
    """BPO's clip is on its complementary-probability weight, which moves only for likely tokens: at a low sampling
    temperature (the tiny random model's logits lie close together) its tokens are likely."""
    cfg, model, tok = policy
    _, adv = batch
    torch.manual_seed(4)
    rolls = HFEngine(model, tok).generate(PROMPTS, SamplingParams(temperature=0.01, max_new_tokens=10, n=3))
    low_t = ["train.lr=0.05", "train.loss=bpo", "generation.temperature=0.01"]
    s1, _, _ = _update(cfg, model, rolls, adv, tok, low_t)
    s2, _, _ = _update(cfg, model, rolls, adv, tok, low_t + ["train.ppo_epochs=2"])
    assert s1["clip_fraction"] == 0.0 and s2["clip_fraction"] > 0.0


# ---------------------------------------------------------------------------------------------------------------
# mismatch correction


def _shifted(rolls, shift):
    """The same rollouts as an engine with other numerics would report them: log-probs moved by `shift(j)`."""
    out = []
    for r in rolls:
        r2 = copy.copy(r)
        r2.logprobs = [lp - shift(j) for j, lp in enumerate(r.logprobs)]
        out.append(r2)
    return out


def test_mismatch_weights_truncated_and_reported(policy, batch):
    cfg, model, tok = policy
    rolls, _ = batch
    # engine log-probs lower than the trainer's by 0.5 on even tokens and 2.0 on odd ones: weights e^0.5, and
    # e^2 truncated at the cap 3
    eng = _shifted(rolls, lambda j: 0.5 if j % 2 == 0 else 2.0)
    c = load_config("smoke", ["model.dtype=float32", "train.mismatch_correction=always", "train.mismatch_cap=3"])
    ids, attn, cmask = pack_sequences(eng, 512, tok.pad_token_id)
    model.eval()
    with torch.no_grad():
        out = sequence_logprobs(model, ids, attn, cmask, temperature=1.0)
    acc = {"sum": 0.0, "n": 0, "max": 0.0, "truncated": 0}
    w = behaviour_weights(c, eng, [None] * len(eng), out.logprobs, out.mask, acc)
    for i, r in enumerate(eng):
        s = len(r.prompt_ids) - 1
        row = w[i, s:s + len(r.completion_ids)]
        want = torch.tensor([math.exp(0.5) if j % 2 == 0 else 3.0 for j in range(len(r.completion_ids))])
        torch.testing.assert_close(row, want, atol=1e-4, rtol=1e-4)
        assert (w[i, :s] == 1).all()
    n_odd = sum(len(r.completion_ids) // 2 for r in eng)
    assert acc["truncated"] == n_odd and acc["n"] == sum(len(r.completion_ids) for r in eng)
    assert acc["max"] == pytest.approx(2.0, abs=1e-4)
    # correction off: no weights, the log-ratio is still measured
    c_off = load_config("smoke", ["model.dtype=float32", "train.mismatch_correction=never"])
    assert behaviour_weights(c_off, eng, [None] * len(eng), out.logprobs, out.mask, dict(acc)) is None


def test_mismatch_correction_changes_the_update_only_when_on(policy, batch):
    cfg, model, tok = policy
    rolls, adv = batch
    eng = _shifted(rolls, lambda j: 0.7 * ((j * 7919) % 5 - 2))  # a token-dependent mismatch, both signs
    base_stats, base, _ = _update(cfg, model, rolls, adv, tok)
    assert base_stats["engine_log_ratio_max"] < 1e-4 and "mismatch_truncated_fraction" not in base_stats
    off_stats, off, _ = _update(cfg, model, eng, adv, tok, ["train.mismatch_correction=never"])
    assert all(torch.equal(off[n], base[n]) for n in base)  # off: the engine's log-probs only feed the metrics
    assert off_stats["engine_log_ratio_max"] == pytest.approx(1.4, abs=1e-3)
    on_stats, on, _ = _update(cfg, model, eng, adv, tok, ["train.mismatch_correction=always", "train.mismatch_cap=2"])
    assert not all(torch.equal(on[n], base[n]) for n in base)
    assert 0 < on_stats["mismatch_truncated_fraction"] < 1


def test_mismatch_correction_default_per_engine():
    assert not mismatch_correction_on(load_config("smoke"))
    assert mismatch_correction_on(load_config("smoke", ["generation.engine=vllm"]))
    assert not mismatch_correction_on(load_config("smoke", ["generation.engine=vllm",
                                                            "train.mismatch_correction=never"]))
    assert mismatch_correction_on(load_config("smoke", ["train.mismatch_correction=always"]))
    # YAML reads on/off as booleans: they mean always/never
    assert load_config("smoke", ["train.mismatch_correction=on"]).train.mismatch_correction == "always"
    assert load_config("smoke", ["train.mismatch_correction=off"]).train.mismatch_correction == "never"


@pytest.mark.parametrize("override,match", [
    ("train.ppo_epochs=0", r"train.ppo_epochs: must be an integer in \[1, 100\]"),
    ("train.mismatch_cap=0.5", r"train.mismatch_cap: must be a number >= 1"),
    ("train.mismatch_correction=sometimes", r"train.mismatch_correction: 'sometimes' is not accepted; choose one of "
                                            r"auto, always, never"),
])
def test_config_ranges(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config("smoke", [override])


# ---------------------------------------------------------------------------------------------------------------
# end to end


def test_training_with_two_epochs(tmp_path):
    """Two passes per batch change the run, the clip acts, and the metrics carry the engine/trainer log-ratio."""
    common = [*VARIED, "estimator.prior_samples=0", "train.steps=2", "train.lr=0.05"]  # a step that moves the ratio
    one = train_smoke(tmp_path / "one", *common, one_thread=True)
    two = train_smoke(tmp_path / "two", *common, "train.ppo_epochs=2", one_thread=True)
    r1, r2 = step_records(one), step_records(two)
    assert [r["clip_fraction"] for r in r1] == [0.0, 0.0]
    assert any(r["clip_fraction"] > 0 for r in r2)
    for r in r1 + r2:
        assert 0 <= r["engine_log_ratio_max"] < 1e-4 and abs(r["engine_log_ratio_mean"]) < 1e-5
        assert "mismatch_truncated_fraction" not in r  # off on the HF engine by default
    assert r1[0]["reward_mean"] == r2[0]["reward_mean"]  # the same first rollouts
    w1, w2 = adapter_weights(one / "adapter"), adapter_weights(two / "adapter")
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)


@pytest.mark.parametrize("which", ["ppo", "bpo"])
def test_loss_weights_multiply_each_token(which):
    """weights w: the loss is sum m w l / N and its gradient w times the unweighted one, token by token."""
    from basis_lite.losses.policy import bpo_loss, ppo_clip_loss

    g = torch.Generator().manual_seed(0)
    lp = (torch.randn(2, 5, generator=g) - 2).requires_grad_()
    old = lp.detach() + 0.3 * torch.randn(2, 5, generator=g)
    adv = torch.tensor([1.0, -0.5])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    w = torch.rand(2, 5, generator=g) * 3
    fn = ppo_clip_loss if which == "ppo" else bpo_loss
    base, _ = fn(lp, old, adv, mask, num_tokens=8)
    g_base = torch.autograd.grad(base, lp)[0]
    weighted, _ = fn(lp, old, adv, mask, num_tokens=8, weights=w)
    g_w = torch.autograd.grad(weighted, lp)[0]
    torch.testing.assert_close(g_w, g_base * w * mask)
    # the value: each token's unweighted term (the loss over that token alone, same divisor) times its weight
    one = torch.arange(10).view(2, 5)
    terms = torch.stack([fn(lp, old, adv, mask & (one == k), num_tokens=8)[0] for k in range(10)])
    assert weighted.item() == pytest.approx(float((terms.detach() * w.flatten()).sum()), rel=1e-5)
    assert base.item() == pytest.approx(float(terms.detach().sum()), rel=1e-5)


def test_behaviour_logprobs_merge_the_prior_at_injected_positions():
    from basis_lite.engines.base import Rollout

    r = Rollout(prompt="p", prompt_ids=[1], completion_ids=[5, 6, 7], text="", finished=False,
                logprobs=[-1.0, -2.0, -3.0], injected=[1], prior_logprobs=[-0.5])
    assert r.behaviour_logprobs() == [-1.0, -0.5, -3.0] and r.logprobs == [-1.0, -2.0, -3.0]
    assert Rollout(prompt="p", prompt_ids=[1], completion_ids=[5], text="", finished=False).behaviour_logprobs() is None
