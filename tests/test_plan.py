"""`basis-lite plan`: a table for every preset, estimates that move the right way, the warning on a small card, the
GPU preset headers, and the arithmetic behind the parts (parameter counts from a real model; the 4-bit weight size
from a real bitsandbytes NF4 load). What no test here can check: the estimate against a measured GPU peak."""
from __future__ import annotations

import re

import pytest
import torch
from conftest import cli_main

from basis_lite.config import list_presets, load_config, preset_path
from basis_lite.model.shape import ModelShape, model_shape, shape_from_config_json
from basis_lite.plan import build_plan, estimate_memory, header_gpu_memory, standby_utilization

GPU_PRESETS = ["colab-t4-qwen2.5-1.5b-gsm8k", "gpu-8gb", "gpu-12gb", "gpu-24gb"]


def test_plan_all_prints_a_table_for_every_preset(capsys):
    assert cli_main("plan", "--all") == 0
    out = capsys.readouterr().out
    presets = list_presets()
    for name in presets:
        assert f"== {name}:" in out, name
    assert out.count("total (estimated peak)") == len(presets)
    assert "NOT YET CHECKED on a GPU" in out and "ONE measured run only" in out
    # every GPU preset fits the card its header names, by the estimate
    for name in GPU_PRESETS:
        block = out.split(f"== {name}:")[1].split("\n\n")[0]
        assert re.search(r"card: [\d.]+ GiB \(preset header\); fits", block), block


def test_plan_single_preset_with_overrides(capsys):
    assert cli_main("plan", "--preset", "gpu-8gb", "--set", "train.micro_batch_size=1") == 0
    out = capsys.readouterr().out
    assert "micro-batch 1 x 512 tokens" in out and "WARNING" not in out


@pytest.mark.parametrize("preset", ["gpu-8gb", "colab-t4-qwen2.5-1.5b-gsm8k"])
def test_estimates_grow_with_batch_and_sequence_length(preset):
    base = estimate_memory(load_config(preset))["total"]
    for more in (["train.micro_batch_size=8", "model.max_seq_length=1024"],
                 ["model.max_seq_length=1024"], ["train.micro_batch_size=16"]):
        assert estimate_memory(load_config(preset, more))["total"] > base, more
    # without a card size the vLLM KV cache is sized by the sequences in flight: more prompts, more memory
    small = estimate_memory(load_config(preset, ["train.batch_size=16"]))["total"]
    big = estimate_memory(load_config(preset, ["train.batch_size=128"]))["total"]
    assert big > small
    # and the hf engine's KV cache grows with its generate() batch
    def hf_kv(extra):
        parts = estimate_memory(load_config(preset, ["generation.engine=hf"] + extra))
        return next(v for k, v in parts.items() if k.startswith("generation: HF KV cache"))

    assert hf_kv(["generation.batch_size=128", "train.batch_size=128"]) > hf_kv(["generation.batch_size=8"])


def test_warning_and_suggestions_on_a_small_card(capsys):
    assert cli_main("plan", "--preset", "colab-t4-qwen2.5-1.5b-gsm8k", "--gpu-memory", "5") == 0  # still exit 0
    out = capsys.readouterr().out
    assert "WARNING: colab-t4-qwen2.5-1.5b-gsm8k is estimated at" in out and "more than the 5 GiB card" in out
    sugg = re.findall(r"--set (\S+)=(\S+)  -> ([\d.]+) GiB", out)
    assert sugg and all(float(total) <= 5 for _, _, total in sugg)
    assert any(k == "train.micro_batch_size" for k, _, _ in sugg)
    # a card so small that vLLM's share cannot even hold the weights is called out whatever the total
    assert cli_main("plan", "--preset", "gpu-8gb", "--gpu-memory", "2.5") == 0
    assert "vLLM will refuse to start" in capsys.readouterr().out


def test_gpu_preset_headers():
    for name in GPU_PRESETS:
        text = preset_path(name).read_text()
        header = [line for line in text.splitlines() if line.startswith("#")]
        assert not header[0].startswith("# Launch") and len(header[0]) > 20  # a title line first
        assert f"# Launch: basis-lite train --preset {name}" in text
        assert "NOT YET MEASURED ON A GPU" in text
        assert header_gpu_memory(name) in (8, 12, 15, 24)
        cfg = load_config(name)  # unknown keys would be rejected here
        assert cfg.device == "cuda" and cfg.model.load_in_4bit and cfg.generation.engine == "vllm"
        assert cfg.estimator.name == "basis" and cfg.estimator.rollouts_per_prompt == 1
        # the header's memory figure is the plan's estimate (to within rounding)
        m = re.search(r"Memory \(basis-lite plan\): ~([\d.]+) GiB", text)
        est = build_plan(cfg, header_gpu_memory(name)).total
        assert m and abs(float(m.group(1)) - est) <= 0.15 * est, (name, m and m.group(1), est)
    t4 = load_config("colab-t4-qwen2.5-1.5b-gsm8k")
    assert t4.model.dtype == "float16" and t4.model.name == "Qwen/Qwen2.5-1.5B-Instruct"  # T4: no bf16
    assert t4.data.dataset == "gsm8k" and t4.estimator.prior_samples == 4
    assert 32 <= t4.train.batch_size <= 64 and 256 <= t4.generation.max_new_tokens <= 384


