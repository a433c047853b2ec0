"""bench/cpu_step.py's pure parts: the FLOP formulas against a hand count (the fast CPU engine's included), the rows'
ratio math, the tables, the results merge, the CPU-flag parsing, the prefill/decode accounting of its forward hooks
on the tiny model, and the fast engine's recorder against what its decoder computed there. No timing is
asserted."""
from __future__ import annotations

import importlib.util
import sys

import pytest
from conftest import REPO

SCRIPT = REPO / "bench" / "cpu_step.py"


@pytest.fixture(scope="module")
def cs():
    spec = importlib.util.spec_from_file_location("bench_cpu_step", SCRIPT)
    m = importlib.util.module_from_spec(spec)
    sys.modules["bench_cpu_step"] = m
    spec.loader.exec_module(m)
    return m


# the shape of builtin:tiny-random: hidden 64, 2 layers, 4 heads of 16, 2 KV heads, MLP 128, vocab 256 + 3
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=259)


def test_shape_counts_by_hand(cs):
    s = cs.Shape.from_config(TINY)
    assert s.head_dim == 16
    # per layer: q 64x64, k 64x32, v 64x32, o 64x64, gate/up 64x128, down 128x64
    assert s.linear_params == 2 * (4096 + 2048 + 2048 + 4096 + 8192 + 8192 + 8192) == 73728
    assert s.head_params == 64 * 259
    assert s.attn_width == 4 * 16 * 2
    # LoRA r=4 on all seven linears: r*(in+out) = 4*(128+96+96+128+192+192+192) per layer
    assert s.lora_params(4) == 2 * 4096 == 8192
    assert s.lora_params(4, ["q_proj", "v_proj"]) == 2 * 4 * (128 + 96)
    assert cs.causal_pairs(10) == 55 and cs.causal_pairs(1) == 1


def test_flop_formulas_by_hand(cs):
    s = cs.Shape.from_config(TINY)
    n, pairs, head, lora = 10, 55, 4, 8192  # one sequence of 10 positions, 4 completion tokens through lm_head
    fwd = 2 * 73728 * 10 + 2 * 8192 * 10 + 4 * 128 * 55 + 2 * 16576 * 4
    assert cs.forward_flops(s, n, pairs, head, lora) == fwd == 1799168
    bwd = 2 * 73728 * 10 + 4 * 8192 * 10 + 8 * 128 * 55 + 4 * 16576 * 4
    assert cs.backward_flops(s, n, pairs, head, lora) == bwd == 2123776
    recompute = 2 * 73728 * 10 + 2 * 8192 * 10 + 4 * 128 * 55  # the decoder again, no lm_head
    assert cs.backward_flops(s, n, pairs, head, lora, recompute=True) == bwd + recompute
    # a pass that stops after layer 1 of 2 (BASIS features for vLLM): half the decoder, no lm_head
    assert cs.forward_flops(s, n, pairs, 0, lora, layers=1) == (2 * 73728 * 10 + 2 * 8192 * 10 + 4 * 128 * 55) / 2


def test_row_ratio_math_and_cells(cs):
    r = cs.Row(variant="float32, gc on", engine="hf", dtype="float32", gc="on", part="train total", seconds=2.0,
               tokens=100, flops=4e9, peak_gflops=10.0, rss_peak_mb=1234.4)
    assert r.tokens_per_s == 50 and r.gflops_per_s == pytest.approx(2.0) and r.peak_ratio == pytest.approx(0.2)
    cells = dict(zip(cs.TABLE_COLUMNS, cs.row_cells(r)))
    assert cells["tok/s"] == "50.0" and cells["GFLOP"] == "4.0" and cells["GFLOP/s"] == "2.00"
    assert cells["% peak"] == "20.0" and cells["RSS MB"] == "1234"
    d = r.to_dict()
    assert d["peak_ratio"] == pytest.approx(0.2) and cs.Row.from_dict(d) == r
    empty = cs.Row(variant="v", engine="hf", dtype="float32", gc="-", part="reward", seconds=0.5)
    assert empty.tokens_per_s is None and empty.gflops_per_s is None and empty.peak_ratio is None
    assert dict(zip(cs.TABLE_COLUMNS, cs.row_cells(empty)))["% peak"] == "-"
    assert cs.Row(variant="v", engine="hf", dtype="f", gc="-", part="p", seconds=1.0, flops=1e9).peak_ratio is None
    # 4 GFLOP at a 10 GFLOP/s peak: 0.4 s of roofline; 2.0 s measured is 5x it
    assert r.roofline_s == pytest.approx(0.4) and r.x_roofline == pytest.approx(5.0) and cells["x roofline"] == "5.00"
    assert empty.roofline_s is None and empty.x_roofline is None


