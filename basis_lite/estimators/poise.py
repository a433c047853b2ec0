"""Estimators with an online value probe: ``poise`` (two or more rollouts per prompt, cross-rollout baselines) and
``basis_probe`` (BASIS with a prompt-feature probe as its prior: one rollout per prompt, no offline prior pass).

Both read ``ctx.replay``, a ``probe.ReplayBuffer`` of EARLIER steps' rollouts (the trainer adds the current batch
only after the baselines are computed), and refit their probe on it at every call; the probe is a deterministic
function of the buffer, so a run resumed from a checkpoint that holds the buffer refits the same probe.

``poise`` (after POISE, arXiv 2605.07579; its released code: a ridge probe on standardised, PCA-reduced hidden
states plus token-entropy statistics, refit online on a buffer, each rollout's baseline predicted from its sibling):

    b_ig = mean over h != g of  probe(x_ih)          (G = 2: b_i1 = probe(x_i2), b_i2 = probe(x_i1))

x_ih is what the probe reads of rollout h of prompt i (``features``): the prompt's hidden state (``prompt``), the
trajectory's hidden state (``hidden``) and statistics (``stats``, engines/trajectory.py), and its reward
(``reward``). By default (``target: sibling``) the probe is fitted on buffer rows (x_jh, mean reward of j's other
rollouts), so it predicts the value of a prompt from one rollout's internal state rather than that rollout's own
reward. b_ig is built from the other rollouts of prompt i and from earlier steps only: it never depends on r_ig or
on rollout g's trajectory, so the policy gradient stays unbiased. ``recenter`` adds the mean residual
r - probe(x) of the OTHER prompts of the batch (all their rollouts). Until the buffer holds ``min_rows`` rows the
baseline is RLOO's (the mean reward of the other rollouts of the prompt).

``basis_probe``: the probe reads the prompt's hidden state only and is fitted on the buffer rows' own rewards; its
prediction q_i for each prompt of the batch (combined with the prompt's earlier rewards when ``estimator.history``
is on: (h_i + c q_i) / (n_i + c), c = ``history_weight``) is the prior of the BASIS baseline (basis.py, with every
BASIS option: by default calibrated by a leave-one-out logit shift and pooled with the similar prompts of the
batch). Until the buffer is warm the prior is absent and the baseline is plain BASIS.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .base import as_float_tensor, estimator, leave_one_out_mean, leave_one_out_sum
from .basis import basis
from .probe import blocks_of, fit_probe
from .probe_options import poise_options, split_basis_probe
from .trajectory_layout import N_STATS


def clip_range(buf) -> tuple[float, float]:
    """[0, 1], widened to the buffer's rewards (rewards outside [0, 1], e.g. a format bonus)."""
    if buf is None or buf.rows == 0:
        return 0.0, 1.0
    return min(0.0, float(buf.reward.min())), max(1.0, float(buf.reward.max()))


def _batch_trajectory(ctx, B: int, G: int) -> Tensor | None:
    if ctx.trajectory_features is None:
        return None
    t = as_float_tensor(ctx.trajectory_features, "trajectory_features")
    if t.dim() != 3 or t.shape[:2] != (B, G):
        raise ValueError(f"trajectory_features must have shape [B, G, D] = [{B}, {G}, D], got {tuple(t.shape)}")
    return t


def fit_poise_probe(buf, o):
    """The POISE probe fitted on a replay buffer (None when the buffer has fewer than ``o.min_rows`` usable rows)."""
    if buf is None:
        return None
    y = buf.sibling if o.target == "sibling" else buf.reward
    if int((~torch.isnan(y)).sum()) < o.min_rows:
        return None
    blocks = blocks_of(buf.prompt_features, buf.trajectory, buf.reward, o.features, N_STATS)
    if not blocks:
        return None
    return fit_probe(blocks, y, buf.groups(), kind=o.probe, ridge=o.ridge, ridge_grid=o.ridge_grid,
                     pca={"prompt": o.pca_prompt, "hidden": o.pca_hidden})


@estimator("poise")
def poise(rewards: Tensor, ctx) -> tuple[Tensor, Tensor]:
    """The registered estimator (see the module docstring): (advantages [B, G], baselines [B, G])."""
    o = poise_options(ctx.options)
    buf = getattr(ctx, "replay", None)
    return poise_with_probe(rewards, ctx, fit_poise_probe(buf, o), o)