def test_plain_vllm_costs_a_16bit_copy_and_standby_frees_the_kv_cache():
    shared = estimate_memory(load_config("gpu-12gb"), 12)
    plain = estimate_memory(load_config("gpu-12gb", ["model.backend=hf"]), 12)
    assert "generation: vLLM's own 16-bit base weights" in plain
    assert plain["generation: vLLM's own 16-bit base weights"] == pytest.approx(3.09e9 * 2 / 2**30, rel=0.02)
    standby = build_plan(load_config("gpu-24gb", ["model.unsloth_standby=true"]), 24)
    assert any("Unsloth overrides gpu_memory_utilization" in n for n in standby.notes)
    assert standby_utilization(24) == pytest.approx(0.825 * 0.95) and standby_utilization(15) == pytest.approx(0.76)
    assert shared["total"] < 12


def test_shape_arithmetic_matches_a_real_model(tmp_path):
    """Parameter counts of the shape formula equal a real (tiny, random) Qwen2 model's linear/embedding params."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    for tied in (True, False):
        config = Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=300, tie_word_embeddings=tied)
        model = Qwen2ForCausalLM(config)
        folder = tmp_path / f"q{tied}"
        model.config.save_pretrained(folder)
        shape = shape_from_config_json(folder / "config.json")
        linear = sum(m.weight.numel() for n, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and n != "lm_head")
        emb = sum(p.numel() for p in {id(p): p for p in [model.get_input_embeddings().weight,
                                                          model.get_output_embeddings().weight]}.values())
        assert shape.linear_params == linear and shape.embedding_params == emb


def test_known_shapes_and_local_config(tmp_path):
    s, src = model_shape("Qwen/Qwen2.5-1.5B-Instruct")
    assert src == "built-in table" and 1.50e9 < s.params < 1.56e9  # Qwen2.5-1.5B: 1.54B
    assert 7.5e9 < model_shape("unsloth/Qwen2.5-7B-Instruct-bnb-4bit")[0].params < 7.7e9  # 7.61B
    assert 3.0e9 < model_shape("Qwen/Qwen2.5-3B-Instruct")[0].params < 3.15e9  # 3.09B
    assert 1.2e9 < model_shape("meta-llama/Llama-3.2-1B-Instruct")[0].params < 1.26e9  # 1.24B
    assert 0.13e9 < model_shape("HuggingFaceTB/SmolLM2-135M-Instruct")[0].params < 0.14e9
    from basis_lite.config import ConfigError

    with pytest.raises(ConfigError, match="no shape known"):
        model_shape("someone/unknown-model")
    from basis_lite.model.loading import builtin_tiny_random_dir

    local, src = model_shape(str(builtin_tiny_random_dir()))
    assert src.startswith("config.json in") and local.hidden == 64 and local.layers == 2


def test_plan_cache_root_matches_models(tmp_path, monkeypatch):
    """plan.py reads the built-in model's config.json from the same cache folder as models.py, for every way of
    setting it (one torch-free cache_root, in config.py)."""
    from basis_lite.model.loading import cache_root
    from basis_lite.model.shape import cache_root as _cache_root

    for env in ({"BASIS_LITE_CACHE": str(tmp_path / "a")}, {"XDG_CACHE_HOME": str(tmp_path / "xdg")}, {}):
        for key in ("BASIS_LITE_CACHE", "XDG_CACHE_HOME"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        for cache_dir in ("", str(tmp_path / "given")):
            assert _cache_root(cache_dir) == cache_root(cache_dir), (env, cache_dir)


def test_plan_reads_the_builtin_models_converted_folder(tmp_path):
    """The folder model/loading.py converts the built-in SmolLM2 into (its current cache version) is where plan
    looks; a config.json there wins over the built-in table (a changed shape shows)."""
    import json

    from basis_lite.model.downloads import SMOLLM2_CACHE_DIR

    folder = tmp_path / SMOLLM2_CACHE_DIR
    folder.mkdir()
    cfg = {"hidden_size": 576, "num_hidden_layers": 7, "num_attention_heads": 9, "num_key_value_heads": 3,
           "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}
    (folder / "config.json").write_text(json.dumps(cfg))
    shape, src = model_shape("builtin:smollm2-135m-instruct", str(tmp_path))
    assert shape.layers == 7 and src == f"config.json in {folder}"
    assert model_shape("builtin:smollm2-135m-instruct", str(tmp_path / "empty"))[1] == "built-in table"


def test_4bit_weight_estimate_matches_bitsandbytes(tmp_path):
    """The 'base weights' part against what bitsandbytes NF4 (double quant) really stores, on a CPU load."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "m")
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", quantization_config=q, dtype=torch.bfloat16,
                                                 device_map={"": "cpu"})
    stored = 0
    for n, p in model.named_parameters():
        if "norm" in n:
            continue
        stored += p.numel() * p.element_size()
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            stored += qs.absmax.numel() * qs.absmax.element_size()
            if qs.state2 is not None:
                stored += qs.state2.absmax.numel() * qs.state2.absmax.element_size()
    cfg = load_config("smoke", [f"model.name={tmp_path / 'm'}", "model.load_in_4bit=true", "model.dtype=bfloat16"])
    est = next(v for k, v in estimate_memory(cfg).items() if k.startswith("base weights")) * 2**30
    assert est == pytest.approx(stored, rel=0.05)


