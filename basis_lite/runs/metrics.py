"""A run's metrics: `RUN_DIR/metrics.jsonl` (written, read, truncated on resume) and the optional TensorBoard / W&B
loggers. Torch-free: `plot` and the benchmarks read metrics without importing torch.

One JSON object per line. A training step:  {"step": N, "reward_mean": ..., ...}  (no "event" key).
An evaluation:                              {"step": N, "event": "eval" | "eval_final", "eval_accuracy": ..., ...}
Every line is flushed and fsynced as it is written, so a crash loses at most the line being written; a line cut
by a crash is skipped (and counted) by the reader.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import ConfigError
from ..safeio import atomic_write_text, disk_full_error, is_disk_full, open_regular

FILE = "metrics.jsonl"
EVAL_EVENTS = ("eval", "eval_final")
MAX_BYTES = 1 << 30  # what a reader takes of metrics.jsonl (a million steps of a few hundred bytes each)


def _lines(path: Path) -> list[str]:
    """The lines of metrics.jsonl (UTF-8, bad bytes replaced); ConfigError naming it when it is not a regular file
    (a FIFO would block, a device never end) or is larger than MAX_BYTES."""
    try:
        with open_regular(path, str(path)) as f:
            data = f.read(MAX_BYTES + 1)
    except ValueError as e:
        raise ConfigError(f"{e}; it is the run's metrics file, one JSON line per step: remove it or put the run's "
                          f"own file back") from None
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_BYTES >> 30} GiB; not the metrics of a basis-lite run")
    return data.decode("utf-8", errors="replace").splitlines()


def append_line(path: Path, rec: dict) -> None:
    """Append one line, flushed and fsynced; a full disk raises DiskFullError (the earlier lines stay intact)."""
    try:
        with open(path, "a") as f:
            f.write(json.dumps(rec, default=float) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if is_disk_full(e, path):
            raise disk_full_error(f"a line of {path.name}", path, e,
                                  f"The lines before it and the last checkpoint are intact: free some space, then "
                                  f"continue the run with `basis-lite train --resume {path.parent}`") from e
        raise


def read_metrics(path: str | os.PathLike) -> tuple[list[dict], list[dict], int]:
    """(step records sorted by step, eval records sorted by step, number of lines skipped).

    A later line for the same step wins (a resumed run redoes the steps after its checkpoint). Eval lines without
    an accuracy are left out.
    """
    steps: dict[int, dict] = {}
    evals: list[dict] = []
    skipped = 0
    for line in _lines(Path(path)):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, RecursionError):  # a cut line, or one nested past the parser's limit
            skipped += 1
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), (int, float)):
            skipped += 1
            continue
        if rec.get("event") in EVAL_EVENTS:
            if "eval_accuracy" in rec:
                evals.append(rec)
        elif "event" not in rec:
            steps[int(rec["step"])] = rec
    evals.sort(key=lambda r: (r["step"], r.get("event") == "eval_final"))
    return [steps[s] for s in sorted(steps)], evals, skipped


def truncate_after(path: Path, last_step: int) -> None:
    """Drop the lines written after the checkpoint of `last_step` (their steps are redone on resume): later steps
    and the final eval, which always follows the last checkpoint. Atomic (temp + fsync + rename)."""
    if not path.exists() and not path.is_symlink():
        return
    keep = []
    for line in _lines(path):
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue  # a line cut by the kill
        if isinstance(rec, dict) and rec.get("step", 0) <= last_step and rec.get("event") != "eval_final":
            keep.append(line)
    try:
        atomic_write_text(path, "".join(k + "\n" for k in keep))
    except OSError as e:
        if is_disk_full(e, path):
            raise disk_full_error(path.name, path, e, "The file is unchanged: free some space and resume again") from e
        raise


def flat_eval(ev: dict) -> dict:
    """The metrics line fields of an `evaluate()` result: overall and per-level accuracy."""
    out = {"eval_accuracy": ev["accuracy"], "eval_n": ev["n"]}
    for lvl, v in ev.get("by_level", {}).items():
        out[f"eval_accuracy_level{lvl}"] = v["accuracy"]
    return out


class MetricsLog:
    """The one writer of a run's metrics: metrics.jsonl always, TensorBoard / W&B when `train.report_to` asks.

    `start()` begins a new run (empty file); `resume(step)` keeps the lines up to `step`. Close it (or use it as a
    context manager) so the optional loggers flush what they hold, also after a crash.
    """

    def __init__(self, run_dir: Path, report_to=(), run_name: str = "", config: dict | None = None,
                 wandb_project: str = ""):
        self.path = Path(run_dir) / FILE
        self.tb = self.wandb = None
        if "tensorboard" in report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("train.report_to: tensorboard needs `pip install tensorboard`") from None
            self.tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        if "wandb" in report_to:
            try:
                import wandb
            except ImportError:
                raise ConfigError("train.report_to: wandb needs `pip install wandb` (and `wandb login`)") from None
            project = wandb_project or os.environ.get("WANDB_PROJECT") or "basis-lite"
            self.wandb = wandb.init(project=project, name=run_name or Path(run_dir).name, config=config,
                                    resume="allow")

    def start(self) -> None:
        atomic_write_text(self.path, "")

    def resume(self, last_step: int) -> None:
        truncate_after(self.path, last_step)

    def step(self, rec: dict) -> None:
        append_line(self.path, rec)
        # grouped tags: train/reward_mean, train/loss, ... (booleans such as skipped as 0/1)
        nums = {f"train/{k}": float(v) for k, v in rec.items()
                if isinstance(v, (int, float)) and k != "step"}
        if self.tb is not None:
            for k, v in nums.items():
                self.tb.add_scalar(k, v, rec["step"])
        if self.wandb is not None:
            self.wandb.log(nums, step=rec["step"])

    def eval(self, step: int, ev: dict | None, final: bool = False) -> None:
        """An eval line; nothing when there was no eval (`ev` None: an empty eval split)."""
        if not ev:
            return
        rec = {"step": step, "event": "eval_final" if final else "eval", **flat_eval(ev)}
        append_line(self.path, rec)
        # grouped tags: eval/accuracy, eval/accuracy_level1, ...
        nums = {f"eval/{k[len('eval_'):]}": v for k, v in rec.items() if k.startswith("eval_")}
        if self.tb is not None:
            for k, v in nums.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(nums, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def loo_reference_ev(n: int) -> float:
    """The explained variance of the plain leave-one-out mean over n rollouts, 1 - (n / (n - 1))^2, whatever the
    rewards (b_i = (S - r_i) / (n - 1) leaves r_i scaled by n / (n - 1)); nan for n < 2. A baseline that earns
    something scores above it."""
    return 1.0 - (n / (n - 1)) ** 2 if n >= 2 else float("nan")
