"""Tests for basis_lite.losses.policy: chunked log-probs against the naive full-vocabulary computation, peft/LoRA paths,
and the policy losses against hand computations."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from basis_lite.losses.policy import (
    aggregate,
    bpo_loss,
    chunked_token_logprobs,
    kl_k3,
    masked_mean,
    ppo_clip_loss,
    sequence_logprobs,
)

VOCAB = 300


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float()
    model.eval()  # no dropout; gradients still flow
    return model


@pytest.fixture
def batch():
    """Two right-padded sequences: prompt tokens, then completion tokens, then padding (seq 1 only)."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (2, 10), generator=g)
    attention_mask = torch.ones(2, 10, dtype=torch.long)
    attention_mask[1, 7:] = 0  # padding
    input_ids[1, 7:] = 0
    completion_mask = torch.zeros(2, 10, dtype=torch.long)
    completion_mask[0, 4:] = 1  # 6 completion tokens
    completion_mask[1, 3:7] = 1  # 4 completion tokens
    return input_ids, attention_mask, completion_mask


def naive_logprobs(model, input_ids, attention_mask, completion_mask, temperature=1.0):
    """Full [B, T, V] fp32 log-softmax + gather, the reference."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
    logits = logits[:, :-1] / temperature
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    mask = completion_mask[:, 1:].bool() & attention_mask[:, 1:].bool()
    return lp * mask, ent * mask, mask


def grads_of(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(g1, g2, atol=1e-6, rtol=1e-4):
    assert g1.keys() == g2.keys() and len(g1) > 0
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], atol=atol, rtol=rtol, msg=lambda m: f"{n}: {m}")


# ---------------------------------------------------------------------------------------------------------------
# chunked_token_logprobs / sequence_logprobs
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1000])
def test_sequence_logprobs_match_naive_values_and_grads(tiny_llama, batch, chunk_size):
    model = tiny_llama
    input_ids, attention_mask, completion_mask = batch
    ref_lp, ref_ent, ref_mask = naive_logprobs(model, input_ids, attention_mask, completion_mask)
    weights = torch.linspace(-1.0, 2.0, ref_lp.numel()).view_as(ref_lp)  # a non-trivial downstream loss
    g_ref = grads_of(model, (ref_lp * weights).sum())

    out = sequence_logprobs(model, input_ids, attention_mask, completion_mask, chunk_size=chunk_size,
                            with_entropy=True)
    assert out.logprobs.shape == (2, 9) and out.logprobs.dtype == torch.float32
    assert torch.equal(out.mask, ref_mask)
    assert int(out.mask.sum()) == 6 + 4  # every completion token is predicted from the position before it
    assert not out.mask[1, 6:].any()  # padding excluded
    torch.testing.assert_close(out.logprobs, ref_lp, atol=1e-5, rtol=1e-5)
    assert torch.all(out.logprobs[~out.mask] == 0)
    assert torch.all(out.logprobs[out.mask] < 0)
    torch.testing.assert_close(out.entropy, ref_ent, atol=1e-5, rtol=1e-5)
    assert not out.entropy.requires_grad
    g = grads_of(model, (out.logprobs * weights).sum())
    assert_grads_close(g, g_ref)
    # the lm_head and the body both get gradients
    assert g["lm_head.weight"].abs().sum() > 0 and g["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0


def test_temperature_and_feature_layer(tiny_llama, batch):
    model = tiny_llama
    input_ids, attention_mask, completion_mask = batch
    ref_lp, ref_ent, _ = naive_logprobs(model, input_ids, attention_mask, completion_mask, temperature=0.7)
    with torch.no_grad():
        out = sequence_logprobs(model, input_ids, attention_mask, completion_mask, chunk_size=4, temperature=0.7,
                                with_entropy=True, feature_layer=1)
        hs = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.logprobs, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.entropy, ref_ent, atol=1e-5, rtol=1e-5)
    assert out.hidden_layer.shape == (2, 10, 32)
    torch.testing.assert_close(out.hidden_layer, hs[1])
    assert not out.logprobs.requires_grad


def test_chunked_grads_wrt_hidden_and_head():
    torch.manual_seed(3)
    B, T, H, V = 3, 5, 8, 50
    head = nn.Linear(H, V, bias=True)
    hidden = torch.randn(B, T, H, requires_grad=True)
    targets = torch.randint(0, V, (B, T))
    mask = torch.rand(B, T) > 0.3
    mask[0, 0] = True
    w = torch.randn(B, T)

    lp_ref = torch.log_softmax(head(hidden).float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask
    (lp_ref * w).sum().backward()
    gh_ref, gw_ref, gb_ref = hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()
    for cs in (1, 2, 100):
        hidden.grad = None
        head.zero_grad()
        lp, ent = chunked_token_logprobs(hidden, head, targets, mask, chunk_size=cs)
        assert ent is None
        torch.testing.assert_close(lp, lp_ref, atol=1e-6, rtol=1e-5)
        (lp * w).sum().backward()
        torch.testing.assert_close(hidden.grad, gh_ref, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(head.weight.grad, gw_ref, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(head.bias.grad, gb_ref, atol=1e-6, rtol=1e-5)
        assert torch.all(hidden.grad[~mask] == 0)  # unmasked positions get no gradient


def test_chunked_bf16_hidden_gives_fp32():
    torch.manual_seed(4)
    head = nn.Linear(8, 40, bias=False).to(torch.bfloat16)
    hidden = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    targets = torch.randint(0, 40, (2, 3))
    mask = torch.ones(2, 3, dtype=torch.bool)
    lp, ent = chunked_token_logprobs(hidden, head, targets, mask, chunk_size=2, with_entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    ref = torch.log_softmax(head(hidden).float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp, ref)
    assert torch.all(ent > 0) and torch.all(ent <= math.log(40) + 1e-4)


class CountingHead(nn.Module):
    """Wraps a head and records the number of rows of every call."""

    def __init__(self, head):
        super().__init__()
        self.head = head
        self.rows = []

    def forward(self, x):
        self.rows.append(x.reshape(-1, x.shape[-1]).shape[0])
        return self.head(x)


@pytest.mark.parametrize("chunk_size", [1, 4, 5])
def test_lm_head_never_sees_more_than_chunk_size_rows(chunk_size):
    torch.manual_seed(5)
    B, T, H, V = 3, 6, 8, 30
    head = CountingHead(nn.Linear(H, V))
    hidden = torch.randn(B, T, H, requires_grad=True)
    targets = torch.randint(0, V, (B, T))
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, 2:] = True
    mask[2, 5] = False
    n = int(mask.sum())  # 11
    lp, ent = chunked_token_logprobs(hidden, head, targets, mask, chunk_size=chunk_size, with_entropy=True)
    forward_rows = list(head.rows)
    assert max(forward_rows) <= chunk_size
    assert sum(forward_rows) == n  # only masked positions, each once (entropy shares the chunk's logits)
    assert len(forward_rows) == math.ceil(n / chunk_size)
    lp.sum().backward()  # checkpoint recomputes each chunk: still at most chunk_size rows per call
    assert max(head.rows) <= chunk_size
    assert sum(head.rows) == 2 * n
    head.rows.clear()
    with torch.no_grad():  # no checkpoint, no recompute
        chunked_token_logprobs(hidden, head, targets, mask, chunk_size=chunk_size)
    assert max(head.rows) <= chunk_size and sum(head.rows) == n


def test_chunked_empty_mask_and_bad_args():
    head = nn.Linear(4, 10)
    hidden = torch.randn(2, 3, 4, requires_grad=True)
    targets = torch.zeros(2, 3, dtype=torch.long)
    lp, ent = chunked_token_logprobs(hidden, head, targets, torch.zeros(2, 3), with_entropy=True)
    assert torch.all(lp == 0) and torch.all(ent == 0)
    lp.sum().backward()  # graph kept, zero gradient
    assert torch.all(hidden.grad == 0)
    with pytest.raises(ValueError):
        chunked_token_logprobs(hidden, head, targets, torch.ones(2, 3), chunk_size=0)


@pytest.mark.parametrize("bias", [False, True])
def test_frozen_head_gradient_found_in_the_forward_matches_autograd(bias, monkeypatch):
    """A frozen float32 head (LoRA never trains it) takes the analytic path: d lp / d h from the forward, no
    checkpoint and no recomputed logits; values, entropy and gradients equal the full-vocabulary autograd ones."""
    import basis_lite.losses.policy as policy

    torch.manual_seed(0)
    head = nn.Linear(16, VOCAB, bias=bias).requires_grad_(False)
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    targets = torch.randint(0, VOCAB, (2, 7))
    mask = torch.rand(2, 7) > 0.3
    weights = torch.randn(2, 7)
    logp = torch.log_softmax(head(hidden).float() / 0.7, -1)
    ref_lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask
    ref_ent = -(logp.exp() * logp).sum(-1) * mask
    (g_ref,) = torch.autograd.grad((ref_lp * weights).sum(), hidden)
    monkeypatch.setattr(policy, "checkpoint", lambda *a, **k: pytest.fail("the frozen head was checkpointed"))
    lp, ent = chunked_token_logprobs(hidden, head, targets, mask, chunk_size=3, temperature=0.7, with_entropy=True)
    (g,) = torch.autograd.grad((lp * weights).sum(), hidden)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=1e-5)
    assert not ent.requires_grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_frozen_16bit_head_takes_the_analytic_path_and_is_as_close_as_autograd(dtype, monkeypatch):
    """A frozen bf16/fp16 head (a GPU model's tied embedding) takes the analytic path too. Against the float64
    truth its log-probs and gradients are at least as close as those of the checkpointed autograd path it replaces
    (which casts the logits' gradient to the head's dtype), and it never runs a checkpoint."""
    import basis_lite.losses.policy as policy

    torch.manual_seed(0)
    head = nn.Linear(32, 300, bias=False).requires_grad_(False).to(dtype)
    h16 = (torch.randn(3, 9, 32) * 0.5).to(dtype).requires_grad_(True)
    targets = torch.randint(0, 300, (3, 9))
    mask = torch.rand(3, 9) > 0.2
    weights = torch.randn(3, 9)
    h64 = h16.detach().double().requires_grad_(True)
    logp = torch.log_softmax(torch.nn.functional.linear(h64, head.weight.double()) / 0.7, -1)
    ref_lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask
    (g_ref,) = torch.autograd.grad((ref_lp * weights.double()).sum(), h64)

    def run(lm_head):
        lp, _ = chunked_token_logprobs(h16, lm_head, targets, mask, chunk_size=4, temperature=0.7)
        (g,) = torch.autograd.grad((lp * weights).sum(), h16)
        return (lp.double() - ref_lp).abs().max().item(), (g.double() - g_ref).abs().max().item()

    trainable = copy.deepcopy(head).requires_grad_(True)  # a trainable head is checkpointed: the old path
    ckpt_lp_err, ckpt_g_err = run(trainable)
    monkeypatch.setattr(policy, "checkpoint", lambda *a, **k: pytest.fail("the frozen 16-bit head was checkpointed"))
    lp_err, g_err = run(head)
    assert lp_err <= ckpt_lp_err * 1.01 + 1e-6 and lp_err < 1e-2
    assert g_err <= ckpt_g_err * 1.01 + 1e-6 and g_err < 5e-2
    assert g_ref.abs().max().item() > 0.1  # the gradient compared is not vanishing


def test_peft_lora_model_and_disable_adapter(tiny_llama, batch):
    from peft import LoraConfig, get_peft_model

    input_ids, attention_mask, completion_mask = batch
    base = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        base_lp = sequence_logprobs(base, input_ids, attention_mask, completion_mask, chunk_size=4).logprobs
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                                                 lora_dropout=0.0))
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)

    ref_lp, _, _ = naive_logprobs(peft_model, input_ids, attention_mask, completion_mask)
    g_ref = grads_of(peft_model, ref_lp.sum())
    out = sequence_logprobs(peft_model, input_ids, attention_mask, completion_mask, chunk_size=3)
    torch.testing.assert_close(out.logprobs, ref_lp, atol=1e-5, rtol=1e-5)
    assert (out.logprobs - base_lp).abs().max() > 1e-3  # the adapter changes the policy
    g = grads_of(peft_model, out.logprobs.sum())
    assert all("lora_" in n for n in g)  # only the adapter trains
    assert_grads_close(g, g_ref)

    with torch.no_grad(), peft_model.disable_adapter():
        ref = sequence_logprobs(peft_model, input_ids, attention_mask, completion_mask, chunk_size=3).logprobs
    torch.testing.assert_close(ref, base_lp, atol=1e-6, rtol=1e-6)


def _prefix_batch(prefix: int = 12):
    """Four right-padded rows that share their first `prefix` tokens (a system prompt), then prompts and completions
    of different lengths."""
    g = torch.Generator().manual_seed(3)
    lens, prompts = (20, 17, 24, 15), (15, 14, 18, 13)
    ids = torch.zeros(4, max(lens), dtype=torch.long)
    attn, comp = torch.zeros_like(ids), torch.zeros_like(ids)
    head = torch.randint(1, VOCAB, (prefix,), generator=g)
    for i, (n, p) in enumerate(zip(lens, prompts)):
        ids[i, :n] = torch.randint(1, VOCAB, (n,), generator=g)
        ids[i, :prefix] = head
        attn[i, :n] = 1
        comp[i, p:n] = 1
    return ids, attn, comp


def test_shared_prefix_pass_matches_the_plain_one_in_values_and_gradients(tiny_llama):
    """Two micro-batches read one SharedPrefix computed at batch 1: the log-probs, entropies and the accumulated
    adapter gradients equal those of the plain per-row passes, and the decoder body sees the prefix once."""
    from peft import LoraConfig, get_peft_model

    from basis_lite.losses.policy import SharedPrefix, common_prefix_len

    ids, attn, comp = _prefix_batch()
    rows = [ids[i, :int(attn[i].sum())].tolist() for i in range(4)]
    prompts = [int(comp[i].argmax()) for i in range(4)]
    assert common_prefix_len(rows, [p - 1 for p in prompts]) == 12  # the prompts differ right after it
    same = [rows[0][:13] + r[13:] for r in rows]  # identical up to row 3's last prompt token (its prompt: 13)
    assert common_prefix_len(same, [p - 1 for p in prompts]) == 12  # = that prompt's length - 1
    model = get_peft_model(copy.deepcopy(tiny_llama), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                                 target_modules=["q_proj", "k_proj", "v_proj",
                                                                                 "o_proj", "up_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    weights = torch.linspace(-1, 1, ids.shape[1] - 1)
    halves = (slice(0, 2), slice(2, 4))
    plain = [sequence_logprobs(model, ids[h], attn[h], comp[h], chunk_size=5, temperature=0.7, with_entropy=True)
             for h in halves]
    g_plain = grads_of(model, sum((o.logprobs * weights).sum() for o in plain))
    calls = []
    hook = model.get_base_model().model.register_forward_pre_hook(
        lambda mod, args, kw: calls.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    model.zero_grad(set_to_none=True)
    try:
        prefix = SharedPrefix.compute(model, ids[0, :12])
        shared = []
        for h in halves:
            out = sequence_logprobs(model, ids[h], attn[h], comp[h], chunk_size=5, temperature=0.7,
                                    with_entropy=True, prefix=prefix)
            (out.logprobs * weights).sum().backward()
            shared.append(out)
        prefix.backward()
    finally:
        hook.remove()
    assert calls == [(1, 12), (2, ids.shape[1] - 12), (2, ids.shape[1] - 12)]  # the prefix once, at batch 1
    g_shared = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    for a, b in zip(shared, plain):
        assert torch.equal(a.mask, b.mask)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.entropy, b.entropy, atol=1e-5, rtol=1e-5)
    assert_grads_close(g_shared, g_plain, atol=1e-5, rtol=1e-4)
    with torch.no_grad(), model.disable_adapter():  # no graph: the reference policy through the same path
        ref_plain = sequence_logprobs(model, ids, attn, comp, chunk_size=5).logprobs
        ref_shared = sequence_logprobs(model, ids, attn, comp, chunk_size=5,
                                       prefix=SharedPrefix.compute(model, ids[0, :12])).logprobs
    torch.testing.assert_close(ref_shared, ref_plain, atol=1e-5, rtol=1e-5)


def test_shared_prefix_refuses_rows_it_does_not_fit(tiny_llama):
    from basis_lite.losses.policy import SharedPrefix, common_prefix_len

    ids, attn, comp = _prefix_batch()
    rows = [ids[i, :int(attn[i].sum())].tolist() for i in range(4)]
    assert common_prefix_len(rows[:1], [20]) == 0  # one row: nothing to share
    assert common_prefix_len([[1] * 5 + [2], [1] * 5 + [3]], [6, 6]) == 0  # under MIN_SHARED_PREFIX
    with torch.no_grad():
        same = ids.clone()
        same[:, :14] = ids[0, :14]  # the rows share 14 tokens, but row 3's prompt has 13: its first log-prob is at 12
        with pytest.raises(ValueError, match="covers positions"):
            sequence_logprobs(tiny_llama, same, attn, comp, prefix=SharedPrefix.compute(tiny_llama, ids[0, :14]))
        other = ids.clone()
        other[2, 3] = (other[2, 3] + 1) % VOCAB
        with pytest.raises(ValueError, match="do not all start"):
            sequence_logprobs(tiny_llama, other, attn, comp, prefix=SharedPrefix.compute(tiny_llama, ids[0, :12]))


# ---------------------------------------------------------------------------------------------------------------
# Policy losses
# ---------------------------------------------------------------------------------------------------------------

def test_ppo_clip_hand_computation():
    # one sequence, 5 positions, the last masked out (and garbage)
    ratios = torch.tensor([1.5, 0.7, 1.1, 0.5, 1.0])
    adv_tok = torch.tensor([1.0, -1.0, 2.0, 1.0, 3.0])
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, float("nan")]])
    lp = (old + ratios.log()).clone().requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, stats = ppo_clip_loss(lp, old, adv_tok.view(1, 5), mask, clip_low=0.2, clip_high=0.28)
    # -min(rA, clip(r, .8, 1.28) A): 1.5,A=1 -> -1.28 (high clip); 0.7,A=-1 -> +0.8 (low clip);
    # 1.1,A=2 -> -2.2; 0.5,A=1 -> -0.5 (r*A is the min: not clipped)
    expected = (-1.28 + 0.8 - 2.2 - 0.5) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["clip_fraction"].item() == pytest.approx(0.5)
    assert stats["clip_high_fraction"].item() == pytest.approx(0.25)
    assert stats["clip_low_fraction"].item() == pytest.approx(0.25)
    assert stats["ratio_mean"].item() == pytest.approx((1.5 + 0.7 + 1.1 + 0.5) / 4, abs=1e-6)
    loss.backward()
    # d/dlp of -r A = -r A / N for unclipped tokens, 0 for clipped and masked ones
    expected_grad = torch.tensor([[0.0, 0.0, -1.1 * 2 / 4, -0.5 * 1 / 4, 0.0]])
    torch.testing.assert_close(lp.grad, expected_grad, atol=1e-6, rtol=1e-5)

    # num_tokens overrides the denominator; per-sequence advantages broadcast like per-token ones
    loss2, _ = ppo_clip_loss(lp, old, adv_tok.view(1, 5), mask, num_tokens=8)
    assert loss2.item() == pytest.approx(expected * 4 / 8, abs=1e-6)
    a_seq = torch.tensor([0.5, -2.0])
    lp2 = torch.randn(2, 3)
    old2 = lp2 + 0.1 * torch.randn(2, 3)
    l_seq, _ = ppo_clip_loss(lp2, old2, a_seq, torch.ones(2, 3))
    l_tok, _ = ppo_clip_loss(lp2, old2, a_seq[:, None].expand(2, 3), torch.ones(2, 3))
    torch.testing.assert_close(l_seq, l_tok)


def test_bpo_hand_computation():
    eps, cap = 0.1, 5.0
    mu = torch.tensor([0.5, 0.5, 0.9, 0.9, 0.05, 0.3])
    pi = torch.tensor([0.8, 0.6, 0.5, 0.5, 0.99, 0.3])
    adv = torch.tensor([1.0, 1.0, -1.0, 2.0, -1.0, 7.0])
    # omega = (1.1 - mu) / (1.1 - pi)
    # t0: 0.6/0.3 = 2.0 > 1.28 and A > 0 -> masked
    # t1: 0.6/0.5 = 1.2 -> weight 1.2
    # t2: 0.2/0.6 = 1/3 < 0.8 and A < 0 -> masked
    # t3: 1/3, A > 0 -> kept, weight 1/3
    # t4: 1.05/0.11 = 9.545 (A < 0, not low-clipped) -> capped at 5
    # t5: padding (masked out)
    weights = torch.tensor([0.0, 1.2, 0.0, 1.0 / 3.0, 5.0, 0.0])
    lp = pi.log().view(1, 6).clone().requires_grad_(True)
    old = mu.log().view(1, 6)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    loss, stats = bpo_loss(lp, old, adv.view(1, 6), mask, eps=eps, cap=cap, clip_low=0.2, clip_high=0.28)
    expected = sum(-a * w * math.log(p) for a, w, p in zip(adv[:5].tolist(), weights[:5].tolist(),
                                                             pi[:5].tolist())) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 5)
    assert stats["clip_high_fraction"].item() == pytest.approx(1 / 5)
    assert stats["clip_low_fraction"].item() == pytest.approx(1 / 5)
    assert stats["capped_fraction"].item() == pytest.approx(1 / 5)
    loss.backward()
    torch.testing.assert_close(lp.grad, (-adv * weights / 5).view(1, 6), atol=1e-6, rtol=1e-5)

    # the mask uses the UNcapped weight: with cap < 1 - clip_low, t4 (omega 9.5) is still kept, at weight cap
    lp.grad = None
    loss_c, _ = bpo_loss(lp, old, adv.view(1, 6), mask, eps=eps, cap=0.5)
    loss_c.backward()
    capped = torch.tensor([0.0, 0.5, 0.0, 1.0 / 3.0, 0.5, 0.0])
    torch.testing.assert_close(lp.grad, (-adv * capped / 5).view(1, 6), atol=1e-6, rtol=1e-5)

    # seq-mean-token-mean (the paper's aggregation) on one sequence equals token-mean
    loss_s, _ = bpo_loss(lp, old, adv.view(1, 6), mask, eps=eps, cap=cap, aggregation="seq-mean-token-mean")
    assert loss_s.item() == pytest.approx(loss.item(), rel=1e-6)

    # a missing behaviour log-prob (NaN) falls back to the current one: omega = 1
    lp.grad = None
    old_nan = old.clone()
    old_nan[0, 0] = float("nan")
    loss_n, _ = bpo_loss(lp, old_nan, adv.view(1, 6), mask, eps=eps, cap=cap)
    loss_n.backward()
    assert lp.grad[0, 0].item() == pytest.approx(-1.0 / 5, rel=1e-5)


@pytest.mark.parametrize("which", ["ppo", "bpo"])
def test_on_policy_gradient_is_reinforce(tiny_llama, batch, which):
    model = tiny_llama
    input_ids, attention_mask, completion_mask = batch
    adv = torch.tensor([1.5, -0.7])
    out = sequence_logprobs(model, input_ids, attention_mask, completion_mask, chunk_size=4)
    m = out.mask.float()
    g_reinforce = grads_of(model, -(adv[:, None] * out.logprobs * m).sum() / m.sum())
    out = sequence_logprobs(model, input_ids, attention_mask, completion_mask, chunk_size=4)
    fn = ppo_clip_loss if which == "ppo" else bpo_loss
    loss, stats = fn(out.logprobs, out.logprobs.detach(), adv, out.mask)
    assert stats["clip_fraction"].item() == 0.0
    assert stats["ratio_mean"].item() == pytest.approx(1.0)
    assert_grads_close(grads_of(model, loss), g_reinforce)


@pytest.mark.parametrize("which", ["ppo", "bpo"])
def test_num_tokens_makes_micro_batches_match_full_batch(tiny_llama, batch, which):
    model = tiny_llama
    input_ids, attention_mask, completion_mask = batch  # 6 and 4 completion tokens: unequal halves
    adv = torch.tensor([0.8, -1.2])
    fn = ppo_clip_loss if which == "ppo" else bpo_loss
    with torch.no_grad():  # slightly off-policy old log-probs so that the ratio/weight is not trivially 1
        old = sequence_logprobs(model, input_ids, attention_mask, completion_mask).logprobs
        old = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(2))

    out = sequence_logprobs(model, input_ids, attention_mask, completion_mask)
    full_loss, _ = fn(out.logprobs, old, adv, out.mask)
    g_full = grads_of(model, full_loss)
    n_total = int(out.mask.sum())

    def accumulated(num_tokens):
        model.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(2):
            sl = slice(i, i + 1)
            o = sequence_logprobs(model, input_ids[sl], attention_mask[sl], completion_mask[sl])
            loss, _ = fn(o.logprobs, old[sl], adv[sl], o.mask, num_tokens=num_tokens)
            loss.backward()
            total += loss.item()
        return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    total, g_acc = accumulated(n_total)
    assert total == pytest.approx(full_loss.item(), rel=1e-5, abs=1e-5)  # terms ~6 cancel to ~1e-2
    assert_grads_close(g_acc, g_full)
    # without the step-wide normaliser each micro-batch divides by its own count: a different gradient
    _, g_bad = accumulated(None)
    assert not torch.allclose(g_bad["lm_head.weight"], g_full["lm_head.weight"], atol=1e-6, rtol=1e-3)


def test_kl_k3_and_masked_mean():
    lp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    k = kl_k3(lp, lp.clone(), mask)
    assert torch.all(k == 0)
    ref = lp + torch.tensor([[1.0, -1.0, 0.3, 5.0]])
    k = kl_k3(lp, ref, mask)
    # d = ref - lp: exp(d) - d - 1
    expected = torch.tensor([[math.e - 2.0, math.exp(-1.0), math.exp(0.3) - 1.3, 0.0]])
    torch.testing.assert_close(k, expected)
    assert torch.all(k[mask.bool()] > 0)
    k_rand = kl_k3(torch.randn(4, 7), torch.randn(4, 7), torch.ones(4, 7))
    assert torch.all(k_rand >= 0)
    # gradient flows through the policy log-probs only: dk3/dlp = 1 - exp(d)
    lp_g = lp.clone().requires_grad_(True)
    kl_k3(lp_g, ref, mask).sum().backward()
    torch.testing.assert_close(lp_g.grad, (1 - torch.exp(ref - lp)) * mask)

    x = torch.tensor([[1.0, 2.0, 3.0, float("inf")]])
    assert masked_mean(x, mask).item() == pytest.approx(2.0)
    assert masked_mean(x, mask, num_tokens=12).item() == pytest.approx(0.5)
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0
    y = torch.tensor([[1.0, 3.0, 0.0], [4.0, 0.0, 0.0]])
    ym = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate(y, ym, "seq-mean-token-mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate(y, ym, "token-mean").item() == pytest.approx(8.0 / 3)
    with pytest.raises(ValueError):
        aggregate(y, ym, "sum")
