"""BASIS with ``mix: true``: several baselines that each leave r_i out, mixed by how well each did on EARLIER batches.

The parts (``mix_parts``; the leave-one-out mean is always one of them, the floor the mix is held to):

- ``loo``: the mean of the other rewards of the batch (what plain REINFORCE-with-LOO uses);
- ``pool``: BASIS as without ``mix``: the other prompts' rewards pooled by prompt similarity, shrunk toward the
  prior the trainer passes (the offline prior / history, if any);
- ``probe``: BASIS whose prior is an online ridge probe from the prompt's hidden state to its reward, refit every
  step on a replay buffer of earlier steps (``basis_probe``'s probe): the prior for prompts that never repeat;
- ``tracker``: BASIS whose prior is the prompt's tracked value (``ValueTracker``, after SPO's per-prompt value
  tracker): a Beta estimate from the prompt's own earlier rewards, each weighted decay^(steps since), with the
  probe's prediction (or, before the probe is warm, the mean reward of earlier steps) as the Beta's prior mean
  worth ``tracker_prior_count`` rollouts. A prompt seen often and recently gets its own success rate; a new one
  gets the probe's guess.

Mixing: b_i = sum_k w_k b_i^(k) with w_k proportional to exp(-mix_rate * L_k), L_k the squared error of part k
on earlier batches, each batch's sum weighted mix_memory^(batches since) (exponentially weighted average
forecaster). Squared error of predictions in [0, 1] is exp-concave for mix_rate <= 1/2, so the mix's total squared
error stays within log(number of parts) / mix_rate of the best part's (the leave-one-out mean included) on a fixed
sequence; ``mix_memory`` < 1 lets the weights follow a part that gets better as the policy drifts. Before any batch
was seen the weights are equal.

The leave-one-out rule holds: every part is built without r_i (the probe and tracker read only earlier steps, BASIS
leaves r_i out of everything it fits), and the weights come from earlier batches only. ``BasisState`` holds what
carries from step to step (tracker, mix losses, the replay buffer's probe is refit from ``ctx.replay``); the trainer
calls ``observe`` after the baselines, saves ``state_dict()`` in checkpoints and restores it on resume. Under
torchrun every rank computes the baselines of the global batch from the same gathered rewards, so every rank's
state is the same.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from .base import estimator, leave_one_out_mean
from .basis import basis
from .basis_options import MIX_KEYS, mix_options
from .poise import clip_range, fit_prompt_probe
from .probe_options import ProbeOptions

PROBE = ProbeOptions(ridge=100.0)  # the probe part: basis_probe's probe, fixed ridge (no per-step grid search)


class ValueTracker:
    """Per-prompt decayed success counts: {prompt id: [successes, failures, observation count at last update]}.

    ``observe`` adds a batch (successes r, failures 1 - r per rollout, after decaying the prompt's earlier counts by
    decay^(observations since)); ``value`` reads (s + c q) / (s + f + c) with the counts decayed to now, c the prior
    count and q the prior mean. Rewards outside [0, 1] are clamped into it for the counts."""

    def __init__(self, decay: float = 0.9, prior_count: float = 2.0):
        self.decay, self.prior_count = float(decay), float(prior_count)
        self.table: dict[str, list[float]] = {}
        self.t = 0  # batches observed

    def counts(self, ids: list) -> tuple[Tensor, Tensor]:
        """([B] decayed successes, [B] decayed trials) now, 0 for a prompt never seen."""
        s, n = [], []
        for i in ids:
            e = self.table.get(str(i))
            if e is None:
                s.append(0.0), n.append(0.0)
                continue
            w = self.decay ** (self.t - e[2])
            s.append(w * e[0]), n.append(w * (e[0] + e[1]))
        return torch.tensor(s, dtype=torch.float64), torch.tensor(n, dtype=torch.float64)

    def value(self, ids: list, prior_mean: Tensor) -> Tensor:
        s, n = self.counts(ids)
        c = self.prior_count
        return (s + c * prior_mean.double()) / (n + c)

    def observe(self, ids: list, rewards: Tensor) -> None:
        r = torch.as_tensor(rewards, dtype=torch.float64).reshape(len(ids), -1).clamp(0.0, 1.0)
        for i, row in zip(ids, r):
            key = str(i)
            e = self.table.get(key)
            succ, fail = float(row.sum()), float((1.0 - row).sum())
            if e is None:
                self.table[key] = [succ, fail, self.t]
            else:
                w = self.decay ** (self.t - e[2])
                e[0], e[1], e[2] = w * e[0] + succ, w * e[1] + fail, self.t
        self.t += 1

    def state_dict(self) -> dict:
        return {"t": self.t, "table": {k: list(v) for k, v in self.table.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.t = int(state["t"])
        self.table = {str(k): [float(v[0]), float(v[1]), int(v[2])] for k, v in state["table"].items()}


def selection_probability(tracker: ValueTracker, strength: float):
    """``data.value_sampling``: example -> the probability that the sampler keeps it, 1 - strength * (1 - 2 sd),
    sd = sqrt(v (1 - v)) and v = (s + 1) / (n + 2) its tracked success rate (1/2 for a prompt never seen, kept for
    sure), at least 0.02 (after SPO's prioritized sampling, weight proportional to sd)."""
    def accept(example) -> float:
        s, n = tracker.counts([example.id])
        v = (float(s[0]) + 1.0) / (float(n[0]) + 2.0)
        return max(0.02, 1.0 - strength * (1.0 - 2.0 * math.sqrt(v * (1.0 - v))))

    return accept


class BasisState:
    """What ``basis`` with ``mix: true`` carries between steps: the value tracker, each part's discounted squared
    error on earlier batches, the mean reward of earlier batches, and (between ``basis`` and ``observe`` of one step)
    the parts' baselines of the current batch."""

    def __init__(self, options: dict):
        o = mix_options(options)
        self.parts = ("loo", *[p for p in o["mix_parts"] if p != "loo"])
        self.tracker = ValueTracker(o["tracker_decay"], o["tracker_prior_count"])
        self.loss = {p: 0.0 for p in self.parts}
        self.reward_sum, self.reward_n = 0.0, 0.0  # earlier batches' rewards, decayed like the mix losses
        self.pending: dict[str, Tensor] | None = None
        self.weights = {p: 1.0 / len(self.parts) for p in self.parts}  # of the last call, for the metrics
        self._rate, self._memory = float(o["mix_rate"]), float(o["mix_memory"])
        self.probe = dataclasses.replace(PROBE, min_rows=int(o["probe_min_rows"]))

    def mix_weights(self) -> dict[str, float]:
        lo = min(self.loss.values())
        z = {p: math.exp(-self._rate * (v - lo)) for p, v in self.loss.items()}
        tot = sum(z.values())
        return {p: v / tot for p, v in z.items()}

    def metrics(self) -> dict[str, float]:
        """The weights of the last call, for the step's metrics line."""
        return {f"mix_weight_{p}": w for p, w in self.weights.items()}

    def prior_mean(self) -> float:
        return self.reward_sum / self.reward_n if self.reward_n > 0 else 0.5

    def observe(self, step: int, ids: list, rewards: Tensor) -> None:
        """After the baselines of a step: score each part on it, then add its rewards to the tracker."""
        r = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
        if self.pending is not None:
            for p, b in self.pending.items():
                self.loss[p] = self._memory * self.loss[p] + float(((r - b.double().reshape(-1)) ** 2).sum())
        self.pending = None
        self.reward_sum = self._memory * self.reward_sum + float(r.clamp(0.0, 1.0).sum())
        self.reward_n = self._memory * self.reward_n + r.numel()
        self.tracker.observe(ids, rewards)

    def state_dict(self) -> dict:
        return {"tracker": self.tracker.state_dict(), "loss": dict(self.loss), "reward_sum": self.reward_sum,
                "reward_n": self.reward_n, "parts": list(self.parts)}

    def load_state_dict(self, state: dict) -> None:
        if list(state["parts"]) != list(self.parts):
            raise ValueError(f"the checkpoint's basis mix has parts {state['parts']}, this run {list(self.parts)}; "
                             "resume with the same estimator.options.mix_parts")
        self.tracker.load_state_dict(state["tracker"])
        self.loss = {p: float(state["loss"][p]) for p in self.parts}
        self.reward_sum, self.reward_n = float(state["reward_sum"]), float(state["reward_n"])


def make_state(options: dict) -> BasisState | None:
    """The trainer's per-run state for ``basis``: a BasisState with ``mix: true``, else None."""
    return BasisState(options) if (options or {}).get("mix") else None


def basis_mix(rewards: Tensor, ctx, state: BasisState) -> tuple[Tensor, Tensor]:
    """(advantages, baselines) of the mix; stores the parts' baselines in ``state.pending`` for ``observe``."""
    B, G = rewards.shape
    opts = {k: v for k, v in (ctx.options or {}).items() if k not in MIX_KEYS}
    parts: dict[str, Tensor] = {"loo": leave_one_out_mean(rewards.reshape(-1)).reshape(B, G)}
    ids = list(ctx.prompt_ids)
    probe_q = None
    if ("probe" in state.parts or "tracker" in state.parts) and ctx.features is not None:
        buf = getattr(ctx, "replay", None)
        probe = fit_prompt_probe(buf, state.probe)
        if probe is not None:
            q = probe.predict({"prompt": torch.as_tensor(ctx.features).double()})
            probe_q = q.clamp(*clip_range(buf)).clamp(0.0, 1.0)
    if "pool" in state.parts:
        parts["pool"] = basis(rewards, dataclasses.replace(ctx, options=opts))[1]
    if "probe" in state.parts:
        # no prior until the probe is warm: then this part is BASIS on the features alone
        parts["probe"] = basis(rewards, dataclasses.replace(ctx, prior=probe_q, options=opts))[1]
    if "tracker" in state.parts:
        mean = probe_q if probe_q is not None else torch.full((B,), state.prior_mean(), dtype=torch.float64)
        prior = state.tracker.value(ids, mean).clamp(0.0, 1.0)
        parts["tracker"] = basis(rewards, dataclasses.replace(ctx, prior=prior, options=opts))[1]
    w = state.mix_weights()
    state.weights = w
    base = sum(w[p] * parts[p].double() for p in state.parts).to(rewards.dtype)
    state.pending = parts
    return rewards - base, base


@estimator("basis")
def basis_estimator(rewards: Tensor, ctx) -> tuple[Tensor, Tensor]:
    """The ``basis`` estimator: BASIS pooling (basis.basis), or with the option ``mix: true`` the mix of its parts,
    whose state is ``ctx.state`` (a fresh one when the caller passes none)."""
    if (ctx.options or {}).get("mix"):
        return basis_mix(rewards, ctx, ctx.state if getattr(ctx, "state", None) is not None
                         else make_state(ctx.options))
    return basis(rewards, ctx)
