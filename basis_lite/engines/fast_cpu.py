"""Rollouts on the CPU at the base model's speed: merged weights, a KV cache allocated once, finished rows leave the
batch, the prefix every prompt shares is prefilled once (used by `engines.hf.HFEngine`, `generation.fast_cpu`).

    dec = FastDecoder.build(peft_model)          # None, with `why_not(peft_model)` saying why, if unsupported
    out = dec.generate(rows_of_ids, ...)         # tokens, log-probs and prompt features per row

Weights. The decoder's linear layers run fused per layer (q|k|v and gate|up) from the engine's own copies, built
from the frozen base and the live adapter. Over a float32 base these are merged: base weight + scale * B @ A.
Over a bf16/fp16 base they hold the base weights only (o and down need no fusing and run on the base's own
tensors: only q|k|v and gate|up are copies), and the adapter runs beside them in float32, added before
rounding to the base dtype as peft's LoRA layer does: rounding a small adapter delta into a 16-bit weight would
drop it, and the rollout policy would silently not be the trained one. What depends on the adapter is rebuilt
whenever a LoRA weight changed since the last build (tensor version counters, so also for an eval right after an
optimizer step without a sync); the base weights are only read, never written. Embeddings, norms and the (tied)
output head are the base model's own tensors. The extra memory is `extra_bytes`.

Forward. A plain Llama decoder step written with torch ops (RMSNorm and rotary embeddings are the model's own
modules) over a per-call cache [layers][k|v][rows, kv heads, slots, head dim] sized for the longest prompt plus
max_new_tokens. Over a float32 base: a float32 cache and scaled_dot_product_attention. Over a 16-bit base: the cache
in the base dtype and attention as the trainer computes it there (transformers' eager kernel,
model.loading.training_attention: 16-bit matmuls, softmax in float32), so the behaviour log-probs follow the trainer's
re-scoring more closely (mean |difference| about halved in bf16) and the cache is half the size. Slot layout of a row:

    [shared prefix (P) | its prompt suffix, right-aligned in S slots (masked gap on its left) | generated tokens]

Rotary positions count real tokens only, so masked gap slots change nothing but summation order. The shared
prefix (longest common token prefix of the batch, leaving each row at least `min_suffix` prompt tokens) runs once
at batch 1 and its keys/values are copied into every row. When a row samples a stop token it is dropped from the
batch (the cache rows are compacted) before the next step.

Sampling is the engine's: log softmax(logits / T) of the sampled token in float32 as the behaviour log-prob
(T = 1 when greedy), greedy = argmax, otherwise temperature / top-k / top-p warpers as in transformers, then
either torch's global RNG (one uniform per row against the float64 cumulative distribution: the distribution
generate()'s multinomial samples, at a fraction of its cost over a large vocabulary) or one torch.Generator per row (engines/seeded.py:
row r draws its k-th uniform vector at its k-th token, whatever the other rows do).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import nonfinite_rows
from .seeded import logit_warpers

SUPPORTED_MODEL_TYPES = ("llama",)
_LINEARS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
            ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))


def _base_model(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def lora_parts(module):
    """(base nn.Linear, [(A [r, in], B [out, r], scale)] of the active adapters) of a peft LoRA layer or a Linear;
    raises ValueError for what the fast path does not reproduce."""
    base = getattr(module, "base_layer", None)
    if base is None:
        if not isinstance(module, torch.nn.Linear):
            raise ValueError(f"{type(module).__name__} is not a torch Linear")
        return module, []
    if not isinstance(base, torch.nn.Linear) or type(base) is not torch.nn.Linear:
        raise ValueError(f"base layer {type(base).__name__} is not a plain torch Linear (quantized?)")
    if getattr(module, "merged", False):
        raise ValueError("the adapter is merged into the base weights")
    if getattr(module, "disable_adapters", False):
        return base, []
    parts = []
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if getattr(module, "use_dora", {}).get(name) or name in getattr(module, "lora_variant", {}):
            raise ValueError(f"adapter {name!r} is a LoRA variant (DoRA, ...)")
        if getattr(module, "lora_bias", {}).get(name):
            raise ValueError(f"adapter {name!r} has a LoRA bias")
        if getattr(module, "fan_in_fan_out", False):
            raise ValueError("fan_in_fan_out LoRA")
        parts.append((module.lora_A[name].weight, module.lora_B[name].weight, float(module.scaling[name])))
    return base, parts


def why_not(model) -> str | None:
    """None when FastDecoder supports `model` (a peft-wrapped or plain causal LM), else the reason."""
    base = _base_model(model)
    cfg = base.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {cfg.model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    try:
        device = next(model.parameters()).device
    except StopIteration:
        return "no parameters"
    if device.type != "cpu":
        return f"model on {device.type}, not the CPU"
    body = getattr(base, "model", None)
    if body is None or not hasattr(body, "rotary_emb") or not hasattr(base, "lm_head"):
        return "no model.rotary_emb / lm_head"
    if getattr(cfg, "sliding_window", None):
        return "sliding-window attention"
    for layer in body.layers:
        for parent, names in _LINEARS:
            for n in names:
                try:
                    base_lin, _ = lora_parts(getattr(getattr(layer, parent), n))
                except (AttributeError, ValueError) as e:
                    return f"layer {parent}.{n}: {e}"
                if base_lin.weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    return f"{parent}.{n} weight dtype {base_lin.weight.dtype}"
    return None


class FastDecoder:
    """Merged-weight batched sampling for a Llama-type model on the CPU (see the module docstring)."""

    def __init__(self, model, packed: bool = True):
        self.model = model
        self.base = _base_model(model)
        self.body = self.base.model
        self.cfg = self.base.config
        a0 = self.body.layers[0].self_attn
        self.head_dim = a0.head_dim
        self.n_heads = self.cfg.num_attention_heads
        self.n_kv = self.cfg.num_key_value_heads
        self.scaling = a0.scaling
        self.dtype = lora_parts(a0.q_proj)[0].weight.dtype  # the compute dtype: the base's
        self.merged = self.dtype == torch.float32
        # over a 16-bit base: keys/values in the base dtype and attention as the trainer's eager kernel computes it
        self.attend_16 = not self.merged
        # float32: oneDNN's inner product on pre-converted weights, at decode's few rows faster than F.linear (not so
        # for bf16, measured: bench/results/generation.md)
        self.packed = packed and self.merged and torch.backends.mkldnn.is_available()
        self._key = None
        self.layers: list[dict] = []
        for layer in self.body.layers:
            groups = []
            for parent, names in _LINEARS:
                modules = [getattr(getattr(layer, parent), n) for n in names]
                bases = [lora_parts(m)[0] for m in modules]
                bias = None if all(b.bias is None for b in bases) else torch.cat([
                    b.bias.detach() if b.bias is not None else torch.zeros(b.weight.shape[0], dtype=self.dtype)
                    for b in bases])
                groups.append(_Group(bias, modules, self.packed))
            self.layers.append({"layer": layer, "groups": groups})
        lm = self.base.lm_head
        self.head = _Group(None if lm.bias is None else lm.bias.detach(), [lm], self.packed)
        self.refresh()
        self.extra_bytes = sum(g.nbytes() for e in self.layers for g in e["groups"])
        if self.packed:
            self.extra_bytes += self.head.nbytes()
        self.release()

    def release(self) -> None:
        """Free the engine's weight copies (HFEngine does after each generate(): they exist during rollouts only,
        not beside the update's activations); the next refresh() builds them again."""
        for g in [g for e in self.layers for g in e["groups"]] + [self.head]:
            g.w = g.wm = g.lora = None
        self._key = None

    @classmethod
    def build(cls, model):
        return None if why_not(model) is not None else cls(model)

    # ------------------------------------------------------------------------------------------------ weights
    def refresh(self, force: bool = False) -> bool:
        """Rebuild what depends on the adapter (merged weights, or the fused adapter beside a 16-bit base) if the
        adapter changed since the last build: a LoRA weight written (version counters), another active adapter, or
        adapters disabled (peft's `with model.disable_adapter():`). True when rebuilt. The base is only read."""
        state = [[lora_parts(m) for m in g.modules] for e in self.layers for g in e["groups"]]
        key = tuple((len(parts), *((A._version, B._version, A.data_ptr(), B.data_ptr(), s) for A, B, s in parts))
                    for mods in state for _, parts in mods)
        if not force and key == self._key:
            return False
        groups = [g for e in self.layers for g in e["groups"]]
        with torch.no_grad():
            if self.head.w is None and self.head.wm is None:
                lm = self.base.lm_head
                if self.packed:
                    self.head.set_weight(lm.weight.detach())  # a oneDNN copy of the (tied) head
                else:
                    self.head.w = lm.weight.detach()  # the base's own tensor
            for g, mods in zip(groups, state):
                if not self.merged and g.w is None and g.wm is None:  # the frozen base, fused
                    ws = [b.weight.detach() for b, _ in mods]
                    # a single linear (o, down) runs on the base's own tensor: a copy would hold the same values
                    g.set_weight(ws[0] if len(ws) == 1 and not self.packed else torch.cat(ws))
                if self.merged:
                    w = g.w if g.w is not None else torch.empty(g.shape, dtype=self.dtype)
                    row = 0
                    for base_lin, parts in mods:
                        dst = w[row:row + base_lin.weight.shape[0]]
                        dst.copy_(base_lin.weight)
                        for A, B, s in parts:
                            dst.addmm_(B.to(self.dtype), A.to(self.dtype), alpha=s)
                        row += base_lin.weight.shape[0]
                    g.set_weight(w)
                    continue
                rank = sum(A.shape[0] for _, parts in mods for A, _, _ in parts)
                if not rank:
                    g.lora = None
                    continue
                if g.lora is None or g.lora[0].shape[0] != rank:  # [A; A; ...] and block-diagonal s * B
                    g.lora = (torch.zeros(rank, g.shape[1]), torch.zeros(g.shape[0], rank))
                row, col = 0, 0
                for base_lin, parts in mods:
                    for A, B, s in parts:
                        r = A.shape[0]
                        g.lora[0][col:col + r].copy_(A)
                        g.lora[1][row:row + B.shape[0], col:col + r].copy_(B).mul_(s)
                        col += r
                    row += base_lin.weight.shape[0]
        self._key = key
        return True

    # ------------------------------------------------------------------------------------------------ forward
    def _forward(self, ids, pos, cache, slot0: int, mask, feature_layer: int | None = None):
        """ids/pos [b, t] -> final hidden states [b, t, D]; writes k/v at slots slot0..slot0+t-1 and attends over
        slots 0..slot0+t-1 with the boolean `mask` [b, 1, t, slots]. Returns (hidden, feature-layer output)."""
        b, t = ids.shape
        h = self.body.embed_tokens(ids).to(self.dtype)
        cos, sin = self.body.rotary_emb(h, pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        end = slot0 + t
        nq, nk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        feat = None
        for li, e in enumerate(self.layers):
            layer = e["layer"]
            qkv_g, o_g, gu_g, d_g = e["groups"]
            x = layer.input_layernorm(h)
            qkv = qkv_g(x)
            q = qkv[..., :nq].view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
            k = qkv[..., nq:nq + nk].view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
            v = qkv[..., nq + nk:].view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
            q, k = rope(q, k, cos, sin)
            kc, vc = cache[li]
            kc[:b, :, slot0:end] = k
            vc[:b, :, slot0:end] = v
            a = self._attend(q, kc[:b, :, :end], vc[:b, :, :end], mask)
            h = h + o_g(a.transpose(1, 2).reshape(b, t, nq).to(self.dtype))
            x = layer.post_attention_layernorm(h)
            gu = gu_g(x)
            inter = gu.shape[-1] // 2
            h = h + d_g(layer.mlp.act_fn(gu[..., :inter]) * gu[..., inter:])
            if li == feature_layer:
                feat = h
        return self.body.norm(h), feat

    def _attend(self, q, k, v, mask):
        """q [b, heads, t, d], k/v [b, kv heads, n, d], boolean mask [b, 1, t, n] -> [b, heads, t, d]."""
        if not self.attend_16:
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=self.scaling,
                                                  enable_gqa=self.n_kv != self.n_heads)
        # transformers' eager attention (the trainer's kernel over a 16-bit base on the CPU,
        # model.loading.training_attention): scores and output through 16-bit matmuls, the softmax in float32 rounded
        # back to the base dtype. Query head h reads kv head h // (heads / kv heads), so the rep heads of a group stack
        # into one matmul's rows.
        b, H, t, d = q.shape
        rep = H // self.n_kv
        s = torch.matmul(q.reshape(b, self.n_kv, rep * t, d), k.transpose(-1, -2)) * self.scaling
        m = mask if rep == 1 else mask.unsqueeze(2).expand(b, 1, rep, t, mask.shape[-1]).reshape(b, 1, rep * t, -1)
        s = s.masked_fill(~m, float("-inf"))
        p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(p, v).view(b, H, t, d)

    def _logits(self, h):
        return self.head(h).float()

    # ------------------------------------------------------------------------------------------------ generate
    def generate(self, rows: list[list[int]], max_new_tokens: int, stop_ids, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, generators: list[torch.Generator] | None = None,
                 feature_layer: int | None = None, feature_tokens: int = 4):
        """rows: prompt token ids per sequence (already expanded to n per prompt). Returns (completions with the
        stop token kept, log-probs per completion token, [rows, D] float32 prompt features or None, per row whether
        its logits and features were finite). A row of non-finite logits (a diverged adapter) is sampled from zeros
        instead, so that decoding finishes; the caller skips what it produced.

        The weight copies are built under no_grad (ordinary tensors, rebuilt in place by later calls), the sampling
        runs under torch.inference_mode (less bookkeeping per op than no_grad: no version counters or view tracking,
        the same values), and the features are handed out as an ordinary tensor."""
        with torch.no_grad():
            self.refresh()
        with torch.inference_mode():
            toks, lps, feats, finite = self._sample(rows, max_new_tokens, stop_ids, temperature, top_p, top_k,
                                                    generators, feature_layer, feature_tokens)
        return toks, lps, None if feats is None else feats.clone(), finite

    def _sample(self, rows, max_new_tokens, stop_ids, temperature, top_p, top_k, generators, feature_layer,
                feature_tokens):
        B = len(rows)
        greedy = temperature <= 0
        stop = torch.tensor(sorted(stop_ids), dtype=torch.long)
        min_suffix = max(1, feature_tokens if feature_layer is not None else 1)
        P = _common_prefix(rows, max(0, min(len(r) for r in rows) - min_suffix))
        S = max(len(r) for r in rows) - P
        slots = P + S + max_new_tokens
        kv_dtype = self.dtype if self.attend_16 else torch.float32
        cache = [(torch.empty(B, self.n_kv, slots, self.head_dim, dtype=kv_dtype),
                  torch.empty(B, self.n_kv, slots, self.head_dim, dtype=kv_dtype)) for _ in self.layers]
        valid = torch.zeros(B, slots, dtype=torch.bool)
        valid[:, :P] = True
        if P:  # the shared prefix once, at batch 1, copied into every row
            pref = torch.tensor([rows[0][:P]])
            causal = torch.ones(P, P, dtype=torch.bool).tril()[None, None]
            self._forward(pref, torch.arange(P)[None], cache, 0, causal)
            for kc, vc in cache:
                kc[1:, :, :P] = kc[:1, :, :P]
                vc[1:, :, :P] = vc[:1, :, :P]
        ids = torch.zeros(B, S, dtype=torch.long)
        pos = torch.full((B, S), P, dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r) - P
            ids[i, S - n:] = torch.tensor(r[P:])
            pos[i, S - n:] = torch.arange(P, P + n)
            valid[i, P + S - n:P + S] = True
        j = torch.arange(P + S)
        q_slot = torch.arange(P, P + S)
        mask = valid[:, None, :P + S] & (j[None, None, :] <= q_slot[None, :, None])  # [B, S, P + S]
        mask |= (j[None, None, :] == q_slot[None, :, None])  # gap queries see themselves: no all-masked row
        h, feat = self._forward(ids, pos, cache, P, mask[:, None], feature_layer)
        feats = feat[:, -feature_tokens:, :].float().mean(dim=1) if feat is not None else None
        finite = torch.ones(B, dtype=torch.bool) if feats is None else torch.isfinite(feats).all(dim=1)
        logits = self._logits(h[:, -1])
        next_pos = torch.tensor([len(r) for r in rows])
        alive = torch.arange(B)  # original row of each cache row
        out_tok = [[] for _ in range(B)]
        out_lp = [[] for _ in range(B)]
        warpers = logit_warpers(1.0, top_p, top_k) if not greedy else []  # z below is already divided by T
        slot = P + S
        for step in range(max_new_tokens):
            bad = nonfinite_rows(logits)
            if bool(bad.any()):
                finite[alive[bad]] = False
                logits = torch.where(bad[:, None], torch.zeros_like(logits), logits)
            z = logits / temperature if (not greedy and temperature != 1.0) else logits
            lps = z - torch.logsumexp(z, dim=-1, keepdim=True)
            if greedy:
                tok = logits.argmax(dim=-1)
            else:
                warped = z
                for w in warpers:
                    warped = w(None, warped)
                if generators is None:
                    # inverse CDF in float64 (one uniform per row): the distribution multinomial samples, at a
                    # fraction of its cost over a large vocabulary
                    cdf = F.softmax(warped, dim=-1).double().cumsum_(dim=-1)
                    u = torch.rand(cdf.shape[0], 1, dtype=torch.float64) * cdf[:, -1:]
                    tok = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
                else:
                    u = torch.stack([torch.rand(warped.shape[1], generator=generators[r]) for r in alive.tolist()])
                    tok = (warped - torch.log(-torch.log(u))).argmax(dim=-1)
            lp = lps.gather(1, tok[:, None]).squeeze(1)
            done = torch.isin(tok, stop)
            for row, t_, l_ in zip(alive.tolist(), tok.tolist(), lp.tolist()):
                out_tok[row].append(t_)
                out_lp[row].append(l_)
            if step == max_new_tokens - 1:
                break
            valid[:, slot] = True
            if bool(done.any()):
                keep = (~done).nonzero().squeeze(1)
                if keep.numel() == 0:
                    break
                for kc, vc in cache:  # compact the live rows to the front, filled slots only
                    kc[:keep.numel(), :, :slot] = kc[keep, :, :slot]
                    vc[:keep.numel(), :, :slot] = vc[keep, :, :slot]
                valid = valid[keep]
                next_pos, alive, tok = next_pos[keep], alive[keep], tok[keep]
            b = alive.numel()
            h, _ = self._forward(tok[:, None], next_pos[:, None], cache, slot, valid[:b, None, None, :slot + 1])
            logits = self._logits(h[:, -1])
            next_pos = next_pos + 1
            slot += 1
        return out_tok, out_lp, feats, finite.tolist()


