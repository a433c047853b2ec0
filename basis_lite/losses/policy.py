"""Policy losses over token log-probs, and a chunked log-prob helper.

Everything here works on per-token tensors of shape [B, T] (B sequences, T positions) plus a boolean/0-1 `mask`
that marks the tokens that count (completion tokens, not prompt or padding). Masked-out positions never influence
a value or a gradient, even when they hold NaN/inf.

Notation (per token t of sequence i):
    lp_{i,t}   = log pi_theta(y_t | s_t)           current policy (carries the gradient)
    old_{i,t}  = log mu(y_t | s_t)                  behaviour policy: the rollout engine's or a detached forward
    r_{i,t}    = exp(lp - old)                      importance ratio
    A_i        advantage (one per sequence, broadcast over tokens) or A_{i,t} (one per token)

Aggregation ("token-mean", as in DAPO, arXiv 2503.14476): the sum over every masked token of the batch
divided by the number of masked tokens,
    L = (1 / N) * sum_{i,t} m_{i,t} * l_{i,t},      N = sum_{i,t} m_{i,t}.
Under gradient accumulation pass `num_tokens` = N of the WHOLE optimizer step (all micro-batches): the micro-batch
losses then add up to the full-batch loss exactly, so 8 micro-batches of 1 and 1 of 8 give the same gradient.
"seq-mean-token-mean" (GRPO / the BPO paper, Appendix B) is available too:
    L = (1 / S) * sum_i (1 / |y_i|) sum_t m_{i,t} l_{i,t}, with S = `num_sequences` of the whole step (default B).

Policy losses and aggregations are registered by name (`@policy_loss`, `@aggregation`, next to each function) against
the torch-free table of losses/__init__.py, with one signature each:
    policy loss:  fn(batch: PolicyBatch, opts: LossOptions) -> (per-token loss [B, T], stats)
    aggregation:  fn(per_token [B, T], mask [B, T] bool, norm: Normalizer) -> scalar
`compute_policy_loss(loss, aggregation, batch, opts, norm, weights)` runs one of each.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from . import AGGREGATIONS, LOSSES

__all__ = [
    "SequenceLogprobs",
    "chunked_token_logprobs",
    "sequence_logprobs",
    "PolicyBatch",
    "LossOptions",
    "Normalizer",
    "policy_loss",
    "aggregation",
    "get_policy_loss",
    "get_aggregation",
    "compute_policy_loss",
    "importance_ratio",
    "masked_mean",
    "aggregate",
    "ppo_clip_loss",
    "bpo_loss",
    "kl_k3",
]

_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: keeps a wild (masked-in) log-ratio from overflowing fp32 to inf


# ----------------------------------------------------------------------------------------------------------------
# Chunked log-probs
# ----------------------------------------------------------------------------------------------------------------

class _FrozenHeadLogprobs(torch.autograd.Function):
    """log softmax(h @ W.T / T)[tgt] for a frozen head W (float32 or 16-bit), with d lp / d h found in the forward:

        d lp_i / d h_i = (W[tgt_i] - softmax(z_i) @ W) / T

    so the backward is one multiply and the logits are never recomputed: two [n, V] matmuls per chunk where the
    checkpointed path runs three (forward, recomputation, gradient). The logits are float32; the softmax is made in
    place of their shifted copy and, over a 16-bit head, cast to the head's dtype for the product with W (as
    autograd casts the logits' gradient), so a chunk holds about two float32 [n, V] tensors at a time."""

    @staticmethod
    def forward(ctx, h, weight, bias, tgt, temperature: float, want_entropy: bool):
        z = torch.nn.functional.linear(h, weight, bias).float()
        if temperature != 1.0:
            z = z / temperature
        lse = torch.logsumexp(z, dim=-1)
        lp = z.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - lse
        p = (z - lse.unsqueeze(-1)).exp_()
        ent = lse - (p * z).sum(-1) if want_entropy else lp.new_empty(0)
        del z
        if weight.dtype == torch.float32:
            g = weight.index_select(0, tgt) - p @ weight
        else:
            p = p.to(weight.dtype)
            g = weight.index_select(0, tgt).float() - (p @ weight).float()
        del p
        if temperature != 1.0:
            g = g / temperature
        ctx.save_for_backward(g)
        ctx.h_dtype = h.dtype
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        (g,) = ctx.saved_tensors
        return (grad_lp.unsqueeze(-1) * g).to(ctx.h_dtype), None, None, None, None, None


def _frozen_head(lm_head: nn.Module) -> bool:
    """True when the head is a plain float Linear (float32, bfloat16 or float16) without trainable parameters: the
    analytic-gradient path."""
    return (isinstance(lm_head, nn.Linear)
            and lm_head.weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and not any(p.requires_grad for p in lm_head.parameters()))


