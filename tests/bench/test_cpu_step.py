"""bench/cpu_step.py's pure parts: the rows' ratio math, the tables and the results merge (bench/cpu_step_report.py),
the variants and engines it measures, the kernel caps, the gap to the roofline. Its FLOP formulas and recorders are
bench/lib's (tests/bench/test_lib.py). No timing is asserted."""
from __future__ import annotations

import pytest
from conftest import REPO, bench_module

SCRIPT = REPO / "bench" / "cpu_step.py"


@pytest.fixture(scope="module")
def cs():
    return bench_module("cpu_step.py")


@pytest.fixture(scope="module")
def rep():
    from bench import cpu_step_report

    return cpu_step_report


def test_row_ratio_math_and_cells(rep):
    r = rep.Row(variant="float32, gc on", engine="hf", dtype="float32", gc="on", part="train total", seconds=2.0,
                tokens=100, flops=4e9, peak_gflops=10.0, rss_peak_mb=1234.4)
    assert r.tokens_per_s == 50 and r.gflops_per_s == pytest.approx(2.0) and r.peak_ratio == pytest.approx(0.2)
    cells = dict(zip(rep.TABLE_COLUMNS, rep.row_cells(r)))
    assert cells["tok/s"] == "50.0" and cells["GFLOP"] == "4.0" and cells["GFLOP/s"] == "2.00"
    assert cells["% peak"] == "20.0" and cells["RSS MB"] == "1234"
    d = r.to_dict()
    assert d["peak_ratio"] == pytest.approx(0.2) and rep.Row.from_dict(d) == r
    empty = rep.Row(variant="v", engine="hf", dtype="float32", gc="-", part="reward", seconds=0.5)
    assert empty.tokens_per_s is None and empty.gflops_per_s is None and empty.peak_ratio is None
    assert dict(zip(rep.TABLE_COLUMNS, rep.row_cells(empty)))["% peak"] == "-"
    assert rep.Row(variant="v", engine="hf", dtype="f", gc="-", part="p", seconds=1.0, flops=1e9).peak_ratio is None
    # 4 GFLOP at a 10 GFLOP/s peak: 0.4 s of roofline; 2.0 s measured is 5x it
    assert r.roofline_s == pytest.approx(0.4) and r.x_roofline == pytest.approx(5.0) and cells["x roofline"] == "5.00"
    assert empty.roofline_s is None and empty.x_roofline is None
    assert empty.bandwidth_s is None and empty.x_bandwidth is None and cells["x bandwidth"] == "-"
    # decode: 10 forwards reading 0.5 GB of weights each at 10 GB/s is 0.5 s; 2.0 s measured is 4x it
    dec = rep.Row(variant="v", engine="fast", dtype="float32", gc="-", part="gen decode", seconds=2.0, bytes=5e9,
                  bandwidth_gbs=10.0)
    dcells = dict(zip(rep.TABLE_COLUMNS, rep.row_cells(dec)))
    assert dec.bandwidth_s == pytest.approx(0.5) and dcells["x bandwidth"] == "4.00" and dcells["GB read"] == "5.0"
    assert rep.Row.from_dict(dec.to_dict()) == dec and dec.to_dict()["x_bandwidth"] == pytest.approx(4.0)
    assert dec.x_bound == pytest.approx(4.0) and r.x_bound == pytest.approx(5.0) and empty.x_bound is None
    both = rep.Row(variant="v", engine="fast", dtype="float32", gc="-", part="gen decode", seconds=2.0, bytes=5e9,
                   bandwidth_gbs=10.0, flops=8e9, peak_gflops=10.0)  # 0.8 s of FLOPs beats 0.5 s of bytes
    assert both.x_bound == pytest.approx(2.5) and dict(zip(rep.TABLE_COLUMNS, rep.row_cells(both)))["x bound"] == "2.50"


