"""Options of the probe estimators (``poise``, ``basis_probe``): defaults, accepted values and checks. Imports no torch.

``validate_poise`` / ``validate_basis_probe`` run when a config loads (``EstimatorSpec.check_options``) and raise
``ConfigError`` naming ``estimator.options.<key>``; ``poise_options`` / ``probe_options`` fill in the defaults on
every call. What each option does is in poise.py's docstrings.
"""
from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..errors import ConfigError, brief
from . import basis_options
from .basis_options import PREFIX, bad_option, grid_option, number_option

BLOCKS = ("prompt", "hidden", "stats", "reward")  # probe inputs: see poise.py
PROBES = ("ridge", "logistic")
TARGETS = ("sibling", "own")


@dataclass(frozen=True)
class PoiseOptions:
    features: tuple = ("prompt", "hidden", "stats")  # what the probe reads of a rollout (BLOCKS)
    target: str = "sibling"  # probe target of a buffer row: the mean reward of its siblings, or its own reward
    probe: str = "ridge"
    ridge: Any = 100.0  # L2 strength on standardised inputs, or "cv" (grouped leave-one-out over ridge_grid)
    ridge_grid: tuple = (1.0, 10.0, 100.0, 1000.0, 10000.0)
    pca_prompt: int = 32  # principal components kept of the prompt hidden state (0: all)
    pca_hidden: int = 64  # principal components kept of the trajectory hidden state (0: all)
    buffer_size: int = 4096  # rollouts kept in the replay buffer (the newest)
    min_rows: int = 64  # rows the buffer needs before the probe is used (until then: RLOO)
    recenter: bool = False  # shift predictions by the other prompts' mean residual in the batch
    clip: bool = True  # clamp predictions to [0, 1] (widened to the buffer's reward range)


@dataclass(frozen=True)
class ProbeOptions:
    """The probe part of ``basis_probe`` (the rest of its options are BASIS options)."""

    probe: str = "ridge"
    ridge: Any = "cv"
    ridge_grid: tuple = (1.0, 10.0, 100.0, 1000.0, 10000.0)
    pca_prompt: int = 32
    buffer_size: int = 4096
    min_rows: int = 32
    history_weight: float = 4.0  # pseudo-count of the probe's prediction against the prompt's own earlier rewards
    clip: bool = True


POISE_DEFAULTS: dict[str, Any] = asdict(PoiseOptions())
PROBE_DEFAULTS: dict[str, Any] = asdict(ProbeOptions())
_POISE_NAMES = tuple(f.name for f in fields(PoiseOptions))
_PROBE_NAMES = tuple(f.name for f in fields(ProbeOptions))


def _whole(key: str, value: Any, lo: int, expected: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or float(value) != int(value) or value < lo:
        raise bad_option(key, value, expected)
    return int(value)


def _check(key: str, value: Any) -> Any:
    """One probe option checked (shared by both estimators); returns the normalised value."""
    if key == "features":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not value or any(v not in BLOCKS for v in value) \
                or len(set(value)) != len(value):
            raise bad_option(key, value, f"a non-empty list of distinct names from {', '.join(BLOCKS)}")
        return list(value) if isinstance(value, list) else tuple(value)
    if key == "target":
        if value not in TARGETS:
            raise bad_option(key, value, f"one of {', '.join(TARGETS)}")
        return value
    if key == "probe":
        if value not in PROBES:
            raise bad_option(key, value, f"one of {', '.join(PROBES)}")
        return value
    if key == "ridge":
        if value == "cv":
            return value
        return number_option(key, value, lambda v: v > 0, "a positive number or 'cv'")
    if key == "ridge_grid":
        return grid_option(key, value, lambda v: v > 0, "positive numbers")
    if key in ("pca_prompt", "pca_hidden"):
        return _whole(key, value, 0, "a whole number >= 0 (0 keeps every dimension)")
    if key == "buffer_size":
        return _whole(key, value, 1, "a whole number >= 1 (rollouts)")
    if key == "min_rows":
        return _whole(key, value, 2, "a whole number >= 2 (rollouts)")
    if key == "history_weight":
        return number_option(key, value, lambda v: v > 0, "a positive number (pseudo-count)")
    if key in ("recenter", "clip"):
        if not isinstance(value, bool):
            raise bad_option(key, value, "true or false")
        return value
    raise AssertionError(key)


def _unknown(options: dict, names, est: str) -> None:
    if not isinstance(options, dict):
        raise ConfigError(f"{PREFIX}: expected a mapping such as {{ridge: 100}}, got {brief(options)}")
    unknown = sorted(str(k) for k in options if k not in names)
    if unknown:
        more = f" (also unknown: {', '.join(unknown[1:])})" if len(unknown) > 1 else ""
        raise ConfigError(f"{PREFIX}.{unknown[0]}: not an option of {est}{more}; accepted options: "
                          f"{', '.join(sorted(names))}")


def validate_poise(options: dict) -> dict:
    """Check ``poise`` options; returns a normalised copy. Raises ConfigError."""
    _unknown(options, _POISE_NAMES, "poise")
    out = {k: _check(k, v) for k, v in options.items()}
    if out.get("target", "sibling") == "own" and "reward" in out.get("features", ()):
        raise ConfigError(f"{PREFIX}.features: 'reward' needs target: sibling (with target: own the probe would "
                          "be given the reward it is asked to predict)")
    return out


def validate_basis_probe(options: dict) -> dict:
    """Check ``basis_probe`` options: the probe's own (ProbeOptions) plus every BASIS option. Raises ConfigError."""
    _unknown(options, _PROBE_NAMES + basis_options._NAMES, "basis_probe")
    probe = {k: _check(k, v) for k, v in options.items() if k in _PROBE_NAMES}
    basis = basis_options.validate_options({k: v for k, v in options.items() if k not in _PROBE_NAMES})
    if basis.get("combine", "toward_prior") == "toward_prior" and "cv" in (basis.get("bandwidth"), basis.get("shrink")):
        raise ConfigError(f"{PREFIX}: bandwidth/shrink 'cv' cannot be combined with the probe's prior under the "
                          "default combine: toward_prior; add combine: residual, or use fixed numbers")
    return {**basis, **probe}


def poise_options(options: dict | None) -> PoiseOptions:
    return PoiseOptions(**validate_poise(dict(options or {})))


def split_basis_probe(options: dict | None) -> tuple[ProbeOptions, dict]:
    """(the probe's options with defaults, the BASIS options as given) of a ``basis_probe`` options mapping."""
    o = validate_basis_probe(dict(options or {}))
    return (ProbeOptions(**{k: v for k, v in o.items() if k in _PROBE_NAMES}),
            {k: v for k, v in o.items() if k not in _PROBE_NAMES})


def replay_capacity_poise(options: dict) -> int:
    return int(validate_poise(dict(options or {})).get("buffer_size", POISE_DEFAULTS["buffer_size"]))


def replay_capacity_probe(options: dict) -> int:
    return int(validate_basis_probe(dict(options or {})).get("buffer_size", PROBE_DEFAULTS["buffer_size"]))


def mix_replay_capacity(options: dict) -> int | None:
    """Rollouts of earlier steps the trainer keeps for the mix's probe (the probe and tracker parts use it); None
    without mix (no buffer)."""
    o = basis_options.mix_options(options)
    return int(PROBE_DEFAULTS["buffer_size"]) if o["mix"] and {"probe", "tracker"} & set(o["mix_parts"]) else None
