"""The layout of a per-rollout trajectory feature, read by the engines that build it (engines/trajectory.py) and
the estimators that use it (estimators/poise.py). Imports nothing.

A trajectory feature is one vector per rollout, ``[hidden (H) | stats (N_STATS)]``: a middle decoder layer's hidden
state averaged over the last completion tokens, then the statistics ``STATS`` in this order (their meaning:
engines/trajectory.py).
"""
from __future__ import annotations

STATS = ("entropy_mean", "entropy_max", "answer_entropy", "answer_logprob", "logprob_mean", "log_length",
         "finished")
N_STATS = len(STATS)


def split(trajectory):
    """(hidden [..., H], stats [..., N_STATS]) of trajectory features [..., H + N_STATS] (a tensor)."""
    return trajectory[..., :-N_STATS], trajectory[..., -N_STATS:]
