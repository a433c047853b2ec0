#!/usr/bin/env python
"""Memory of one log-prob chunk's forward + backward, per head dtype and path: the bytes it holds per logit.

    python bench/logprob_memory.py                      # vocab 151936 (Qwen2.5), hidden 1536, chunks 1024 and 256
    python bench/logprob_memory.py --vocab 49152 --hidden 576 --no-write

`chunked_token_logprobs` (basis_lite/losses/policy.py) computes the completion tokens' log-probs `chunk` rows at a
time, so its transient memory is (chunk x vocab) logits times some bytes each. This script measures that factor
for the two paths the training step can take:

- `analytic`: a frozen head (LoRA training), d lp / d hidden found in the forward (`_FrozenHeadLogprobs`);
- `checkpointed`: a head that trains (or anything that is not a plain Linear), recomputed under
  torch.utils.checkpoint in the backward (what a 16-bit head took before the analytic path accepted it).

Each case runs in a fresh process on the CPU: the head and the chunk's hidden rows are built first, then one
forward + backward; the process's peak resident memory above what it held before is the chunk's transient (large
tensors come straight from the system, so the resident peak tracks them). `basis_lite/plan.py` uses these factors.
Writes bench/results/logprob_memory/logprob_memory.json and .md with the machine's flags.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.lib.paths import results_dir, shown  # noqa: E402
from bench.lib.provenance import flags_line, machine_record  # noqa: E402
from bench.lib.recorders import peak_rss_mb, rss_mb  # noqa: E402
from bench.lib.report import markdown_table, write_json  # noqa: E402

DTYPES = ("float32", "bfloat16")
PATHS = ("analytic", "checkpointed")


def measure(vocab: int, hidden: int, chunk: int, dtype: str, path: str) -> dict:
    """One case, in this process: the peak resident bytes the chunk's forward + backward adds."""
    import torch

    from basis_lite.losses.policy import chunked_token_logprobs

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    head = torch.nn.Linear(hidden, vocab, bias=False, dtype=dt).requires_grad_(path == "checkpointed")
    h = torch.randn(1, chunk, hidden, dtype=dt, requires_grad=True)
    targets = torch.randint(0, vocab, (1, chunk))
    mask = torch.ones(1, chunk, dtype=torch.bool)
    before = max(peak_rss_mb()["peak_rss_mb"], rss_mb())
    lp, _ = chunked_token_logprobs(h, head, targets, mask, chunk_size=chunk)
    lp.sum().backward()
    extra = max(0.0, peak_rss_mb()["peak_rss_mb"] - before) * 2**20
    return {"vocab": vocab, "hidden": hidden, "chunk": chunk, "dtype": dtype, "path": path,
            "transient_gib": extra / 2**30, "bytes_per_logit": extra / (chunk * vocab)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--chunks", default="1024,256", help="comma-separated chunk sizes (default 1024,256)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results/logprob_memory)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # child: chunk,dtype,path
    args = ap.parse_args(argv)
    if args.case:
        chunk, dtype, path = args.case.split(",")
        print(json.dumps(measure(args.vocab, args.hidden, int(chunk), dtype, path)))
        return 0
    rows = []
    for chunk in [int(c) for c in args.chunks.split(",")]:
        for dtype in DTYPES:
            for path in PATHS:
                out = subprocess.run([sys.executable, __file__, "--vocab", str(args.vocab), "--hidden",
                                      str(args.hidden), "--case", f"{chunk},{dtype},{path}"],
                                     capture_output=True, text=True, check=True, cwd=REPO)
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                r = rows[-1]
                print(f"chunk {chunk:5d} {dtype:9s} {path:12s} {r['transient_gib']:.3f} GiB "
                      f"({r['bytes_per_logit']:.1f} B per logit)", flush=True)
    machine = machine_record()
    table = markdown_table(["chunk", "head dtype", "path", "transient GiB", "bytes per logit"],
                           [[r["chunk"], r["dtype"], r["path"], f"{r['transient_gib']:.3f}",
                             f"{r['bytes_per_logit']:.1f}"] for r in rows])
    print(flags_line(machine))
    if not args.no_write:
        folder = Path(args.out) if args.out else results_dir("logprob_memory")
        write_json(folder / "logprob_memory.json", {"machine": machine, "argv": sys.argv[1:], "results": rows})
        (folder / "logprob_memory.md").write_text(
            f"# One log-prob chunk's forward + backward: transient memory (vocab {args.vocab}, hidden "
            f"{args.hidden})\n\nWritten by `python bench/logprob_memory.py {' '.join(sys.argv[1:])}`".rstrip()
            + f"; {flags_line(machine)}.\n\n{table}\n")
        print(f"wrote {shown(folder)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
