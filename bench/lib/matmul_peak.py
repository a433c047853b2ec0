"""The matmul peak a step's FLOPs are set against: GFLOP/s of GEMMs typical of the model, per dtype and weight
layout, timed with torch's own thread count.

Shapes: 4096x576 @ 576x1536 (an MLP projection over a micro-batch of tokens) and 2048^3. Layouts: `a@b`, a
contiguous [K, N] right operand; `a@w.T`, an [N, K] weight as nn.Linear stores it (what the model runs); `onednn`,
that weight packed by oneDNN and applied by its inner product (what the fast CPU engine runs in float32; on an AMD
CPU MKL's float32 GEMM takes its AVX2 path, and only this one reaches the AVX-512 rate). One call to warm up, then
the best of up to `repeats` calls (at most PEAK_BUDGET_S of calls per GEMM); a GEMM that a smaller shape of the
same dtype and layout predicts at over PEAK_SKIP_S per call is skipped and marked so. The peak of a dtype is its
best GFLOP/s.
"""
from __future__ import annotations

import time

from bench.lib.flops import matmul_flops

PEAK_SHAPES = ((4096, 576, 1536), (2048, 2048, 2048))
PEAK_LAYOUTS = ("a@b", "a@w.T", "onednn")
PEAK_DTYPES = ("float32", "bfloat16")
PEAK_SKIP_S = 10.0  # skip a GEMM predicted to take longer than this per call
PEAK_BUDGET_S = 3.0  # stop repeating a GEMM after this many seconds of timed calls
BANDWIDTH_MIB = 256  # the buffer of the bandwidth measurement: far larger than any last-level cache


def _gemm(torch, m: int, k: int, n: int, dt, layout: str):
    """The timed call of one GEMM: its operands built (and, for onednn, converted) once, outside the timing."""
    g = torch.Generator().manual_seed(0)
    lhs = torch.randn(m, k, generator=g).to(dt)
    rhs = torch.randn(*((k, n) if layout == "a@b" else (n, k)), generator=g).to(dt)
    if layout == "onednn":
        lhs, rhs = lhs.to_mkldnn(), rhs.to_mkldnn()
        return lambda: torch._C._nn.mkldnn_linear(lhs, rhs, None)
    if layout == "a@w.T":
        return lambda: lhs @ rhs.T
    return lambda: lhs @ rhs


def _best_seconds(fn, repeats: int) -> tuple[list[float], float]:
    """(timed seconds of up to `repeats` calls after one warm-up, the warm-up's seconds)."""
    t0 = time.perf_counter()
    fn()
    warm = time.perf_counter() - t0
    times, spent = [], 0.0
    for _ in range(max(1, repeats)):
        if times and spent > PEAK_BUDGET_S:
            break
        t0 = time.perf_counter()
        fn()
        dt_s = time.perf_counter() - t0
        times.append(dt_s)
        spent += dt_s
    return times, warm


def measure_peak(dtypes=PEAK_DTYPES, shapes=PEAK_SHAPES, layouts=PEAK_LAYOUTS, repeats: int = 3) -> dict:
    """GFLOP/s of each (dtype, shape, layout) GEMM: {"gemms": [...], "best": {dtype: GFLOP/s}, "threads"}."""
    import torch

    gemms, best = [], {}
    for dt_name in dtypes:
        dt = getattr(torch, dt_name)
        last_rate: dict[str, float] = {}
        for m, k, n in shapes:
            flops = matmul_flops(m, k, n)
            for layout in layouts:
                rec = {"dtype": dt_name, "shape": [m, k, n], "layout": layout}
                if layout in last_rate and flops / (last_rate[layout] * 1e9) > PEAK_SKIP_S:
                    rec["note"] = (f"skipped: ~{flops / (last_rate[layout] * 1e9):.0f} s per call predicted from "
                                   f"the smaller shape")
                elif layout == "onednn" and not torch.backends.mkldnn.is_available():
                    rec["note"] = "skipped: torch built without oneDNN"
                else:
                    times, warm = _best_seconds(_gemm(torch, m, k, n, dt, layout), repeats)
                    rate = flops / min(times) / 1e9
                    rec.update(gflops=rate, seconds=times, warmup_s=warm)
                    last_rate[layout] = rate
                    best[dt_name] = max(best.get(dt_name, 0.0), rate)
                gemms.append(rec)
    return {"gemms": gemms, "best": best, "threads": torch.get_num_threads()}


def measure_bandwidth(mib: int = BANDWIDTH_MIB, repeats: int = 5) -> dict:
    """Main-memory bandwidth with torch's own thread count, the bound of a step that reads more bytes than it
    computes on (decoding a batch of a few rows reads every weight once per token): `read_gbs`, a float32 buffer
    of `mib` MiB summed (its bytes read once); `copy_gbs`, that buffer copied into another (bytes read + written).
    GB/s from the best of up to `repeats` calls after one warm-up."""
    import torch

    n = mib * 2**20 // 4
    src, dst = torch.ones(n), torch.empty(n)
    read, _ = _best_seconds(lambda: src.sum(), repeats)
    copy, _ = _best_seconds(lambda: dst.copy_(src), repeats)
    return {"read_gbs": 4 * n / min(read) / 1e9, "copy_gbs": 8 * n / min(copy) / 1e9, "mib": mib,
            "read_s": read, "copy_s": copy, "threads": torch.get_num_threads()}
