"""SPO (Single-stream Policy Optimization, arXiv 2509.13232; the SPO recipe of verl): one rollout per prompt, a
per-prompt value tracker as the baseline, advantages normalized over the batch, prompts sampled by uncertainty.

The tracker holds Beta counts (alpha, beta) per prompt; its value v(x) = alpha / (alpha + beta) is the baseline.

- Start: with K reference samples (``estimator.prior_samples``: rl/priors.py's table, s of them right)
  alpha = N0 (s + 1/2) / (K + 1), beta = N0 (K - s + 1/2) / (K + 1), N0 = 1 / (1 - rho_min); without, 1/2 each.
- Advantages: A = r - v(x) with v from EARLIER steps only, then (A - mean) / (std + eps) over the whole batch (the
  recipe's global normalization; its batch mean includes r_i, as REINFORCE++'s does).
- After the baselines each prompt's counts decay and take its new rewards (clamped to [0, 1]):
  alpha <- rho alpha + r, beta <- rho beta + (1 - r).
- rho (``rho: kl``): 2^(-D / kl_half) clipped to [rho_min, rho_max], where D is the mean |log-prob change| over the
  completion tokens of the prompt's previous response, between the policy that sampled it and the policy now; the
  more the policy moved since the prompt's last visit, the less its old evidence counts. A prompt seen for the
  first time (or whose previous response did not train) gets rho_max, as in the recipe. ``rho: <number>`` is a
  constant decay.
- Prompt sampling (``prioritize``): the sampler keeps a prompt with probability w / (1/2 + explore),
  w = sqrt(v (1 - v)) + explore, so prompts are drawn in proportion to w (the recipe's weights).

How D is measured (``tracks_drift``): the trainer keeps, per prompt, its last response and the log-probs the
update's forward gave it (``keep_responses``: the sampling policy's, as the trainer computes them), and at the
prompt's next visit scores that response again with the current policy, before the update (``drift_responses``,
rl/update.py ``response_drift``). The recipe instead compares the policies after the two visits' updates: the
same number of updates apart, but it scores every batch twice more; here only revisited prompts cost a forward.
Everything the tracker holds travels in checkpoints (``state_dict``), so a resumed run continues exactly.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .base import EPS, estimator
from .reference_options import spo_options


class SPOState:
    """The per-prompt tracker: {prompt id: [alpha, beta]}, the initial counts from the reference samples, and the
    kept responses {prompt id: (token ids, prompt length, float32 log-probs of the completion tokens)}."""

    def __init__(self, options: dict):
        o = spo_options(options)
        self.rho = o["rho"]
        self.rho_min, self.rho_max, self.kl_half = float(o["rho_min"]), float(o["rho_max"]), float(o["kl_half"])
        self.explore = float(o["explore"])
        self.tracks_drift = self.rho == "kl"
        self.counts: dict[str, list[float]] = {}
        self.initial: dict[str, tuple[float, float]] = {}
        self.responses: dict[str, tuple[list[int], int, Tensor]] = {}
        self.accept = self.sampling_weight if o["prioritize"] else None
        self.last: dict[str, float] = {}

    def set_reference(self, table: dict) -> None:
        """Initial counts from the reference samples: s successes of K per prompt."""
        k = int(table["k"])
        n0 = 1.0 / (1.0 - self.rho_min)
        self.initial = {str(i): (n0 * (s + 0.5) / (k + 1), n0 * (k - s + 0.5) / (k + 1))
                        for i, s in table["counts"].items()}

    def _ab(self, key: str) -> tuple[float, float]:
        c = self.counts.get(key)
        return (c[0], c[1]) if c is not None else self.initial.get(key, (0.5, 0.5))

    def values(self, ids: list) -> Tensor:
        """[B] tracked success rates v = alpha / (alpha + beta) (float64)."""
        return torch.tensor([a / (a + b) for a, b in map(self._ab, map(str, ids))], dtype=torch.float64)

    def sampling_weight(self, example) -> float:
        """The sampler's keep probability of `example`: (sqrt(v (1 - v)) + explore) / (1/2 + explore)."""
        a, b = self._ab(str(example.id))
        v = a / (a + b)
        return (math.sqrt(max(0.0, v * (1.0 - v))) + self.explore) / (0.5 + self.explore)

    def drift_responses(self, ids: list) -> list[tuple[int, list[int], int, Tensor]]:
        """(batch position, token ids, prompt length, log-probs then) of each prompt of the batch with a kept
        response: the responses whose drift the trainer measures before `observe`."""
        return [(pos, *self.responses[str(i)]) for pos, i in enumerate(ids) if str(i) in self.responses]

    def decay(self, drift: float | None) -> float:
        if not self.tracks_drift:
            return float(self.rho)
        if drift is None:
            return self.rho_max
        return min(self.rho_max, max(self.rho_min, 2.0 ** (-drift / self.kl_half)))

    def observe(self, step: int, ids: list, rewards: Tensor, drift: dict | None = None) -> None:
        """Decay each prompt's counts by its rho (``drift``: batch position -> D) and add its rewards."""
        r = torch.as_tensor(rewards, dtype=torch.float64).reshape(len(ids), -1).clamp(0.0, 1.0)
        rhos, drifts = [], []
        for pos, (i, row) in enumerate(zip(ids, r)):
            d = (drift or {}).get(pos)
            rho = self.decay(d)
            a, b = self._ab(str(i))
            self.counts[str(i)] = [rho * a + float(row.sum()), rho * b + float((1.0 - row).sum())]
            rhos.append(rho)
            if d is not None:
                drifts.append(d)
        self.last = {"spo_rho_mean": sum(rhos) / len(rhos) if rhos else float("nan"),
                     "spo_drift_mean": sum(drifts) / len(drifts) if drifts else float("nan")}

    def keep_responses(self, ids: list, responses: list) -> None:
        """After the update: each prompt's response of this step (token ids, prompt length, log-probs), or None
        for a prompt whose response did not train (its old response is dropped: its next visit gets rho_max)."""
        for i, resp in zip(ids, responses):
            if resp is None:
                self.responses.pop(str(i), None)
            else:
                tokens, n_prompt, lps = resp
                self.responses[str(i)] = (list(tokens), int(n_prompt), torch.as_tensor(lps, dtype=torch.float32))

    def metrics(self) -> dict[str, float]:
        return dict(self.last)

    def state_dict(self) -> dict:
        keys = list(self.responses)
        resp = [self.responses[k] for k in keys]
        return {"counts": {k: list(v) for k, v in self.counts.items()},
                "responses": {"ids": keys, "prompt_len": [r[1] for r in resp], "len": [len(r[0]) for r in resp],
                              "lp_len": [len(r[2]) for r in resp],
                              "tokens": torch.tensor([t for r in resp for t in r[0]], dtype=torch.int64),
                              "logprobs": torch.cat([r[2] for r in resp]) if resp else torch.zeros(0)}}

    def load_state_dict(self, state: dict) -> None:
        self.counts = {str(k): [float(v[0]), float(v[1])] for k, v in state["counts"].items()}
        resp = state["responses"]
        tokens, lps = resp["tokens"].tolist(), resp["logprobs"].float()
        self.responses, t, p = {}, 0, 0
        for key, n_prompt, n, n_lp in zip(resp["ids"], resp["prompt_len"], resp["len"], resp["lp_len"]):
            self.responses[str(key)] = (tokens[t:t + n], int(n_prompt), lps[p:p + n_lp].clone())
            t, p = t + n, p + n_lp


@estimator("spo")
def spo(rewards: Tensor, ctx) -> tuple[Tensor, Tensor]:
    """b = the prompt's tracked value (earlier steps only), A = (r - b - mean) / (std + eps) over the batch."""
    state = ctx.state if isinstance(ctx.state, SPOState) else SPOState(ctx.options)
    base = state.values(ctx.prompt_ids).to(rewards.dtype)[:, None].expand_as(rewards).clone()
    adv = rewards - base
    if adv.numel() > 1:
        adv = (adv - adv.mean()) / (adv.std() + EPS)
    return adv, base
