"""bench/decode_gemm.py: the products it times are the fast engine's, its three kernels compute the same product,
and its per-forward sums follow from the per-product times (hand-made numbers; nothing is timed here)."""
from __future__ import annotations

import pytest
import torch
from conftest import bench_module

from basis_lite.config import load_config
from basis_lite.model.shape import KNOWN_SHAPES, model_shape


@pytest.fixture(scope="module")
def dg():
    return bench_module("decode_gemm.py")


def test_fused_shapes_are_the_fast_engines_groups(dg):
    """The (out, in) of each timed product equal the fused groups FastDecoder builds on the tiny model, the head
    included, and each per-layer group is timed once per layer."""
    from basis_lite.engines.fast_cpu import FastDecoder
    from basis_lite.model.loading import load_policy

    cfg = load_config("smoke", ["device=cpu", "model.dtype=float32"])
    model, _ = load_policy(cfg, torch.device("cpu"), torch.float32)
    shape, _ = model_shape(cfg.model.name)
    dec = FastDecoder(model)
    want = [g.shape for g in dec.layers[0]["groups"]] + [dec.head.shape]
    got = dg.fused_shapes(shape)
    assert [(o, i) for o, i, _ in got.values()] == want
    assert [c for _, _, c in got.values()] == [len(dec.layers)] * 4 + [1]
    q, h = dg.fused_shapes(KNOWN_SHAPES["smollm2-135m"])["q|k|v"], 576
    assert q == (h + 2 * 192, h, 30)  # 9 query heads and 3 key/value heads of 64


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="the onednn kernel needs oneDNN")
def test_the_three_kernels_compute_the_same_product(dg):
    torch.manual_seed(0)
    w = [torch.randn(48, 32), torch.randn(48, 32)]
    x = torch.randn(5, 32)
    outs = {kn: [c() for c in dg._kernel_calls(torch, kn, w, x)] for kn in dg.KERNELS}
    for kn in dg.KERNELS[1:]:
        for a, b in zip(outs[dg.KERNELS[0]], outs[kn]):
            assert a.shape == (5, 48)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["F.linear"][1], x @ w[1].T)
    assert not torch.allclose(outs["x@wT"][0], outs["x@wT"][1])  # one call per weight copy, not one copy twice


def test_forward_sums_and_bounds_follow_the_products(dg):
    groups = {"a": (10, 20, 3), "head": (100, 20, 1)}
    results = {"a": [{"rows": 4, "seconds": {"onednn": 3e-6, "F.linear": 2e-6, "x@wT": 5e-6}}],
               "head": [{"rows": 4, "seconds": {"onednn": 1e-5, "F.linear": 4e-5, "x@wT": 2e-5}}]}
    per, fwd = dg.analyse(groups, results, peak_gflops=1.0, read_gbs=1.0)
    assert [p["best"] for p in per] == ["F.linear", "onednn"]
    a = per[0]
    assert a["flop_bound_s"] == pytest.approx(2 * 4 * 20 * 10 / 1e9)
    assert a["byte_bound_s"] == pytest.approx(4 * 20 * 10 / 1e9)
    assert a["bound_s"] == max(a["flop_bound_s"], a["byte_bound_s"])
    (f,) = fwd
    assert f["onednn_s"] == pytest.approx(3 * 3e-6 + 1e-5)
    assert f["best_s"] == pytest.approx(3 * 2e-6 + 1e-5)
    assert f["bound_s"] == pytest.approx(3 * a["bound_s"] + per[1]["bound_s"])
