"""Where the benchmarks live and write: each script's results go to bench/results/<script>/ by default."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"


def results_dir(script: str) -> Path:
    """bench/results/<script>/: the default output folder of bench/<script>.py (recordings included)."""
    return RESULTS / script


def shown(path) -> str:
    """A path as written into results: relative to the repository when inside it, else its name (results never hold
    machine paths)."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return Path(path).name
