"""The HF engine's fast CPU path (engines/fast_cpu.py) against plain generate() and the trainer, on the tiny model:
base weights never written, log-probs equal to the trainer's re-scoring, greedy and seeded output equal to
generate()'s on the same weights, finished rows leaving the batch, the shared prefix, and the fallbacks."""
from __future__ import annotations

import pytest
import torch
from conftest import bench_module, trainer_logprobs

from basis_lite.config import load_config
from basis_lite.engines.base import SamplingParams
from basis_lite.engines.fast_cpu import FastDecoder
from basis_lite.engines.hf import HFEngine
from basis_lite.engines.seeded import stream_seed
from basis_lite.errors import ConfigError
from basis_lite.model.loading import load_policy
from basis_lite.rl.update import make_optimizer, policy_update

CPU = torch.device("cpu")
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
QUESTIONS = ["What is 1 + 2?", "Solve for x: 3x + 4 = 19. Show work.", "Hi", "What is 12 * 7?", "Name a prime.",
             "Compute 5 - 9."]
# chat prompts sharing a system prompt and the user header: the fast path prefills that prefix once
PROMPTS = [f"{SYSTEM}<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in QUESTIONS]


def _policy(dtype=torch.float32, seed: int = 0):
    torch.set_num_threads(1)
    # the chat prompts are ~100-130 tokens of the byte-level tiny tokenizer: room for them in the update
    cfg = load_config("smoke", [f"model.dtype={str(dtype).split('.')[-1]}", "model.max_seq_length=256"])
    model, tok = load_policy(cfg, CPU, dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # move the adapter off zero, so policy and base differ; A drawn here too (its init reads
        for n, p in model.named_parameters():  # the global RNG), so the model is the same whatever ran before
            if "lora_A" in n:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return cfg, model, tok


@pytest.fixture(scope="module")
def policy():
    return _policy()


def _engines(model, tok, **kw):
    fast, plain = HFEngine(model, tok, **kw), HFEngine(model, tok, fast_cpu="off", **kw)
    assert fast.fast_decoder() is not None, fast.fast_cpu_fallback
    assert plain.fast_decoder() is None and plain.fast_cpu_fallback
    return fast, plain




def _top2_margin(model, prompt_ids, completion, at):
    """The gap between the two largest logits of the reference model before completion token `at`."""
    ids = torch.tensor([prompt_ids + completion[:at]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def _assert_same_tokens(model, got, want):
    """Equal token lists; where they part, the reference's top-2 logits were within fp32 rounding of each other
    (matmuls of other shapes may order a near-tie either way), which a wrong weight or cache could not give."""
    for g, w in zip(got, want):
        assert g.prompt_ids == w.prompt_ids
        if g.completion_ids != w.completion_ids:
            at = next(i for i, (a, b) in enumerate(zip(g.completion_ids, w.completion_ids)) if a != b)
            margin = _top2_margin(model, w.prompt_ids, w.completion_ids, at)
            assert margin < 1e-4, (at, margin, g.completion_ids, w.completion_ids)


def test_greedy_equals_generate_with_stops_rows_leaving_and_shared_prefix(policy):
    """Greedy output of the fast path is generate()'s on the same weights (the live adapter), with rows that stop
    at different steps (a frequent token made a stop token, as the random model never says EOS), prompt features
    and log-probs to fp32 rounding."""
    _, model, tok = policy
    fast, plain = _engines(model, tok, batch_size=16)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    free = plain.generate(PROMPTS, params)

    def outcomes(t):  # where each row would stop with t as a stop token (None: it would not)
        return {next((i for i, x in enumerate(r.completion_ids) if x == t), None) for r in free}

    stop = max(sorted({t for r in free for t in r.completion_ids}), key=lambda t: len(outcomes(t)))
    for e in (fast, plain):
        e.stop_ids = sorted({*e.stop_ids, stop})
    want = plain.generate(PROMPTS, params)
    got = fast.generate(PROMPTS, params)
    lengths = {len(r.completion_ids) for r in want}
    assert len(lengths) > 1 and any(r.finished for r in want)  # rows left the batch at different steps
    _assert_same_tokens(model, got, want)
    for g, w in zip(got, want):
        assert g.finished == w.finished and g.text == w.text
        if g.completion_ids == w.completion_ids:
            assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-4
        torch.testing.assert_close(g.feature, w.feature, atol=1e-4, rtol=1e-4)
    assert _prefix_len(fast, PROMPTS) >= len(tok(SYSTEM, add_special_tokens=False).input_ids)


def _prefix_len(engine, prompts):
    from basis_lite.engines.fast_cpu import _common_prefix

    enc = engine._encode(prompts)
    rows = [ids[m.bool()].tolist() for ids, m in zip(enc.input_ids, enc.attention_mask)]
    return _common_prefix(rows, min(len(r) for r in rows) - engine.feature_tokens)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8)])
def test_seeded_sampling_equals_generate_and_ignores_the_batch(policy, temperature, top_k, top_p):
    """Per-prompt streams: the fast path draws each row's k-th token from the k-th uniform vector of its own
    generator, as generate()'s seeded sampler does, so both give the same completions; and a prompt's completions
    do not depend on the batch or the chunking it came in."""
    _, model, tok = policy
    fast, plain = _engines(model, tok, batch_size=16)
    seeds = [stream_seed(7, "t", i) for i in range(len(PROMPTS))]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=10, n=2, seeds=seeds)
    got = fast.generate(PROMPTS, params)
    _assert_same_tokens(model, got, plain.generate(PROMPTS, params))
    assert got[0].completion_ids != got[1].completion_ids  # two samples of one prompt differ
    fast.batch_size = 2  # one prompt per call
    torch.manual_seed(123)  # the global RNG plays no part
    chunked = fast.generate(PROMPTS, params)
    alone = fast.generate(PROMPTS[3:4], SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                                       max_new_tokens=10, n=2, seeds=seeds[3:4]))
    assert [r.completion_ids for r in chunked] == [r.completion_ids for r in got]
    assert [r.completion_ids for r in alone] == [r.completion_ids for r in got[6:8]]


