"""torchrun entry point of tests/rl/test_distributed.py: records what its rank does, then runs `basis-lite ARGS`.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_entry.py LOG_DIR WATCHED_DIR ARGS...

Writes LOG_DIR/rank-R.jsonl (R = the launcher's RANK, 0 without one), one JSON object per line:

- {"kind": "write", "event": ..., "path": ...}: every file or folder under WATCHED_DIR that this process opens for
  writing, creates, renames, truncates or removes, seen through Python's audit hooks (`sys.addaudithook`). Writes
  made inside C or Rust code without a Python call (torch.save's zip writer, safetensors) are not seen; the folders
  they write into are created from Python and are.
- {"kind": "step", ...}: per training step, the global batch's prompt ids, rewards, baselines and advantages as
  `trainer.baselines` returned them on this rank, and this rank's completions.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATH_EVENTS = {"os.mkdir": 0, "os.remove": 0, "os.rmdir": 0, "shutil.rmtree": 0, "os.truncate": 0, "os.rename": 0,
               "os.link": 1, "os.symlink": 1, "os.chmod": 0, "os.utime": 0}


class Recorder:
    def __init__(self, log_path: Path, watched: Path | None):
        self.f = open(log_path, "a", buffering=1)  # opened before the hook: the hook never sees its own log
        self.watched = str(watched.resolve()) if watched else None
        self.busy = False

    def write(self, rec: dict) -> None:
        self.f.write(json.dumps(rec) + "\n")

    def _under(self, path) -> str | None:
        if self.watched is None or isinstance(path, int) or path is None:
            return None
        p = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
        full = os.path.abspath(p)
        return full if full == self.watched or full.startswith(self.watched + os.sep) else None

    def audit(self, event: str, args) -> None:
        if self.busy:
            return
        self.busy = True
        try:
            hits = []
            if event == "open" and len(args) >= 3:
                path, mode, flags = args[0], args[1], args[2]
                writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                    mode is None and isinstance(flags, int) and flags & WRITE_FLAGS)
                if writing:
                    hits.append(path)
            elif event in PATH_EVENTS:
                hits.append(args[PATH_EVENTS[event]])
                if event == "os.rename":
                    hits.append(args[1])
            for h in hits:
                full = self._under(h)
                if full is not None:
                    self.write({"kind": "write", "event": event, "path": full})
        finally:
            self.busy = False

    def wrap_trainer(self) -> None:
        """Record every step's global baselines (and this rank's completions) as `trainer.baselines` returns them."""
        from basis_lite import trainer

        original = trainer.baselines

        def baselines(run, step, *args, **kwargs):
            adv, base = original(run, step, *args, **kwargs)
            self.write({"kind": "step", "step": run.step + 1, "ids": [ex.id for ex in step.batch],
                        "rewards": step.rewards.reshape(-1).tolist(), "baselines": base.reshape(-1).tolist(),
                        "advantages": adv.reshape(-1).tolist(), "texts": [r.text for r in step.rollouts]})
            return adv, base

        trainer.baselines = baselines


def main() -> int:
    log_dir, watched, args = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    log_dir.mkdir(parents=True, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    repo = Path(__file__).resolve().parent.parent
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    rec = Recorder(log_dir / f"rank-{rank}.jsonl", watched)
    sys.addaudithook(rec.audit)
    rec.wrap_trainer()
    from basis_lite.cli import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
