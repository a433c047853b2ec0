#!/usr/bin/env python
"""Peak resident memory of a whole `basis-lite train` job, by phase, first run included.

    python bench/job_memory.py OUT.json [basis-lite train arguments ...]
    python bench/job_memory.py /tmp/mem.json --no-progress --output /tmp/run --set train.steps=2
    BASIS_LITE_CACHE=$(mktemp -d) python bench/job_memory.py /tmp/first.json ...   # a first run: fetch + convert

Runs the CLI's `main` in this process with a thread that reads /proc/self/statm every 10 ms and keeps the peak of
each phase: `convert` (models.builtin_smollm2_dir: the first-run fetch and GGUF conversion), `load_policy`, `eval`
(trainer.run_eval: before and after), `rollout` (trainer.rollout), `update` (trainer.update) with its parts
`update:fwd` (the log-prob forward) and `update:bwd` (backward), and `other` (imports, setup, checkpoints). Writes
{"peaks": {phase: MB}, "maxrss_mb": ..., "trace": [[time, phase, MB], ...], "machine": ...} to OUT.json and prints
the peaks; "machine" is bench/lib/provenance.py's record (CPU flags, commit, load average before and after, and the
allocator and kernel variables in `env`: MALLOC_* settings change these peaks).
ru_maxrss (`maxrss_mb`) is the kernel's own peak of this process; the pip download of a first run is a child
process and not in it (pip's RSS is far below the conversion's).
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.lib.provenance import machine_record, with_load_after  # noqa: E402
from bench.lib.recorders import peak_rss_mb, rss_mb  # noqa: E402


class PhaseSampler:
    def __init__(self, interval: float = 0.01):
        self.phase, self.peaks, self.trace = "other", {}, []
        self.interval = interval
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            r, ph = rss_mb(), self.phase
            self.peaks[ph] = max(self.peaks.get(ph, 0.0), r)
            self.trace.append((round(time.time(), 2), ph, round(r)))
            time.sleep(self.interval)

    def wrap(self, mod, name: str, phase: str) -> None:
        orig = getattr(mod, name)

        def f(*a, **k):
            prev, self.phase = self.phase, phase
            try:
                return orig(*a, **k)
            finally:
                self.phase = prev
        setattr(mod, name, f)


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):  # the first argument is the output file; -h / --help show this
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    out, cli_args = Path(argv[0]), argv[1:]
    sampler = PhaseSampler()
    import torch

    machine = machine_record()
    from basis_lite import trainer
    from basis_lite.cli import main as cli_main
    from basis_lite.model import loading as models
    from basis_lite.rl import update

    sampler.wrap(models, "builtin_smollm2_dir", "convert")
    sampler.wrap(models, "load_policy", "load_policy")
    sampler.wrap(trainer, "rollout", "rollout")
    sampler.wrap(trainer, "update", "update")
    sampler.wrap(trainer, "run_eval", "eval")
    sampler.wrap(update, "sequence_logprobs", "update:fwd")
    sampler.wrap(torch.Tensor, "backward", "update:bwd")
    t0 = time.time()
    try:
        rc = cli_main(["train", *cli_args])
    except SystemExit as e:
        rc = e.code
    doc = {"command": "python bench/job_memory.py " + " ".join(argv), "seconds": time.time() - t0, "exit": rc,
           "peaks": {k: round(v) for k, v in sampler.peaks.items()},
           "maxrss_mb": round(peak_rss_mb()["ru_maxrss_mb"]),
           "trace": sampler.trace[::10], "machine": with_load_after(machine)}
    out.write_text(json.dumps(doc))
    print(json.dumps({"peaks": doc["peaks"], "maxrss_mb": doc["maxrss_mb"], "seconds": round(doc["seconds"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