def test_model_shape_dataclass_describe():
    s = ModelShape("x", 8, 1, 2, 1, 4, 16, 10, True)
    assert "params" in s.describe() and s.kv_bytes_per_token(2) == 2 * 1 * 1 * 4 * 2


def test_the_eval_batch_is_a_generation_phase_of_its_own():
    """The HF engine's eval decodes min(eval_batch_size, eval_size) rows of the prompt room + eval_max_new_tokens:
    its KV cache is counted by those, and the generation phase is the larger of the eval's and the rollouts'."""
    from basis_lite.config import load_config
    from basis_lite.model.shape import KNOWN_SHAPES
    from basis_lite.plan import GIB, build_plan

    shape = KNOWN_SHAPES["smollm2-135m"]
    base = ["model.dtype=float32", "model.max_seq_length=160", "generation.max_new_tokens=48"]

    def plan(extra):
        return build_plan(load_config("cpu-smollm2-arith", base + extra), shape=shape, shape_source="test")

    p = plan(["train.eval_batch_size=150", "data.eval_size=150", "train.eval_max_new_tokens=48"])
    (key,) = [k for k in p.parts if k.startswith("eval: HF KV cache")]
    assert "150 greedy sequences x 160 tokens" in key
    assert p.parts[key] == pytest.approx((150 * 160 * shape.kv_bytes_per_token(4) + 150 * shape.vocab * 8) / GIB)
    # 320 eval tokens: the prompt room (160 - 48) + 320; fewer rows than the batch when the eval set is smaller
    longer = plan(["train.eval_batch_size=150", "data.eval_size=100", "train.eval_max_new_tokens=320"])
    assert any(k.startswith("eval: HF KV cache (100 greedy sequences x 432 tokens") for k in longer.parts)
    assert longer.total > p.total and any("smaller train.eval_batch_size" in n for n in longer.notes)
    # an eval smaller than a rollout batch does not raise the peak; no eval, no eval part
    tiny = plan(["train.eval_batch_size=1"])
    none = plan(["data.eval_size=0"])
    assert not any(k.startswith("eval:") for k in none.parts) and tiny.total == pytest.approx(none.total)


