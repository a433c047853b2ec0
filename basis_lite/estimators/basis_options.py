"""BASIS options: their defaults, accepted values and checks. Imports no torch (config validation uses it at load).

``validate_options`` is what ``get_estimator("basis").validate_options`` runs when a config loads; ``parse_options``
is what ``basis_baseline`` runs on every call. Both raise ``ConfigError`` naming the bad key as
``estimator.options.<key>`` and what would be accepted. The meaning of each option is in ``basis_baseline``'s
docstring (basis_lite/estimators/basis.py).
"""
from __future__ import annotations

import difflib
import math
import numbers
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..errors import ConfigError, brief

PRIOR_CLIP = 0.05  # clamp priors to [0.05, 0.95] before the logit
DEFAULT_SHIFT_GRID = tuple(round(-4.0 + 0.1 * k, 10) for k in range(81))  # linspace(-4, 4, 81)

CHOICES = {
    "calibration": ("shift", "affine", "none"),
    "pooling": ("none", "additive", "ratio"),
    "fallback": ("prior", "zero"),
    "kernel": ("exp", "softmax"),
    "feature_norm": ("center", "standardize", "none"),
    "combine": ("toward_prior", "residual"),
}
PREFIX = "estimator.options"
MIX_PARTS = ("loo", "pool", "probe", "tracker")
MIX_KEYS = ("mix", "mix_parts", "mix_rate", "mix_memory", "tracker_decay", "tracker_prior_count", "probe_min_rows")


@dataclass(frozen=True)
class BasisOptions:
    use_prior: bool = True
    use_features: bool = True
    prior_clip: float = PRIOR_CLIP
    prior_k: int | None = None
    calibration: str = "shift"
    shift_grid: Any = None  # None = DEFAULT_SHIFT_GRID
    scale_grid: Any = (0.5, 0.75, 1.0, 1.25, 1.5)
    calib_reg: float = 0.0
    pooling: str = "none"
    tau: float = 0.02
    fallback: str = "prior"
    kernel: str = "exp"
    bandwidth: Any = 0.3  # fixed 0.3 / 2.0 rather than "cv": see bench/results/value_mse.md
    bandwidth_grid: Any = (0.03, 0.1, 0.3, 1.0, 3.0)
    shrink: Any = 2.0
    shrink_grid: Any = (0.5, 2.0, 8.0, 32.0)
    feature_norm: str = "center"
    combine: str = "toward_prior"  # prior AND features: see basis_baseline, step 3
    clip: bool = True
    empty_baseline: float = 0.0
    # mix: true mixes several leave-one-out baselines by their error on earlier batches (basis_mix.py); the keys
    # below are read only then (basis_baseline ignores them)
    mix: bool = False
    mix_parts: Any = ("pool", "probe", "tracker")  # besides "loo", always a part
    mix_rate: float = 0.5  # exponential-weights rate on squared error (<= 0.5: the exp-concave guarantee)
    mix_memory: float = 0.8  # weight of a batch's error per batch since (1: never forget)
    tracker_decay: float = 0.9  # weight of a prompt's earlier reward per batch since
    tracker_prior_count: float = 2.0  # rollouts' worth of the probe's (or the running mean's) prediction
    probe_min_rows: int = 32  # earlier rollouts the probe needs before it is used


BASIS_DEFAULTS: dict[str, Any] = asdict(BasisOptions())
_NAMES = tuple(f.name for f in fields(BasisOptions))
_SCI_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")  # YAML 1.1 reads 1e-3 (no dot) as a string


