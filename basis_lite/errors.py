"""Every exception a user can fix by changing their input or setup. The CLI prints the message and exits with 2.

This module imports nothing from the package, so any module (and the torch-free commands) can import it.
"""
from __future__ import annotations


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
