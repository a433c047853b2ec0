"""The exceptions a user can fix by changing input; the CLI prints their message and exits with code 2."""
from __future__ import annotations

from .config import ConfigError
from .data import DataError
from .models import ModelError
from .rewards import RewardError


class DiskFullError(OSError):
    """Writing a checkpoint or export failed for lack of space; the previous checkpoint is intact."""


def _training_aborted():
    from .trainer import TrainingAborted

    return TrainingAborted


USER_ERRORS = (ConfigError, DataError, ModelError, RewardError, DiskFullError, _training_aborted())
