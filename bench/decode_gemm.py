#!/usr/bin/env python
"""The decoder's matrix products at decode's few rows, per CPU kernel: where a decode forward's time goes and
whether another kernel would pay.

    python bench/decode_gemm.py                         # SmolLM2-135M shapes, rows 8 16 24 32, float32
    python bench/decode_gemm.py --model smollm2-360m --rows 16 --no-write

The fast CPU engine (basis_lite/engines/fast_cpu.py) runs, per layer and decode step, four fused products over the
batch's live rows (q|k|v, o, gate|up, down) and, per step, the tied output head over the whole vocabulary. This
script times each of them, for each number of rows, in three kernels on the same float32 weight:

- `onednn`: the weight packed once by oneDNN, the rows converted to oneDNN and back around its inner product (what
  the engine runs in float32 today);
- `F.linear`: the dense [out, in] weight as nn.Linear stores it (MKL's sgemm, the weight read transposed);
- `x@wT`: the weight stored transposed, [in, out], a plain matmul.

Weights stream from memory as in a real decode: each fused shape has one distinct weight per layer of the model
(the head one), and the calls cycle through them, so no weight is in cache when its product runs (a layer's
weights are far larger than a core's share of the last-level cache; the head alone is over 100 MB). A timed round
is one pass over the layers; one warm-up round, then the median of `--repeats` rounds, kernels interleaved.

The references, measured in the same run: the matmul peak of bench/lib/matmul_peak.py (float32, its best layout)
and the read bandwidth. "FLOP bound" is a product's FLOPs at that peak, "byte bound" its weight read once at that
bandwidth; "x bound" is its time over the larger of the two. The per-forward table adds the products of one decode
step (layers x the four groups + the head) per kernel, and the best kernel per product, against the sum of bounds.

Writes bench/results/decode_gemm/decode_gemm.json and decode_gemm.md (--out to change) with the machine's flags.
Run it alone on the machine: a second torch job on the same cores changes every figure.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.lib.flops import matmul_flops  # noqa: E402
from bench.lib.matmul_peak import measure_bandwidth, measure_peak  # noqa: E402
from bench.lib.paths import results_dir  # noqa: E402
from bench.lib.provenance import header_lines, machine_record, with_load_after  # noqa: E402
from bench.lib.report import markdown_table, write_json  # noqa: E402

KERNELS = ("onednn", "F.linear", "x@wT")


def fused_shapes(shape) -> dict[str, tuple[int, int, int]]:
    """{group: (out features, in features, copies)}: the engine's fused products of one decode step."""
    lin = shape.linear_shapes
    return {"q|k|v": (sum(lin[n][1] for n in ("q_proj", "k_proj", "v_proj")), shape.hidden, shape.layers),
            "o": (shape.hidden, lin["o_proj"][0], shape.layers),
            "gate|up": (2 * shape.intermediate, shape.hidden, shape.layers),
            "down": (shape.hidden, shape.intermediate, shape.layers),
            "head": (shape.vocab, shape.hidden, 1)}


def _kernel_calls(torch, kernel: str, weights: list, x):
    """One call per weight copy of x @ w.T by `kernel`; operands prepared outside the timing (as the engine
    prepares its weights once per rollout)."""
    import torch.nn.functional as F

    if kernel == "onednn":
        packed = [w.to_mkldnn() for w in weights]
        return [lambda w=w: torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), w, None).to_dense()
                for w in packed]
    if kernel == "F.linear":
        return [lambda w=w: F.linear(x, w) for w in weights]
    transposed = [w.t().contiguous() for w in weights]
    return [lambda w=w: x @ w for w in transposed]


def measure_shape(torch, out_f: int, in_f: int, copies: int, rows_list, repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(out_f, in_f, generator=g) for _ in range(copies)]
    recs = []
    for rows in rows_list:
        x = torch.randn(rows, in_f, generator=g)
        calls = {kn: _kernel_calls(torch, kn, weights, x) for kn in KERNELS}
        times: dict[str, list[float]] = {kn: [] for kn in KERNELS}
        for rnd in range(repeats + 1):
            order = KERNELS if rnd % 2 == 0 else tuple(reversed(KERNELS))
            for kn in order:
                t0 = time.perf_counter()
                for c in calls[kn]:
                    c()
                if rnd:  # round 0 warms up
                    times[kn].append((time.perf_counter() - t0) / copies)
        recs.append({"rows": rows, "seconds": {kn: statistics.median(v) for kn, v in times.items()},
                     "all_seconds": times})
        del calls
    return recs


