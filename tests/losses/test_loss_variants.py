"""The registered policy losses and aggregations (train.loss, train.loss_aggregation,
train.importance_sampling_level) against hand computations; TRL's names read as ours; every variant through
policy_update on the tiny random model."""
from __future__ import annotations

import math

import pytest
import torch

from basis_lite import losses as loss_specs
from basis_lite.config import CHOICES, load_config
from basis_lite.errors import ConfigError
from basis_lite.losses.policy import (
    LossOptions,
    Normalizer,
    PolicyBatch,
    compute_policy_loss,
    get_aggregation,
    get_policy_loss,
    importance_ratio,
    ppo_clip_loss,
)


def test_every_spec_has_its_function_and_every_function_its_spec():
    from basis_lite.losses import policy as losses
    from basis_lite.rl import update

    assert set(losses._LOSS_FNS) == set(loss_specs.LOSSES)
    assert set(losses._AGGREGATION_FNS) == set(loss_specs.AGGREGATIONS)
    assert set(update._OPTIMIZERS) | {"auto"} == set(CHOICES["train.optimizer"])
    for spec in loss_specs.AGGREGATIONS.values():  # TRL's loss_type names are read as ours once, at config load
        assert loss_specs.canonical_aggregation(spec.trl) == spec.name
        assert load_config("smoke", [f"loss_type={spec.trl}"]).train.loss_aggregation == spec.name
        with pytest.raises(ValueError, match="not accepted"):
            get_aggregation(spec.trl)
    with pytest.raises(ValueError, match="not accepted; choose one of ppo_clip"):
        get_policy_loss("reinforce")
    with pytest.raises(ValueError, match="an_unknown_loss"):
        losses.policy_loss("an_unknown_loss")(lambda b, o: None)  # a function needs its spec first


def test_cispo_hand_computation():
    ratios = torch.tensor([1.5, 0.7, 1.1, 0.5, 1.0])
    adv = torch.tensor([[1.0, -1.0, 2.0, 1.0, 3.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, float("nan")]])
    lp = (old + ratios.log()).clone().requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, stats = compute_policy_loss("cispo", "token-mean", PolicyBatch(lp, old, adv, mask),
                                      LossOptions(clip_high=0.28), Normalizer())
    # weight = min(r, 1.28), detached: 1.28, 0.7, 1.1, 0.5; l = -w A lp
    w = [1.28, 0.7, 1.1, 0.5]
    lps = (old[0, :4] + ratios[:4].log()).tolist()
    expected = sum(-wi * a * x for wi, a, x in zip(w, adv[0, :4].tolist(), lps)) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["clip_fraction"].item() == pytest.approx(0.25)  # only 1.5 is capped
    assert stats["clip_low_fraction"].item() == 0.0
    loss.backward()
    # every token keeps a gradient -w A / N, even the capped one (ppo_clip would zero it)
    expected_grad = torch.tensor([[-1.28 * 1 / 4, -0.7 * -1 / 4, -1.1 * 2 / 4, -0.5 * 1 / 4, 0.0]])
    torch.testing.assert_close(lp.grad, expected_grad, atol=1e-6, rtol=1e-5)


def test_gspo_sequence_level_ratio_hand_computation():
    # sequence 0: 3 tokens, log-ratios 0.3, -0.1, 0.1 -> s0 = exp(0.1), inside the clip band;
    # sequence 1: 2 tokens, log-ratios 0.4, 0.6 -> s1 = exp(0.5) = 1.65 > 1.28 with A > 0: clipped
    old = torch.tensor([[-1.0, -2.0, -1.5, -9.0], [-0.5, -1.0, -7.0, -7.0]])
    dlog = torch.tensor([[0.3, -0.1, 0.1, 5.0], [0.4, 0.6, 3.0, 3.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    lp = (old + dlog).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0])
    r = importance_ratio(lp, old, mask.bool(), "sequence")
    s0, s1 = math.exp(0.1), math.exp(0.5)
    torch.testing.assert_close(r, torch.tensor([[s0] * 4, [s1] * 4]))
    loss, stats = compute_policy_loss("ppo_clip", "token-mean", PolicyBatch(lp, old, adv, mask),
                                      LossOptions(importance_sampling_level="sequence"), Normalizer())
    assert loss.item() == pytest.approx((-3 * s0 - 2 * 1.28) / 5, rel=1e-6)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 5)
    loss.backward()
    # d(-s0)/d lp_{0,t} = -s0 / 3 for each of sequence 0's tokens, times 3 tokens / N = 5; sequence 1 clipped
    expected = torch.tensor([[-s0 / 5] * 3 + [0.0], [0.0] * 4])
    torch.testing.assert_close(lp.grad, expected, atol=1e-6, rtol=1e-5)
    # token level on the same numbers differs (every token its own ratio)
    loss_tok, _ = ppo_clip_loss(lp, old, adv, mask)
    assert abs(loss_tok.item() - loss.item()) > 1e-3


