"""EAPO experience injection: the importance weights on a toy problem with a closed-form gradient, the HF engine's
injection on the tiny random model (positions and both log-probs recorded), and a training run with a prior adapter.
"""
from __future__ import annotations

import math

import pytest
import torch
from conftest import VARIED, cli_main, sets, step_records, train_smoke

from basis_lite.config import EapoConfig, load_config
from basis_lite.engines.base import SamplingParams
from basis_lite.engines.eapo import PRIOR_ADAPTER, importance_weights, inject_mask, load_prior_adapter
from basis_lite.engines.hf import HFEngine
from basis_lite.errors import ConfigError, ModelError
from basis_lite.losses.policy import ppo_clip_loss, sequence_logprobs
from basis_lite.model.loading import load_policy
from basis_lite.rl.update import pack_sequences

CPU = torch.device("cpu")

# ---------------------------------------------------------------------------------------------------------------
# the weights


def test_importance_weights_hand_computed():
    pol = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0], [-0.1, -3.0, -0.2]])
    pri = torch.tensor([[-2.0, -1.0, -9.0], [-5.0, -5.0, -5.0], [-3.0, -1.0, -0.1]])
    inj = torch.tensor([[True, True, False], [False, False, False], [True, False, True]])
    # sequence: exp(sum of d over injected) on every token; row 0: d = 1 - 1 = 0 -> 1; row 2: 2.9 - 0.1 -> capped
    w, st = importance_weights(pol, pri, inj, "sequence", cap=3.0)
    torch.testing.assert_close(w, torch.tensor([[1.0] * 3, [1.0] * 3, [3.0] * 3]))
    assert st["weight_mean"] == pytest.approx(2.0) and st["capped_fraction"] == pytest.approx(0.5)
    assert st["log_ratio_mean"] == pytest.approx((1.0 - 1.0 + 2.9 - 0.1) / 4)
    # token: each injected token its own ratio, 1 elsewhere
    w, st = importance_weights(pol, pri, inj, "token", cap=3.0)
    e = math.exp
    torch.testing.assert_close(w, torch.tensor([[e(1.0), e(-1.0), 1.0], [1.0, 1.0, 1.0], [3.0, 1.0, e(-0.1)]]))
    assert st["capped_fraction"] == pytest.approx(0.25)
    w, st = importance_weights(pol, pri, torch.zeros_like(inj), "sequence", cap=3.0)
    assert torch.equal(w, torch.ones(3, 3)) and math.isnan(st["weight_mean"])
    with pytest.raises(ValueError):
        importance_weights(pol, pri, inj, "sequence", cap=0.5)


def test_inject_mask_threshold_rate_and_active():
    torch.manual_seed(0)
    ent = torch.linspace(0, 2, 20000)
    active = torch.ones(20000, dtype=torch.bool)
    active[:100] = False
    m = inject_mask(ent, active, threshold=1.0, rate=0.3)
    assert not m[ent < 1.0].any() and not m[:100].any()
    assert m[ent >= 1.0].float().mean().item() == pytest.approx(0.3, abs=0.02)
    assert inject_mask(ent, active, 0.0, 1.0).sum() == 20000 - 100
    assert not inject_mask(ent, active, 0.0, 0.0).any()


# ---------------------------------------------------------------------------------------------------------------
# the toy problem: two tokens from a vocabulary of 3, a known reward table, a tabular softmax policy


V = 3
TH1 = [0.2, -0.1, 0.0]  # first-token logits (entropy ~1.09 nats: critical)
TH2 = [[2.5, -1.0, 0.0], [0.1, 0.0, -0.2], [0.0, 0.3, 0.1]]  # second-token logits after token a1 (a1=0: not critical)
Q1 = [-1.0, 2.0, 0.0]  # the prior: a different policy
Q2 = [[0.0, 0.0, 1.5], [2.0, -1.0, 0.0], [-1.0, 0.0, 2.0]]
R = torch.tensor([[1.0, 0.0, 0.2], [0.3, 0.9, 0.0], [0.0, 0.5, 1.0]])
THRESHOLD, RATE = 0.8, 0.5


def _entropy(logits):
    return -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)


