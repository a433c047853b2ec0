"""bench/lib, what the bench scripts share: the FLOP formulas against a hand count (and against what the tiny model's
forwards and the fast engine's decoder computed), the machine record's fields, the matmul peak's skip rule, the
report helpers, the eval-curve reader and the value-error bookkeeping. No timing is asserted."""
from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

from bench.lib import curves, flops, matmul_peak, provenance, recorders, report, value_errors

# the shape of builtin:tiny-random: hidden 64, 2 layers, 4 heads of 16, 2 KV heads, MLP 128, vocab 256 + 3
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=259)


# ---- FLOP formulas -------------------------------------------------------------------------------------------------

def test_shape_counts_by_hand():
    s = flops.Shape.from_config(TINY)
    assert s.head_dim == 16
    # per layer: q 64x64, k 64x32, v 64x32, o 64x64, gate/up 64x128, down 128x64
    assert s.linear_params == 2 * (4096 + 2048 + 2048 + 4096 + 8192 + 8192 + 8192) == 73728
    assert s.head_params == 64 * 259
    assert s.attn_width == 4 * 16 * 2
    # LoRA r=4 on all seven linears: r*(in+out) = 4*(128+96+96+128+192+192+192) per layer
    assert s.lora_params(4) == 2 * 4096 == 8192
    assert s.lora_params(4, ["q_proj", "v_proj"]) == 2 * 4 * (128 + 96)
    assert flops.causal_pairs(10) == 55 and flops.causal_pairs(1) == 1
    assert flops.Shape.from_config({**TINY, "head_dim": 8}).head_dim == 8


def test_flop_formulas_by_hand():
    assert flops.matmul_flops(3, 4, 5) == 2 * 3 * 4 * 5
    s = flops.Shape.from_config(TINY)
    n, pairs, head, lora = 10, 55, 4, 8192  # one sequence of 10 positions, 4 completion tokens through lm_head
    fwd = 2 * 73728 * 10 + 2 * 8192 * 10 + 4 * 128 * 55 + 2 * 16576 * 4
    assert flops.forward_flops(s, n, pairs, head, lora) == fwd == 1799168
    bwd = 2 * 73728 * 10 + 4 * 8192 * 10 + 8 * 128 * 55 + 4 * 16576 * 4
    assert flops.backward_flops(s, n, pairs, head, lora) == bwd == 2123776
    recompute = 2 * 73728 * 10 + 2 * 8192 * 10 + 4 * 128 * 55  # the decoder again, no lm_head
    assert flops.backward_flops(s, n, pairs, head, lora, recompute=True) == bwd + recompute
    # a pass that stops after layer 1 of 2 (BASIS features for vLLM): half the decoder, no lm_head
    assert flops.forward_flops(s, n, pairs, 0, lora, layers=1) == (2 * 73728 * 10 + 2 * 8192 * 10 + 4 * 128 * 55) / 2


def test_vllm_generation_flops_by_hand():
    s = flops.Shape.from_config(TINY)
    # two prompts of 3 and 5 tokens, n=1; completions of 2 and 1 tokens: one decode step (prompt 3, over 4 keys)
    f = flops.vllm_generation_flops(s, [3, 5], [2, 1], 1, lora=0)
    assert f["prefill_tokens"] == 8 and f["decode_tokens"] == 1
    assert f["prefill_flops"] == flops.forward_flops(s, 3, 6, 1) + flops.forward_flops(s, 5, 15, 1)
    assert f["decode_flops"] == flops.forward_flops(s, 1, 4, 1) == 2 * 73728 + 4 * 128 * 4 + 2 * 16576
    # n=2: both sequences of the first prompt decode over that prompt's length
    f2 = flops.vllm_generation_flops(s, [3, 5], [2, 3, 1, 1], 2, lora=0)
    assert f2["decode_tokens"] == 3
    one = flops.forward_flops
    assert f2["decode_flops"] == one(s, 1, 4, 1) + one(s, 1, 4, 1) + one(s, 1, 5, 1)


def test_fast_generation_flops_by_hand():
    """Two rows of 5 and 3 prompt tokens sharing a 2-token prefix; completions of 3 and 1 tokens."""
    s = flops.Shape.from_config(TINY)
    f = flops.fast_generation_flops(s, [5, 3], 2, [3, 1], lora=0)
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
    g = flops.fast_generation_flops(s, [4, 2], 0, [2, 2], lora=100)
    assert g["prefix_flops"] == 0 and g["prefix_calls"] == 0 and g["prompt_positions"] == 8
    assert g["prompt_flops"] == flops.forward_flops(s, 8, 2 * 4 * 4, 2, 100)
    assert g["decode_flops"] == 2 * flops.forward_flops(s, 1, 5, 1, 100)