@pytest.mark.parametrize("name,trl,norm,expected", [
    ("token-mean", "dapo", Normalizer(), 8 / 3),
    ("token-mean", "dapo", Normalizer(num_tokens=10), 0.8),
    ("seq-mean-token-mean", "grpo", Normalizer(), (2.0 + 4.0) / 2),
    ("seq-mean-token-mean", "grpo", Normalizer(num_sequences=4), 6.0 / 4),
    ("local-token-mean", "bnpo", Normalizer(num_tokens=10, local_tokens=3, num_ranks=2), 8 / 6),
    ("seq-mean-token-sum-norm", "dr_grpo", Normalizer(max_completion_length=5), 8 / (2 * 5)),
    ("seq-mean-token-sum-norm", "dr_grpo", Normalizer(num_sequences=4, max_completion_length=5), 8 / 20),
    ("seq-mean-token-sum", "luspo", Normalizer(), 8 / 2),
    ("seq-mean-token-sum", "luspo", Normalizer(num_sequences=4), 8 / 4),
])
def test_aggregation_hand_computation(name, trl, norm, expected):
    y = torch.tensor([[1.0, 3.0, float("nan")], [4.0, 0.0, float("inf")]])  # masked-out garbage never counts
    m = torch.tensor([[1, 1, 0], [1, 0, 0]]).bool()
    assert get_aggregation(name)(y, m, norm).item() == pytest.approx(expected)
    assert load_config("smoke", [f"loss_type={trl}"]).train.loss_aggregation == name


@pytest.mark.parametrize("name", list(loss_specs.AGGREGATIONS))
def test_micro_batches_add_up_to_the_whole_step(name):
    """With the step-wide Normalizer, the micro-batch losses sum to the one-batch loss for every aggregation."""
    g = torch.Generator().manual_seed(0)
    y = torch.randn(4, 6, generator=g)
    m = torch.rand(4, 6, generator=g) > 0.3
    m[:, 0] = True
    norm = Normalizer(num_tokens=int(m.sum()), num_sequences=4, local_tokens=int(m.sum()), max_completion_length=6)
    fn = get_aggregation(name)
    whole = fn(y, m, norm)
    parts = fn(y[:1], m[:1], norm) + fn(y[1:], m[1:], norm)
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


@pytest.mark.parametrize("overrides,loss,agg,level", [
    ([], "ppo_clip", "token-mean", "token"),
    (["loss_type=grpo"], "ppo_clip", "seq-mean-token-mean", "token"),
    (["train.loss_type=bnpo"], "ppo_clip", "local-token-mean", "token"),
    (["loss_type=dr_grpo", "importance_sampling_level=sequence"], "ppo_clip", "seq-mean-token-sum-norm", "sequence"),
    (["loss_type=dapo"], "ppo_clip", "token-mean", "token"),
    (["loss_type=cispo"], "cispo", "token-mean", "token"),
    (["loss_type=sapo"], "sapo", "seq-mean-token-mean", "token"),
    (["loss_type=vespo"], "vespo", "token-mean", "token"),
    (["loss_type=luspo", "importance_sampling_level=sequence"], "ppo_clip", "seq-mean-token-sum", "sequence"),
    (["train.loss=bpo", "train.loss_aggregation=seq-mean-token-mean"], "bpo", "seq-mean-token-mean", "token"),
    # auto: the estimator's own loss and that loss's own aggregation
    (["estimator.name=astar", "estimator.prior_samples=2"], "astar", "seq-mean-token-mean", "token"),
    (["estimator.name=astar", "estimator.prior_samples=2", "train.loss=ppo_clip"], "ppo_clip", "token-mean", "token"),
    (["estimator.name=spo"], "ppo_clip", "token-mean", "token"),
])
def test_config_reads_trl_names(overrides, loss, agg, level):
    t = load_config("smoke", overrides).train
    assert (t.loss, t.loss_aggregation, t.importance_sampling_level) == (loss, agg, level)


