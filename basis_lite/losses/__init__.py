"""Policy losses and loss aggregations by name: the torch-free table that the config reads. Imports no torch.

A policy loss turns per-token log-probs into a per-token loss l_{i,t}; an aggregation reduces l over the step to
the scalar that is differentiated. ``train.loss`` names the first, ``train.loss_aggregation`` the second,
``train.importance_sampling_level`` says whether the ratio is per token or per sequence (GSPO). TRL's
``loss_type`` names a pair: `trl_loss_types` maps each of its names to (loss, aggregation) here, and
``train.loss_aggregation`` accepts them (grpo, bnpo, dr_grpo, dapo, luspo name an aggregation of ppo_clip; cispo,
sapo, vespo a policy loss with the aggregation TRL gives it).
The functions live in ``basis_lite.losses.policy`` (torch), bound to these names by the ``@policy_loss`` and
``@aggregation`` decorators next to each function; the trainer looks them up by name and never branches on it.
TRL's ``loss_type`` names are read as ours once, when the config loads (``check_loss_config``); the config's help
texts for these keys are built here from the tables (``loss_help``, ``aggregation_help``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["LossSpec", "LOSSES", "AGGREGATIONS", "LEVELS", "AUTO", "trl_loss_types", "loss_names",
           "aggregation_names", "check_loss_config", "loss_help", "aggregation_help"]


@dataclass(frozen=True)
class LossSpec:
    """A policy loss or an aggregation: its name here, TRL's loss_type for it ('' = none), the formula it computes,
    a few words for the config's help (``summary``), and (policy losses) the importance-sampling levels it accepts,
    the aggregation TRL's loss_type pairs it with (or its own), whether that is the only aggregation it takes
    (``only_aggregation``: then `train.loss_aggregation: auto` picks it and the others are refused), whether it
    reads the reference policy's log-probs (``reference``: the base, adapter off, one more forward per micro-batch)
    and the estimator it needs ('' = any)."""

    name: str
    trl: str
    formula: str
    levels: tuple = ("token", "sequence")
    summary: str = ""
    aggregation: str = "token-mean"
    only_aggregation: bool = False
    reference: bool = False
    estimator: str = ""


LEVELS = ("token", "sequence")

LOSSES = {s.name: s for s in (
    LossSpec("ppo_clip", "", "-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A); r = exp(lp - old) per token, or "
                             "exp(mean_t(lp - old)) per sequence (GSPO)", summary="clip-higher PPO surrogate"),
    LossSpec("bpo", "", "-A c min(w, bpo_cap) lp; w = sg[(1 + bpo_eps - exp(old)) / (1 + bpo_eps - exp(lp))], "
                        "c = 0 where w is outside the clip band on A's side", levels=("token",),
             summary="complementary-probability weight"),
    LossSpec("cispo", "cispo", "-sg[min(r, 1 + clip_high)] A lp (clipped-weight REINFORCE; r as in ppo_clip)",
             summary="REINFORCE with the importance weight capped at 1 + clip_high, detached"),
    LossSpec("sapo", "sapo", "-(4 / tau) sigmoid(tau (r - 1)) A; tau = sapo_temperature_pos where A > 0, else "
                             "sapo_temperature_neg (a soft gate instead of the clip; r as in ppo_clip)",
             summary="a sigmoid gate on the ratio instead of the clip", aggregation="seq-mean-token-mean"),
    LossSpec("vespo", "vespo", "-sg[phi(w)] A lp; w = exp(sum_t (lp - old)) of the sequence, phi(w) = "
                               "exp(lambda + k log w - lambda w), (k, lambda) = (vespo_k_pos, vespo_lambda_pos) where "
                               "A >= 0, else the _neg pair", levels=("token",),
             summary="REINFORCE weighted by a gamma function of the sequence ratio"),
    LossSpec("astar", "", "(astar_beta sum_t (lp - lp_ref) - A)^2 per sequence, A = r - V*(x) (A*-PO's least "
                          "squares; every token of sequence i holds its squared error)", levels=("token",),
             summary="A*-PO's least squares on r - V*; estimator astar only", aggregation="seq-mean-token-mean",
             only_aggregation=True, reference=True, estimator="astar"),
)}
AUTO = "auto"  # train.loss: the estimator's own loss (else ppo_clip); train.loss_aggregation: see check_loss_config

AGGREGATIONS = {s.name: s for s in (
    LossSpec("token-mean", "dapo", "sum_{i,t} m l / N, N = completion tokens of the whole step (all ranks)"),
    LossSpec("seq-mean-token-mean", "grpo", "sum_i [sum_t m l / |y_i|] / S, S = sequences of the whole step"),
    LossSpec("local-token-mean", "bnpo", "each rank's sum_{i,t} m l / N_rank, averaged over the ranks"),
    LossSpec("seq-mean-token-sum-norm", "dr_grpo", "sum_{i,t} m l / (S * generation.max_new_tokens)"),
    LossSpec("seq-mean-token-sum", "luspo", "sum_i [sum_t m l] / S, S = sequences of the whole step"),
)}


def trl_loss_types() -> dict:
    """TRL's loss_type -> (train.loss, train.loss_aggregation), read from the tables now (rows added later count);
    GSPO is importance_sampling_level: sequence on top."""
    return {**{s.trl: ("ppo_clip", s.name) for s in AGGREGATIONS.values() if s.trl},
            **{s.trl: (s.name, s.aggregation) for s in LOSSES.values() if s.trl}}


def loss_names() -> tuple:
    return tuple(LOSSES)


def aggregation_names(with_trl: bool = False) -> tuple:
    """The aggregation names, and with `with_trl` every TRL loss_type name (cispo, sapo, vespo name policy
    losses)."""
    return tuple(AGGREGATIONS) + (tuple(trl_loss_types()) if with_trl else ())


def loss_help() -> str:
    """train.loss's meaning: auto, then every policy loss with its summary (and TRL's loss_type name, where it has
    one)."""
    own = ", ".join(f"{s.name} for {s.estimator}" for s in LOSSES.values() if s.estimator)
    return f"{AUTO} (the estimator's own: {own}, else ppo_clip) | " + " | ".join(
        f"{s.name} ({s.summary}" + (f"; TRL: loss_type {s.trl})" if s.trl else ")") for s in LOSSES.values())


def aggregation_help() -> str:
    """train.loss_aggregation's meaning: every aggregation with TRL's loss_type name, and TRL's names of losses."""
    aggs = " | ".join(s.name + (f" ({'TRL: ' if i == 0 else ''}{s.trl})" if s.trl else "")
                      for i, s in enumerate(AGGREGATIONS.values()))
    losses = "".join(f", whose {s.trl} means train.loss={s.name} with {s.aggregation}"
                     for s in LOSSES.values() if s.trl)
    own = ", ".join(f"{s.aggregation} for {s.name}" for s in LOSSES.values() if s.only_aggregation)
    return (f"how per-token losses become the step's loss: {AUTO} ({own}, the only one it takes; else token-mean) | "
            f"{aggs}; TRL: loss_type{losses}")