def analyse(groups: dict, results: dict, peak_gflops: float, read_gbs: float) -> tuple[list[dict], list[dict]]:
    """Per product rows and per decode-forward rows, with FLOP and byte bounds."""
    per, forward = [], {}
    for name, (out_f, in_f, copies) in groups.items():
        for rec in results[name]:
            rows = rec["rows"]
            flops = matmul_flops(rows, in_f, out_f)
            flop_s, byte_s = flops / (peak_gflops * 1e9), 4 * out_f * in_f / (read_gbs * 1e9)
            bound = max(flop_s, byte_s)
            best = min(KERNELS, key=lambda kn: rec["seconds"][kn])
            per.append({"group": name, "out": out_f, "in": in_f, "rows": rows, "best": best,
                        "best_s": rec["seconds"][best], "bound_s": bound, "flop_bound_s": flop_s,
                        "byte_bound_s": byte_s,
                        **{f"{kn}_s": rec["seconds"][kn] for kn in KERNELS},
                        **{f"{kn}_gflops": flops / rec["seconds"][kn] / 1e9 for kn in KERNELS}})
            f = forward.setdefault(rows, {"rows": rows, "bound_s": 0.0, "best_s": 0.0,
                                          **{f"{kn}_s": 0.0 for kn in KERNELS}})
            f["bound_s"] += copies * bound
            f["best_s"] += copies * rec["seconds"][best]
            for kn in KERNELS:
                f[f"{kn}_s"] += copies * rec["seconds"][kn]
    return per, list(forward.values())


def write(out_dir: Path, result: dict) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "decode_gemm.json", result)
    m = result["machine"]
    ref = result["reference"]
    lines = ["# The decoder's products at decode's few rows, per CPU kernel (bench/decode_gemm.py)", "",
             *header_lines(m, result["command"], result["threads"]),
             f"- model shapes: {result['model']} ({result['layers']} layers); float32 weights, one per layer, cycled",
             f"- references in this run: matmul peak {ref['peak_gflops']:.1f} GFLOP/s (float32, best layout), read "
             f"bandwidth {ref['read_gbs']:.1f} GB/s",
             "- Method: the docstring of bench/decode_gemm.py. Medians of the rounds, microseconds per call.", "",
             "## Per product", ""]
    rows = [[p["group"], f"{p['out']}x{p['in']}", p["rows"],
             *[f"{p[f'{kn}_s'] * 1e6:.0f} ({p[f'{kn}_gflops']:.0f})" for kn in KERNELS], p["best"],
             f"{p['flop_bound_s'] * 1e6:.0f}", f"{p['byte_bound_s'] * 1e6:.0f}",
             f"{p['best_s'] / p['bound_s']:.2f}"] for p in result["per_product"]]
    lines += [markdown_table(("group", "out x in", "rows", *[f"{kn} us (GFLOP/s)" for kn in KERNELS], "fastest",
                              "FLOP bound us", "byte bound us", "fastest x bound"), rows), "",
              "## One decode forward's products (layers x 4 groups + head)", ""]
    rows = [[f["rows"], *[f"{f[f'{kn}_s'] * 1e3:.1f}" for kn in KERNELS], f"{f['best_s'] * 1e3:.1f}",
             f"{f['onednn_s'] / f['best_s']:.2f}x", f"{f['bound_s'] * 1e3:.1f}",
             f"{f['onednn_s'] / f['bound_s']:.2f}", f"{f['best_s'] / f['bound_s']:.2f}"]
            for f in result["per_forward"]]
    lines += [markdown_table(("rows", *[f"{kn} ms" for kn in KERNELS], "fastest per product ms",
                              "gain over onednn", "bound ms", "onednn x bound", "fastest x bound"), rows)]
    text = "\n".join(lines) + "\n"
    (out_dir / "decode_gemm.md").write_text(text)
    return text


def main(argv=None) -> int:
    from basis_lite.model.shape import KNOWN_SHAPES

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help=f"one of {', '.join(KNOWN_SHAPES)}")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 24, 32])
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (median kept)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=str(results_dir("decode_gemm")), help="default bench/results/decode_gemm")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    if args.model not in KNOWN_SHAPES:
        raise SystemExit(f"--model {args.model!r}: not one of {', '.join(KNOWN_SHAPES)}")
    if min(args.rows) < 1 or args.repeats < 1:
        raise SystemExit(f"--rows {args.rows} and --repeats {args.repeats} must be at least 1")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("this torch is built without oneDNN: the engine's float32 kernel cannot be timed")
    machine = machine_record()
    shape = KNOWN_SHAPES[args.model]
    peak = measure_peak(dtypes=("float32",))
    bw = measure_bandwidth()
    groups = fused_shapes(shape)
    results = {}
    for name, (out_f, in_f, copies) in groups.items():
        print(f"{name}: {out_f}x{in_f}, {copies} copies ...", flush=True)
        results[name] = measure_shape(torch, out_f, in_f, copies, args.rows, args.repeats)
    per, forward = analyse(groups, results, peak["best"]["float32"], bw["read_gbs"])
    result = {"command": " ".join(["python bench/decode_gemm.py", *(argv if argv is not None else sys.argv[1:])]),
              "model": shape.name, "layers": shape.layers, "threads": torch.get_num_threads(),
              "reference": {"peak_gflops": peak["best"]["float32"], "read_gbs": bw["read_gbs"], "peak": peak,
                            "bandwidth": bw},
              "per_product": per, "per_forward": forward, "machine": with_load_after(machine)}
    if args.no_write:
        for f in forward:
            print(f"{f['rows']} rows: " + ", ".join(f"{kn} {f[f'{kn}_s'] * 1e3:.1f} ms" for kn in KERNELS)
                  + f", fastest per product {f['best_s'] * 1e3:.1f} ms, bound {f['bound_s'] * 1e3:.1f} ms")
    else:
        print(write(Path(args.out), result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
