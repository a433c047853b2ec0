"""The update's shared prefix (train.shared_prefix, rl/update.py): the token prefix every trained rollout shares runs
once per pass, and the step moves the adapter as the plain per-row passes do, over several micro-batches and passes."""
from __future__ import annotations

import copy

import pytest
import torch

from basis_lite.config import load_config
from basis_lite.engines.base import Rollout
from basis_lite.errors import ConfigError
from basis_lite.model.loading import load_policy
from basis_lite.rl.update import make_optimizer, policy_update, share_prefix_on, step_prefix

PREFIX = 10


def _setup(extra=()):
    torch.manual_seed(0)
    cfg = load_config("smoke", ["train.micro_batch_size=2", "train.lr=1e-2", "model.gradient_checkpointing=false",
                                *extra])
    model, tok = load_policy(cfg, torch.device("cpu"), torch.float32)
    for n, p in model.named_parameters():  # lora_B non-zero: every LoRA weight gets a gradient
        if "lora_B" in n:
            p.data.normal_(0, 0.1)
    g = torch.Generator().manual_seed(1)
    head = torch.randint(0, 250, (PREFIX,), generator=g).tolist()  # the shared system prompt
    rolls = [Rollout(prompt="", prompt_ids=head + torch.randint(0, 250, (3 + i % 3,), generator=g).tolist(),
                     completion_ids=torch.randint(0, 250, (4 + i,), generator=g).tolist(), text="", finished=True)
             for i in range(6)]
    return cfg, model, tok, rolls


def _update(cfg, model, tok, rolls, adv, mode):
    cfg = copy.deepcopy(cfg)
    cfg.train.shared_prefix = mode
    opt = make_optimizer(cfg, model, torch.device("cpu"))
    stats, ok = policy_update(cfg, model, opt, rolls, adv, tok.pad_token_id, torch.device("cpu"))
    assert ok
    return stats, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("extra", [[], ["train.ppo_epochs=2"], ["train.kl_coef=0.05"]])
def test_update_with_the_shared_prefix_moves_the_adapter_as_the_plain_one(extra):
    cfg, model, tok, rolls = _setup(extra)
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.0, 0.7])
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model2 = copy.deepcopy(model)
    s_plain, plain = _update(cfg, model, tok, rolls, adv, "never")
    s_shared, shared = _update(cfg, model2, tok, rolls, adv, "always")
    assert any(not torch.equal(before[n], plain[n]) for n in plain)  # the update did something
    for n in plain:
        torch.testing.assert_close(shared[n], plain[n], atol=1e-6, rtol=1e-5)
    for k in ("loss", "grad_norm", "entropy", "kl", "clip_fraction"):
        assert s_shared[k] == pytest.approx(s_plain[k], rel=1e-4, abs=1e-7), k
    rows = s_plain["trained_sequences"]  # each pass: the prefix once instead of once per row
    assert s_plain["trained_tokens"] - s_shared["trained_tokens"] == (rows - 1) * PREFIX * cfg.train.ppo_epochs


def test_the_prefix_stops_before_the_first_scored_position_and_auto_follows_the_device():
    cfg, model, _, rolls = _setup()
    assert len(step_prefix(cfg, rolls, [[0, 1], [2, 3]])) == PREFIX  # the prompts differ right after it
    same = [Rollout(prompt="", prompt_ids=rolls[0].prompt_ids, completion_ids=r.completion_ids, text="",
                    finished=True) for r in rolls[:3]]
    assert len(step_prefix(cfg, same, [[0, 1, 2]])) == len(rolls[0].prompt_ids) - 1  # the last prompt token scores
    assert step_prefix(cfg, rolls, [[0]]) == []  # one row: nothing to share
    assert share_prefix_on(cfg, model)  # auto: on the CPU with gradient checkpointing off
    cfg.model.gradient_checkpointing = True
    assert not share_prefix_on(cfg, model)
    with pytest.raises(ConfigError, match="train.shared_prefix: always needs model.gradient_checkpointing=false"):
        load_config("smoke", ["train.shared_prefix=always", "model.gradient_checkpointing=true"])
