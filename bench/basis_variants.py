"""Named BASIS option sets for the value-MSE benchmark (bench/value_mse.py) and the option-coverage tests.

Each entry is a set of ``estimator.options`` for ``basis``: ``basis_baseline(r, prior, features, **BASIS_VARIANTS[v])``
(basis_lite/estimators/basis.py). ``use_prior`` / ``use_features`` = False make a variant ignore an input it was
given. Plain dicts, no imports: the tests load this file too. Results: bench/results/value_mse/value_mse.md.
"""
from __future__ import annotations

from typing import Any

BASIS_VARIANTS: dict[str, dict[str, Any]] = {
    # no side information: leave-one-out batch mean (REINFORCE++'s baseline, made leave-one-out)
    "loo_mean": dict(use_prior=False, use_features=False),
    # prior only
    "prior_raw": dict(use_features=False, calibration="none", pooling="none"),
    "prior_shift": dict(use_features=False, calibration="shift", pooling="none"),
    "prior_affine": dict(use_features=False, calibration="affine", pooling="none"),
    "prior_shift_additive": dict(use_features=False, calibration="shift", pooling="additive"),
    "prior_shift_ratio": dict(use_features=False, calibration="shift", pooling="ratio"),
    # closest to the paper as described: shift calibration, BLUE pooling, active set with a zero fallback
    "paper": dict(use_features=False, calibration="shift", pooling="additive", tau=0.05, fallback="zero"),
    "paper_ratio": dict(use_features=False, calibration="shift", pooling="ratio", tau=0.05, fallback="zero"),
    # features only
    "features_fixed": dict(use_prior=False, bandwidth=0.3, shrink=2.0),
    "features_cv": dict(use_prior=False, bandwidth="cv", shrink="cv"),
    "features_softmax_cv": dict(use_prior=False, kernel="softmax", bandwidth="cv", shrink="cv"),
    "features_standardize_cv": dict(use_prior=False, feature_norm="standardize", bandwidth="cv", shrink="cv"),
    # prior and features: kernel smoother on calibrated residuals
    "prior_features_fixed": dict(calibration="shift", pooling="none", bandwidth=0.3, shrink=2.0, combine="residual"),
    "prior_features_cv": dict(calibration="shift", pooling="none", bandwidth="cv", shrink="cv", combine="residual"),
    "prior_features_additive_cv": dict(calibration="shift", pooling="additive", bandwidth="cv", shrink="cv",
                                       combine="residual"),
    "prior_features_affine_cv": dict(calibration="affine", pooling="none", bandwidth="cv", shrink="cv",
                                     combine="residual"),
    # the kernel mean of the other prompts' rewards, shrunk toward the calibrated prior (the default combination)
    "prior_features_toward_prior": dict(calibration="shift", combine="toward_prior", bandwidth=0.3, shrink=2.0),
    # the current defaults (whatever BASIS_DEFAULTS in basis_lite/estimators/basis_options.py says)
    "default": dict(),
}