def poise_with_probe(rewards: Tensor, ctx, probe, o) -> tuple[Tensor, Tensor]:
    """``poise`` with its probe given (fitted on ``ctx.replay`` by ``fit_poise_probe``; None: not warm)."""
    B, G = rewards.shape
    buf = getattr(ctx, "replay", None)
    rloo = leave_one_out_mean(rewards, dim=1, empty=0.0)
    traj = _batch_trajectory(ctx, B, G)
    feats = None if ctx.features is None else as_float_tensor(ctx.features, "features")
    if probe is None or G < 2:
        return rewards - rloo, rloo
    pf = None if feats is None else feats.repeat_interleave(G, dim=0)
    tr = None if traj is None else traj.reshape(B * G, -1)
    blocks = blocks_of(pf, tr, rewards.reshape(-1), o.features, N_STATS)
    if set(blocks) != set(probe.names):
        raise ValueError(f"poise: the probe was fitted on {sorted(probe.names)} but the batch has {sorted(blocks)} "
                         "(trajectory features need an engine that captures them; prompt features need "
                         "estimator.use_features)")
    pred = probe.predict(blocks).reshape(B, G)
    if o.clip:
        lo, hi = clip_range(buf)
        pred = pred.clamp(lo, hi)
    base = leave_one_out_mean(pred, dim=1)  # rollout g: the other rollouts' predictions
    if o.recenter and B > 1:
        resid = (rewards.double() - pred).mean(1)  # per prompt, over all its rollouts
        base = base + (leave_one_out_sum(resid, 0) / (B - 1))[:, None]
    if o.clip:
        base = base.clamp(lo, hi)
    base = base.to(rewards.dtype)
    return rewards - base, base


def fit_prompt_probe(buf, po):
    """The ``basis_probe`` probe: prompt hidden state -> own reward (None until the buffer is warm)."""
    if buf is None or buf.prompt_features is None or buf.rows < po.min_rows:
        return None
    return fit_probe({"prompt": buf.prompt_features.double()}, buf.reward, buf.groups(), kind=po.probe,
                     ridge=po.ridge, ridge_grid=po.ridge_grid, pca={"prompt": po.pca_prompt})


def probe_prior(probe, features: Tensor, ids: list, history: dict | None, po, clip_range=(0.0, 1.0)) -> Tensor:
    """[B] the probe's prediction per prompt, in [0, 1], folded with the prompt's earlier rewards (h + c q)/(n + c)."""
    q = probe.predict({"prompt": as_float_tensor(features, "features").double()})
    if po.clip:
        q = q.clamp(*clip_range)
    q = q.clamp(0.0, 1.0)
    if history:
        c = float(po.history_weight)
        h = torch.tensor([float((history.get(i) or (0, 0))[0]) for i in ids], dtype=torch.float64)
        n = torch.tensor([float((history.get(i) or (0, 0))[1]) for i in ids], dtype=torch.float64)
        q = (h + c * q) / (n + c)
    return q


@estimator("basis_probe")
def basis_probe(rewards: Tensor, ctx) -> tuple[Tensor, Tensor]:
    """The registered estimator: BASIS with the online prompt probe as its prior (see the module docstring)."""
    po, _ = split_basis_probe(ctx.options)
    probe = fit_prompt_probe(getattr(ctx, "replay", None), po) if ctx.features is not None else None
    return basis_probe_with_probe(rewards, ctx, probe)


def basis_probe_with_probe(rewards: Tensor, ctx, probe) -> tuple[Tensor, Tensor]:
    """``basis_probe`` with its probe given (fitted on ``ctx.replay`` by ``fit_prompt_probe``; None: not warm)."""
    po, basis_opts = split_basis_probe(ctx.options)
    prior = None
    if probe is not None and ctx.features is not None:
        prior = probe_prior(probe, ctx.features, list(ctx.prompt_ids), ctx.history, po,
                            clip_range(getattr(ctx, "replay", None)))
    return basis(rewards, dataclasses.replace(ctx, prior=prior, options=basis_opts))