def test_memory_breakdown_adds_up_to_the_measured_peak(cs):
    rows = cs.memory_breakdown(baseline_mb=300.0, weights_mb=500.0, lora_mb=20.0, optimizer_mb=40.0,
                               activations_mb=900.0, head_rows=256, vocab=1024, kv_cache_mb=50.0, startup_peak=900.0,
                               gen_peak=1200.0, train_peak=2000.0)
    by = {r["component"]: r["mb"] for r in rows}
    assert by["LoRA weights + gradients"] == 40.0
    assert by["log-prob head working set"] == pytest.approx(3 * 256 * 1024 * 4 / 2**20)  # 3 MB
    parts = ("process baseline", "frozen weights", "LoRA weights + gradients", "AdamW moments",
             "activations saved for backward", "log-prob head working set", "allocator and other (update)")
    assert sum(by[k] for k in parts) == pytest.approx(2000.0)
    doc = {"runs": [{"dtype": "float32", "engine": "fast", "overrides": [], "memory": rows}]}
    assert ["float32", "fast", "peak: update", "2000", "measured"] in cs.memory_rows(doc)


def test_cpu_flags_and_model(cs):
    text = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx2 fma avx512f avx512_bf16\n"
    assert cs.parse_cpu_flags(text) == {"avx2": True, "fma": True, "avx512f": True, "avx512_bf16": True,
                                        "amx_bf16": False}
    assert cs.parse_cpu_model(text) == "AMD EPYC"
    assert not any(cs.parse_cpu_flags("flags: sse sse2").values())


def _run(cs, engine, dtype, gen_s, tokens, overrides=(), startup=None):
    rows = [cs.Row(variant=dtype, engine=engine, dtype=dtype, gc="-", part="gen total", seconds=gen_s,
                   tokens=tokens, flops=1e9, peak_gflops=10.0).to_dict(),
            cs.Row(variant=f"{dtype}, gc off", engine=engine, dtype=dtype, gc="off", part="train total", seconds=4.0,
                   flops=2e10, peak_gflops=10.0).to_dict(),
            cs.Row(variant=f"{dtype}, gc off", engine=engine, dtype=dtype, gc="off", part="step total",
                   seconds=gen_s + 4.0).to_dict()]
    if startup is not None:
        rows.insert(0, cs.Row(variant=dtype, engine=engine, dtype=dtype, gc="-", part="startup",
                              seconds=startup).to_dict())
    machine = {"cpu_model": "X", "cores": 2, "cpu_flags": {"avx2": True, "avx512_bf16": False},
               "torch": "2.x", "torch_cpu_capability": "AVX2", "torch_threads": 2, "git_commit": "abc",
               "loadavg_start": [1.0], "loadavg_end": [1.5]}
    return {"engine": engine, "dtype": dtype, "overrides": list(overrides), "gc": ["off"], "rows": rows,
            "command": "python bench/cpu_step.py", "created": f"2000-01-01 00:00:0{len(rows)}", "machine": machine,
            "peak": {"best": {dtype: 10.0}, "gemms": [{"dtype": dtype, "shape": [8, 8, 8], "layout": "a@b",
                                                      "gflops": 10.0}]},
            "batch": {"prompts": 4, "rollouts_per_prompt": 1, "max_new_tokens": 8, "temperature": 1.0,
                      "micro_batch_size": 4, "lora_r": 4, "lora_params": 8192}}


def test_merge_comparison_and_markdown(cs):
    hf = _run(cs, "hf", "float32", 10.0, 200)
    old_vllm = _run(cs, "vllm", "float32", 9.0, 200, startup=30.0)
    doc = cs.merge_runs(None, [hf, old_vllm])
    new_vllm = _run(cs, "vllm", "float32", 5.0, 200, startup=40.0)
    small = _run(cs, "hf", "float32", 3.0, 50, overrides=["train.batch_size=8"])
    doc = cs.merge_runs(doc, [new_vllm, small])
    assert [(r["engine"], r["overrides"]) for r in doc["runs"]] == [
        ("hf", []), ("vllm", []), ("hf", ["train.batch_size=8"])]
    assert doc["runs"][1] is new_vllm  # same (engine, dtype, overrides): replaced
    cmp_rows = cs.engine_comparison(doc)
    by = {(r[0], r[1]): r for r in cmp_rows}
    assert by[("float32", "vllm")][2] == "5.00" and by[("float32", "vllm")][4] == "40.0"  # 200 tokens / 5 s
    assert by[("float32", "vllm")][5] == "40.0" and by[("float32", "vllm")][6] == "2.00x"  # HF 10 s / vLLM 5 s
    assert by[("float32", "hf")][6] == "-"
    assert ("float32 [train.batch_size=8]", "hf") in by
    summary = cs.step_summary(doc)
    assert ["float32, gc off", "hf", "10.0", "4.0", "14.0", "5.00", "50.0", "-", "-", "-", "-"] in summary
    md = cs.render_markdown(doc)
    for text in ("avx2 yes", "avx512_bf16 no", "git commit abc", "| variant | engine | part |",
                 "engines side by side", "train.batch_size=8"):
        assert text in md, text


