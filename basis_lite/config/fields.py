"""How a config key is declared: `setting(default, help, range=..., choices=..., trl=..., refuse=...)` beside its field.

Every leaf of the config tree (basis_lite/config/keys.py) is a dataclass field built by `setting`, so its type (the
annotation), default, accepted values, meaning and TRL alias sit on one line; the readers below take them back
from the field's metadata. `choices` and `help` may be callables, so a registry (estimators, losses) stays the one
list of its names and names registered later are seen. Imports nothing of the package's.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Range", "ANY", "POS", "NONNEG", "AT_LEAST_1", "UNIT_OPEN", "setting", "help_text", "choices_of",
           "range_of", "trl_name", "refused_names", "must_be_set"]


@dataclass(frozen=True)
class Range:
    """The accepted values of one numeric key: finite, between lo and hi (open or closed ends; None = unbounded)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def contains(self, v: float) -> bool:
        try:
            if not math.isfinite(v):
                return False
        except OverflowError:  # an int too large for a float
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return not (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi))

    def describe(self, integer: bool) -> str:
        kind = "an integer" if integer else "a number"

        def num(x: float) -> str:
            return str(int(x)) if float(x).is_integer() else f"{x:g}"

        if self.lo is None and self.hi is None:
            return f"{kind}" if integer else "a finite number"
        if self.hi is None:
            return f"{kind} {'>' if self.lo_open else '>='} {num(self.lo)}"
        if self.lo is None:
            return f"{kind} {'<' if self.hi_open else '<='} {num(self.hi)}"
        return f"{kind} in {'(' if self.lo_open else '['}{num(self.lo)}, {num(self.hi)}{')' if self.hi_open else ']'}"


ANY = Range()
POS = Range(0, lo_open=True)  # > 0
NONNEG = Range(0)  # >= 0
AT_LEAST_1 = Range(1)
UNIT_OPEN = Range(0, 1, lo_open=True, hi_open=True)  # (0, 1)


def setting(default: Any, help: str | Callable[[], str], *, range: Range | None = None,
        choices: tuple | Callable[[], tuple] | None = None, trl: str = "", refuse: dict | None = None,
        nonempty: bool = False, bools: tuple[str, str] | None = None) -> Any:
    """A config field: its default (a list or dict is copied for every config), what it means (`help`), the values
    it accepts (`range` for numbers, `choices` for names), TRL's GRPOConfig name with the same meaning (`trl`,
    read as this key), TRL names near it whose meaning differs ({name: what to write instead}, refused),
    `nonempty` for a string that must not be blank, and `bools` (the names YAML's true and false are read as, for a
    key of names that also takes a switch)."""
    meta = {"help": help, "range": range, "choices": choices, "trl": trl, "refuse": refuse or {},
            "nonempty": nonempty, "bools": bools}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def help_text(f: dataclasses.Field) -> str:
    h = f.metadata.get("help", "")
    return h() if callable(h) else h


def choices_of(f: dataclasses.Field) -> tuple | None:
    """The accepted names (read now: a registry's names include those registered after import), or None."""
    c = f.metadata.get("choices")
    return tuple(c() if callable(c) else c) if c is not None else None


def range_of(f: dataclasses.Field) -> Range | None:
    return f.metadata.get("range")


def trl_name(f: dataclasses.Field) -> str:
    return f.metadata.get("trl", "")


def refused_names(f: dataclasses.Field) -> dict:
    return f.metadata.get("refuse", {})


def bool_names(f: dataclasses.Field) -> tuple[str, str] | None:
    return f.metadata.get("bools")


def must_be_set(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("nonempty"))
