"""Real GPU checks (marker `gpu`): deselected by default, skipped where torch sees no CUDA device.

Run on a CUDA machine with `python -m pytest -m gpu -x -q`. Everything is on the tiny random model (no download):
  * 4-bit NF4 (bitsandbytes, CUDA kernels): LoRA gradients through Linear4bit after a generate() match those of a
    full-precision model holding the dequantized weights;
  * fp16 loss scaling with torch's CUDA GradScaler: the scaled update equals the unscaled one, an overflow is
    skipped by the scaler and not counted as a bad step;
  * the HF engine's generate with the KV cache gives the same greedy tokens as without it, on the 4-bit model;
  * the Unsloth backend (when unsloth imports): one real RL step (generate, score, update) moves the adapter.
Nothing here is faked. The CPU twins of the first two are tests/model/test_bnb_cpu.py and tests/losses/test_loss_scaling.py.
"""
from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")]

CUDA = torch.device("cuda")
PROMPT = "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"


def _cfg(*overrides):
    from basis_lite.config import load_config

    return load_config("smoke", ["device=cuda", "model.backend=hf", *overrides])


def test_4bit_cuda_lora_gradients_match_the_dequantized_model():
    bnb = pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from basis_lite.model.loading import load_policy, resolve_model_path

    cfg = _cfg("model.load_in_4bit=true", "model.dtype=float32")
    torch.manual_seed(0)
    model, tok = load_policy(cfg, CUDA, torch.float32)
    layers = {n.replace(".base_layer", ""): m for n, m in model.get_base_model().named_modules()
              if isinstance(m, bnb.nn.Linear4bit)}
    assert layers and next(iter(layers.values())).weight.device.type == "cuda"
    ref = AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg.model.name), dtype=torch.float32).to(CUDA)
    ref_mods = dict(ref.named_modules())
    for name, m in layers.items():
        w = bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state).float()
        ref_mods[name].weight.data.copy_(w.view_as(ref_mods[name].weight))
    ref = get_peft_model(ref, LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=0.0,
                                         target_modules=cfg.lora.target_modules, task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(1)
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_((torch.randn(p.shape, generator=g) * 0.1).to(p.device))
                ref_params[n].copy_(p)
    enc = tok([PROMPT], return_tensors="pt", add_special_tokens=False).to(CUDA)
    model.eval()
    with torch.no_grad():
        model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    ids = torch.randint(0, 250, (2, 24), generator=g).to(CUDA)

    def grads(m):
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.detach().float().clone() for n, p in m.named_parameters() if "lora_" in n}

    ga, gr = grads(model), grads(ref)
    assert ga.keys() == gr.keys() and ga
    cos = {n: torch.nn.functional.cosine_similarity(ga[n].flatten(), gr[n].flatten(), dim=0).item() for n in ga}
    worst = min(cos, key=cos.get)
    assert cos[worst] > 0.99, (worst, cos[worst])


def _rollouts(n=4):
    from basis_lite.engines.base import Rollout

    g = torch.Generator().manual_seed(1)
    return [Rollout(prompt="", prompt_ids=torch.randint(0, 250, (5,), generator=g).tolist(),
                    completion_ids=torch.randint(0, 250, (4 + i,), generator=g).tolist(), text="", finished=True)
            for i in range(n)]