def canonical_aggregation(name: str) -> str:
    """An aggregation's name here for its name or TRL's loss_type name; ConfigError for anything else."""
    if name in AGGREGATIONS:
        return name
    for spec in AGGREGATIONS.values():
        if name == spec.trl:
            return spec.name
    raise ConfigError(f"train.loss_aggregation: {name!r} is not accepted; choose one of {AUTO}, "
                      f"{', '.join(f'{s.name} (TRL: {s.trl})' for s in AGGREGATIONS.values())}")


def check_loss_config(train, estimator_loss: str = "") -> None:
    """Check train.loss, train.loss_aggregation (TRL's loss_type names read as ours, in place: sapo sets
    train.loss=sapo with seq-mean-token-mean, as TRL aggregates it) and train.importance_sampling_level together;
    `auto` is resolved in place (train.loss: `estimator_loss`, the estimator's own, else ppo_clip; the aggregation:
    the loss's only one where it has one, else token-mean). ConfigError naming the key, the value and what is
    accepted."""
    if train.loss == AUTO:
        train.loss = estimator_loss or "ppo_clip"
    if train.loss not in LOSSES:
        raise ConfigError(f"train.loss: {train.loss!r} is not accepted; choose one of {AUTO}, {', '.join(LOSSES)}")
    own = LOSSES[train.loss]
    if train.loss_aggregation == AUTO:
        train.loss_aggregation = own.aggregation if own.only_aggregation else "token-mean"
    by_trl = {s.trl: s for s in LOSSES.values() if s.trl}
    if train.loss_aggregation in by_trl:  # TRL's loss_type cispo / sapo / vespo: that loss, aggregated as TRL does
        spec = by_trl[train.loss_aggregation]
        if train.loss not in ("ppo_clip", spec.name):
            raise ConfigError(f"train.loss_aggregation: {train.loss_aggregation!r} (TRL's loss_type) means "
                              f"train.loss={spec.name}, but train.loss is {train.loss}; set one of them")
        train.loss, train.loss_aggregation = spec.name, spec.aggregation
    train.loss_aggregation = canonical_aggregation(train.loss_aggregation)
    if own.only_aggregation and train.loss_aggregation != own.aggregation:
        raise ConfigError(f"train.loss_aggregation: {train.loss_aggregation!r} is not accepted with train.loss="
                          f"{train.loss}, which takes {own.aggregation} only; use {own.aggregation} or {AUTO}")
    level = train.importance_sampling_level
    if level not in LEVELS:
        raise ConfigError(f"train.importance_sampling_level: {level!r} is not accepted; choose one of "
                          f"{', '.join(LEVELS)}")
    accepted = LOSSES[train.loss].levels
    if level not in accepted:
        raise ConfigError(f"train.importance_sampling_level: {level!r} is not accepted with train.loss="
                          f"{train.loss}, which takes {' or '.join(accepted)}; use that level, or "
                          f"train.loss {' or '.join(n for n, s in LOSSES.items() if level in s.levels)}")