def test_choose_variants(cs):
    assert cs.choose_variants("float32", False, "hf", None, None) == (["float32", "bfloat16"], ["off", "on"])
    assert cs.choose_variants("bfloat16", True, "vllm", None, None) == (["bfloat16", "float32"], ["on"])
    assert cs.choose_variants("float32", True, "hf", "float32", "off") == (["float32"], ["off"])
    with pytest.raises(SystemExit):
        cs.choose_variants("float32", True, "hf", "float16", None)
    with pytest.raises(SystemExit):
        cs.choose_variants("float32", True, "hf", None, "maybe")


def test_peak_skips_a_gemm_predicted_too_slow(cs, monkeypatch):
    monkeypatch.setattr(cs, "PEAK_SKIP_S", 0.0)  # any larger shape is "too slow" once a smaller one was timed
    p = cs.measure_peak(dtypes=("float32",), shapes=((16, 16, 16), (32, 32, 32)), layouts=("a@b", "a@w.T"),
                        repeats=2)
    done = [g for g in p["gemms"] if "gflops" in g]
    skipped = [g for g in p["gemms"] if "gflops" not in g]
    assert [g["shape"] for g in done] == [[16, 16, 16]] * 2 and [g["shape"] for g in skipped] == [[32, 32, 32]] * 2
    assert all("skipped" in g["note"] for g in skipped)
    assert p["best"]["float32"] == max(g["gflops"] for g in done) > 0


