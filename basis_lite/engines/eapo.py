"""EAPO experience injection: a prior adapter samples the tokens at critical decision points, and importance weights
keep the policy gradient pointed at the policy being trained.

    load_prior_adapter(model, path)                         the prior as a second peft adapter on the same base
    generate_with_injection(model, ids, mask, params, ...)  HF sampling loop that injects the prior's tokens
    inject_mask(entropy, active, threshold, rate)           which rows take the prior's token at this position
    importance_weights(policy_lp, prior_lp, injected, level, cap)   the loss weights of the injected rollouts

EAPO (papers.md) describes a prior RL-trained policy whose actions are injected at "critical decision points" and an
adapted importance-sampling scheme; its exact criterion and weights were not in the material read, so this module
is our reconstruction:

* Critical point: the current policy's next-token entropy at the sampling temperature is at least
  `eapo.entropy_threshold` (nats). At a critical point the token comes from the prior with probability
  `eapo.injection_rate` (a coin drawn from torch's global RNG, independent of the token), else from the policy.
  Threshold 0 makes every position critical (rate-only injection).
* Behaviour policy: at an injected position the token was drawn from the prior q, elsewhere from the policy pi.
  Because the injection decision depends only on the state (and the coin), the likelihood ratio of a whole
  completion between "pi everywhere" and "this behaviour" is the product over the injected positions of
  pi(token)/q(token). `is_level: sequence` (the default) applies that product, truncated at `eapo.weight_cap`, to
  every token of the completion: before truncation the policy gradient is then unbiased (tests/engines/test_eapo.py checks
  it against the closed-form gradient of a toy problem). `is_level: token` weights only the injected tokens by
  their own truncated ratio: lower variance, but biased wherever the advantage depends on other tokens than the
  injected one (the same test measures that bias).

The prior shares the base model: peft holds its LoRA matrices beside the trained adapter, and one forward over
[policy rows; prior rows] with peft's per-row `adapter_names` and one KV cache scores both; each decode step is a
forward of twice the rows. The run saves only the trained adapter. vLLM engines do not support injection.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from ..errors import ModelError
from .base import SamplingParams

PRIOR_ADAPTER = "eapo_prior"  # the peft adapter name the prior is loaded under


def load_prior_adapter(model, path: str) -> str:
    """Load the peft adapter at `path` as a frozen second adapter of `model` (a peft model on the same base).

    The trained adapter stays active and trainable; `model.save_pretrained` keeps saving only the active adapter,
    so checkpoints and the final adapter never carry the prior. Returns the prior's adapter name.
    """
    from ..runs.checkpoint import Unusable, adapter_problem, check_adapter_tensors, load_adapter_tensors

    folder = Path(path).expanduser()
    if not (folder / "adapter_config.json").is_file():
        raise ModelError(f"eapo.prior_adapter: {path!r} is not a peft adapter folder (no adapter_config.json); "
                         "give the adapter/ folder of an earlier run on the same base model, or '' to turn EAPO off")
    why = adapter_problem(folder)  # checked before peft reads it: a folder without weights is never a hub id
    if why is not None:
        raise ModelError(f"eapo.prior_adapter: {path!r} is not a usable adapter ({why}); give the adapter/ folder "
                         f"of an earlier run on the same base model, or '' to turn EAPO off")
    if not hasattr(model, "load_adapter") or not hasattr(model, "active_adapter"):
        raise ModelError("eapo.prior_adapter needs a peft model (model.backend: hf)")
    trained = model.active_adapter
    before = {n for n, p in model.named_parameters() if p.requires_grad}
    try:
        from peft import get_peft_model_state_dict

        model.load_adapter(str(folder), adapter_name=PRIOR_ADAPTER, is_trainable=False)
        check_adapter_tensors(load_adapter_tensors(folder), get_peft_model_state_dict(model, adapter_name=PRIOR_ADAPTER))
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError, OSError, Unusable) as e:
        raise ModelError(f"eapo.prior_adapter: {path!r} does not load onto this base model ({type(e).__name__}: "
                         f"{str(e)[:300]}); the prior must be a LoRA adapter trained on the same base "
                         f"(model.name)") from None
    for n, p in model.named_parameters():
        if PRIOR_ADAPTER in n:
            p.requires_grad_(False)
    after = {n for n, p in model.named_parameters() if p.requires_grad}
    if after != before or model.active_adapter != trained:
        raise ModelError("eapo.prior_adapter: loading the prior changed the trained adapter's parameters")
    # save only the trained adapter (peft's default saves every loaded adapter, the prior in a subfolder)
    model.save_pretrained = functools.partial(model.save_pretrained, selected_adapters=[trained])
    return PRIOR_ADAPTER


def inject_mask(entropy: torch.Tensor, active: torch.Tensor, threshold: float, rate: float) -> torch.Tensor:
    """[B] bool: rows whose next token the prior samples. Critical: entropy >= threshold (and the row still
    generating); injected: critical and a uniform coin from torch's global RNG < rate. One coin per row is drawn at
    every call, so the RNG stream does not depend on which rows are critical."""
    coin = torch.rand(entropy.shape[0], device=entropy.device)
    return active & (entropy >= threshold) & (coin < rate)


def importance_weights(policy_lp: torch.Tensor, prior_lp: torch.Tensor, injected: torch.Tensor,
                       level: str = "sequence", cap: float = 2.0) -> tuple[torch.Tensor, dict]:
    """Loss weights [N, L] for completions whose `injected` [N, L] positions were sampled from the prior.

    policy_lp, prior_lp: [N, L] log-probs of the sampled tokens under the policy that generated the batch and
    under the prior (only read where `injected`). With d_t = policy_lp - prior_lp at injected positions:

        sequence:  w_{i,t} = min(exp(sum_{t' injected} d_{i,t'}), cap)   for every position t of completion i
        token:     w_{i,t} = min(exp(d_{i,t}), cap) at injected positions, 1 elsewhere

    A completion without injected positions has weight 1 everywhere. Returns (weights, stats) with stats
    `log_ratio_mean` (mean d over injected positions), `weight_mean` (mean weight of the completions / injected
    tokens it applies to) and `capped_fraction` (share of those weights at the cap), as floats (NaN when nothing
    was injected).
    """
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    inj = injected.bool()
    d = torch.where(inj, policy_lp.float() - prior_lp.float(), torch.zeros((), dtype=torch.float32))
    log_cap = math.log(cap)
    if level == "sequence":
        log_w = d.sum(-1)
        w_seq = torch.exp(log_w.clamp(max=log_cap))
        weights = w_seq[:, None].expand(d.shape).clone()
        which, raw = inj.any(-1), log_w
        applied = w_seq
    elif level == "token":
        weights = torch.where(inj, torch.exp(d.clamp(max=log_cap)), torch.ones((), dtype=torch.float32))
        which, raw, applied = inj, d, weights
    else:
        raise ValueError(f"level {level!r} not accepted; choose sequence or token")
    n = int(which.sum())
    nan = float("nan")
    stats = {"log_ratio_mean": float(d[inj].mean()) if inj.any() else nan,
             "weight_mean": float(applied[which].mean()) if n else nan,
             "capped_fraction": float((raw[which] >= log_cap).float().mean()) if n else nan}
    return weights, stats


def _warp(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """top-k / top-p filtering of temperature-scaled logits (transformers' own warpers)."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    if top_k and top_k > 0:
        z = TopKLogitsWarper(top_k)(None, z)
    if top_p < 1.0:
        z = TopPLogitsWarper(top_p)(None, z)
    return z


@torch.no_grad()
def generate_with_injection(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams, *,
                            stop_ids: list[int], pad_id: int, threshold: float, rate: float,
                            prior: str = PRIOR_ADAPTER, feature_layer=None, feature_tokens: int = 4) -> dict:
    """Sample `params.n` completions per left-padded prompt, taking the prior's token at critical points.

    Sampling follows params' temperature, top_k, top_p and max_new_tokens, drawing from torch's global RNG
    (params.seeds and params.inject are not read).

    The model must be in eval mode (peft refuses per-row adapters in train mode). Rows 0..B-1 of every forward run
    the trained adapter, rows B..2B-1 the prior, both fed the same tokens, so the prior's log-probs are those of
    the same prefix. Returns a dict of lists per sequence (prompt-major, n per prompt): "tokens" (until the first
    stop id, included), "policy_lp" (every token, at `temperature`), "injected" (positions), "prior_lp" (at those
    positions), and "features" ([B, H] mean of the last `feature_tokens` prompt positions of `feature_layer`'s
    output for the policy rows, or None).
    """
    temperature, n, max_new_tokens = params.temperature, params.n, params.max_new_tokens
    if temperature <= 0:
        raise ValueError("experience injection samples: temperature must be > 0")
    ids = input_ids.repeat_interleave(n, dim=0)
    attn = attention_mask.repeat_interleave(n, dim=0)
    B = ids.shape[0]
    trained = model.active_adapter
    names = [trained] * B + [prior] * B
    ids2, attn2 = torch.cat([ids, ids]), torch.cat([attn, attn])
    captured: list[torch.Tensor] = []
    handle = None
    if feature_layer is not None:
        def hook(_module, _inp, output):
            if not captured:  # the prefill
                h = output[0] if isinstance(output, tuple) else output
                captured.append(h[:B, -feature_tokens:, :].float().mean(dim=1).cpu())

        handle = feature_layer.register_forward_hook(hook)
    stops = torch.tensor(sorted(stop_ids), device=ids.device)
    tokens, pol_lp, inj_pos, pri_lp = ([[] for _ in range(B)] for _ in range(4))
    done = torch.zeros(B, dtype=torch.bool, device=ids.device)
    try:
        pos = (attn2.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids2, attention_mask=attn2, position_ids=pos, use_cache=True, logits_to_keep=1,
                    adapter_names=names)
        next_pos = attn2.sum(-1, keepdim=True)
        for step in range(max_new_tokens):
            z = out.logits[:, -1, :].float()
            if temperature != 1.0:
                z = z / temperature
            lse = torch.logsumexp(z, dim=-1)
            zp, lse_p = z[:B], lse[:B]
            entropy = lse_p - (torch.softmax(zp, dim=-1) * zp).sum(-1)
            inject = inject_mask(entropy, ~done, threshold, rate)
            probs = torch.softmax(_warp(z, params.top_k, params.top_p), dim=-1)
            drawn = torch.multinomial(probs, 1).squeeze(-1)  # [2B]: a policy draw and a prior draw per row
            tok = torch.where(inject, drawn[B:], drawn[:B])
            tok = torch.where(done, torch.full_like(tok, pad_id), tok)
            lp_pi = zp.gather(-1, tok[:, None]).squeeze(-1) - lse_p
            lp_q = z[B:].gather(-1, tok[:, None]).squeeze(-1) - lse[B:]
            for i in (~done).nonzero().flatten().tolist():
                tokens[i].append(int(tok[i]))
                pol_lp[i].append(float(lp_pi[i]))
                if inject[i]:
                    inj_pos[i].append(step)
                    pri_lp[i].append(float(lp_q[i]))
            done = done | torch.isin(tok, stops)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            attn2 = torch.cat([attn2, torch.ones_like(attn2[:, :1])], dim=1)
            out = model(input_ids=torch.cat([tok, tok])[:, None], attention_mask=attn2, position_ids=next_pos,
                        past_key_values=out.past_key_values, use_cache=True, adapter_names=names)
            next_pos = next_pos + 1
    finally:
        if handle is not None:
            handle.remove()
    return {"tokens": tokens, "policy_lp": pol_lp, "injected": inj_pos, "prior_lp": pri_lp,
            "features": captured[0] if captured else None}