def test_fast_lora_width_and_merge_by_hand():
    s = flops.Shape.from_config(TINY)
    # r=4, all linears, per layer: qkv 3*4*(64 + 64+32+32), o 4*(64+64), gate|up 2*4*(64 + 256), down 4*(128+64)
    per_layer = 3 * 4 * 192 + 4 * 128 + 2 * 4 * 320 + 4 * 192
    assert flops.fast_lora_width(s, 4) == 2 * per_layer == 2 * 6144
    assert flops.fast_lora_width(s, 4) > s.lora_params(4)  # the block-diagonal B's zero blocks are multiplied too
    # q and v only: one group of 2 adapted linears, whose fused output is still q|k|v
    assert flops.fast_lora_width(s, 4, ["q_proj", "v_proj"]) == 2 * 2 * 4 * (64 + 128)
    # merge W + s*B@A: 2*r*in*out per adapted linear = 2*r*P
    assert flops.fast_merge_flops(s, 4) == 2 * 4 * 73728
    assert flops.fast_merge_flops(s, 4, ["q_proj"]) == 2 * 4 * 2 * 64 * 64


def test_lora_of_the_tiny_model_is_the_shapes_count():
    """R counted from the peft model's LoRA matrices equals the formula's r*(in+out) over the adapted linears."""
    import torch

    from basis_lite.config import load_config
    from basis_lite.model.loading import load_policy

    cfg = load_config("smoke", ["model.dtype=float32"])
    model, _tok = load_policy(cfg, torch.device("cpu"), torch.float32)
    shape = flops.Shape.from_config(model.get_base_model().config)
    R, trainable = flops.lora_of_model(model)
    assert R == shape.lora_params(cfg.lora.r, cfg.lora.target_modules) > 0
    assert trainable == sum(p.numel() for p in model.parameters() if p.requires_grad) == R


# ---- recorders: the FLOPs of what the model really ran -------------------------------------------------------------