def bad_option(key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{PREFIX}.{key}: {brief(value)} is not accepted; expected {expected}")


def check_choice(key: str, value: Any) -> None:
    allowed = CHOICES[key]
    if not isinstance(value, str) or value not in allowed:
        raise ConfigError(f"{PREFIX}.{key}: {brief(value)} is not accepted; choose one of {', '.join(allowed)}")


def number_option(key: str, value: Any, ok, expected: str) -> float | int:
    """A finite real number (not a bool) for which ok(value) holds; '1e-3' strings are read as numbers."""
    v = value
    if isinstance(v, str) and _SCI_FLOAT.fullmatch(v.strip()):
        v = float(v)
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or not ok(v):
        raise bad_option(key, value, expected)
    return v


def grid_option(key: str, value: Any, ok, expected: str) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or len(value) == 0:
        raise bad_option(key, value, f"a non-empty list of {expected}")
    vals = [number_option(key, v, ok, f"a non-empty list of {expected}") for v in value]
    return tuple(vals) if isinstance(value, tuple) else vals


def _number_or_cv(key: str, value: Any, ok, expected: str) -> Any:
    if value == "cv":
        return value
    return number_option(key, value, ok, f"{expected} or 'cv'")


def validate_options(options: dict) -> dict:
    """Check BASIS options; returns a copy with '1e-3'-style strings read as numbers. Raises ConfigError."""
    if not isinstance(options, dict):
        raise ConfigError(f"{PREFIX}: expected a mapping such as {{bandwidth: 0.3}}, got {brief(options)}")
    unknown = sorted(str(k) for k in options if k not in _NAMES)
    if unknown:
        close = difflib.get_close_matches(unknown[0], _NAMES, n=1, cutoff=0.7)
        hint = f" (did you mean {close[0]}?)" if close else ""
        more = f" (also unknown: {', '.join(unknown[1:])})" if len(unknown) > 1 else ""
        raise ConfigError(f"{PREFIX}.{unknown[0]}: not an option of basis{hint}{more}; accepted options: "
                          f"{', '.join(sorted(_NAMES))}")
    out = dict(options)
    for key, value in options.items():
        if key in CHOICES:
            check_choice(key, value)
        elif key in ("use_prior", "use_features", "clip", "mix"):
            if not isinstance(value, bool):
                raise bad_option(key, value, "true or false")
        elif key == "prior_clip":
            out[key] = number_option(key, value, lambda v: 0.0 < v < 0.5, "a number in (0, 0.5)")
        elif key == "prior_k":
            if value is not None:
                out[key] = number_option(key, value, lambda v: v >= 1 and float(v).is_integer(),
                                   "null or a whole number >= 1 (reference rollouts per prompt)")
        elif key == "calib_reg":
            out[key] = number_option(key, value, lambda v: v >= 0, "a number >= 0")
        elif key == "tau":
            out[key] = number_option(key, value, lambda v: 0.0 <= v < 0.5, "a number in [0, 0.5)")
        elif key == "empty_baseline":
            out[key] = number_option(key, value, lambda v: True, "a finite number")
        elif key == "bandwidth":
            out[key] = _number_or_cv(key, value, lambda v: v > 0, "a positive number")
        elif key == "shrink":
            out[key] = _number_or_cv(key, value, lambda v: v >= 0, "a number >= 0")
        elif key == "shift_grid":
            if value is not None:
                out[key] = grid_option(key, value, lambda v: True, "finite numbers (or null: -4 to 4 in steps of 0.1)")
        elif key in ("scale_grid", "bandwidth_grid"):
            out[key] = grid_option(key, value, lambda v: v > 0, "positive numbers")
        elif key == "shrink_grid":
            out[key] = grid_option(key, value, lambda v: v >= 0, "numbers >= 0")
        elif key == "mix_parts":
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value \
                    or any(p not in MIX_PARTS for p in value):
                raise bad_option(key, value, f"a non-empty list of parts from {', '.join(MIX_PARTS)}")
            out[key] = list(dict.fromkeys(value))
        elif key == "mix_rate":
            out[key] = number_option(key, value, lambda v: v > 0, "a number > 0")
        elif key == "mix_memory":
            out[key] = number_option(key, value, lambda v: 0 <= v <= 1, "a number in [0, 1]")
        elif key == "tracker_decay":
            out[key] = number_option(key, value, lambda v: 0 < v <= 1, "a number in (0, 1]")
        elif key == "probe_min_rows":
            out[key] = int(number_option(key, value, lambda v: v >= 2 and float(v).is_integer(), "a whole number >= 2"))
        elif key == "tracker_prior_count":
            out[key] = number_option(key, value, lambda v: v > 0, "a number > 0")
    if out.get("mix") and out.get("combine", "toward_prior") == "toward_prior" \
            and "cv" in (out.get("bandwidth"), out.get("shrink")):
        raise ConfigError(f"{PREFIX}: bandwidth/shrink 'cv' cannot be combined with mix: true (its probe and tracker "
                          "parts are priors) under the default combine: toward_prior; add combine: residual, or use "
                          "fixed numbers")
    return out


def mix_options(options: dict | None) -> dict:
    """The mix settings of a BASIS options mapping, checked, with the defaults filled in."""
    o = validate_options(dict(options or {}))
    out = {k: o.get(k, BASIS_DEFAULTS[k]) for k in MIX_KEYS}
    out["mix_parts"] = list(out["mix_parts"])
    return out


def parse_options(options: dict) -> BasisOptions:
    """The options of one ``basis_baseline`` call, checked (``validate_options``) and filled in with the defaults."""
    return BasisOptions(**validate_options(options))
