"""4-bit NF4 on the CPU: LoRA gradients through bitsandbytes' Linear4bit after a generate() are the gradients of the
dequantized model (basis_lite.model.loading.disable_bnb_cpu_packing), and without that workaround they are not."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")


def _has_avx512_bf16() -> bool:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in info and bool(bnb.functional.has_avx512bf16())


def _lora_grads_after_generate(keep_workaround: bool) -> dict[str, float]:
    """Cosine similarity per LoRA parameter between the 4-bit model's gradient (after a generate() in eval mode)
    and the gradient of a full-precision model holding the dequantized weights and the same LoRA weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from basis_lite.config import load_config
    from basis_lite.model.loading import load_policy, resolve_model_path

    cfg = load_config("smoke", ["model.load_in_4bit=true"])
    torch.manual_seed(0)
    model, tok = load_policy(cfg, torch.device("cpu"), torch.float32)
    layers = {n.replace(".base_layer", ""): m for n, m in model.get_base_model().named_modules()
              if isinstance(m, bnb.nn.Linear4bit)}
    assert layers, "nothing was quantized"
    q = next(iter(layers.values())).weight.quant_state
    assert q.quant_type == "nf4" and q.nested  # NF4 with double quantization
    assert all(m.support_avx512bf16_for_cpu is False for m in layers.values())  # the workaround is applied
    if not keep_workaround:
        for m in layers.values():
            m.support_avx512bf16_for_cpu = True

    # reference: the same base in fp32 with each quantized weight replaced by its dequantized value
    ref = AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg.model.name), dtype=torch.float32)
    ref_mods = dict(ref.named_modules())
    for name, m in layers.items():
        w = bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state).float()
        ref_mods[name].weight.data.copy_(w.view_as(ref_mods[name].weight))
    ref = get_peft_model(ref, LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=0.0,
                                         target_modules=cfg.lora.target_modules, task_type="CAUSAL_LM"))
    # the same non-zero LoRA weights in both (a fresh lora_B = 0 would zero every lora_A gradient)
    g = torch.Generator().manual_seed(1)
    ref_params = dict(ref.named_parameters())
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert lora and all(p.requires_grad for p in lora.values())
    with torch.no_grad():
        for n, p in lora.items():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            ref_params[n].copy_(p)

    # generate first (eval mode, no grad): this is where bitsandbytes may repack the weights for its CPU kernel
    enc = tok(["<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"], return_tensors="pt",
              add_special_tokens=False)
    model.eval()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > enc.input_ids.shape[1]

    ids = torch.randint(0, 250, (2, 24), generator=g)

    def grads(m):
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.detach().clone() for n, p in m.named_parameters() if "lora_" in n}

    ga, gr = grads(model), grads(ref)
    assert ga.keys() == gr.keys()
    for n in ga:
        assert gr[n].abs().sum() > 0, n
    return {n: torch.nn.functional.cosine_similarity(ga[n].flatten(), gr[n].flatten(), dim=0).item() for n in ga}


def test_4bit_lora_gradients_match_the_dequantized_model():
    cos = _lora_grads_after_generate(keep_workaround=True)
    worst = min(cos, key=cos.get)
    assert cos[worst] > 0.99, (worst, cos[worst])


@pytest.mark.skipif(not _has_avx512_bf16(), reason="the CPU has no avx512_bf16: bitsandbytes never repacks")
def test_without_the_workaround_gradients_after_generate_are_wrong():
    """Proves the check above can fail, and that disable_bnb_cpu_packing matters on this CPU."""
    cos = _lora_grads_after_generate(keep_workaround=False)
    worst = min(cos, key=cos.get)
    assert cos[worst] < 0.99, f"gradients stayed right without the workaround (worst cos {cos[worst]:.4f})"