@pytest.mark.parametrize("temperature,top_k,seeded", [(0.7, 0, False), (1.3, 5, True), (0.0, 0, False)])
def test_logprobs_equal_the_trainer_rescoring_after_updates(temperature, top_k, seeded):
    """After optimizer steps (the adapter moved, the engine re-merges on its own) the engine's log-prob of every
    token is the trainer's log softmax(logits / T) of a full forward, within 1e-4; at another temperature they
    differ (the check can tell)."""
    cfg, model, tok = _policy(seed=1)
    fast = HFEngine(model, tok, batch_size=16)
    opt = make_optimizer(load_config("smoke", ["model.dtype=float32", "train.lr=0.05"]), model, CPU)
    seeds = [stream_seed(3, "t", i) for i in range(len(PROMPTS))] if seeded else None
    params = SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=8, n=2 if temperature else 1,
                            seeds=seeds)
    for step in range(3):
        torch.manual_seed(step)
        fast.sync(model)
        rolls = fast.generate(PROMPTS, params)
        scale = temperature or 1.0
        for r, w, o in zip(rolls, trainer_logprobs(model, tok, rolls, scale), trainer_logprobs(model, tok, rolls, 2 * scale)):
            got = torch.tensor(r.logprobs)
            assert len(got) == len(r.completion_ids) > 0
            assert (got - w).abs().max().item() <= 1e-4, (step, got, w)
            assert (got - o).abs().max().item() > 1e-2
        adv = torch.linspace(-1, 1, len(rolls))
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        model.train()
        policy_update(cfg, model, opt, rolls, adv, tok.pad_token_id, CPU)
        assert any(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_base_weights_stay_bit_identical_over_syncs_steps_and_evals(dtype):
    """The fast path reads the frozen base and never writes it: after repeated sync + rollout + optimizer step +
    greedy eval, every base weight equals the loaded one bit for bit, while the rollouts follow the moving adapter."""
    cfg, model, tok = _policy(dtype, seed=2)
    loaded = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert loaded and all("lora_" not in n for n in loaded)
    fast = HFEngine(model, tok, batch_size=16)
    opt = make_optimizer(load_config("smoke", ["train.lr=0.05"]), model, CPU)
    texts = []
    for step in range(6):
        fast.sync(model)
        rolls = fast.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=6))
        model.train()
        policy_update(cfg, model, opt, rolls, torch.linspace(-1, 1, len(rolls)), tok.pad_token_id, CPU)
        texts.append([r.completion_ids for r in fast.generate(PROMPTS, SamplingParams(temperature=0.0,
                                                                                      max_new_tokens=6))])
        assert fast._fast._key is None and fast._fast.head.wm is None  # copies freed after each generate()
    assert texts[0] != texts[-1]  # the adapter moved and greedy output followed it
    for n, p in model.named_parameters():
        if n in loaded:
            assert p.dtype == loaded[n].dtype and torch.equal(p.detach(), loaded[n]), n