def _lora(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_fp16_loss_scaling_on_cuda():
    from basis_lite.model.loading import load_policy
    from basis_lite.rl.update import make_optimizer, policy_update

    cfg = _cfg("train.micro_batch_size=2", "train.lr=1e-2", "model.dtype=float32")
    torch.manual_seed(0)
    model, tok = load_policy(cfg, CUDA, torch.float32)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.1)
    model2 = copy.deepcopy(model)
    rolls, adv = _rollouts(), torch.tensor([1.0, -0.5, 0.25, -1.0])
    opt1, opt2 = make_optimizer(cfg, model, CUDA), make_optimizer(cfg, model2, CUDA)
    before = _lora(model)
    s1, ok1 = policy_update(cfg, model, opt1, rolls, adv, tok.pad_token_id, CUDA)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12)
    s2, ok2 = policy_update(cfg, model2, opt2, rolls, adv, tok.pad_token_id, CUDA, scaler=scaler)
    assert ok1 and ok2
    a, b = _lora(model), _lora(model2)
    assert any(not torch.equal(before[n], a[n]) for n in a)
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=1e-5, rtol=1e-4)
    # an overflow: the scaler skips the step and backs off; not a bad (NaN) step
    opt3 = make_optimizer(cfg, model2, CUDA)
    before = _lora(model2)
    big = torch.amp.GradScaler("cuda", init_scale=2.0**100)
    _, ok = policy_update(cfg, model2, opt3, rolls, torch.tensor([1e30, -1e30, 1e30, -1e30]), tok.pad_token_id,
                          CUDA, scaler=big)
    assert ok and big.get_scale() < 2.0**100
    assert all(torch.equal(before[n], v) for n, v in _lora(model2).items())


def test_hf_engine_cached_generate_equals_uncached_on_4bit():
    pytest.importorskip("bitsandbytes")
    from basis_lite.engines.base import params_from_config
    from basis_lite.engines.hf import HFEngine
    from basis_lite.model.loading import inference_mode, load_policy

    cfg = _cfg("model.load_in_4bit=true", "model.dtype=float16")
    torch.manual_seed(0)
    model, tok = load_policy(cfg, CUDA, torch.float16)
    engine = HFEngine(model, tok, batch_size=8)
    params = params_from_config(cfg.generation, greedy=True, max_new_tokens=12)
    rolls = engine.generate([PROMPT, PROMPT.replace("3 + 4", "12 + 30")], params, with_features=True)
    assert all(r.feature is not None and torch.isfinite(r.feature).all() for r in rolls)
    for r in rolls:
        ids = torch.tensor([r.prompt_ids], device=CUDA)
        with inference_mode(model):
            ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                 do_sample=False, use_cache=False, pad_token_id=tok.pad_token_id,
                                 eos_token_id=engine.stop_ids, temperature=None, top_p=None, top_k=None)
        expected = ref[0, ids.shape[1]:].tolist()
        assert r.completion_ids == expected[:len(r.completion_ids)] and len(r.completion_ids) > 0


def tiny_with_distinct_pad(folder):
    """A copy of builtin:tiny-random whose pad token is its `~~` special token instead of its eos <|im_end|>.

    Unsloth refuses a tokenizer whose pad equals its eos when the vocabulary holds no other pad-like token (it adds
    one, finds no embedding row for it and raises); real checkpoints carry one (SmolLM2's <|endoftext|>), the tiny
    byte-level tokenizer does not."""
    import json
    import shutil

    from basis_lite.model.loading import TINY_MERGED, builtin_tiny_random_dir

    shutil.copytree(builtin_tiny_random_dir(), folder)
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "pad_token": TINY_MERGED}))
    return folder


@pytest.mark.skipif(importlib.util.find_spec("unsloth") is None, reason="unsloth is not installed")
def test_unsloth_backend_one_rl_step_moves_the_adapter(tmp_path):
    from basis_lite.engines.base import params_from_config
    from basis_lite.rl.update import make_optimizer, policy_update
    from basis_lite.runtime import build_policy, seed_everything

    cfg = _cfg(f"model.name={tiny_with_distinct_pad(tmp_path / 'tiny')}", "model.backend=unsloth",
               "model.load_in_4bit=true", "model.fast_inference=false", "generation.engine=hf", "train.lr=1e-2")
    seed_everything(0)
    model, tok, engine = build_policy(cfg, CUDA, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    rollouts = engine.generate([PROMPT] * 4, params_from_config(cfg.generation), with_features=False)
    assert len(rollouts) == 4 and all(r.completion_ids for r in rollouts)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.1)
    before = _lora(model)
    opt = make_optimizer(cfg, model, CUDA)
    stats, ok = policy_update(cfg, model, opt, rollouts, torch.tensor([1.0, -1.0, 0.5, -0.5]), tok.pad_token_id, CUDA)
    assert ok and stats["grad_norm"] > 0
    assert any(not torch.equal(before[n], v) for n, v in _lora(model).items())