def test_memory_breakdown_adds_up_to_the_measured_peak(rep):
    rows = rep.memory_breakdown(baseline_mb=300.0, weights_mb=500.0, lora_mb=20.0, optimizer_mb=40.0,
                                activations_mb=900.0, head_rows=256, vocab=1024, kv_cache_mb=50.0, startup_peak=900.0,
                                gen_peak=1200.0, train_peak=2000.0)
    by = {r["component"]: r["mb"] for r in rows}
    assert by["LoRA weights + gradients"] == 40.0
    assert by["log-prob head working set"] == pytest.approx(3 * 256 * 1024 * 4 / 2**20)  # 3 MB
    parts = ("process baseline", "frozen weights", "LoRA weights + gradients", "AdamW moments",
             "activations saved for backward", "log-prob head working set", "allocator and other (update)")
    assert sum(by[k] for k in parts) == pytest.approx(2000.0)
    doc = {"runs": [{"dtype": "float32", "engine": "fast", "overrides": [], "memory": rows}]}
    assert ["float32", "fast", "peak: update", "2000", "measured"] in rep.memory_rows(doc)


def _run(rep, engine, dtype, gen_s, tokens, overrides=(), startup=None):
    rows = [rep.Row(variant=dtype, engine=engine, dtype=dtype, gc="-", part="gen total", seconds=gen_s,
                    tokens=tokens, flops=1e9, peak_gflops=10.0).to_dict(),
            rep.Row(variant=f"{dtype}, gc off", engine=engine, dtype=dtype, gc="off", part="train total", seconds=4.0,
                    flops=2e10, peak_gflops=10.0).to_dict(),
            rep.Row(variant=f"{dtype}, gc off", engine=engine, dtype=dtype, gc="off", part="step total",
                    seconds=gen_s + 4.0).to_dict()]
    if startup is not None:
        rows.insert(0, rep.Row(variant=dtype, engine=engine, dtype=dtype, gc="-", part="startup",
                               seconds=startup).to_dict())
    machine = {"cpu_model": "X", "cores": 2, "cpu_flags": {"avx2": True, "avx512_bf16": False},
               "torch": "2.x", "torch_cpu_capability": "AVX2", "torch_threads": 2, "git_commit": "abc",
               "loadavg_before": [1.0], "loadavg_after": [1.5]}
    return {"engine": engine, "dtype": dtype, "overrides": list(overrides), "gc": ["off"], "rows": rows,
            "command": "python bench/cpu_step.py", "created": f"2000-01-01 00:00:0{len(rows)}", "machine": machine,
            "peak": {"best": {dtype: 10.0}, "gemms": [{"dtype": dtype, "shape": [8, 8, 8], "layout": "a@b",
                                                      "gflops": 10.0}]},
            "batch": {"prompts": 4, "rollouts_per_prompt": 1, "max_new_tokens": 8, "temperature": 1.0,
                      "micro_batch_size": 4, "lora_r": 4, "lora_params": 8192}}


def test_merge_comparison_and_markdown(rep):
    hf = _run(rep, "hf", "float32", 10.0, 200)
    old_vllm = _run(rep, "vllm", "float32", 9.0, 200, startup=30.0)
    doc = rep.merge_runs(None, [hf, old_vllm])
    new_vllm = _run(rep, "vllm", "float32", 5.0, 200, startup=40.0)
    small = _run(rep, "hf", "float32", 3.0, 50, overrides=["train.batch_size=8"])
    doc = rep.merge_runs(doc, [new_vllm, small])
    assert [(r["engine"], r["overrides"]) for r in doc["runs"]] == [
        ("hf", []), ("vllm", []), ("hf", ["train.batch_size=8"])]
    assert doc["runs"][1] is new_vllm  # same (engine, dtype, overrides): replaced
    cmp_rows = rep.engine_comparison(doc)
    by = {(r[0], r[1]): r for r in cmp_rows}
    assert by[("float32", "vllm")][2] == "5.00" and by[("float32", "vllm")][4] == "40.0"  # 200 tokens / 5 s
    assert by[("float32", "vllm")][5] == "40.0" and by[("float32", "vllm")][6] == "2.00x"  # HF 10 s / vLLM 5 s
    assert by[("float32", "hf")][6] == "-"
    assert ("float32 [train.batch_size=8]", "hf") in by
    summary = rep.step_summary(doc)
    assert ["float32, gc off", "hf", "10.0", "4.0", "14.0", "5.00", "50.0", "-", "-", "-", "-"] in summary
    md = rep.render_markdown(doc)
    for text in ("avx2 yes", "avx512_bf16 no", "git commit abc", "| variant | engine | part |",
                 "engines side by side", "train.batch_size=8", "| [1.0] / [1.5] |"):
        assert text in md, text
    # a run kept from before the shared machine record names its load averages loadavg_start / loadavg_end
    m = small["machine"]
    small["machine"] = {**{k: v for k, v in m.items() if not k.startswith("loadavg")}, "loadavg_start": [2.0],
                        "loadavg_end": [2.5]}
    assert "| [2.0] / [2.5] |" in rep.render_markdown(doc)


