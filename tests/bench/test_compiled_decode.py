"""bench/compiled_decode.py: its per-layer decode step is the fast engine's layer (same tokens, same log-probs when
routed uncompiled), and its job estimate follows from the per-call numbers (hand-made numbers; nothing is timed or
compiled here: compiling takes minutes on 2 cores)."""
from __future__ import annotations

import pytest
import torch
from conftest import bench_module

from basis_lite.config import load_config


@pytest.fixture(scope="module")
def cd():
    return bench_module("compiled_decode.py")


def test_the_per_layer_step_is_the_engines_layer(cd):
    """Routed through `_layer_step` (uncompiled), a bf16 engine with a trained-looking adapter samples the same
    tokens with the same log-probs as the engine's own forward; a step that drops the adapter does not."""
    from basis_lite.engines.fast_cpu import FastDecoder
    from basis_lite.model.loading import load_policy

    cfg = load_config("smoke", ["device=cpu", "model.dtype=bfloat16"])
    model, _ = load_policy(cfg, torch.device("cpu"), torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    rows = [[1, 5, 9, 13, 2], [1, 5, 9, 7], [1, 5, 3, 11, 12, 4]]

    def run(dec):
        gens = [torch.Generator().manual_seed(i) for i in range(len(rows))]
        return dec.generate(rows, 8, stop_ids={0}, temperature=1.0, generators=gens)[:2]

    want = run(FastDecoder(model))
    dec = FastDecoder(model)
    cd.route_decode(dec, per_layer=True, compile=False)
    assert run(dec) == want

    step = cd._layer_step
    try:  # the adapter's B set to zero inside the step: the tokens or log-probs must change
        cd._layer_step = lambda *a: step(*a[:12], a[12] * 0, *a[13:])
        dec = FastDecoder(model)
        cd.route_decode(dec, per_layer=True, compile=False)
        assert run(dec) != want
    finally:
        cd._layer_step = step


def test_job_estimate_follows_from_the_calls(cd):
    def mode(secs, toks):
        return {"runs": [{"seconds": s, "tokens": t} for s, t in zip(secs, toks)], "greedy": [[1], [2]],
                "graphs": None, "steps": 20}

    modes = cd.summarize({"eager": mode([4.0, 4.0, 3.0], [1000, 1000, 1000]),
                          "compiled_warm": mode([50.0, 3.0, 2.0], [1000, 1000, 1000]) | {"greedy": [[1], [3]]}})
    e, c = modes["eager"], modes["compiled_warm"]
    assert e["steady_ms_per_token"] == pytest.approx(3.5)  # median of calls 1.. per token
    assert c["steady_ms_per_token"] == pytest.approx(2.5)
    assert c["job_saved_s"] == pytest.approx(20 * 1000 * 1.0 / 1e3)
    assert c["job_paid_s"] == pytest.approx(50.0 - 2.5)
    assert c["job_net_s"] == pytest.approx(20.0 - 47.5)
    assert (e["greedy_rows_equal"], c["greedy_rows_equal"]) == (2, 1)


def test_fewer_than_two_calls_is_refused(cd, capsys):
    with pytest.raises(SystemExit):
        cd.main(["--calls", "1"])
    assert "--calls 1" in capsys.readouterr().err