def test_bf16_base_keeps_a_small_adapter_update():
    """Over a bf16 base the adapter runs beside the base weights in float32 instead of being rounded into them: an
    adapter change far below a bf16 weight's resolution still changes the rollout's log-probs, as it changes the
    trainer's."""
    _, model, tok = _policy(torch.bfloat16, seed=3)
    fast = HFEngine(model, tok, batch_size=16)
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    a = fast.generate(PROMPTS[:2], params)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(1.0 + 2 ** -12)  # relative change ~2e-4: less than half a bf16 ulp of every base weight
    b = fast.generate(PROMPTS[:2], params)
    assert any(x.logprobs != y.logprobs for x, y in zip(a, b))


def test_disabled_adapter_samples_the_base(policy):
    """Inside peft's `with model.disable_adapter():` (the BASIS prior, `basis-lite eval --base`) the fast path samples
    the base model, as generate() does there; after it, the adapter again."""
    _, model, tok = policy
    fast, plain = _engines(model, tok, batch_size=16)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    with_adapter = fast.generate(PROMPTS, params)
    with model.disable_adapter():
        base = fast.generate(PROMPTS, params)
        _assert_same_tokens(model, base, plain.generate(PROMPTS, params))
    assert [r.logprobs for r in base] != [r.logprobs for r in with_adapter]
    assert [r.logprobs for r in fast.generate(PROMPTS, params)] == [r.logprobs for r in with_adapter]


def test_sampling_under_inference_mode_gives_no_grad_s_values_and_ordinary_features(policy):
    """generate() samples under torch.inference_mode: the same tokens, log-probs and features as the same loop under
    no_grad, and the features it hands out are ordinary tensors (a caller may change them in place)."""
    _, model, tok = policy
    dec = FastDecoder(model)
    rows = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    kw = dict(stop_ids={tok.eos_token_id}, temperature=0.0, feature_layer=1)
    toks, lps, feats, finite = dec.generate(rows, 8, **kw)
    with torch.no_grad():
        want = dec._sample(rows, 8, kw["stop_ids"], 0.0, 1.0, 0, None, 1, 4)
    assert (toks, lps, finite) == (want[0], want[1], want[3])
    assert torch.equal(feats, want[2])
    assert not torch.is_inference(feats)
    feats.add_(1)  # an inference tensor would raise here


