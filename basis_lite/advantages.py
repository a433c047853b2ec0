"""Temporary re-export of the old entry point, for callers not yet on ``basis_lite.estimators``; to be deleted.

New code: ``get_estimator(name).compute(rewards, EstimatorContext(...))`` (basis_lite/estimators/__init__.py).
"""
from __future__ import annotations

from .estimators import EstimatorContext, get_estimator
from .estimators.base import as_float_tensor, explained_variance

__all__ = ["compute_advantages", "explained_variance"]


def compute_advantages(name, rewards, prior=None, features=None, normalize=False, **options):
    """(advantages, baselines), both [B, G], from the estimator registered under ``name``; see EstimatorSpec.compute."""
    r = as_float_tensor(rewards, "rewards")
    ids = list(range(r.shape[0])) if r.dim() else []
    ctx = EstimatorContext(prompt_ids=ids, prior=prior, features=features, options=options, normalize=normalize)
    return get_estimator(name).compute(r, ctx)