def test_choose_variants(cs):
    assert cs.choose_variants("float32", False, "hf", None, None) == (["float32", "bfloat16"], ["off", "on"])
    assert cs.choose_variants("bfloat16", True, "vllm", None, None) == (["bfloat16", "float32"], ["on"])
    assert cs.choose_variants("float32", True, "hf", "float32", "off") == (["float32"], ["off"])
    with pytest.raises(SystemExit):
        cs.choose_variants("float32", True, "hf", "float16", None)
    with pytest.raises(SystemExit):
        cs.choose_variants("float32", True, "hf", None, "maybe")


def test_engines_caps_and_the_roofline_gap(cs, rep):
    assert cs.parse_engines("fast,hf,fast") == ["fast", "hf"]
    with pytest.raises(SystemExit):
        cs.parse_engines("turbo")
    env = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "X": "1"}
    caps = cs.kernel_caps(env)
    assert set(caps) == set(cs.CAP_VARIABLES) and rep.caps_tag(caps) == " [kernels<=AVX2]" and rep.caps_tag({}) == ""
    # a capped run of the same (engine, dtype) is kept beside the uncapped one; engines sort fast, hf, vllm
    fast = _run(rep, "fast", "float32", 4.0, 200)
    capped = dict(_run(rep, "fast", "float32", 6.0, 200), kernel_caps=caps)
    doc = rep.merge_runs(None, [capped, _run(rep, "hf", "float32", 10.0, 200), fast])
    assert [(r["engine"], bool(r.get("kernel_caps"))) for r in doc["runs"]] == [
        ("fast", False), ("hf", False), ("fast", True)]
    # the gap: gen total 4 s with 1 GFLOP at 10 GFLOP/s (0.1 s of roofline), train 4 s with 20 GFLOP (2 s)
    rows = [rep.Row(variant="float32", engine="fast", dtype="float32", gc="-", part="gen decode", seconds=4.0,
                    flops=1e9, peak_gflops=10.0),
            rep.Row(variant="float32, gc off", engine="fast", dtype="float32", gc="off", part="train backward",
                    seconds=4.0, flops=2e10, peak_gflops=10.0),
            rep.Row(variant="float32, gc off", engine="fast", dtype="float32", gc="off", part="step total",
                    seconds=8.0, flops=2.1e10, peak_gflops=10.0)]
    one = {"runs": [{"engine": "fast", "rows": [r.to_dict() for r in rows]}]}
    gaps = {r[2]: r for r in rep.gap_rows(one)}
    assert gaps["gen decode"][7] == "3.90" and gaps["train backward"][7] == "2.00"
    assert gaps["**step total**"][6] == "3.81" and gaps["**step total**"][7] == "5.90"
    (line,) = rep.target_lines(one)
    assert "**3.81x** (target 1.5x: not met)" in line and "largest gap is gen decode: 3.90 s" in line