def test_forward_recorder_splits_prefill_and_decode(cs):
    """On the tiny model: one prefill over the left-padded prompts (one lm_head row each), then one decode call per
    further token, each over every row and the whole cache."""
    import torch
    from transformers import AutoModelForCausalLM

    from basis_lite.model.loading import builtin_tiny_random_dir, load_tokenizer

    path = str(builtin_tiny_random_dir())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = load_tokenizer(path)
    enc = tok(["What is 1 + 2?", "Hi"], return_tensors="pt", padding=True, add_special_tokens=False)
    B, T = enc.input_ids.shape
    shape = cs.Shape.from_config(model.config)
    rec = cs.ForwardRecorder(model)
    try:
        with torch.no_grad():
            model.generate(**enc, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    finally:
        rec.remove()
    s = rec.summary(shape, lora=0)
    assert s["prefill"]["calls"] == 1 and s["decode"]["calls"] == 3
    assert s["prefill"]["positions"] == B * T and s["prefill"]["real"] == int(enc.attention_mask.sum())
    assert s["prefill"]["flops"] == cs.forward_flops(shape, B * T, B * cs.causal_pairs(T), B, 0)
    assert s["decode"]["positions"] == 3 * B
    # decode step j (1-based) over T + j keys
    assert s["decode"]["flops"] == sum(cs.forward_flops(shape, B, B * (T + j), B, 0) for j in (1, 2, 3))
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_vllm_generation_flops_by_hand(cs):
    s = cs.Shape.from_config(TINY)
    # two prompts of 3 and 5 tokens, n=1; completions of 2 and 1 tokens: one decode step (prompt 3, over 4 keys)
    f = cs.vllm_generation_flops(s, [3, 5], [2, 1], 1, lora=0)
    assert f["prefill_tokens"] == 8 and f["decode_tokens"] == 1
    assert f["prefill_flops"] == cs.forward_flops(s, 3, 6, 1) + cs.forward_flops(s, 5, 15, 1)
    assert f["decode_flops"] == cs.forward_flops(s, 1, 4, 1) == 2 * 73728 + 4 * 128 * 4 + 2 * 16576
    # n=2: both sequences of the first prompt decode over that prompt's length
    f2 = cs.vllm_generation_flops(s, [3, 5], [2, 3, 1, 1], 2, lora=0)
    assert f2["decode_tokens"] == 3
    one = cs.forward_flops
    assert f2["decode_flops"] == one(s, 1, 4, 1) + one(s, 1, 4, 1) + one(s, 1, 5, 1)


def test_fast_generation_flops_by_hand(cs):
    """Two rows of 5 and 3 prompt tokens sharing a 2-token prefix; completions of 3 and 1 tokens."""
    s = cs.Shape.from_config(TINY)
    f = cs.fast_generation_flops(s, [5, 3], 2, [3, 1], lora=0)
    # prefix: 2 positions at batch 1, 2 x 2 attention pairs, no lm_head row
    assert f["prefix_positions"] == 2 and f["prefix_calls"] == 1
    assert f["prefix_flops"] == 2 * 73728 * 2 + 4 * 128 * 4 == 296960
    # prompt: S = 5 - 2 = 3 suffix slots per row (the 1-token suffix padded to 3), each query over 2 + 3 slots
    assert f["prompt_positions"] == 6 and f["prompt_tokens"] == 8
    assert f["prompt_flops"] == 2 * 73728 * 6 + 4 * 128 * 6 * 5 + 2 * 16576 * 2 == 966400
    # decode: row 0 runs 2 single-token steps over 6 and 7 slots; row 1 stopped after its first token: none
    assert f["decode_positions"] == 2 and f["decode_calls"] == 2
    assert f["decode_flops"] == 2 * 2 * 73728 + 4 * 128 * (6 + 7) + 2 * 2 * 16576 == 367872
    # no shared prefix: no prefix pass, S = the longest prompt; LoRA beside the weights adds 2*R per position
    g = cs.fast_generation_flops(s, [4, 2], 0, [2, 2], lora=100)
    assert g["prefix_flops"] == 0 and g["prefix_calls"] == 0 and g["prompt_positions"] == 8
    assert g["prompt_flops"] == cs.forward_flops(s, 8, 2 * 4 * 4, 2, 100)
    assert g["decode_flops"] == 2 * cs.forward_flops(s, 1, 5, 1, 100)


def test_fast_lora_width_and_merge_by_hand(cs):
    s = cs.Shape.from_config(TINY)
    # r=4, all linears, per layer: qkv 3*4*(64 + 64+32+32), o 4*(64+64), gate|up 2*4*(64 + 256), down 4*(128+64)
    per_layer = 3 * 4 * 192 + 4 * 128 + 2 * 4 * 320 + 4 * 192
    assert cs.fast_lora_width(s, 4) == 2 * per_layer == 2 * 6144
    assert cs.fast_lora_width(s, 4) > s.lora_params(4)  # the block-diagonal B's zero blocks are multiplied too
    # q and v only: one group of 2 adapted linears, whose fused output is still q|k|v
    assert cs.fast_lora_width(s, 4, ["q_proj", "v_proj"]) == 2 * 2 * 4 * (64 + 128)
    # merge W + s*B@A: 2*r*in*out per adapted linear = 2*r*P
    assert cs.fast_merge_flops(s, 4) == 2 * 4 * 73728
    assert cs.fast_merge_flops(s, 4, ["q_proj"]) == 2 * 4 * 2 * 64 * 64


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fast_recorder_matches_what_the_decoder_computed(cs, dtype):
    """On the tiny model with LoRA: the recorder splits the fast engine's generate into the prefix, prompt and
    decode forwards with the shapes `fast_generation_flops` counts (rows leaving the batch at different steps), and
    the adapter width it assumes over a 16-bit base is the decoder's own buffers'. The wrappers come off after."""
    import torch

    from basis_lite.config import load_config
    from basis_lite.engines.base import SamplingParams
    from basis_lite.engines.fast_cpu import FastDecoder
    from basis_lite.engines.hf import HFEngine
    from basis_lite.model.loading import load_policy

    torch.set_num_threads(1)
    dt = getattr(torch, dtype)
    cfg = load_config("smoke", [f"model.dtype={dtype}", "model.max_seq_length=256"])
    model, tok = load_policy(cfg, torch.device("cpu"), dt)
    system = "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
    prompts = [f"{system}<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
               for q in ("What is 1 + 2?", "Hi", "Compute 12 * 7, then add 5.")]
    engine = HFEngine(model, tok, batch_size=16)
    dec = engine.fast_decoder()
    assert dec is not None, engine.fast_cpu_fallback
    # per-prompt seeds: the same samples in both calls below, different ones across rows
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seeds=[11, 12, 13])
    free = engine.generate(prompts, params)
    # a token some rows sample early made a stop token: rows leave the batch at different steps
    stop = max(sorted({t for r in free for t in r.completion_ids}),
               key=lambda t: len({next((i for i, x in enumerate(r.completion_ids) if x == t), None) for r in free}))
    engine.stop_ids = sorted({*engine.stop_ids, stop})
    shape = cs.Shape.from_config(model.get_base_model().config)
    lora_w = 0 if dec.merged else cs.fast_lora_width(shape, cfg.lora.r, cfg.lora.target_modules)
    rec = cs.FastRecorder(dec)
    try:
        rolls = engine.generate(prompts, params)
    finally:
        rec.remove()
    merge = cs.fast_merge_flops(shape, cfg.lora.r, cfg.lora.target_modules)
    s = rec.summary(shape, lora_w, merge if dec.merged else 0.0)
    lens = [len(r.completion_ids) for r in rolls]
    assert len(set(lens)) > 1 and s["checked"]
    assert s["generate_calls"] == 1 and rec.gens[0]["completion_lens"] == lens
    P = rec.gens[0]["prefix"]
    assert P >= len(tok(system, add_special_tokens=False).input_ids)
    assert s["prefix"]["calls"] == 1 and s["prefix"]["positions"] == P
    assert s["decode"]["calls"] == max(lens) - 1 and s["decode"]["positions"] == sum(c - 1 for c in lens)
    # the FLOPs from the recorded shapes, call by call, equal the analytic count
    calls = rec.gens[0]["calls"]
    by_shape = sum(cs.forward_flops(shape, c["rows"] * c["new"], c["rows"] * c["new"] * (c["slot0"] + c["new"]),
                                    c.get("head_rows", 0), lora_w) for c in calls)
    assert by_shape == pytest.approx(s["prefix"]["flops"] + s["prompt"]["flops"] + s["decode"]["flops"], rel=1e-12)
    assert s["weights"]["rebuilds"] == 1 and s["weights"]["flops"] == (merge if dec.merged else 0.0)
    if not dec.merged:  # the fused adapter buffers the decoder multiplies, [A; A; ...] and block-diagonal s*B
        dec.refresh(force=True)
        per_pos = sum(g.lora[0].numel() + g.lora[1].numel() for e in dec.layers for g in e["groups"] if g.lora)
        dec.release()
        assert lora_w == per_pos
    for name in ("refresh", "_forward", "_logits", "generate"):
        assert name not in vars(dec)
    import basis_lite.engines.fast_cpu as fmod

    assert fmod._common_prefix.__name__ == "_common_prefix"
    assert isinstance(dec, FastDecoder)