def test_fallbacks_trajectory_and_unsupported_models(policy, monkeypatch):
    """Trajectory features and fast_cpu=off take generate(); a model the fast path does not implement says why."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from basis_lite.engines import fast_cpu

    _, model, tok = policy
    fast = HFEngine(model, tok, batch_size=16)
    assert fast.fast_decoder() is not None

    def boom(*_a, **_k):
        raise AssertionError("fast path used")

    monkeypatch.setattr(fast_cpu.FastDecoder, "generate", boom)
    rolls = fast.generate(PROMPTS[:2], SamplingParams(temperature=1.0, max_new_tokens=4), with_trajectory=True)
    assert all(r.trajectory is not None for r in rolls)
    with pytest.raises(AssertionError, match="fast path used"):
        fast.generate(PROMPTS[:2], SamplingParams(temperature=1.0, max_new_tokens=4))
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert "gpt2" in fast_cpu.why_not(gpt2)
    with pytest.raises(ValueError, match="auto, off"):
        HFEngine(model, tok, fast_cpu="yes")


def test_config_key_generation_fast_cpu(policy):
    from basis_lite.runtime import make_engine

    _, model, tok = policy
    assert load_config("smoke").generation.fast_cpu == "auto"
    cfg = load_config("smoke", ["generation.fast_cpu=off"])
    eng = make_engine(cfg, model, tok)
    assert eng.fast_decoder() is None and "off" in eng.fast_cpu_fallback
    assert load_config("smoke", ["generation.fast_cpu=false"]).generation.fast_cpu == "off"
    assert load_config("smoke", ["generation.fast_cpu=true"]).generation.fast_cpu == "auto"
    with pytest.raises(ConfigError, match="generation.fast_cpu.*auto.*off"):
        load_config("smoke", ["generation.fast_cpu=fast"])


def test_bench_generation_runs_both_paths_on_the_tiny_model(tmp_path):
    """bench/generation.py end to end on the smoke preset: both engines measured in one run, the tables written
    (no timing asserted)."""
    import json

    m = bench_module("generation.py")
    assert m.main(["--preset", "smoke", "--dtypes", "float32", "--repeats", "1", "--step", "--out",
                   str(tmp_path)]) == 0
    res = json.loads((tmp_path / "generation.json").read_text())
    (d,) = res["dtypes"]
    assert set(d["best"]) == {"fast", "generate"} and d["best"]["fast"]["tokens"] > 0
    assert d["merged_extra_mb"] > 0 and set(res["steps"]["float32"]) == {"fast", "generate"}
    md = (tmp_path / "generation.md").read_text()
    assert "fast path" in md and "generate()" in md and "avx2" in md


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smollm2_fast_path_equals_generate_on_the_default_batch(dtype):
    """SmolLM2 on 16 prompts of the default task (system prompt, real EOS, rows ending at different steps): greedy
    output of the fast path equals generate()'s on the same weights and its log-probs equal the trainer's
    re-scoring within 1e-4 (float32). In bf16 both paths round differently (greedy rows part at near-ties), so the
    check is the mismatch metric: the fast path's log-probs are no further from the trainer's bf16 re-scoring than
    generate()'s are."""
    from basis_lite.data import format_prompt, load_examples

    cfg = load_config("cpu-smollm2-arith", [f"model.dtype={str(dtype).split('.')[-1]}"])
    torch.set_num_threads(2)
    model, tok = load_policy(cfg, CPU, dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # an adapter off zero, as after some training
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 1e-3)
    prompts = [format_prompt(tok, e.question, cfg.data) for e in load_examples(cfg.data, "eval")[:16]]
    fast, plain = _engines(model, tok)
    params = SamplingParams(temperature=0.0, max_new_tokens=48)
    got, want = fast.generate(prompts, params), plain.generate(prompts, params)
    assert sum(r.finished for r in want) >= 8 and len({len(r.completion_ids) for r in want}) > 2
    if dtype == torch.float32:
        _assert_same_tokens(model, got, want)
        for r, w in zip(got, trainer_logprobs(model, tok, got, 1.0)):
            assert (torch.tensor(r.logprobs) - w).abs().max().item() <= 1e-4
    else:
        def mismatch(rolls):
            return torch.cat([(torch.tensor(r.logprobs) - w.float()).abs()
                              for r, w in zip(rolls, trainer_logprobs(model, tok, rolls, 1.0))]).mean().item()

        fast_mm, plain_mm = mismatch(got), mismatch(want)
        assert fast_mm <= 1.5 * plain_mm + 1e-3, (fast_mm, plain_mm)