def _toy_gradient_estimate(th1, th2, n: int, level: str | None, cap: float) -> torch.Tensor:
    """One batch of n two-token rollouts sampled with injection; the gradient estimate is minus the gradient of the
    project's PPO-clip loss (on-policy ratio, advantage R - 0.5, EAPO weights unless level is None)."""
    lp1 = torch.log_softmax(th1, -1).expand(n, V)
    lq1 = torch.log_softmax(torch.tensor(Q1), -1).expand(n, V)
    ones = torch.ones(n, dtype=torch.bool)
    i1 = inject_mask(_entropy(th1.detach()).expand(n), ones, THRESHOLD, RATE)
    a1 = torch.where(i1, torch.multinomial(lq1.exp(), 1)[:, 0], torch.multinomial(lp1.detach().exp(), 1)[:, 0])
    lp2 = torch.log_softmax(th2, -1)[a1]
    lq2 = torch.log_softmax(torch.tensor(Q2), -1)[a1]
    i2 = inject_mask(_entropy(th2.detach())[a1], ones, THRESHOLD, RATE)
    a2 = torch.where(i2, torch.multinomial(lq2.exp(), 1)[:, 0], torch.multinomial(lp2.detach().exp(), 1)[:, 0])
    lp = torch.stack([lp1.gather(1, a1[:, None])[:, 0], lp2.gather(1, a2[:, None])[:, 0]], 1)
    lq = torch.stack([lq1.gather(1, a1[:, None])[:, 0], lq2.gather(1, a2[:, None])[:, 0]], 1)
    inj = torch.stack([i1, i2], 1)
    weights = importance_weights(lp.detach(), lq, inj, level, cap)[0] if level else None
    loss, _ = ppo_clip_loss(lp, lp.detach(), R[a1, a2] - 0.5, torch.ones(n, 2, dtype=torch.bool), num_tokens=n,
                            weights=weights)
    return -torch.cat([g.flatten() for g in torch.autograd.grad(loss, [th1, th2])])


def test_toy_weighted_estimator_is_unbiased_and_unweighted_is_not():
    """E[gradient estimate] against the exact gradient of J = sum_tau pi(tau) R(tau), over 40 batches of 4000.

    The cap is above the largest possible weight, so the sequence-level estimator is the untruncated one; it must
    match within Monte-Carlo error (|z| < 4.5 on each of the 12 parameters), while ignoring the injection (no
    weights) and token-level weights are both off by many standard errors.
    """
    torch.manual_seed(0)
    th1 = torch.tensor(TH1, requires_grad=True)
    th2 = torch.tensor(TH2, requires_grad=True)
    assert _entropy(th1).item() >= THRESHOLD and _entropy(th2[0]).item() < THRESHOLD <= _entropy(th2[1]).item()
    J = (torch.softmax(th1, -1)[:, None] * torch.softmax(th2, -1) * R).sum()
    exact = torch.cat([g.flatten() for g in torch.autograd.grad(J, [th1, th2])])
    # the largest weight any rollout can get: the product of pi/q over both positions
    r1 = (torch.log_softmax(th1, -1) - torch.log_softmax(torch.tensor(Q1), -1)).max()
    r2 = (torch.log_softmax(th2, -1) - torch.log_softmax(torch.tensor(Q2), -1)).max()
    cap = math.exp(max(0.0, r1.item()) + max(0.0, r2.item())) * 1.01

    def z_scores(level):
        est = torch.stack([_toy_gradient_estimate(th1, th2, 4000, level, cap) for _ in range(40)])
        se = est.std(0) / math.sqrt(est.shape[0])
        return (est.mean(0) - exact) / se

    z_seq = z_scores("sequence")
    assert z_seq.abs().max().item() < 4.5, z_seq
    assert z_scores(None).abs().max().item() > 20
    assert z_scores("token").abs().max().item() > 20


# ---------------------------------------------------------------------------------------------------------------
# injection in the HF engine on the tiny random model