class _Group:
    """Linear layers that read the same input, fused: y = x @ w.T + bias (+ the adapter in float32 beside a 16-bit
    base: (x @ A.T) @ (s * B).T added in float32 and rounded to the base dtype, as peft's LoRA layer computes).
    With `packed`, w is kept only as a oneDNN tensor and applied by oneDNN's inner product."""

    def __init__(self, bias, modules, packed: bool):
        self.bias, self.modules, self.packed = bias, modules, packed
        base = [lora_parts(m)[0] if hasattr(m, "base_layer") else m for m in modules]
        self.shape = (sum(b.weight.shape[0] for b in base), base[0].weight.shape[1])
        self.w: torch.Tensor | None = None  # dense [out, in], unless packed
        self.wm = self.bm = None  # oneDNN copies of w and bias
        self.lora: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_weight(self, w: torch.Tensor) -> None:
        if not self.packed:
            self.w = w
            return
        self.wm = w.to_mkldnn()
        if self.bias is not None and self.bm is None:
            self.bm = self.bias.to_mkldnn()

    def nbytes(self) -> int:
        """The bytes this group holds beside the base model (a base tensor used as it is counts 0)."""
        dense = self.w if self.w is not None else self.wm
        own = self.wm is not None or (self.w is not None and not any(
            self.w.data_ptr() == (lora_parts(m)[0] if hasattr(m, "base_layer") else m).weight.data_ptr()
            for m in self.modules))
        n = self.shape[0] * self.shape[1] * dense.element_size() if own else 0
        return n + (sum(_nbytes(t) for t in self.lora) if self.lora else 0)

    def __call__(self, x):
        if self.wm is not None:
            lead = x.shape[:-1]
            y = torch._C._nn.mkldnn_linear(x.reshape(-1, x.shape[-1]).contiguous().to_mkldnn(), self.wm, self.bm)
            y = y.to_dense().view(*lead, self.shape[0])
        else:
            y = F.linear(x, self.w, self.bias)
        if self.lora is None:
            return y
        A, B = self.lora
        return (y.float() + F.linear(F.linear(x.float(), A), B)).to(y.dtype)


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def rope(q, k, cos, sin):
    """Rotary embeddings applied to q and k [b, heads, t, d] with cos/sin [b, 1, t, d] (the rotate-half form of
    transformers' Llama)."""
    def rot(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def _common_prefix(rows: list[list[int]], limit: int) -> int:
    first = rows[0]
    n = min(limit, len(first))
    for r in rows[1:]:
        i = 0
        while i < n and r[i] == first[i]:
            i += 1
        n = i
    return n

