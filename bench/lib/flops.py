"""The model's shape and its analytic FLOP counts (bench/cpu_step.py sets measured seconds against them).

Elementwise work, norms, RoPE, softmax and the optimizer are not counted. With P = the decoder's linear weights
(q, k, v, o, gate, up, down over all layers), R = the sum over LoRA-adapted linears of r*(in+out), A =
n_heads*head_dim*n_layers, H x V = lm_head, and per pass n = positions computed, s = attention (query, key) pairs,
h = rows through lm_head:

    matmul    = 2*M*K*N   for an [M, K] @ [K, N] product
    forward   = 2*P*n + 2*R*n + 4*A*s + 2*H*V*h
    backward  = 2*P*n     input gradients through the frozen linears (no weight gradients: the base is frozen)
              + 4*R*n     LoRA: the gradients of both LoRA matrices and of their inputs
              + 8*A*s     attention: gradients through the scores and the values (2x its forward)
              + 4*H*V*h   lm_head: its input gradient, and the recomputation of each checkpointed log-prob chunk
              + (2*P*n + 2*R*n + 4*A*s) when gradient checkpointing recomputes the decoder's forward

Positions are those the hardware computes: padding included, and in HF generate finished rows are computed until
every row has stopped. Attention pairs are causal (query t sees t+1 keys; a decode step sees the whole cache, left
padding included). lm_head rows: generate computes one row per sequence per call (logits_to_keep=1), the log-prob
pass only the completion tokens. vLLM computes no padding (`vllm_generation_flops`): its prefill counts the real
prompt tokens and each sampled token after the first costs one decode position.

The fast CPU engine (`fast_generation_flops`, per FastDecoder.generate call of basis_lite/engines/fast_cpu.py): the
shared prefix P once at batch 1 (P x P attention pairs: sdpa computes every pair of its boolean mask), B x S prompt
positions (S = longest prompt - P; shorter suffixes are left-padded, and the pads computed) over P + S cache slots
each, then c - 1 single-token decode positions for a row that sampled c tokens (finished rows leave the batch),
step s over P + S + s + 1 slots, one lm_head row per row and step. R is 0 in float32 (the adapter is merged:
`fast_merge_flops` counts the merge, 2*r*in*out per adapted linear) and, over a 16-bit base, the fused adapter's
dense width (`fast_lora_width`: per group of linears reading one input, the stacked A [k*r, in] and the
block-diagonal B [group out, k*r], zero blocks included).
"""
from __future__ import annotations

import dataclasses

from basis_lite.model.shape import ModelShape, shape_from_config


class Shape(ModelShape):
    """The product's model shape (basis_lite.model.shape) with the counts the FLOP formulas need."""

    @classmethod
    def from_config(cls, c) -> "Shape":
        """From a transformers config object or a config.json mapping."""
        return cls(**dataclasses.asdict(shape_from_config(c)))

    @property
    def head_params(self) -> int:  # lm_head H x V (tied or not, it is a matmul)
        return self.hidden * self.vocab

    @property
    def attn_width(self) -> int:  # A: per (query, key) pair, QK^T and AV each cost 2*A FLOPs over all layers
        return self.heads * self.head_dim * self.layers

    def lora_params(self, r: int, targets=None) -> int:
        """R = sum of r*(in+out) over the adapted linears of all layers (targets None or 'all-linear': all seven)."""
        lin = self.linear_shapes
        names = lin if targets in (None, "all-linear") else [n for n in lin if n in targets]
        return self.layers * sum(r * (lin[n][0] + lin[n][1]) for n in names)


def matmul_flops(m: int, k: int, n: int) -> float:
    """An [m, k] @ [k, n] product: m*n dot products of length k, a multiply and an add each."""
    return 2.0 * m * k * n


def causal_pairs(length: int) -> int:
    """(query, key) pairs of causal attention over `length` positions: sum_{t=1..L} t."""
    return length * (length + 1) // 2


def forward_flops(shape: Shape, positions: int, pairs: int, head_rows: int, lora: int = 0,
                  layers: int | None = None) -> float:
    """2*P*n + 2*R*n + 4*A*s + 2*H*V*h; `layers` < shape.layers for a pass that stops early (no lm_head then)."""
    frac = 1.0 if layers is None else layers / shape.layers
    return (frac * (2.0 * shape.linear_params * positions + 2.0 * lora * positions + 4.0 * shape.attn_width * pairs)
            + 2.0 * shape.head_params * head_rows)


def backward_flops(shape: Shape, positions: int, pairs: int, head_rows: int, lora: int = 0,
                   recompute: bool = False) -> float:
    """Frozen base + LoRA: 2*P*n + 4*R*n + 8*A*s + 4*H*V*h, plus one decoder forward when checkpointing recomputes."""
    f = (2.0 * shape.linear_params * positions + 4.0 * lora * positions + 8.0 * shape.attn_width * pairs
         + 4.0 * shape.head_params * head_rows)
    if recompute:
        f += forward_flops(shape, positions, pairs, 0, lora)
    return f


