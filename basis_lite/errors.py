"""Every exception a user can fix by changing their input or setup. The CLI prints the message and exits with 2.

This module imports nothing from the package, so any module (and the torch-free commands) can import it.
"""
from __future__ import annotations

import reprlib


class ConfigError(ValueError):
    """A bad configuration value; the message names the key and what would be accepted."""


class DataError(ValueError):
    """Data that cannot be loaded or has too many bad rows; the message says what and where."""


class ModelError(RuntimeError):
    """The model cannot be loaded as configured; the message says what to change."""


class RewardError(ValueError):
    """A user reward function spec that cannot be loaded; the message names the spec and the problem."""


class DiskFullError(OSError):
    """Writing a checkpoint or export failed for lack of space; the previous checkpoint is intact."""


class TrainingAborted(RuntimeError):
    """The run cannot go on (repeated NaN losses, out of memory); the message says what to change."""


USER_ERRORS = (ConfigError, DataError, ModelError, RewardError, DiskFullError, TrainingAborted)


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT or SIGTERM; the message names the run folder, what was kept and how to continue."""

    def __init__(self, signal_name: str = "SIGINT", message: str = ""):
        super().__init__(message or f"stopped by {signal_name}")
        self.signal_name = signal_name


class _Brief(reprlib.Repr):
    def __init__(self, limit: int):
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 3, limit, limit, 40
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 8

    def repr_int(self, x, level):
        if x.bit_length() > 128:  # str() of an int past Python's digit limit raises; long ones are cut anyway
            return f"<an integer of about {x.bit_length() * 0.30103:.0f} digits>"
        return super().repr_int(x, level)


def brief(value, limit: int = 200) -> str:
    """`repr(value)` cut to about `limit` characters, for an error message: a few items of each list or mapping, a
    few levels deep, long texts and numbers shortened (a config value can be huge, or hold itself)."""
    text = _Brief(limit).repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