PROMPTS = ["<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nSolve for x: 3x + 4 = 19.<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def with_prior(tmp_path_factory):
    """The tiny model with a trained-looking adapter (random lora_B) and, loaded beside it, a prior: another
    random adapter saved to disk, as an earlier run leaves it."""
    torch.set_num_threads(1)
    cfg = load_config("smoke", ["model.dtype=float32"])
    model, tok = load_policy(cfg, CPU, torch.float32)
    folder = tmp_path_factory.mktemp("eapo") / "prior"
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.save_pretrained(folder)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert load_prior_adapter(model, str(folder)) == PRIOR_ADAPTER
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
    return cfg, model, tok, folder


def _scored(model, tok, rolls, temperature, adapter=None):
    """Per rollout: (log-probs of the completion tokens, policy entropy there) from one forward of the whole
    sequence, under the trained adapter or (adapter=PRIOR_ADAPTER) the prior."""
    ids, attn, cmask = pack_sequences(rolls, 512, tok.pad_token_id)
    model.eval()
    with torch.no_grad():
        if adapter is None:
            out = sequence_logprobs(model, ids, attn, cmask, temperature=temperature, with_entropy=True)
            lp, ent = out.logprobs, out.entropy
        else:
            z = model(input_ids=ids, attention_mask=attn, adapter_names=[adapter] * len(rolls)).logits[:, :-1].float()
            lp = torch.log_softmax(z / temperature, -1).gather(-1, ids[:, 1:, None])[..., 0]
            ent = None
    res = []
    for i, r in enumerate(rolls):
        s = slice(len(r.prompt_ids) - 1, len(r.prompt_ids) - 1 + len(r.completion_ids))
        res.append((lp[i, s], None if ent is None else ent[i, s]))
    return res


def test_every_injected_position_is_recorded_with_both_logprobs(with_prior):
    _, model, tok, _ = with_prior
    T = 1.0
    params = SamplingParams(temperature=T, max_new_tokens=10, n=2, inject=True)
    # the threshold: the median policy entropy at the positions of a first batch, so some positions are critical
    torch.manual_seed(0)
    probe = HFEngine(model, tok, batch_size=16, eapo=EapoConfig(prior_adapter="x", entropy_threshold=0.0,
                                                               injection_rate=0.0)).generate(PROMPTS, params)
    assert all(not r.injected for r in probe)
    thr = torch.cat([e for _, e in _scored(model, tok, probe, T)]).median().item()
    eng = HFEngine(model, tok, batch_size=4, eapo=EapoConfig(prior_adapter="x", entropy_threshold=thr,
                                                             injection_rate=1.0))
    torch.manual_seed(1)
    rolls = eng.generate(PROMPTS, params)
    assert len(rolls) == 6 and [r.prompt for r in rolls] == [p for p in PROMPTS for _ in range(2)]
    pol, pri = _scored(model, tok, rolls, T), _scored(model, tok, rolls, T, PRIOR_ADAPTER)
    n_inj = n_not = 0
    for r, (lp, ent), (lq, _) in zip(rolls, pol, pri):
        assert len(r.logprobs) == len(r.completion_ids) and len(r.prior_logprobs) == len(r.injected)
        assert r.text == tok.decode(r.completion_ids, skip_special_tokens=True)
        assert r.finished == (r.completion_ids[-1] in eng.stop_ids)
        # the policy's log-prob of every token (injected or not), as a separate forward computes it
        torch.testing.assert_close(torch.tensor(r.logprobs), lp, atol=1e-4, rtol=0)
        # the prior's log-prob at every injected position
        torch.testing.assert_close(torch.tensor(r.prior_logprobs), lq[r.injected], atol=1e-4, rtol=0)
        # injected exactly where the policy's entropy reached the threshold (rate 1)
        for j, h in enumerate(ent.tolist()):
            if abs(h - thr) > 1e-3:
                assert (j in r.injected) == (h >= thr), (j, h, thr)
        n_inj += len(r.injected)
        n_not += len(r.completion_ids) - len(r.injected)
    assert n_inj > 0 and n_not > 0
    # eval-style calls (inject False, or greedy) never inject
    assert not any(r.injected for r in eng.generate(PROMPTS, SamplingParams(temperature=T, max_new_tokens=6)))


def test_injected_tokens_come_from_the_prior(with_prior):
    """Threshold 0, rate 1, a low temperature: every token is one the prior is sure of and the policy is not."""
    _, model, tok, _ = with_prior
    T = 0.005  # the tiny random model's logits are close together: a low temperature makes both policies peaked
    eng = HFEngine(model, tok, eapo=EapoConfig(prior_adapter="x", entropy_threshold=0.0, injection_rate=1.0))
    torch.manual_seed(0)
    rolls = eng.generate(PROMPTS, SamplingParams(temperature=T, max_new_tokens=8, inject=True), with_features=False)
    far = []
    for r, (lq, _), (lp, _) in zip(rolls, _scored(model, tok, rolls, T, PRIOR_ADAPTER), _scored(model, tok, rolls, T)):
        assert r.injected == list(range(len(r.completion_ids)))
        assert lq.mean().item() > -1.0  # typical draws of the prior
        assert (lq >= lp - 1e-3).all()  # never a token the policy prefers
        far += (lq - lp > 20).tolist()  # mostly tokens the policy would almost never have drawn
    assert sum(far) / len(far) > 0.7


def test_prior_is_not_saved_and_bad_prior_path(with_prior, tmp_path):
    _, model, _, _ = with_prior
    model.save_pretrained(tmp_path / "a")
    assert (tmp_path / "a" / "adapter_model.safetensors").exists()
    assert not (tmp_path / "a" / PRIOR_ADAPTER).exists()
    cfg = load_config("smoke", ["model.dtype=float32"])
    m2, _ = load_policy(cfg, CPU, torch.float32)
    with pytest.raises(ModelError, match="eapo.prior_adapter"):
        load_prior_adapter(m2, str(tmp_path / "nothing-here"))


# ---------------------------------------------------------------------------------------------------------------
# config and training


@pytest.mark.parametrize("override,match", [
    ("eapo.injection_rate=1.5", r"eapo.injection_rate: must be a number in \[0, 1\]"),
    ("eapo.weight_cap=0.5", r"eapo.weight_cap: must be a number >= 1"),
    ("eapo.entropy_threshold=-1", r"eapo.entropy_threshold: must be a number >= 0"),
    ("eapo.is_level=path", r"eapo.is_level: 'path' is not accepted; choose one of sequence, token"),
])
def test_eapo_config_ranges(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config("smoke", [override])


def test_eapo_refused_on_vllm_unsloth_and_greedy():
    with pytest.raises(ConfigError, match=r"eapo.prior_adapter: .*generation.engine=hf only"):
        load_config("smoke", ["eapo.prior_adapter=some/adapter", "generation.engine=vllm"])
    with pytest.raises(ConfigError, match=r"eapo.prior_adapter: .*model.backend hf"):
        load_config("smoke", ["eapo.prior_adapter=some/adapter", "model.backend=unsloth"])
    with pytest.raises(ConfigError, match=r"generation.temperature: must be a number > 0"):  # greedy: refused for all
        load_config("smoke", ["eapo.prior_adapter=some/adapter", "generation.temperature=0"])
    assert load_config("smoke", ["eapo.prior_adapter=some/adapter"]).eapo.prior_adapter == "some/adapter"


def test_training_with_a_prior_adapter(with_prior, tmp_path, capsys):
    _, _, _, folder = with_prior
    run = train_smoke(tmp_path / "run", *VARIED, "train.steps=2", "train.save_every=1",
                      f"eapo.prior_adapter={folder}", "eapo.entropy_threshold=0", "eapo.injection_rate=0.3",
                      one_thread=True)
    recs = step_records(run)
    assert len(recs) == 2
    for r in recs:
        assert 0.1 < r["eapo_injected_fraction"] < 0.6 and r["eapo_injected_rollouts"] > 0.5
        assert r["eapo_weight_mean"] > 0 and 0 <= r["eapo_capped_fraction"] <= 1
        assert r["engine_log_ratio_max"] < 1e-3  # the HF engine scores like the trainer
    # the run saves the trained adapter only, never the prior
    for adapter in [run / "adapter", *sorted((run / "checkpoints").glob("step-*/adapter"))]:
        assert (adapter / "adapter_model.safetensors").exists() and not (adapter / PRIOR_ADAPTER).exists()
    # a prior that is not there: exit 2 with the key named, before any training
    rc = cli_main("train", "--preset", "smoke", "--output", str(tmp_path / "bad"), "--no-progress",
                  *sets(VARIED + [f"eapo.prior_adapter={tmp_path / 'missing'}"]))
    assert rc == 2 and "eapo.prior_adapter" in capsys.readouterr().err
