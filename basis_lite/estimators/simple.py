"""The standard estimators: REINFORCE++ (one rollout per prompt), and GRPO, Dr. GRPO and RLOO (G >= 2 per prompt).

Each registered function has the one estimator signature ``fn(rewards [B, G], ctx) -> (advantages, baselines)``;
none of them uses the side information in ``ctx`` (prior, features, history) or takes options.

Whether the baseline of a rollout uses that rollout's own reward:
- RLOO: no, b_ig is the mean of the OTHER G - 1 rollouts of prompt i.
- GRPO and Dr. GRPO: yes, the group mean includes r_ig (the bias scales with 1/G).
- REINFORCE++: yes, the batch mean includes r_ig (the bias scales with 1/(B G)).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .base import EPS, estimator, leave_one_out_mean, rewards_1d, rewards_2d


def reinforce_pp_advantages(rewards: Tensor) -> Tensor:
    """REINFORCE++ advantages: global batch whitening of a 1-D reward tensor.

    A_i = (r_i - mean(r)) / (std(r) + eps), mean and (unbiased, N-1) std over the whole batch. The implicit baseline
    is the batch mean, which includes r_i itself. One reward gives 0.
    """
    r = rewards_1d(rewards)
    if r.numel() == 0:
        return r.clone()
    mean = r.mean()
    std = r.std() if r.numel() > 1 else r.new_zeros(())
    return (r - mean) / (std + EPS)


def group_mean_baseline(rewards: Tensor) -> Tensor:
    """Group-mean baseline of GRPO / Dr. GRPO: b_ig = mean over the G rollouts of prompt i of r_ig.

    Includes the rollout's own reward. A group of one (G == 1) has no baseline: b = 0 (veRL's convention, which
    turns GRPO with G = 1 into plain REINFORCE instead of a zero advantage).
    """
    r = rewards_2d(rewards, "group_mean_baseline")
    if r.shape[1] == 1:
        return torch.zeros_like(r)
    return r.mean(dim=1, keepdim=True).expand_as(r).clone()


def rloo_baseline(rewards: Tensor) -> Tensor:
    """RLOO baseline: b_ig = mean of the OTHER G-1 rollouts of prompt i = (sum_{h != g} r_ih) / (G - 1).

    Leave-one-out, so r_ig never enters b_ig. For G == 1 there are no other rollouts and b = 0.
    """
    r = rewards_2d(rewards, "rloo_baseline")
    return leave_one_out_mean(r, dim=1, empty=0.0)


def grpo_advantages(rewards: Tensor) -> Tensor:
    """GRPO advantages: A_ig = (r_ig - group mean_i) / (group std_i + eps).

    The group std is the unbiased (G-1) std over the G rollouts of prompt i, as in TRL and veRL. For G == 1 the
    group mean is taken as 0 and the std as 1 (veRL's convention), so A = r / (1 + eps).
    """
    r = rewards_2d(rewards, "grpo_advantages")
    if r.shape[1] == 1:
        return r / (1.0 + EPS)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True)
    return (r - mean) / (std + EPS)


def dr_grpo_advantages(rewards: Tensor) -> Tensor:
    """Dr. GRPO advantages: A_ig = r_ig - group mean_i (no division by the group std). G == 1 gives A = r."""
    r = rewards_2d(rewards, "dr_grpo_advantages")
    return r - group_mean_baseline(r)


# ----------------------------------------------------------------------------------------------------------------
# the registered estimators: fn(rewards [B, G], ctx) -> (advantages [B, G], baselines [B, G])


@estimator("reinforce_pp")
def reinforce_pp(rewards: Tensor, ctx) -> tuple[Tensor, Tensor]:
    """Whitening of all B*G rewards together; the returned baseline is the batch mean (r_ig included)."""
    B, G = rewards.shape
    adv = reinforce_pp_advantages(rewards.reshape(-1)).reshape(B, G)
    base = rewards.mean().expand(B, G).clone() if rewards.numel() else rewards.clone()
    return adv, base


@estimator("grpo")
def grpo(rewards: Tensor, ctx) -> tuple[Tensor, Tensor]:
    """b = group mean (r_ig included), A = (r - b) / (group std + eps)."""
    return grpo_advantages(rewards), group_mean_baseline(rewards)


@estimator("dr_grpo")
def dr_grpo(rewards: Tensor, ctx) -> tuple[Tensor, Tensor]:
    """b = group mean (r_ig included), A = r - b."""
    base = group_mean_baseline(rewards)
    return rewards - base, base


@estimator("rloo")
def rloo(rewards: Tensor, ctx) -> tuple[Tensor, Tensor]:
    """b = mean of the other G - 1 rollouts of the prompt (r_ig excluded), A = r - b."""
    base = rloo_baseline(rewards)
    return rewards - base, base