def test_engines_caps_and_the_roofline_gap(cs):
    assert cs.parse_engines("fast,hf,fast") == ["fast", "hf"]
    with pytest.raises(SystemExit):
        cs.parse_engines("turbo")
    env = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "X": "1"}
    caps = cs.kernel_caps(env)
    assert set(caps) == set(cs.CAP_VARIABLES) and cs.caps_tag(caps) == " [kernels<=AVX2]" and cs.caps_tag({}) == ""
    # a capped run of the same (engine, dtype) is kept beside the uncapped one; engines sort fast, hf, vllm
    fast = _run(cs, "fast", "float32", 4.0, 200)
    capped = dict(_run(cs, "fast", "float32", 6.0, 200), kernel_caps=caps)
    doc = cs.merge_runs(None, [capped, _run(cs, "hf", "float32", 10.0, 200), fast])
    assert [(r["engine"], bool(r.get("kernel_caps"))) for r in doc["runs"]] == [
        ("fast", False), ("hf", False), ("fast", True)]
    # the gap: gen total 4 s with 1 GFLOP at 10 GFLOP/s (0.1 s of roofline), train 4 s with 20 GFLOP (2 s)
    rows = [cs.Row(variant="float32", engine="fast", dtype="float32", gc="-", part="gen decode", seconds=4.0,
                   flops=1e9, peak_gflops=10.0),
            cs.Row(variant="float32, gc off", engine="fast", dtype="float32", gc="off", part="train backward",
                   seconds=4.0, flops=2e10, peak_gflops=10.0),
            cs.Row(variant="float32, gc off", engine="fast", dtype="float32", gc="off", part="step total",
                   seconds=8.0, flops=2.1e10, peak_gflops=10.0)]
    one = {"runs": [{"engine": "fast", "rows": [r.to_dict() for r in rows]}]}
    gaps = {r[2]: r for r in cs.gap_rows(one)}
    assert gaps["gen decode"][7] == "3.90" and gaps["train backward"][7] == "2.00"
    assert gaps["**step total**"][6] == "3.81" and gaps["**step total**"][7] == "5.90"
    (line,) = cs.target_lines(one)
    assert "**3.81x** (target 1.5x: not met)" in line and "largest gap is gen decode: 3.90 s" in line