def _chunk_logprobs(h: Tensor, tgt: Tensor, lm_head: nn.Module, temperature: float,
                    want_entropy: list) -> tuple[Tensor, Tensor]:
    """log softmax(lm_head(h) / T)[tgt] for one chunk of rows h [n, H] -> ([n] fp32, entropy [n] fp32 or empty).

    The entropy part runs last and under no_grad: during a non-reentrant checkpoint's recomputation (backward) it
    is skipped (`want_entropy[0]` is False by then, and recomputation stops early once the saved tensors exist).
    """
    logits = lm_head(h).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    lp = logits.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - lse
    if want_entropy[0]:
        with torch.no_grad():
            # H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v
            ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    else:
        ent = lp.new_empty(0)
    return lp, ent.detach()


def chunked_token_logprobs(hidden: Tensor, lm_head: nn.Module, targets: Tensor, mask: Tensor,
                           chunk_size: int = 1024, temperature: float = 1.0,
                           with_entropy: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """Per-token log-probs of `targets` under softmax(lm_head(hidden) / temperature), without a [B, T, V] tensor.

        logprobs[b, t] = z[b, t, targets[b, t]] - logsumexp_v z[b, t, v],   z = float32(lm_head(hidden)) / temperature
        entropy[b, t]  = logsumexp_v z[b, t, v] - sum_v softmax(z[b, t])_v * z[b, t, v]

    Only positions where `mask` is true are computed; the others are exactly 0. The selected rows of `hidden` are
    processed `chunk_size` at a time (lm_head never sees more than `chunk_size` rows), logits are cast to float32
    inside the chunk. When autograd is on and something needs a gradient: over a frozen head (LoRA training)
    each chunk's d lp / d hidden is found in the forward (`_FrozenHeadLogprobs`, [n, H] kept, no recomputation);
    otherwise each chunk runs under `torch.utils.checkpoint(use_reentrant=False)`: the backward saves only the
    chunk's hidden rows and recomputes its logits. Either way peak memory is O(chunk_size * V). Differentiable w.r.t. `hidden` and
    lm_head's parameters. The entropy is a metric: computed under no_grad.

    Args:
        hidden: [B, T, H] final hidden states (after the model's final norm).
        lm_head: module mapping [..., H] -> [..., V] (the model's output embedding).
        targets: [B, T] token ids whose log-prob is wanted at each position.
        mask: [B, T] bool or 0/1; positions to compute.
    Returns:
        (logprobs [B, T] float32, entropy [B, T] float32 or None).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.dim() != 3 or targets.shape != hidden.shape[:2] or mask.shape != hidden.shape[:2]:
        raise ValueError(f"expected hidden [B, T, H], targets and mask [B, T]; got {tuple(hidden.shape)}, "
                         f"{tuple(targets.shape)}, {tuple(mask.shape)}")
    B, T, H = hidden.shape
    flat_mask = mask.reshape(-1).bool()
    idx = flat_mask.nonzero(as_tuple=True)[0]  # [N]
    n = idx.numel()
    out = torch.zeros(B * T, dtype=torch.float32, device=hidden.device)
    ent_out = torch.zeros(B * T, dtype=torch.float32, device=hidden.device) if with_entropy else None

    needs_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in lm_head.parameters()))
    if n == 0:
        if needs_grad and hidden.requires_grad:
            out = out + hidden.reshape(B * T, H)[:, 0].float() * 0.0  # keep a (zero) graph for .backward()
        return out.view(B, T), (ent_out.view(B, T) if with_entropy else None)

    h_sel = hidden.reshape(B * T, H).index_select(0, idx)  # [N, H]
    t_sel = targets.reshape(-1).index_select(0, idx).long()
    want_entropy = [with_entropy]  # read at call time: False during backward recomputation
    lps, ents = [], []
    analytic = needs_grad and _frozen_head(lm_head)
    for s in range(0, n, chunk_size):
        h_c, t_c = h_sel[s:s + chunk_size], t_sel[s:s + chunk_size]
        if analytic:
            lp, ent = _FrozenHeadLogprobs.apply(h_c, lm_head.weight, lm_head.bias, t_c, temperature, with_entropy)
            ent = ent.detach()
        elif needs_grad:
            lp, ent = checkpoint(_chunk_logprobs, h_c, t_c, lm_head, temperature, want_entropy,
                                 use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(h_c, t_c, lm_head, temperature, want_entropy)
        lps.append(lp)
        ents.append(ent)
    want_entropy[0] = False
    out = out.index_put((idx,), torch.cat(lps))
    if with_entropy:
        ent_out = ent_out.index_put((idx,), torch.cat(ents))
        ent_out = ent_out.view(B, T)
    return out.view(B, T), ent_out


@dataclass
class SequenceLogprobs:
    """Output of `sequence_logprobs`; all [B, T-1], position t scores input_ids[:, t+1]."""

    logprobs: Tensor  # float32, 0 where mask is false
    mask: Tensor  # bool: completion_mask[:, 1:] & attention_mask[:, 1:]
    entropy: Optional[Tensor] = None  # float32, no grad, 0 where mask is false
    hidden_layer: Optional[Tensor] = None  # [B, T, H] output of layer `feature_layer` (detached), unshifted


def _body_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(base causal LM, decoder body, lm_head) for an HF causal LM or a peft PeftModel around one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(base, "model", None)
    if body is None and hasattr(base, "get_decoder"):
        body = base.get_decoder()
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if body is None or head is None:
        raise TypeError(f"{type(base).__name__}: expected a causal LM with a `.model` decoder body and an "
                        f"output embedding (lm_head)")
    cfg = getattr(base, "config", None)
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", 1.0) not in (None, 1.0):
        raise NotImplementedError(f"{type(base).__name__}: logit soft-capping/scaling is not applied by the "
                                  f"chunked log-prob path")
    return base, body, head


MIN_SHARED_PREFIX = 8  # tokens: a shorter common prefix is not worth a pass of its own


def common_prefix_len(rows: list[list[int]], needed_from: list[int]) -> int:
    """The length P of the token prefix all `rows` share that no log-prob reads: P <= needed_from[i] (the first
    position whose hidden state row i needs: its prompt length - 1) for every row. 0 under MIN_SHARED_PREFIX or
    with fewer than two rows."""
    if len(rows) < 2:
        return 0
    first = rows[0]
    n = min(min(needed_from), len(first))
    for r in rows[1:]:
        i = 0
        while i < n and i < len(r) and r[i] == first[i]:
            i += 1
        n = i
    return n if n >= MIN_SHARED_PREFIX else 0


class SharedPrefix:
    """The keys and values of a token prefix that every sequence of a step shares (system prompt, chat template),
    computed once at batch 1 and read by every micro-batch's rows instead of running the prefix once per row.

        prefix = SharedPrefix.compute(model, ids)     # in the same mode and attention kernel as the rows
        out = sequence_logprobs(model, ..., prefix=prefix)   # rows must start with `ids`; loss.backward()
        prefix.backward()                             # after the last micro-batch: the rows' gradients reach
                                                      # the prefix pass (and through it the adapter) once

    The rows read detached copies (`leaves`) whose .grad sums what every micro-batch sends back; `backward` runs
    the prefix pass's graph once with those sums, so the accumulated gradient is the one of the plain per-row
    passes up to float rounding. Without autograd (no_grad) there is no graph and `backward` does nothing."""

    def __init__(self, ids: Tensor, outputs: list[Tensor]):
        self.ids = ids.reshape(1, -1)  # [1, P]
        self.length = self.ids.shape[1]
        self.outputs = outputs  # [k0, v0, k1, v1, ...] each [1, kv heads, P, head dim], with their graph
        self.leaves = [t.detach().requires_grad_(t.requires_grad) for t in outputs]

    @classmethod
    def compute(cls, model: nn.Module, ids: Tensor) -> "SharedPrefix":
        """Run the decoder body over `ids` ([P] or [1, P]) with a cache; keep its keys and values."""
        _, body, _ = _body_and_head(model)
        ids = ids.reshape(1, -1)
        out = body(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
        cache = out.past_key_values
        if cache is None or not hasattr(cache, "layers"):
            raise RuntimeError(f"{type(body).__name__} returned no key/value cache for the shared prefix "
                               "(gradient checkpointing on?); use train.shared_prefix=never")
        return cls(ids, [t for layer in cache.layers for t in (layer.keys, layer.values)])

    def cache(self, body: nn.Module, rows: int):
        """A fresh cache holding the prefix for `rows` sequences (views of the leaves: no copy until the rows'
        own keys are appended)."""
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=getattr(body, "config", None))
        for i in range(len(self.leaves) // 2):
            k, v = self.leaves[2 * i], self.leaves[2 * i + 1]
            cache.update(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1), i)
        return cache

    def backward(self) -> None:
        pairs = [(o, leaf.grad) for o, leaf in zip(self.outputs, self.leaves)
                 if o.requires_grad and leaf.grad is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        for leaf in self.leaves:
            leaf.grad = None


def _body_hidden(body: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                 prefix: Optional[SharedPrefix]) -> Tensor:
    """[B, T, H] final hidden states. With a `prefix` of P tokens the rows run only their own tokens (from P on)
    against its keys and values; positions before P come back as zeros (no log-prob reads them)."""
    if prefix is None:
        out = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    B, P = input_ids.shape[0], prefix.length
    out = body(input_ids=input_ids[:, P:], attention_mask=attention_mask, past_key_values=prefix.cache(body, B),
               use_cache=True)
    tail = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return torch.cat([tail.new_zeros(B, P, tail.shape[-1]), tail], dim=1)


def sequence_logprobs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor,
                      chunk_size: int = 1024, temperature: float = 1.0, with_entropy: bool = False,
                      feature_layer: Optional[int] = None,
                      prefix: Optional[SharedPrefix] = None) -> SequenceLogprobs:
    """Next-token log-probs of a causal LM over the completion tokens, computed chunk by chunk.

        logprobs[:, t] = log p(input_ids[:, t+1] | input_ids[:, :t+1])         (softmax of logits / temperature)
        mask[:, t]     = completion_mask[:, t+1] and attention_mask[:, t+1]

    Runs the decoder body (`base.model`, use_cache=False) and applies `base.get_output_embeddings()` through
    `chunked_token_logprobs`, so the full-vocabulary logits are never built. `model` may be a plain HF causal LM
    (LlamaForCausalLM, Qwen2ForCausalLM, ...) or a peft PeftModel around one: the LoRA layers live inside the
    body's modules, so the adapter is applied, and `with model.disable_adapter():` gives the reference policy.
    `feature_layer` (an index into HF's `hidden_states` tuple: 0 = embeddings, -1 = final, normed) also returns
    that layer's [B, T, H] output, detached. `prefix` (a SharedPrefix every row starts with; not with
    `feature_layer`): the rows run from its end on, against its keys and values; the log-probs agree with the plain
    pass up to float rounding.
    """
    _, body, head = _body_and_head(model)
    mask = completion_mask[:, 1:].bool() & attention_mask[:, 1:].bool()
    layer = None
    if feature_layer is not None:
        out = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_hidden_states=True)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        hs = getattr(out, "hidden_states", None)
        if hs is None:
            raise RuntimeError(f"{type(body).__name__} returned no hidden_states for feature_layer={feature_layer}")
        layer = hs[feature_layer].detach()
    else:
        if prefix is not None:
            P = prefix.length
            if not torch.equal(input_ids[:, :P], prefix.ids.to(input_ids.device).expand(input_ids.shape[0], -1)):
                raise ValueError(f"the rows do not all start with the shared prefix of {P} tokens")
            if bool(mask[:, :P].any()):
                raise ValueError(f"a shared prefix of {P} tokens covers positions whose log-prob is needed")
        hidden = _body_hidden(body, input_ids, attention_mask, prefix)
    lp, ent = chunked_token_logprobs(hidden[:, :-1], head, input_ids[:, 1:], mask, chunk_size=chunk_size,
                                     temperature=temperature, with_entropy=with_entropy)
    return SequenceLogprobs(logprobs=lp, mask=mask, entropy=ent, hidden_layer=layer)


# ----------------------------------------------------------------------------------------------------------------
# Registries: policy losses and aggregations, bound by name to the torch-free specs of losses/__init__.py
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class PolicyBatch:
    """One micro-batch's inputs to a policy loss, all [B, T] but `advantages` ([B] per sequence or [B, T])."""

    logprobs: Tensor  # current policy, carries the gradient
    old_logprobs: Tensor  # the policy the ratio compares with (detached)
    advantages: Tensor
    mask: Tensor
    ref_logprobs: Optional[Tensor] = None  # the reference policy's (adapter off), for losses whose spec says so


@dataclass
class LossOptions:
    """The knobs the policy losses read (train.* of the same names)."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    bpo_eps: float = 0.1
    bpo_cap: float = 5.0
    importance_sampling_level: str = "token"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    astar_beta: float = 1e-3

    @classmethod
    def from_train(cls, t) -> "LossOptions":
        return cls(t.clip_low, t.clip_high, t.bpo_eps, t.bpo_cap, t.importance_sampling_level,
                   t.sapo_temperature_pos, t.sapo_temperature_neg, t.vespo_k_pos, t.vespo_lambda_pos,
                   t.vespo_k_neg, t.vespo_lambda_neg, t.astar_beta)


@dataclass
class Normalizer:
    """The step-wide counts an aggregation divides by (so that micro-batches add up to the whole step).

    num_tokens: completion tokens of the whole step, all ranks; local_tokens: this rank's; num_sequences: sequences
    of the whole step, all ranks; max_completion_length: generation.max_new_tokens. None = this call's own count."""

    num_tokens: Optional[float] = None
    num_sequences: Optional[float] = None
    local_tokens: Optional[float] = None
    num_ranks: int = 1
    max_completion_length: Optional[int] = None


PolicyLossFn = Callable[[PolicyBatch, LossOptions], tuple]  # -> (per-token loss [B, T], stats)
AggregationFn = Callable[[Tensor, Tensor, Normalizer], Tensor]  # (per-token loss, mask, counts) -> scalar
_LOSS_FNS: dict[str, PolicyLossFn] = {}
_AGGREGATION_FNS: dict[str, AggregationFn] = {}


def _binder(table: dict, specs: dict, kind: str):
    def bind(name: str):
        def deco(fn):
            if name not in specs:
                raise ValueError(f"{kind} {name!r} has no entry in basis_lite.losses ({', '.join(specs)})")
            table[name] = fn
            return fn
        return deco
    return bind


policy_loss = _binder(_LOSS_FNS, LOSSES, "policy loss")  # @policy_loss("name") above fn(batch, opts)
aggregation = _binder(_AGGREGATION_FNS, AGGREGATIONS, "aggregation")  # @aggregation("name") above fn(l, m, norm)


def get_policy_loss(name: str) -> PolicyLossFn:
    if name not in _LOSS_FNS:
        raise ValueError(f"policy loss {name!r} not accepted; choose one of {', '.join(_LOSS_FNS)}")
    return _LOSS_FNS[name]


def get_aggregation(name: str) -> AggregationFn:
    """The aggregation named `name` here (TRL's loss_type names are read as ours when the config loads)."""
    if name not in _AGGREGATION_FNS:
        raise ValueError(f"aggregation {name!r} not accepted; choose one of {', '.join(_AGGREGATION_FNS)}")
    return _AGGREGATION_FNS[name]


def compute_policy_loss(name: str, aggregation_name: str, batch: PolicyBatch, opts: LossOptions,
                        norm: Normalizer, weights: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """The scalar loss of one micro-batch: the policy loss `name` per token, times the detached `weights`
    ([B, T] importance weights, or None), reduced by the aggregation `aggregation_name`. Returns (loss, stats)."""
    per_token, stats = get_policy_loss(name)(batch, opts)
    if weights is not None:
        per_token = per_token * weights.detach().to(per_token.dtype)
    return get_aggregation(aggregation_name)(per_token, batch.mask.bool(), norm), stats


# ----------------------------------------------------------------------------------------------------------------
# Aggregations
# ----------------------------------------------------------------------------------------------------------------

def masked_mean(x: Tensor, mask: Tensor, num_tokens: Optional[float] = None) -> Tensor:
    """sum(x * mask) / N with N = `num_tokens` if given, else sum(mask) (at least 1). Masked-out x is ignored,
    even if NaN/inf."""
    m = mask.bool()
    total = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()
    denom = float(num_tokens) if num_tokens is not None else m.sum().clamp(min=1).to(total.dtype)
    return total / denom


def _masked_sum_rows(x: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(-1)


@aggregation("token-mean")
def token_mean(per_token: Tensor, m: Tensor, norm: Normalizer) -> Tensor:
    """sum_{i,t} m l / N, N = completion tokens of the whole step (TRL: dapo)."""
    return masked_mean(per_token, m, norm.num_tokens)


@aggregation("seq-mean-token-mean")
def seq_mean_token_mean(per_token: Tensor, m: Tensor, norm: Normalizer) -> Tensor:
    """sum_i [sum_t m l / max(1, |y_i|)] / S, S = sequences of the whole step or B (TRL: grpo)."""
    per_seq = _masked_sum_rows(per_token, m) / m.sum(-1).clamp(min=1).to(per_token.dtype)
    denom = float(norm.num_sequences) if norm.num_sequences is not None else float(per_token.shape[0])
    return per_seq.sum() / denom


@aggregation("local-token-mean")
def local_token_mean(per_token: Tensor, m: Tensor, norm: Normalizer) -> Tensor:
    """Each rank's token mean, averaged over the ranks: sum m l / (N_rank * ranks) (TRL: bnpo, without its
    dependence on the micro-batch split)."""
    local = norm.local_tokens if norm.local_tokens is not None else norm.num_tokens
    return masked_mean(per_token, m, None if local is None else max(1.0, float(local)) * norm.num_ranks)


@aggregation("seq-mean-token-sum")
def seq_mean_token_sum(per_token: Tensor, m: Tensor, norm: Normalizer) -> Tensor:
    """sum_i [sum_t m l] / S, S = sequences of the whole step or B (TRL: luspo)."""
    seqs = float(norm.num_sequences) if norm.num_sequences is not None else float(per_token.shape[0])
    return _masked_sum_rows(per_token, m).sum() / seqs


@aggregation("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(per_token: Tensor, m: Tensor, norm: Normalizer) -> Tensor:
    """sum_{i,t} m l / (S * L), S = sequences of the whole step or B, L = max_completion_length (TRL: dr_grpo)."""
    if norm.max_completion_length is None:
        raise ValueError("seq-mean-token-sum-norm needs Normalizer.max_completion_length")
    seqs = float(norm.num_sequences) if norm.num_sequences is not None else float(per_token.shape[0])
    return _masked_sum_rows(per_token, m).sum() / (seqs * float(norm.max_completion_length))


def aggregate(per_token: Tensor, mask: Tensor, aggregation: str = "token-mean", num_tokens: Optional[float] = None,
              num_sequences: Optional[float] = None) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar with a registered aggregation (by its name here):

    token-mean:           sum_{i,t} m l / N,  N = num_tokens (whole step) or sum(m) of this micro-batch.
    seq-mean-token-mean:  sum_i [ sum_t m l / max(1, sum_t m) ] / S,  S = num_sequences (whole step) or B.
    """
    return get_aggregation(aggregation)(per_token, mask.bool(), Normalizer(num_tokens, num_sequences))


def _broadcast_adv(advantages: Tensor, like: Tensor) -> Tensor:
    a = advantages.to(like.dtype)
    if a.dim() == 1:
        a = a.unsqueeze(-1)
    return a.expand_as(like)


def _frac(x: Tensor, mask: Tensor) -> Tensor:
    return masked_mean(x.float(), mask).detach()


def importance_ratio(logprobs: Tensor, old_logprobs: Tensor, m: Tensor, level: str = "token") -> Tensor:
    """r = exp(lp - old) per token, or with level "sequence" (GSPO) exp(mean over the sequence's masked tokens of
    lp - old), broadcast to every token; masked-out positions are 1 (token level). [B, T], carries the gradient."""
    log_ratio = torch.where(m, logprobs - old_logprobs.to(logprobs.dtype), torch.zeros_like(logprobs))
    if level == "sequence":
        log_ratio = (log_ratio.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).expand_as(logprobs)
    elif level != "token":
        raise ValueError(f"importance_sampling_level {level!r} not accepted; choose token or sequence")
    return torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))


def _ratio_stats(ratio: Tensor, low: Tensor, high: Tensor, m: Tensor) -> dict:
    r_masked = torch.where(m, ratio, torch.zeros_like(ratio))
    return {
        "clip_fraction": _frac(low | high, m),
        "clip_low_fraction": _frac(low, m),
        "clip_high_fraction": _frac(high, m),
        "ratio_mean": _frac(ratio, m),
        "ratio_max": r_masked.max().detach() if m.any() else ratio.new_zeros(()),
    }


# ----------------------------------------------------------------------------------------------------------------
# Policy losses: fn(batch, opts) -> (per-token loss [B, T], stats of detached 0-d tensors)
# ----------------------------------------------------------------------------------------------------------------

@policy_loss("ppo_clip")
def ppo_clip(b: PolicyBatch, o: LossOptions) -> tuple[Tensor, dict]:
    """PPO clipped surrogate with asymmetric (DAPO clip-higher) bounds:

        l_{i,t} = -min( r A,  clip(r, 1 - clip_low, 1 + clip_high) A ),   r from `importance_ratio`

    A token is clipped (zero gradient) when A > 0 and r > 1 + clip_high, or A < 0 and r < 1 - clip_low.
    On-policy (old = lp.detach(), r = 1): the REINFORCE gradient, at either level.
    Stats: clip_fraction, clip_low_fraction, clip_high_fraction, ratio_mean, ratio_max (this call's masked tokens).
    """
    m = b.mask.bool()
    adv = _broadcast_adv(b.advantages, b.logprobs)
    ratio = importance_ratio(b.logprobs, b.old_logprobs, m, o.importance_sampling_level)
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - o.clip_low, 1.0 + o.clip_high) * adv
    per_token = -torch.minimum(surr1, surr2)
    with torch.no_grad():
        low = (adv < 0) & (ratio < 1.0 - o.clip_low)
        high = (adv > 0) & (ratio > 1.0 + o.clip_high)
        stats = _ratio_stats(ratio, low, high, m)
    return per_token, stats


@policy_loss("cispo")
def cispo(b: PolicyBatch, o: LossOptions) -> tuple[Tensor, dict]:
    """CISPO (MiniMax-M1; TRL loss_type "cispo"): REINFORCE with a clipped, detached importance weight,

        l_{i,t} = -sg[ min(r, 1 + clip_high) ] A lp_{i,t},   r from `importance_ratio`

    Every token keeps a gradient (the weight is capped, never zeroed). Stats as ppo_clip's; clip_fraction and
    clip_high_fraction count the capped tokens.
    """
    m = b.mask.bool()
    adv = _broadcast_adv(b.advantages, b.logprobs)
    with torch.no_grad():
        ratio = importance_ratio(b.logprobs.detach(), b.old_logprobs, m, o.importance_sampling_level)
        weight = ratio.clamp(max=1.0 + o.clip_high)
        high = ratio > 1.0 + o.clip_high
        stats = _ratio_stats(ratio, torch.zeros_like(high), high, m)
    lp_safe = torch.where(m, b.logprobs, torch.zeros_like(b.logprobs))
    return -adv * weight * lp_safe, stats


@policy_loss("sapo")
def sapo(b: PolicyBatch, o: LossOptions) -> tuple[Tensor, dict]:
    """SAPO (soft adaptive policy optimization; TRL loss_type "sapo"): a sigmoid gate on the ratio instead of the clip,

        l_{i,t} = -(4 / tau) sigmoid(tau (r - 1)) A,   tau = sapo_temperature_pos where A > 0, else _neg

    r from `importance_ratio` (token or sequence level). At r = 1 the gradient is REINFORCE's (-A d lp); far from 1
    it fades smoothly instead of being cut. Stats: ratio_mean, ratio_max; clip_fraction is 0 (nothing is cut).
    """
    m = b.mask.bool()
    adv = _broadcast_adv(b.advantages, b.logprobs)
    ratio = importance_ratio(b.logprobs, b.old_logprobs, m, o.importance_sampling_level)
    tau = torch.where(adv > 0, torch.full_like(adv, o.sapo_temperature_pos),
                      torch.full_like(adv, o.sapo_temperature_neg))
    per_token = -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv
    with torch.no_grad():
        none = torch.zeros_like(m)
        stats = _ratio_stats(ratio, none, none, m)
    return per_token, stats


@policy_loss("vespo")
def vespo(b: PolicyBatch, o: LossOptions) -> tuple[Tensor, dict]:
    """VESPO (TRL loss_type "vespo"): REINFORCE weighted by a detached gamma function of the sequence ratio,

        log w_i = clamp(sum_t clamp(lp - old, -20, 20), log 1e-8, 20)          (the sum, not the mean)
        phi_i   = exp(lambda + k log w_i - lambda w_i),   (k, lambda) = (vespo_k_pos, vespo_lambda_pos) where A >= 0,
                                                          else (vespo_k_neg, vespo_lambda_neg)
        l_{i,t} = -sg[phi_i] A lp_{i,t}

    phi(1) = 1: on-policy it is REINFORCE; samples whose ratio is far from 1 on either side are weighted down.
    Token level only (the sequence weight is built here). Stats: phi_mean, ratio_mean; clip_fraction is 0.
    """
    m = b.mask.bool()
    adv = _broadcast_adv(b.advantages, b.logprobs)
    with torch.no_grad():
        d = torch.where(m, b.logprobs.detach() - b.old_logprobs.to(b.logprobs.dtype), torch.zeros_like(b.logprobs))
        log_w = d.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).sum(-1, keepdim=True).clamp(math.log(1e-8), _MAX_LOG_RATIO)
        w = log_w.exp()
        pos = adv >= 0
        k = torch.where(pos, torch.full_like(adv, o.vespo_k_pos), torch.full_like(adv, o.vespo_k_neg))
        lam = torch.where(pos, torch.full_like(adv, o.vespo_lambda_pos),
                          torch.full_like(adv, o.vespo_lambda_neg)).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * w).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        none = torch.zeros_like(m)
        stats = {"clip_fraction": _frac(none, m), "phi_mean": _frac(torch.where(m, phi, torch.zeros_like(phi)), m),
                 "ratio_mean": _frac(w.expand_as(phi), m)}
    lp_safe = torch.where(m, b.logprobs, torch.zeros_like(b.logprobs))
    return -phi * adv * lp_safe, stats


@policy_loss("bpo")
def bpo(b: PolicyBatch, o: LossOptions) -> tuple[Tensor, dict]:
    """Bellman Policy Optimization practical loss (papers.md §4.2; TRL `BPOTrainer._compute_loss`, "paper, Eq. 14").

        mu_{i,t}  = exp(old_{i,t})     behaviour-policy probability of the sampled token
        pi_{i,t}  = exp(lp_{i,t})      current-policy probability
        w_{i,t}   = sg[ (1 + eps - mu) / (1 + eps - pi) ]                    smoothed complementary-probability ratio
        c_{i,t}   = 0 if (A > 0 and w > 1 + clip_high) or (A < 0 and w < 1 - clip_low), else 1   (UNcapped w)
        l_{i,t}   = -A_i * c_{i,t} * min(w_{i,t}, C) * lp_{i,t}

    The weight is detached: grad = -A c min(w, C) grad lp (w = 1 on-policy: REINFORCE). Clipped tokens stay in the
    denominator. Paper defaults: eps = 0.1, C = 3.0 (the project config's cap is 5.0); no KL, no entropy bonus.
    Non-finite `old_logprobs` (behaviour log-prob missing) fall back to the detached current log-prob, as TRL does.
    Token level only. Stats: clip_fraction, clip_low_fraction, clip_high_fraction, capped_fraction, omega_mean,
    ratio_mean (pi/mu).
    """
    if o.importance_sampling_level != "token":
        raise ValueError("bpo: importance_sampling_level must be token")
    m = b.mask.bool()
    adv = _broadcast_adv(b.advantages, b.logprobs)
    lp_det = b.logprobs.detach()
    old = b.old_logprobs.to(b.logprobs.dtype)
    old = torch.where(torch.isfinite(old), old, lp_det)
    with torch.no_grad():
        mu = old.exp()
        pi = lp_det.exp()
        omega = (1.0 + o.bpo_eps - mu) / (1.0 + o.bpo_eps - pi)
        low = (adv < 0) & (omega < 1.0 - o.clip_low)
        high = (adv > 0) & (omega > 1.0 + o.clip_high)
        keep = ~(low | high)
        weight = torch.where(keep, omega.clamp(max=o.bpo_cap), torch.zeros_like(omega))
    lp_safe = torch.where(m, b.logprobs, torch.zeros_like(b.logprobs))
    per_token = -adv * weight * lp_safe
    with torch.no_grad():
        log_ratio = torch.where(m, lp_det - old, torch.zeros_like(lp_det)).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        stats = {
            "clip_fraction": _frac(low | high, m),
            "clip_low_fraction": _frac(low, m),
            "clip_high_fraction": _frac(high, m),
            "capped_fraction": _frac(keep & (omega > o.bpo_cap), m),
            "omega_mean": _frac(torch.where(m, omega, torch.zeros_like(omega)), m),
            "ratio_mean": _frac(log_ratio.exp(), m),
        }
    return per_token, stats


@policy_loss("astar")
def astar_regression(b: PolicyBatch, o: LossOptions) -> tuple[Tensor, dict]:
    """A*-PO's least-squares regression (arXiv 2505.20686; TRL A2POTrainer.compute_loss), one error per sequence:

        s_i = astar_beta * sum_t m (lp - lp_ref)        the implicit reward of completion i
        L_i = (s_i - A_i)^2                             A_i = r_i - V*(x_i), estimator astar's advantage

    Every masked token of sequence i holds L_i, so seq-mean-token-mean (the aggregation the loss's spec requires)
    gives TRL's mean over the step's sequences. The gradient flows through lp; `old_logprobs` is not read (no
    importance ratio: the regression is on-policy by construction). Stats: clip_fraction (0), implicit_reward_mean.
    """
    if b.ref_logprobs is None:
        raise ValueError("astar loss: PolicyBatch.ref_logprobs is None (the reference policy's log-probs)")
    m = b.mask.bool()
    log_ratio = torch.where(m, b.logprobs - b.ref_logprobs.to(b.logprobs.dtype), torch.zeros_like(b.logprobs))
    implicit = o.astar_beta * log_ratio.sum(-1)  # [B]
    adv = b.advantages.to(b.logprobs.dtype)
    target = adv if adv.dim() == 1 else adv[:, 0]
    per_seq = (implicit - target) ** 2
    stats = {"clip_fraction": b.logprobs.new_zeros(()).detach(), "implicit_reward_mean": implicit.detach().mean()}
    return per_seq[:, None].expand_as(b.logprobs), stats


def ppo_clip_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                  clip_low: float = 0.2, clip_high: float = 0.28, num_tokens: Optional[float] = None,
                  aggregation: str = "token-mean", num_sequences: Optional[float] = None,
                  weights: Optional[Tensor] = None, level: str = "token") -> tuple[Tensor, dict]:
    """`ppo_clip` aggregated (token-mean by default: sum m w l / N, N = num_tokens or the masked tokens), with
    optional detached per-token `weights` [B, T]. Returns (loss scalar, stats)."""
    return compute_policy_loss("ppo_clip", aggregation, PolicyBatch(logprobs, old_logprobs, advantages, mask),
                               LossOptions(clip_low, clip_high, importance_sampling_level=level),
                               Normalizer(num_tokens, num_sequences), weights)


def bpo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, eps: float = 0.1,
             cap: float = 5.0, clip_low: float = 0.2, clip_high: float = 0.28, num_tokens: Optional[float] = None,
             aggregation: str = "token-mean", num_sequences: Optional[float] = None,
             weights: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """`bpo` aggregated as `ppo_clip_loss` is. Returns (loss scalar, stats)."""
    return compute_policy_loss("bpo", aggregation, PolicyBatch(logprobs, old_logprobs, advantages, mask),
                               LossOptions(clip_low, clip_high, eps, cap), Normalizer(num_tokens, num_sequences),
                               weights)


# ----------------------------------------------------------------------------------------------------------------
# KL to the reference
# ----------------------------------------------------------------------------------------------------------------

def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref) (Schulman), [B, T], 0 where mask is false:

        d = ref_lp - lp;   k3 = exp(d) - d - 1  >= 0   (= 0 iff lp == ref_lp)

    Unbiased for KL(pi || pi_ref) when tokens are sampled from pi. `ref_logprobs` is detached; the gradient flows
    through `logprobs` (d k3 / d lp = 1 - exp(d)). d is clamped to +-20 against fp32 overflow. Average it with
    `masked_mean(kl_k3(...), mask, num_tokens)`.
    """
    m = mask.bool()
    d = torch.where(m, ref_logprobs.detach().to(logprobs.dtype) - logprobs, torch.zeros_like(logprobs))
    d = d.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.where(m, torch.exp(d) - d - 1.0, torch.zeros_like(d))