@pytest.mark.parametrize("overrides,match", [
    (["train.loss=reinforce"], r"train\.loss: 'reinforce' is not accepted; choose one of auto, ppo_clip, bpo, cispo, "
                               r".*astar"),
    (["loss_type=sum"], r"train\.loss_aggregation: 'sum' is not accepted; choose one of auto, token-mean, .*dr_grpo"),
    (["train.loss=astar"], r"train\.loss: astar regresses onto the advantages of estimator astar .*not basis's; set "
                           r"estimator\.name=astar or train\.loss=auto"),
    (["estimator.name=astar", "estimator.prior_samples=2", "loss_type=dapo"],
     r"train\.loss_aggregation: 'token-mean' is not accepted with train\.loss=astar, which takes seq-mean-token-mean "
     r"only"),
    (["estimator.name=astar", "estimator.prior_samples=2", "train.importance_sampling_level=sequence"],
     r"train\.importance_sampling_level: 'sequence' is not accepted with train\.loss=astar"),
    (["estimator.name=astar", "estimator.prior_samples=2", "estimator.normalize=always"],
     r"estimator\.normalize: always would divide the regression target of train\.loss=astar"),
    (["estimator.name=astar", "estimator.prior_samples=0"], r"estimator\.prior_samples: astar needs K >= 1 .*got 0"),
    (["train.loss=bpo", "importance_sampling_level=sequence"],
     r"train\.importance_sampling_level: 'sequence' is not accepted with train\.loss=bpo"),
    (["train.loss=bpo", "loss_type=cispo"], r"means train\.loss=cispo, but train\.loss is bpo"),
    (["loss_type=vespo", "importance_sampling_level=sequence"],
     r"'sequence' is not accepted with train\.loss=vespo, which takes token"),
    (["importance_sampling_level=sequence_token"], r"importance_sampling_level: 'sequence_token' .*token, sequence"),
])
def test_config_rejects_bad_loss_settings(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("smoke", overrides)


@pytest.mark.parametrize("overrides", [
    ["train.loss=ppo_clip"], ["train.loss=bpo"], ["train.loss=cispo"], ["loss_type=grpo"], ["loss_type=bnpo"],
    ["loss_type=dr_grpo"], ["importance_sampling_level=sequence"],
    ["train.loss=cispo", "importance_sampling_level=sequence"], ["loss_type=sapo"], ["loss_type=vespo"],
    ["loss_type=luspo", "importance_sampling_level=sequence"], ["estimator.name=astar", "estimator.prior_samples=2"],
])
def test_every_variant_updates_the_policy(overrides):
    """Two PPO passes (so that the ratio moves) of every variant on the tiny model: finite, and the weights move."""
    from basis_lite.engines.base import Rollout
    from basis_lite.model.loading import load_policy
    from basis_lite.rl.update import make_optimizer, policy_update

    torch.manual_seed(0)
    cfg = load_config("smoke", ["train.micro_batch_size=2", "train.lr=1e-2", "train.ppo_epochs=2", *overrides])
    model, tok = load_policy(cfg, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(1)
    rolls = [Rollout(prompt="", prompt_ids=torch.randint(0, 250, (5,), generator=g).tolist(),
                     completion_ids=torch.randint(0, 250, (3 + i,), generator=g).tolist(), text="", finished=True)
             for i in range(4)]
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = make_optimizer(cfg, model, torch.device("cpu"))
    stats, ok = policy_update(cfg, model, opt, rolls, torch.tensor([1.0, -0.5, 0.0, -1.0]), tok.pad_token_id,
                              torch.device("cpu"))
    assert ok and math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    # the zero-advantage rollout is left out, except by A*-PO's regression (its error has a gradient at A = 0)
    assert stats["trained_sequences"] == (4 if cfg.train.loss == "astar" else 3)
    assert stats["forward_only_tokens"] == (stats["trained_tokens"] / 2 if cfg.train.loss == "astar" else 0)
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p.detach(), before[n])]
    assert moved


def test_astar_regression_hand_computation():
    """A*-PO's loss: (beta * sum_t m (lp - lp_ref) - A)^2 per sequence, every token of it holding that value, so
    seq-mean-token-mean is the mean over sequences (TRL's A2POTrainer.compute_loss); its gradient by hand."""
    lp = torch.tensor([[-1.0, -2.0, -0.5, 7.0], [-0.3, -0.6, float("nan"), 0.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-0.4, -0.1, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv = torch.tensor([0.25, -0.5])
    beta = 0.1
    loss, stats = compute_policy_loss("astar", "seq-mean-token-mean",
                                      PolicyBatch(lp, lp.detach(), adv, mask, ref_logprobs=ref),
                                      LossOptions(astar_beta=beta), Normalizer())
    s0, s1 = beta * (0.5 - 1.0 + 0.0), beta * (0.1 - 0.5)
    e0, e1 = s0 - 0.25, s1 + 0.5
    assert loss.item() == pytest.approx((e0 ** 2 + e1 ** 2) / 2, rel=1e-6)
    assert stats["clip_fraction"].item() == 0.0 and stats["implicit_reward_mean"].item() == pytest.approx(
        (s0 + s1) / 2, rel=1e-6)
    loss.backward()
    # d/d lp_{i,t} = 2 e_i beta / S on the masked tokens, 0 elsewhere (the nan and the masked 7.0 never count)
    want = torch.tensor([[e0 * beta] * 3 + [0.0], [e1 * beta] * 2 + [0.0, 0.0]])
    torch.testing.assert_close(lp.grad, want, atol=1e-7, rtol=1e-5)
    # micro-batches add up to the step (the step's sequence count divides every part)
    norm = Normalizer(num_sequences=2)
    parts = sum(compute_policy_loss("astar", "seq-mean-token-mean",
                                    PolicyBatch(lp[i:i + 1], lp[i:i + 1].detach(), adv[i:i + 1], mask[i:i + 1],
                                                ref_logprobs=ref[i:i + 1]), LossOptions(astar_beta=beta), norm)[0]
                for i in range(2))
    assert parts.item() == pytest.approx(loss.item(), rel=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs is None"):
        compute_policy_loss("astar", "seq-mean-token-mean", PolicyBatch(lp, lp.detach(), adv, mask),
                            LossOptions(), Normalizer())
