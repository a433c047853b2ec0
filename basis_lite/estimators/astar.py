"""A*-PO (Optimal Advantage Regression, arXiv 2505.20686; TRL's ``trl.experimental.a2po``): one rollout per prompt,
an offline baseline from reference samples, and a least-squares policy loss.

Before training the reference policy (the base model, adapter off) samples K completions of every training prompt
(``estimator.prior_samples: K``: the table of rl/priors.py, cached on disk, its tokens counted in the run's cost);
their reward totals r_1..r_K give the value of the KL-regularised optimal policy,

    V*(x) = beta * log( (1/K) * sum_k exp(r_k / beta) )        (``estimator.options.beta``; TRL's beta1, 0.5)

The baseline of a rollout is V*(x), fixed for the whole run (so it never uses the rollout's own reward), and the
advantage r - V*(x). The loss that ``train.loss: auto`` picks with it (``astar``, basis_lite/losses/policy.py)
regresses the policy's implicit reward onto that advantage, one squared error per sequence:

    L = mean_i ( train.astar_beta * sum_t (log pi - log pi_ref)(y_i,t) - (r_i - V*(x_i)) )^2      (TRL's beta2)

With ``filter_all_incorrect`` (TRL's default) the sampler never draws a prompt none of whose K reference samples
earned a positive reward. Differences from TRL: the log-probs of the loss are those of the sampling distribution
(logits / generation.temperature, like every other loss here; TRL takes temperature 1, the same at its default
temperature 1.0); TRL also estimates V* for its eval prompts, which only its eval loss reads.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..errors import ConfigError
from .base import estimator
from .reference_options import astar_options


def optimal_value(rewards: Tensor, beta: float) -> Tensor:
    """V* = beta log mean_k exp(r_k / beta) along the last dimension (float64, computed stably)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    return beta * (torch.logsumexp(r / beta, dim=-1) - math.log(r.shape[-1]))


class AStarState:
    """V*(x) of every training prompt, from the reference samples (``set_reference``); ``accept`` leaves out the
    prompts whose samples all scored 0 or less when ``filter_all_incorrect`` is on. Nothing is learned across steps,
    so its checkpointed state is empty: a resumed run reads the same cached table again."""

    def __init__(self, options: dict):
        o = astar_options(options)
        self.beta, self.filter = float(o["beta"]), bool(o["filter_all_incorrect"])
        self.v_star: dict[str, float] = {}
        self.accept = None

    def set_reference(self, table: dict) -> None:
        rewards = table.get("rewards") or {}
        ids = list(table["counts"])
        missing = [i for i in ids if i not in rewards]
        if missing:
            raise ValueError(f"the reference table has no rewards for {len(missing)} prompts (e.g. {missing[0]!r})")
        values = optimal_value(torch.tensor([rewards[i] for i in ids], dtype=torch.float64), self.beta)
        self.v_star = {str(i): float(v) for i, v in zip(ids, values)}
        if self.filter:
            keep = {str(i) for i in ids if max(rewards[i]) > 0}
            if not keep:
                raise ConfigError(f"estimator.options.filter_all_incorrect: none of the {table['k']} reference samples "
                                  f"of any of the {len(ids)} training prompts earned a positive reward, so no prompt "
                                  f"is left to train on; set filter_all_incorrect: false or raise "
                                  f"estimator.prior_samples")
            self.accept = lambda example: 1.0 if str(example.id) in keep else 0.0

    def values(self, ids: list) -> Tensor:
        """[B] V* of the prompts (float64); ValueError naming a prompt the reference samples did not cover."""
        try:
            return torch.tensor([self.v_star[str(i)] for i in ids], dtype=torch.float64)
        except KeyError as e:
            raise ValueError(f"astar: no reference samples for prompt {e.args[0]!r}; astar needs "
                             f"estimator.prior_samples >= 1 and the reference table of every training prompt") from None

    def observe(self, step: int, ids: list, rewards: Tensor) -> None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None


@estimator("astar")
def astar(rewards: Tensor, ctx) -> tuple[Tensor, Tensor]:
    """b = V*(x) from the reference samples (fixed before training), A = r - b."""
    state = ctx.state
    if not isinstance(state, AStarState) or not state.v_star:
        raise ValueError("astar needs its state with the reference samples (AStarState.set_reference); the trainer "
                         "builds it when estimator.prior_samples >= 1")
    base = state.values(ctx.prompt_ids).to(rewards.dtype)[:, None].expand_as(rewards).clone()
    return rewards - base, base