def test_eapo_doubles_the_hf_generation_rows():
    """EAPO injection decodes a prior row beside every policy row: the HF generation phase holds twice the KV cache
    and logits."""
    from basis_lite.config import load_config
    from basis_lite.plan import estimate_memory

    base = ["generation.engine=hf", "model.backend=hf"]
    plain = estimate_memory(load_config("gpu-8gb", base))
    eapo = estimate_memory(load_config("gpu-8gb", base + ["eapo.prior_adapter=runs/earlier/adapter"]))
    (ka,) = [k for k in plain if k.startswith("generation: HF KV cache")]
    (kb,) = [k for k in eapo if k.startswith("generation: HF KV cache")]
    assert "EAPO" in kb and "EAPO" not in ka
    assert eapo[kb] == pytest.approx(2 * plain[ka])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_cpu_weight_copies_match_the_decoder(dtype):
    """On the CPU the engine table picks the fast path (engines/__init__.py: fast_cpu, memory model kv_cache with
    weight copies); the plan's copies equal what FastDecoder builds on the tiny model, merged fp32 linears + the
    oneDNN head copy, or 16-bit fused linears + fp32 LoRA factors."""
    from basis_lite.engines.fast_cpu import FastDecoder
    from basis_lite.model.loading import load_policy
    from basis_lite.plan import fast_cpu_copies

    if dtype == torch.float32 and not torch.backends.mkldnn.is_available():
        pytest.skip("the fp32 head copy is a oneDNN tensor")
    cfg = load_config("smoke", ["device=cpu", f"model.dtype={str(dtype)[6:]}"])
    model, _ = load_policy(cfg, torch.device("cpu"), dtype)
    shape, _ = model_shape(cfg.model.name)
    copies, _ = fast_cpu_copies(shape, 4 if dtype == torch.float32 else 2, cfg.lora.r, cfg.lora.target_modules)
    assert copies == FastDecoder(model).extra_bytes
    plan = build_plan(cfg)
    assert plan.engine.startswith("hf with the fast CPU path")
    (part,) = [v for k, v in plan.parts.items() if k.startswith("generation: fast CPU path's weight copies")]
    assert part == pytest.approx(copies / 2**30)
    for off in (["generation.fast_cpu=off"], ["model.load_in_4bit=true"]):  # generate(): no copies
        other = build_plan(load_config("smoke", ["device=cpu", *off]))
        assert not any("weight copies" in k for k in other.parts) and other.engine.startswith("hf (")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_activation_estimate_matches_autograds_saved_tensors(dtype):
    """The plan's per-layer activation bytes on the CPU (plan.layer_activation_bytes, without checkpointing) against
    the unique storages autograd really keeps for the backward of one padded micro-batch of the tiny model through
    the trainer's log-prob pass: sdpa's per-head mask in fp32; eager attention's softmax and the adapters' 16-bit
    inputs over a bf16 base (peft's own fp32 input copies, which model/lora.py removes, would read 1.26x here)."""
    from basis_lite.losses.policy import sequence_logprobs
    from basis_lite.model.loading import load_policy, training_attention
    from basis_lite.plan import layer_activation_bytes

    cfg = load_config("smoke", ["device=cpu", f"model.dtype={str(dtype)[6:]}", "model.gradient_checkpointing=false"])
    model, _ = load_policy(cfg, torch.device("cpu"), dtype)
    model.train()
    shape, _ = model_shape(cfg.model.name)
    b, T = 4, 192
    torch.manual_seed(0)
    ids = torch.randint(5, shape.vocab, (b, T))
    attention = torch.ones(b, T, dtype=torch.long)
    attention[1, :T // 4] = 0  # a padded row: the kernels then see a mask
    completion = torch.zeros(b, T, dtype=torch.long)
    completion[:, T // 2:] = 1
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with training_attention(model), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sequence_logprobs(model, ids, attention, completion, chunk_size=128)
    measured = sum(saved.values())
    estimate = shape.layers * b * T * layer_activation_bytes(shape, dtype.itemsize, T, cuda=False)
    assert 0.9 * measured <= estimate <= 1.15 * measured, (estimate, measured)


def test_cpu_plan_bounds_the_measured_whole_job_peaks():
    """`basis-lite plan` on the CPU against whole-job peak RSS measured on this kind of machine: bench/cost_scaling.py's
    points (budget 48-256 tokens, 16-64 rollouts, SmolLM2-135M and -360M shapes) and every basis-lite run of the
    committed comparisons (default-dev, default-confirm: 48 tokens; wordproblems-confirm: 320). Never below a
    measured peak, and at most 80 % above (every micro-batch is sized at model.max_seq_length, the eval's KV cache
    at its full length; real rows are shorter)."""
    import json
    from pathlib import Path

    from basis_lite.model.shape import KNOWN_SHAPES

    results = Path(__file__).resolve().parent.parent / "bench/results"
    points = sorted((results / "scaling-wordproblems/points").glob("*.json"))
    assert len(points) >= 7
    for f in points:
        rec = json.loads(f.read_text())
        overrides = [o for o in rec["overrides"] if not o.startswith(("model.name=shapes:", "reward.functions="))]
        overrides.append("train.eval_batch_size=1")  # the points' evals held one problem (cost_scaling --eval-limit 1)
        shape = KNOWN_SHAPES[rec["model"].split(":")[1]] if rec["model"].startswith("shapes:") else None
        plan = build_plan(load_config(rec["preset"], overrides), shape=shape, shape_source="test")
        measured = rec["arms"]["basis"]["peak_rss_mb"] / 1024
        assert measured <= plan.total <= 1.8 * measured, (f.name, plan.total, measured)
    runs = [json.loads(f.read_text()) for name in ("default-dev", "default-confirm", "wordproblems-confirm")
            for f in sorted((results / name / "runs").glob("*/seed*/summary.json"))]
    runs = [s for s in runs if not s["arm"].startswith("trl")]  # TRL's trainers: not what the plan estimates
    assert len(runs) >= 60 and any(s["overrides"].count("generation.max_new_tokens=320") for s in runs)
    for s in runs:
        plan = build_plan(load_config(s["preset"], s["overrides"]))
        measured = s["peak_rss_mb"] / 1024
        assert measured <= plan.total <= 1.8 * measured, (s["arm"], s["seed"], plan.total, measured)


def _max_rss_gib(path) -> float:
    """GiB from a committed `/usr/bin/time -v` output."""
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", path.read_text())
    assert m, path
    return int(m.group(1)) / 2**20


def test_cpu_auto_dtype_note_follows_the_cpus_native_bf16_flags(monkeypatch):
    """On the CPU, dtype auto is counted in float32 either way; without native bf16 the note says float32 is what
    runs, with it the note adds the bfloat16 table's total and the peak of auto's one-time dtype timing."""
    import basis_lite.plan as plan

    cfg = load_config(None, [])
    assert cfg.device == "cpu" and cfg.model.dtype == "auto"
    fp32 = build_plan(load_config(None, ["model.dtype=float32"])).total
    bf16 = build_plan(load_config(None, ["model.dtype=bfloat16"])).total
    assert bf16 < fp32

    monkeypatch.setattr(plan, "cpu_bf16_flags", lambda: ())
    p = build_plan(cfg)
    note = [n for n in p.notes if n.startswith("model.dtype auto")]
    assert p.total == pytest.approx(fp32) and len(note) == 1
    assert "float32 on this CPU" in note[0] and "GiB" not in note[0]

    monkeypatch.setattr(plan, "cpu_bf16_flags", lambda: ("avx512_bf16",))
    p = build_plan(cfg)
    note = [n for n in p.notes if n.startswith("model.dtype auto")]
    assert p.total == pytest.approx(fp32) and len(note) == 1
    assert "avx512_bf16" in note[0] and f"about {bf16:.2f} GiB then" in note[0]
    assert f"peaks at about {plan.dtype_probe_estimate():.2f} GiB" in note[0]
    gpu = build_plan(load_config("gpu-8gb", []), 8.0)
    assert not any(n.startswith("model.dtype auto") for n in gpu.notes)


def test_bf16_and_dtype_probe_estimates_bound_the_measured_peaks():
    """The note's two figures against the whole-job peaks (time -v) committed from a 2-core avx512_bf16 EPYC: the
    default job in bf16 after the dtype timing was cached (default_run/v8-avx512bf16/lora-inputs), the timing alone
    (v9-first-run/probe-after-*), and a first job, timing included (v9-first-run/first-run.txt); and the same two
    jobs on a 2-core Intel Xeon with AMX, which peak higher (v10-amx/cached, v10-amx/first-run). Never below the
    measured peak, at most 80 % above, as for the float32 runs above."""
    from pathlib import Path

    from basis_lite.plan import dtype_probe_estimate

    runs = Path(__file__).resolve().parent.parent / "bench/results/default_run"
    bf16 = build_plan(load_config(None, ["model.dtype=bfloat16"])).total
    probe = dtype_probe_estimate()
    later = _max_rss_gib(runs / "v8-avx512bf16/lora-inputs/time-v.txt")
    assert later <= bf16 <= 1.8 * later, (bf16, later)
    probes = [_max_rss_gib(f) for f in sorted((runs / "v9-first-run").glob("probe-after-*.txt"))]
    assert len(probes) == 2
    for measured in probes:
        assert measured <= probe <= 1.8 * measured, (probe, measured)
    first = _max_rss_gib(runs / "v9-first-run/first-run.txt")
    assert first <= max(bf16, probe) <= 1.8 * first, (bf16, probe, first)
    amx_later = _max_rss_gib(runs / "v10-amx/cached/time-v.txt")
    assert amx_later <= bf16 <= 1.8 * amx_later, (bf16, amx_later)
    amx_first = _max_rss_gib(runs / "v10-amx/first-run/time-v.txt")
    assert amx_first <= max(bf16, probe) <= 1.8 * amx_first, (bf16, probe, amx_first)