def test_forward_recorder_splits_prefill_and_decode():
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
    shape = flops.Shape.from_config(model.config)
    rec = recorders.ForwardRecorder(model)
    try:
        with torch.no_grad():
            model.generate(**enc, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    finally:
        rec.remove()
    s = rec.summary(shape, lora=0)
    assert s["prefill"]["calls"] == 1 and s["decode"]["calls"] == 3
    assert s["prefill"]["positions"] == B * T and s["prefill"]["real"] == int(enc.attention_mask.sum())
    assert s["prefill"]["flops"] == flops.forward_flops(shape, B * T, B * flops.causal_pairs(T), B, 0)
    assert s["decode"]["positions"] == 3 * B
    # decode step j (1-based) over T + j keys
    assert s["decode"]["flops"] == sum(flops.forward_flops(shape, B, B * (T + j), B, 0) for j in (1, 2, 3))
    assert not model._forward_hooks and not model._forward_pre_hooks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fast_recorder_matches_what_the_decoder_computed(dtype):
    """On the tiny model with LoRA: the recorder splits the fast engine's generate into the prefix, prompt and
    decode forwards with the shapes `fast_generation_flops` counts (rows leaving the batch at different steps), and
    the adapter width it assumes over a 16-bit base is the decoder's own buffers'. The wrappers come off after."""
    import torch

    import basis_lite.engines.fast_cpu as fmod
    from basis_lite.config import load_config
    from basis_lite.engines.base import SamplingParams
    from basis_lite.engines.fast_cpu import FastDecoder
    from basis_lite.engines.hf import HFEngine
    from basis_lite.model.loading import load_policy

    torch.set_num_threads(1)
    cfg = load_config("smoke", [f"model.dtype={dtype}", "model.max_seq_length=256"])
    model, tok = load_policy(cfg, torch.device("cpu"), getattr(torch, dtype))
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
    shape = flops.Shape.from_config(model.get_base_model().config)
    lora_w = 0 if dec.merged else flops.fast_lora_width(shape, cfg.lora.r, cfg.lora.target_modules)
    rec = recorders.FastRecorder(dec)
    try:
        rolls = engine.generate(prompts, params)
    finally:
        rec.remove()
    merge = flops.fast_merge_flops(shape, cfg.lora.r, cfg.lora.target_modules)
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
    by_shape = sum(flops.forward_flops(shape, c["rows"] * c["new"], c["rows"] * c["new"] * (c["slot0"] + c["new"]),
                                       c.get("head_rows", 0), lora_w) for c in calls)
    assert by_shape == pytest.approx(s["prefix"]["flops"] + s["prompt"]["flops"] + s["decode"]["flops"], rel=1e-12)
    assert s["weights"]["rebuilds"] == 1 and s["weights"]["flops"] == (merge if dec.merged else 0.0)
    # what one forward reads: every dense weight copy of the decoder, built again here to count their bytes
    dec.refresh(force=True)
    built = [g for e in dec.layers for g in e["groups"]] + [dec.head]
    dense = sum((g.w if g.w is not None else g.wm.to_dense()).numel() for g in built)
    dec.release()
    assert s["weight_bytes"] == dense * dec.dtype.itemsize > 0
    if not dec.merged:  # the fused adapter buffers the decoder multiplies, [A; A; ...] and block-diagonal s*B
        dec.refresh(force=True)
        per_pos = sum(g.lora[0].numel() + g.lora[1].numel() for e in dec.layers for g in e["groups"] if g.lora)
        dec.release()
        assert lora_w == per_pos
    for name in ("refresh", "_forward", "_logits", "generate"):
        assert name not in vars(dec)
    assert fmod._common_prefix.__name__ == "_common_prefix"
    assert isinstance(dec, FastDecoder)


def test_patched_and_timer_restore_the_original():
    class Box:
        def f(self, x):
            return x + 1

    orig = Box.f
    acc = {"f": 0.0}
    with recorders.patched(Box, "f", recorders.timer(acc, "f")):
        assert Box.f is not orig and Box().f(1) == 2
    assert Box.f is orig and acc["f"] > 0.0
    with pytest.raises(ZeroDivisionError), recorders.patched(Box, "f", lambda o: lambda self, x: 1 / 0):
        Box().f(1)
    assert Box.f is orig


def test_rss_is_read():
    assert recorders.rss_mb() > 10
    assert recorders.rss_mb(os.getpid()) == pytest.approx(recorders.rss_mb(), rel=0.2)  # another process's, by pid
    child = subprocess.Popen(["sleep", "0"])
    child.wait()
    assert recorders.rss_mb(child.pid) == 0.0  # a process that is gone
    peak = recorders.peak_rss_mb()
    assert peak["peak_rss_mb"] >= recorders.rss_mb() - 1 and peak["peak_rss_mb"] == round(max(
        v for k, v in peak.items() if k != "peak_rss_mb"), 1)


# ---- the matmul peak -----------------------------------------------------------------------------------------------

def test_peak_skips_a_gemm_predicted_too_slow(monkeypatch):
    monkeypatch.setattr(matmul_peak, "PEAK_SKIP_S", 0.0)  # any larger shape is "too slow" once a smaller one was timed
    p = matmul_peak.measure_peak(dtypes=("float32",), shapes=((16, 16, 16), (32, 32, 32)), layouts=("a@b", "a@w.T"),
                                 repeats=2)
    done = [g for g in p["gemms"] if "gflops" in g]
    skipped = [g for g in p["gemms"] if "gflops" not in g]
    assert [g["shape"] for g in done] == [[16, 16, 16]] * 2 and [g["shape"] for g in skipped] == [[32, 32, 32]] * 2
    assert all("skipped" in g["note"] for g in skipped)
    assert p["best"]["float32"] == max(g["gflops"] for g in done) > 0
    # the rate is the matmul's FLOPs over the best call
    assert all(g["gflops"] == pytest.approx(flops.matmul_flops(16, 16, 16) / min(g["seconds"]) / 1e9) for g in done)


def test_bandwidth_is_bytes_over_the_best_call():
    bw = matmul_peak.measure_bandwidth(mib=8, repeats=2)
    n_bytes = 8 * 2**20
    assert bw["read_gbs"] > 0 and bw["read_gbs"] == pytest.approx(n_bytes / min(bw["read_s"]) / 1e9)
    assert bw["copy_gbs"] > 0 and bw["copy_gbs"] == pytest.approx(2 * n_bytes / min(bw["copy_s"]) / 1e9)
    assert bw["threads"] >= 1 and len(bw["read_s"]) >= 1


# ---- the machine record --------------------------------------------------------------------------------------------

LSCPU = "Architecture:  x86_64\nModel name:    AMD EPYC 9R14\nFlags:         fpu sse avx2 fma avx512f avx512_bf16\n"
CPUINFO = "processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: fpu sse avx2 amx_bf16 amx_tile\n"


def test_cpu_flags_and_model_from_lscpu_and_cpuinfo():
    assert provenance.parse_cpu_model(LSCPU) == "AMD EPYC 9R14"
    assert provenance.parse_cpu_flags(LSCPU) == {"avx2": True, "fma": True, "avx512f": True, "avx512_bf16": True,
                                                 "amx_bf16": False, "amx_tile": False}
    assert provenance.parse_cpu_model(CPUINFO) == "Intel Xeon"
    assert [f for f, v in provenance.parse_cpu_flags(CPUINFO).items() if v] == ["avx2", "amx_bf16", "amx_tile"]
    assert provenance.parse_cpu_model("flags: sse") is None and not any(provenance.parse_cpu_flags("x: y").values())


def test_machine_record_fields():
    import torch

    m = provenance.machine_record(("numpy", "no-such-package-here"))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert m["git_commit"] == (head or "unknown") and isinstance(m["git_dirty"], bool)
    assert m["cores"] == os.cpu_count() and 1 <= m["cpus_usable"] <= m["cores"]
    assert list(m["cpu_flags"]) == list(provenance.SPEED_FLAGS) and all(isinstance(v, bool)
                                                                        for v in m["cpu_flags"].values())
    assert m["cpu_model"] and m["python"] and m["platform"]
    assert m["torch"] == torch.__version__ and m["torch_threads"] == torch.get_num_threads()
    assert m["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert m["numpy"] == np.__version__ and m["no-such-package-here"] is None
    assert len(m["loadavg_before"]) == 3 and "loadavg_after" not in m
    assert m["env"] == provenance.measurement_env()
    done = provenance.with_load_after(m)
    assert len(done["loadavg_after"]) == 3 and "loadavg_after" not in m and done["git_commit"] == m["git_commit"]
    json.dumps(done)  # plain JSON


def test_flags_line_reads_the_record_and_older_ones():
    m = {"cpu_model": "X", "cores": 2, "cpu_flags": {"avx2": True, "avx512f": False}}
    assert provenance.flags_line(m) == "X, 2 cores; flags: avx2; without avx512f"
    old = {"cpu": "Y", "cpu_count": 4, "flags": {"avx2": True}}  # vs_trl's records before the shared one
    assert provenance.flags_line(old) == "Y, 4 cores; flags: avx2"
    assert provenance.flags_line({}) == "?, ? cores; flags: -"


def test_header_lines_name_the_machine_commit_state_and_command():
    m = {"cpu_model": "X", "cores": 2, "cpu_flags": {"avx2": True}, "torch": "2.13.0+cpu",
         "git_commit": "0123456789abcdef", "git_dirty": False, "loadavg_before": [1.0], "loadavg_after": [2.0]}
    assert provenance.header_lines(m, "python bench/x.py --a", 2, ", bfloat16") == [
        "- CPU: X, 2 cores; flags: avx2", "- torch 2.13.0+cpu, 2 threads, bfloat16; git 0123456789ab",
        "- command: `python bench/x.py --a`; load average before / after: [1.0] / [2.0]"]
    assert provenance.header_lines({**m, "git_dirty": True}, "c", 1)[1].endswith("git 0123456789ab plus uncommitted "
                                                                                   "changes")


def test_measurement_env_keeps_the_variables_that_change_a_timing_and_no_paths():
    env = {"ATEN_CPU_CAPABILITY": "avx2", "MALLOC_ARENA_MAX": "1", "HOME": "/root", "PATH": "/usr/bin",
           "LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2:/opt/x/libfoo.so"}
    assert provenance.measurement_env(env) == {"ATEN_CPU_CAPABILITY": "avx2", "MALLOC_ARENA_MAX": "1",
                                               "LD_PRELOAD": "libjemalloc.so.2 libfoo.so"}
    assert provenance.measurement_env({"HOME": "/root"}) == {}


def test_machine_facts_are_read_in_bench_lib_only():
    """No bench script reads the load average, the CPU's flags or the commit itself: bench/lib/provenance.py does."""
    pattern = re.compile(r"getloadavg|/proc/cpuinfo|\"lscpu\"|rev-parse|sched_getaffinity")
    readers = [p.name for p in sorted((REPO / "bench").glob("*.py")) if pattern.search(p.read_text())]
    assert readers == []


# ---- report helpers ------------------------------------------------------------------------------------------------

def test_formats_and_tables():
    assert report.fmt(None, ".2f") == "-" and report.fmt(1.234, ".1f") == "1.2"
    assert [report.fmt_seconds(s) for s in (None, 9.994, 10.0, 599.0, 600.0)] == ["-", "9.99 s", "10 s", "599 s",
                                                                                  "10.0 min"]
    assert report.fmt_na(None) == report.fmt_na(float("nan")) == "n/a" and report.fmt_na(0.5, 2) == "0.50"
    assert report.markdown_table(["a", "b"], [[1, "x|y"]]) == "| a | b |\n|---|---|\n| 1 | x/y |"
    assert report.text_table(["a", "long"], [["wide", 1]]).splitlines() == ["a     long", "----  ----", "wide  1"]


def test_write_json_numbers_paths_and_no_leftover(tmp_path):
    import torch

    out = report.write_json(tmp_path / "sub" / "r.json", {"x": np.float32(0.5), "t": torch.tensor(2.0),
                                                          "p": Path("a/b"), "n": [1, 2]})
    assert json.loads(out.read_text()) == {"x": 0.5, "t": 2.0, "p": "a/b", "n": [1, 2]}
    assert [p.name for p in out.parent.iterdir()] == ["r.json"]


# ---- eval curves ---------------------------------------------------------------------------------------------------

def test_first_point_reaching():
    pts = [{"step": s, "clock_s": c, "acc": a} for s, c, a in ((0, 0.0, 0.5), (10, 100.0, 0.7), (20, 200.0, 0.8),
                                                              (30, 300.0, 0.75))]
    assert curves.first_point_reaching(pts, 0.75, key="acc")["step"] == 20
    assert curves.first_point_reaching(pts, 0.70, key="acc")["clock_s"] == 100.0  # equal counts as reached
    assert curves.first_point_reaching(pts, 0.7 - 1e-12, key="acc")["step"] == 10
    assert curves.first_point_reaching(pts, 0.81, key="acc") is None
    assert curves.first_point_reaching(list(reversed(pts)), 0.75, key="acc")["step"] == 20  # by step, not list order


def test_read_run(tmp_path):
    lines = [{"step": 0, "event": "eval", "eval_accuracy": 0.1}, {"step": 1, "generation_s": 1.0},
             {"step": 1, "generation_s": 2.0}, {"step": 1, "event": "eval", "eval_accuracy": 0.2},
             {"step": 1, "event": "eval", "eval_accuracy": 0.3},
             {"step": 1, "event": "eval_final", "eval_accuracy": 0.4}, {"step": 2, "event": "eval"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 3, "gen')
    steps, evals = curves.read_run(tmp_path)
    assert steps == {1: {"step": 1, "generation_s": 2.0}}  # a later line of a step wins; the cut line is skipped
    assert [(e["step"], e["event"], e["eval_accuracy"]) for e in evals] == [
        (0, "eval", 0.1), (1, "eval", 0.3), (1, "eval_final", 0.4)]
    assert curves.read_run(tmp_path / "none") == ({}, [])
    packed = tmp_path / "packed"  # a comparison keeps metrics.jsonl gzipped: read the same
    packed.mkdir()
    with gzip.open(packed / "metrics.jsonl.gz", "wb") as f:
        f.write((tmp_path / "metrics.jsonl").read_bytes())
    assert curves.read_run(packed) == (steps, evals)


# ---- value errors --------------------------------------------------------------------------------------------------

def test_truth_noise_unbiased():
    # with a constant baseline equal to the true value, the corrected squared error averages to ~0
    rng = np.random.default_rng(0)
    v = rng.uniform(0.1, 0.9, 4000)
    pol = (rng.random((4000, 6)) < v[:, None]).astype(float)
    raw, noise = value_errors.sq_err(v, pol, np.zeros_like(pol, dtype=bool))
    assert abs((raw - noise).mean()) < 3e-3
    assert raw.mean() > 0.02


def test_error_sums_by_hand():
    pol = np.array([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]])
    used = np.array([[True, False, False, False], [False, False, False, False]])
    sums = value_errors.ErrorSums(["reinforce_pp"], 3)
    sums.add("reinforce_pp", np.array([0, 2]), np.array([1.0, 0.5]), pol, used)
    sums.count[[0, 2]] += 1
    per, per_raw, per_noise = sums.per_prompt(np.array([0.25, 0.0, 0.2]))
    # row 0: truth = mean of samples 1..3 = 2/3, m = 3; row 1: truth = 1/4, m = 4
    want_raw = [(1 - 2 / 3) ** 2, (0.5 - 0.25) ** 2]
    want_noise = [(2 / 3) * (1 / 3) / 2, 0.25 * 0.75 / 3]
    assert per_raw["reinforce_pp"] == pytest.approx(want_raw) and per_noise["reinforce_pp"] == pytest.approx(want_noise)
    assert per["reinforce_pp"] == pytest.approx(np.subtract(want_raw, want_noise))
    assert per["group_mean_G4"] == pytest.approx([0.25 / 4, 0.2 / 4]) and per["rloo_G2"] == pytest.approx([0.25, 0.2])
