"""Policy losses and loss aggregations by name: the torch-free table that the config reads. Imports no torch.

A policy loss turns per-token log-probs into a per-token loss l_{i,t}; an aggregation reduces l over the step to
the scalar that is differentiated. ``train.loss`` names the first, ``train.loss_aggregation`` the second (TRL's
``loss_type``), ``train.importance_sampling_level`` says whether the ratio is per token or per sequence (GSPO).
The functions live in ``basis_lite.losses.policy`` (torch), bound to these names by the ``@policy_loss`` and
``@aggregation`` decorators next to each function; the trainer looks them up by name and never branches on it.
TRL's ``loss_type`` names are read as ours once, when the config loads (``check_loss_config``); the config's help
texts for these keys are built here from the tables (``loss_help``, ``aggregation_help``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["LossSpec", "LOSSES", "AGGREGATIONS", "LEVELS", "loss_names", "aggregation_names", "check_loss_config",
           "loss_help", "aggregation_help"]


@dataclass(frozen=True)
class LossSpec:
    """A policy loss or an aggregation: its name here, TRL's name for it ('' = none), the formula it computes,
    a few words for the config's help (``summary``), and (policy losses) the importance-sampling levels it
    accepts."""

    name: str
    trl: str
    formula: str
    levels: tuple = ("token", "sequence")
    summary: str = ""


LEVELS = ("token", "sequence")

LOSSES = {s.name: s for s in (
    LossSpec("ppo_clip", "", "-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A); r = exp(lp - old) per token, or "
                             "exp(mean_t(lp - old)) per sequence (GSPO)", summary="clip-higher PPO surrogate"),
    LossSpec("bpo", "", "-A c min(w, bpo_cap) lp; w = sg[(1 + bpo_eps - exp(old)) / (1 + bpo_eps - exp(lp))], "
                        "c = 0 where w is outside the clip band on A's side", levels=("token",),
             summary="complementary-probability weight"),
    LossSpec("cispo", "cispo", "-sg[min(r, 1 + clip_high)] A lp (clipped-weight REINFORCE; r as in ppo_clip)",
             summary="REINFORCE with the importance weight capped at 1 + clip_high, detached"),
)}

AGGREGATIONS = {s.name: s for s in (
    LossSpec("token-mean", "dapo", "sum_{i,t} m l / N, N = completion tokens of the whole step (all ranks)"),
    LossSpec("seq-mean-token-mean", "grpo", "sum_i [sum_t m l / |y_i|] / S, S = sequences of the whole step"),
    LossSpec("local-token-mean", "bnpo", "each rank's sum_{i,t} m l / N_rank, averaged over the ranks"),
    LossSpec("seq-mean-token-sum-norm", "dr_grpo", "sum_{i,t} m l / (S * generation.max_new_tokens)"),
)}


def loss_names() -> tuple:
    return tuple(LOSSES)


def aggregation_names(with_trl: bool = False) -> tuple:
    """The aggregation names, and with `with_trl` every TRL loss_type name (cispo names a policy loss)."""
    trl = tuple(s.trl for s in (*AGGREGATIONS.values(), *LOSSES.values()) if s.trl)
    return tuple(AGGREGATIONS) + (trl if with_trl else ())


# TRL's loss_type that names a policy loss (cispo) means that loss under this aggregation (TRL's dapo)
TRL_LOSS_AGGREGATION = "token-mean"


def loss_help() -> str:
    """train.loss's meaning: every policy loss with its summary (and TRL's loss_type name, where it has one)."""
    return " | ".join(f"{s.name} ({s.summary}" + (f"; TRL: loss_type {s.trl})" if s.trl else ")")
                      for s in LOSSES.values())


def aggregation_help() -> str:
    """train.loss_aggregation's meaning: every aggregation with TRL's loss_type name, and TRL's names of losses."""
    aggs = " | ".join(s.name + (f" ({'TRL: ' if i == 0 else ''}{s.trl})" if s.trl else "")
                      for i, s in enumerate(AGGREGATIONS.values()))
    losses = "".join(f", whose {s.trl} means train.loss={s.name} with {TRL_LOSS_AGGREGATION}"
                     for s in LOSSES.values() if s.trl)
    return f"how per-token losses become the step's loss: {aggs}; TRL: loss_type{losses}"


def canonical_aggregation(name: str) -> str:
    """An aggregation's name here for its name or TRL's loss_type name; ConfigError for anything else."""
    if name in AGGREGATIONS:
        return name
    for spec in AGGREGATIONS.values():
        if name == spec.trl:
            return spec.name
    raise ConfigError(f"train.loss_aggregation: {name!r} is not accepted; choose one of "
                      f"{', '.join(f'{s.name} (TRL: {s.trl})' for s in AGGREGATIONS.values())}")


def check_loss_config(train) -> None:
    """Check train.loss, train.loss_aggregation (TRL's loss_type names read as ours, in place: cispo
    sets train.loss=cispo with token-mean) and train.importance_sampling_level together; ConfigError naming the key, the value and what is accepted."""
    if train.loss not in LOSSES:
        raise ConfigError(f"train.loss: {train.loss!r} is not accepted; choose one of {', '.join(LOSSES)}")
    by_trl = {s.trl: s.name for s in LOSSES.values() if s.trl}
    if train.loss_aggregation in by_trl:  # TRL's loss_type cispo: that policy loss, normalised as dapo
        loss = by_trl[train.loss_aggregation]
        if train.loss not in ("ppo_clip", loss):
            raise ConfigError(f"train.loss_aggregation: {train.loss_aggregation!r} (TRL's loss_type) means "
                              f"train.loss={loss}, but train.loss is {train.loss}; set one of them")
        train.loss, train.loss_aggregation = loss, TRL_LOSS_AGGREGATION
    train.loss_aggregation = canonical_aggregation(train.loss_aggregation)
    level = train.importance_sampling_level
    if level not in LEVELS:
        raise ConfigError(f"train.importance_sampling_level: {level!r} is not accepted; choose one of "
                          f"{', '.join(LEVELS)}")
    accepted = LOSSES[train.loss].levels
    if level not in accepted:
        raise ConfigError(f"train.importance_sampling_level: {level!r} is not accepted with train.loss="
                          f"{train.loss} (it has no importance ratio to average); use {' or '.join(accepted)}, or "
                          f"train.loss ppo_clip or cispo")
