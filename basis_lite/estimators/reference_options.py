"""Options of ``astar`` (A*-PO) and ``spo`` (SPO): defaults, accepted values and checks. Imports no torch.

``validate_astar`` / ``validate_spo`` run when a config loads (``EstimatorSpec.check_options``) and raise
``ConfigError`` naming ``estimator.options.<key>``; ``astar_options`` / ``spo_options`` fill in the defaults on
every call. What each option does is in astar.py's and spo.py's docstrings; the defaults are TRL's A2POConfig
(beta1, filter_all_incorrect) and the SPO recipe's (rho clip 0.875..0.96, D_half 0.06, exploration 0.05).
"""
from __future__ import annotations

import difflib
from typing import Any

from ..errors import ConfigError, brief
from .basis_options import PREFIX, bad_option, number_option

ASTAR_DEFAULTS: dict[str, Any] = {
    "beta": 0.5,  # V*(x) = beta log mean_k exp(r_k / beta) (TRL: beta1)
    "filter_all_incorrect": True,  # never train on a prompt whose K reference samples all scored 0
}
SPO_DEFAULTS: dict[str, Any] = {
    "rho": "kl",  # the tracker's decay per visit: "kl" (2^(-D / kl_half) clipped to [rho_min, rho_max]) or a number
    "rho_min": 0.875,
    "rho_max": 0.96,
    "kl_half": 0.06,  # the policy drift D (mean |log-prob change| on the prompt's last response) that halves rho
    "prioritize": True,  # sample prompts with weight sqrt(p (1 - p)) + explore
    "explore": 0.05,
}


def _known(options: Any, defaults: dict, name: str) -> dict:
    if not isinstance(options, dict):
        raise ConfigError(f"{PREFIX}: expected a mapping such as {{{next(iter(defaults))}: ...}}, got {brief(options)}")
    unknown = sorted(str(k) for k in options if k not in defaults)
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(defaults), n=1, cutoff=0.7)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"{PREFIX}.{unknown[0]}: not an option of {name}{hint}; accepted options: "
                          f"{', '.join(sorted(defaults))}")
    return dict(options)


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad_option(key, value, "true or false")
    return value


def validate_astar(options: dict) -> dict:
    """Check A*-PO options; returns a copy with '1e-3'-style strings read as numbers. Raises ConfigError."""
    out = _known(options, ASTAR_DEFAULTS, "astar")
    if "beta" in out:
        out["beta"] = number_option("beta", out["beta"], lambda v: v > 0, "a number > 0")
    if "filter_all_incorrect" in out:
        _bool("filter_all_incorrect", out["filter_all_incorrect"])
    return out


def validate_spo(options: dict) -> dict:
    """Check SPO options; returns a copy with '1e-3'-style strings read as numbers. Raises ConfigError."""
    out = _known(options, SPO_DEFAULTS, "spo")
    if "rho" in out and out["rho"] != "kl":
        out["rho"] = number_option("rho", out["rho"], lambda v: 0 < v <= 1, "'kl' or a number in (0, 1]")
    for key in ("rho_min", "rho_max"):
        if key in out:
            out[key] = number_option(key, out[key], lambda v: 0 < v <= 1, "a number in (0, 1]")
    if "kl_half" in out:
        out["kl_half"] = number_option("kl_half", out["kl_half"], lambda v: v > 0, "a number > 0")
    if "explore" in out:
        out["explore"] = number_option("explore", out["explore"], lambda v: v > 0, "a number > 0")
    if "prioritize" in out:
        _bool("prioritize", out["prioritize"])
    lo, hi = out.get("rho_min", SPO_DEFAULTS["rho_min"]), out.get("rho_max", SPO_DEFAULTS["rho_max"])
    if lo > hi:
        raise ConfigError(f"{PREFIX}.rho_min: {lo} is above rho_max {hi}; expected rho_min <= rho_max")
    if lo >= 1:
        raise ConfigError(f"{PREFIX}.rho_min: {lo} leaves the tracker's initial count 1 / (1 - rho_min) infinite; "
                          f"expected a number below 1")
    return out


def astar_options(options: dict | None) -> dict:
    return {**ASTAR_DEFAULTS, **validate_astar(dict(options or {}))}


def spo_options(options: dict | None) -> dict:
    return {**SPO_DEFAULTS, **validate_spo(dict(options or {}))}


def astar_picks_prompts(options: dict | None) -> bool:
    return bool(astar_options(options)["filter_all_incorrect"])


def spo_picks_prompts(options: dict | None) -> bool:
    return bool(spo_options(options)["prioritize"])