def vllm_generation_flops(shape: Shape, prompt_lens, completion_lens, n: int, lora: int = 0) -> dict:
    """vLLM's generation FLOPs: each prompt prefilled once (one lm_head row), then every sampled token after a
    sequence's first is one decode position over its prompt plus the tokens before it. `completion_lens` is per
    sequence, prompt-major (n per prompt)."""
    pre = sum(forward_flops(shape, L, causal_pairs(L), 1, lora) for L in prompt_lens)
    dec, dec_tokens = 0.0, 0
    for i, c in enumerate(completion_lens):
        L = prompt_lens[i // n]
        for j in range(1, c):  # the j-th token after the first comes from a decode step over L + j keys
            dec += forward_flops(shape, 1, L + j, 1, lora)
            dec_tokens += 1
    return {"prefill_tokens": sum(prompt_lens), "prefill_flops": pre, "decode_tokens": dec_tokens,
            "decode_flops": dec}


# the fast CPU engine's fused linear groups (engines/fast_cpu.py): one matrix per group and layer
FAST_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def fast_lora_width(shape: Shape, r: int, targets=None) -> int:
    """The R-equivalent (so that 2*R*n is the adapter's FLOPs) of the fast engine's adapter over a 16-bit base: per
    group, the k adapted linears' A matrices stacked [k*r, in] and their s*B block-diagonal [out of the group, k*r],
    both applied dense (the zero blocks are multiplied too): k*r*(in + group out) per layer. Over a float32 base
    the adapter is merged into the weights and costs nothing per position (width 0)."""
    lin = shape.linear_shapes
    total = 0
    for group in FAST_GROUPS:
        k = sum(1 for n in group if targets in (None, "all-linear") or n in targets)
        if k:
            total += k * r * (lin[group[0]][0] + sum(lin[n][1] for n in group))
    return shape.layers * total


def fast_merge_flops(shape: Shape, r: int, targets=None) -> float:
    """FLOPs of one merge of the adapter into float32 weights: W + s * B @ A per adapted linear, 2*out*r*in each."""
    lin = shape.linear_shapes
    names = lin if targets in (None, "all-linear") else [n for n in lin if n in targets]
    return 2.0 * r * shape.layers * sum(lin[n][0] * lin[n][1] for n in names)


def fast_generation_flops(shape: Shape, prompt_lens, prefix: int, completion_lens, lora: int = 0) -> dict:
    """What one FastDecoder.generate call computes (engines/fast_cpu.py), per phase.

    `prompt_lens` and `completion_lens` per row (sampled tokens, the stop token included), `prefix` the shared
    prefix P it prefilled once, `lora` the adapter's width (`fast_lora_width`; 0 when merged). With B rows and
    S = longest prompt - P:
      prefix  P positions at batch 1, a dense P x P boolean mask (sdpa computes every pair), no lm_head row;
      prompt  B x S positions (shorter suffixes left-padded to S: the pads are computed), each query over P + S
              cache slots, one lm_head row per row;
      decode  a row that sampled c tokens runs c - 1 single-token steps (finished rows leave the batch; the last
              token needs no forward), step s (0-based) over P + S + s + 1 slots, one lm_head row each.
    Attention pairs are what sdpa computes with the engine's masks: masked slots included."""
    B = len(prompt_lens)
    P = prefix
    S = max(prompt_lens) - P if B else 0
    pre = forward_flops(shape, P, P * P, 0, lora) if P else 0.0
    prompt = forward_flops(shape, B * S, B * S * (P + S), B, lora) if B else 0.0
    dec, dec_pos = 0.0, 0
    for c in completion_lens:
        for s in range(max(0, c - 1)):
            dec += forward_flops(shape, 1, P + S + s + 1, 1, lora)
            dec_pos += 1
    return {"prefix_positions": P, "prefix_flops": pre, "prefix_calls": int(P > 0),
            "prompt_positions": B * S, "prompt_tokens": sum(prompt_lens), "prompt_flops": prompt,
            "decode_positions": dec_pos, "decode_flops": dec,
            "decode_calls": max(0, max(completion_lens, default=0) - 1)}


def lora_of_model(model) -> tuple[int, int]:
    """(R = sum of r*(in+out) over the model's LoRA layers, trainable parameter count)."""
    total = 0
    for m in model.modules():
        la = getattr(m, "lora_A", None)
        if la is None or not hasattr(la, "keys"):
            continue
        for k in la.keys():
            a, b = m.lora_A[k], m.lora_B[k]
            total += a.weight.numel() + b.weight.numel()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable
