"""The run folder of a training run: claimed (a fresh `runs/<preset>-<time>`, a given --output, or a run to
resume), locked by rank 0 and named to the other ranks; a finished run's summary; the message an interrupted run
leaves. Used by trainer.train."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import Config
from ..errors import ConfigError
from ..rl.distributed import Ranks
from ..safeio import RunLock, check_run_folder, held_by_other, read_json
from . import checkpoint as ckpt

if TYPE_CHECKING:
    from ..rl.state import RunState


def claim_on_main(cfg: Config, run_dir, resume: bool, ranks: Ranks):
    """(run folder, created by this call, RunLock or None, finished summary or None), the same folder on every
    rank: rank 0 claims and locks it (`claim_run_dir`, `RunLock`) and sends its name; a user error on rank 0 is
    raised on every rank."""
    msg: dict = {}
    folder, created, lock = None, False, None
    if ranks.is_main:
        try:
            folder, created = claim_run_dir(cfg, run_dir, resume)
            check_run_folder(folder)  # no link out of it: nothing below is read or written elsewhere
            lock = _lock(folder)
            done = finished_summary(folder, cfg) if resume else None
            msg = {"dir": str(folder), "done": done is not None}
        except ConfigError as e:
            msg = {"error": str(e)}
            if not ranks.active:
                raise
            ranks.broadcast_text(json.dumps(msg))
            raise
    msg = json.loads(ranks.broadcast_text(json.dumps(msg)))
    if "error" in msg:
        raise ConfigError(f"rank 0: {msg['error']}")
    if ranks.is_main:
        return folder, created, lock, done
    return Path(msg["dir"]), False, None, ({"run_dir": msg["dir"]} if msg["done"] else None)


def _lock(folder: Path) -> RunLock:
    try:
        return RunLock(folder).acquire()
    except OSError as e:
        raise ConfigError(f"run folder {folder}: cannot write there ({type(e).__name__}: {e.strerror or e}); choose "
                          f"a folder you can write with --output") from None


def interrupt_message(run_dir: Path | None, run: RunState | None, e: BaseException, removed: bool = False) -> str:
    """What an interrupted run says: the folder, what was kept, how to continue. `removed`: the run had not started,
    and its new folder is removed (nothing to resume)."""
    sig = getattr(e, "signal_name", "SIGINT")
    if run_dir is None:
        return f"stopped by {sig} before the run folder was chosen; nothing was written"
    if removed:
        return (f"stopped by {sig} while setting up, before anything was trained; the new run folder {run_dir} is "
                f"removed. Start the run again to train")
    where = f"during step {run.step + 1} of {run.cfg.train.steps}" if run is not None else "while setting up"
    last = ckpt.latest_checkpoint(run_dir, quiet=True)
    kept = (f"the checkpoint {last.name} is kept and the steps after it are redone" if last is not None else
            "there is no checkpoint yet, so resuming starts it again from step 0 with its saved config")
    return (f"stopped by {sig} {where}; {run_dir}: {kept}. Continue with `basis-lite train --resume {run_dir}`")


def default_run_dir(cfg: Config) -> Path:
    name = Path(cfg.preset).stem if cfg.preset else "run"
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def claim_run_dir(cfg: Config, run_dir, resume: bool) -> tuple[Path, bool]:
    """(the run folder, whether this call created it). Without a folder given, `runs/<preset>-<time>` is claimed
    with an exclusive mkdir (`-2`, `-3`, ... when that name is taken), so two runs started in the same second get
    two folders. A given folder must not hold another run unless `resume`."""
    given = run_dir or cfg.output_dir
    if resume:
        run_dir = Path(given)
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"--resume {run_dir}: no config.yaml there; is it a basis-lite run folder?")
        return run_dir, False
    if given:
        run_dir = Path(given)
        if run_dir.exists() and not run_dir.is_dir():
            raise ConfigError(f"--output {run_dir}: a file of that name exists; the output is a run folder: choose "
                              f"a new folder name (or an empty folder)")
        if (run_dir / "metrics.jsonl").exists() or (run_dir / "config.yaml").exists():
            holder = held_by_other(run_dir)
            if holder:
                raise ConfigError(f"run folder {run_dir} is in use by another basis-lite process ({holder}); "
                                  f"choose another --output")
            raise ConfigError(f"output folder {run_dir} already holds a run; pass --resume {run_dir} to continue "
                              f"it or choose another --output")
        created = not run_dir.exists()
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--output {run_dir}: cannot create the run folder ({type(e).__name__}: "
                              f"{e.strerror or e}); choose a folder you can write") from None
        return run_dir, created
    base = default_run_dir(cfg)
    for i in range(1, 1000):
        cand = base if i == 1 else base.with_name(f"{base.name}-{i}")
        try:
            base.parent.mkdir(parents=True, exist_ok=True)
            cand.mkdir()
        except FileExistsError:
            continue
        except OSError as e:
            raise ConfigError(f"cannot create the run folder {cand} ({type(e).__name__}: {e.strerror or e}); "
                              f"pass --output with a folder you can write") from None
        return cand, True
    raise ConfigError(f"could not find a free run folder name next to {base}; pass --output")


def finished_summary(run_dir: Path, cfg: Config) -> dict | None:
    """The summary of a run that already finished every step (summary.json and the final adapter are written last),
    else None."""
    path = run_dir / "summary.json"
    if not (path.is_file() and (run_dir / "adapter" / "adapter_config.json").is_file()):
        return None
    try:
        summary = read_json(path, "summary.json")
    except ValueError:
        return None
    if not isinstance(summary, dict):
        return None
    return summary if summary.get("steps") == cfg.train.steps and summary.get("eval_after") else None
