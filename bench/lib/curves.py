"""Held-out accuracy curves: a run's eval points read from its metrics.jsonl (or the metrics.jsonl.gz a comparison
keeps), and the first point at a target."""
from __future__ import annotations

import gzip
import shutil
import tempfile
from pathlib import Path

from basis_lite.runs.metrics import FILE, read_metrics


def read_run(run_dir: Path) -> tuple[dict[int, dict], list[dict]]:
    """(step records by step, eval records sorted by step) of a run folder's metrics.jsonl, else its
    metrics.jsonl.gz (empty when it has neither); of two eval lines of one step and kind, the later wins."""
    path = Path(run_dir) / FILE
    packed = path.with_name(FILE + ".gz")
    if path.exists():
        steps, evals, _skipped = read_metrics(path)
    elif packed.exists():
        with tempfile.TemporaryDirectory() as tmp:
            plain = Path(tmp) / FILE
            with gzip.open(packed, "rb") as src, open(plain, "wb") as dst:
                shutil.copyfileobj(src, dst)
            steps, evals, _skipped = read_metrics(plain)
    else:
        return {}, []
    by_key = {(int(e["step"]), e.get("event") == "eval_final"): e for e in evals}
    return {int(s["step"]): s for s in steps}, [by_key[k] for k in sorted(by_key)]


def first_point_reaching(points: list[dict], accuracy: float, key: str = "accuracy") -> dict | None:
    """The first eval point (by step, then clock) whose `key` is at or above `accuracy`, or None if none is. Eval
    points come every train.eval_every steps, so this is "reached by", at that granularity."""
    for p in sorted(points, key=lambda q: (q["step"], q.get("clock_s", 0.0))):
        if p[key] >= accuracy - 1e-9:
            return p
    return None
