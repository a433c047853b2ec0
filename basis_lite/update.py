"""The policy update: one optimizer step from a batch of scored rollouts, and the optimizer and LR schedule.

    stats, ok = policy_update(cfg, model, optimizer, rollouts, advantages, pad_id, device, step, scaler)

The loss is token-level (every micro-batch divides by the completion-token count of the whole step, so gradient
accumulation is exact). The update is on-policy with one pass: the behaviour log-probs are the detached log-probs of
the same forward, so the PPO ratio is exactly 1, the clip never acts (`clip_fraction` is 0) and `ppo_clip` and
`bpo`'s ratio part reduce to REINFORCE with the given advantages (tests/test_losses.py shows it). BPO's
complementary-probability weight still applies. The ratio matters once rollouts come from another policy (engine
log-probs, several passes over a batch), which this code does not do yet.
"""
from __future__ import annotations

import math

import torch

from .config import Config
from .errors import ConfigError
from .faults import maybe_kill
from .losses import bpo_loss, kl_k3, masked_mean, ppo_clip_loss, sequence_logprobs


def make_optimizer(cfg: Config, model, device):
    params = [p for p in model.parameters() if p.requires_grad]
    kind = cfg.train.optimizer
    if kind == "auto":
        kind = "adamw8bit" if device.type == "cuda" else "adamw"
    if kind == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ConfigError("train.optimizer: adamw8bit needs bitsandbytes (pip install 'basis-lite[gpu]'); "
                              "or use adamw") from None
        return bnb.optim.AdamW8bit(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)


def make_scheduler(cfg: Config, optimizer):
    t = cfg.train

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / (t.warmup_steps + 1)
        if t.schedule == "constant":
            return 1.0
        progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))  # cosine down to 10%

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def pack_sequences(rollouts, max_len: int, pad_id: int):
    """Right-padded [N, T] input_ids, attention_mask and completion_mask (1 on completion tokens)."""
    seqs, comp = [], []
    for r in rollouts:
        ids = (r.prompt_ids + r.completion_ids)[:max_len]
        seqs.append(ids)
        comp.append([0] * len(r.prompt_ids) + [1] * (len(ids) - len(r.prompt_ids)))
    t = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), t), dtype=torch.long)
    cmask = torch.zeros((len(seqs), t), dtype=torch.long)
    for i, (s, c) in enumerate(zip(seqs, comp)):
        input_ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
        cmask[i, :len(s)] = torch.tensor(c)
    return input_ids, attn, cmask


def policy_update(cfg: Config, model, optimizer, rollouts, advantages: torch.Tensor, pad_id: int, device,
                  step: int = 0, scaler=None, ranks=None):
    """Accumulate the token-level loss over micro-batches, then clip and step. Returns (stats, ok).

    Every micro-batch divides by the completion-token count of the WHOLE step, so the accumulated gradient equals
    the full-batch gradient (batch 8 x accumulation 1 == 1 x 8). Rollouts whose advantage is exactly 0 add
    nothing to the policy loss and are skipped (their tokens still count in the divisor) unless a KL term needs
    them. With `ranks` (data-parallel, basis_lite.distributed) `rollouts` are this rank's share: the divisor is the
    token count of the global batch, and gradients and statistics are summed over the ranks before clipping, so
    every rank takes the same step.
    """
    t = cfg.train
    total_tokens = sum(max(0, min(len(r.prompt_ids) + len(r.completion_ids), cfg.model.max_seq_length)
                           - len(r.prompt_ids)) for r in rollouts)
    if ranks is not None:
        total_tokens = int(round(ranks.sum([float(total_tokens)])[0]))
    idx = [i for i in range(len(rollouts)) if t.kl_coef > 0 or advantages[i].item() != 0.0]
    # micro-batches of similar lengths: each is padded to its longest sequence, so sorting wastes fewer FLOPs
    idx.sort(key=lambda i: len(rollouts[i].prompt_ids) + len(rollouts[i].completion_ids))
    stats = {"loss": 0.0, "kl": 0.0, "entropy_sum": 0.0, "clip_fraction": 0.0, "trained_sequences": len(idx)}
    model.train()
    ent_tokens = 0
    for start in range(0, len(idx), t.micro_batch_size):
        mb = idx[start:start + t.micro_batch_size]
        input_ids, attn, cmask = pack_sequences([rollouts[i] for i in mb], cfg.model.max_seq_length, pad_id)
        input_ids, attn, cmask = input_ids.to(device), attn.to(device), cmask.to(device)
        # log-probs of the distribution the rollouts were sampled from: logits / T (T = 0 is greedy: use 1)
        out = sequence_logprobs(model, input_ids, attn, cmask, chunk_size=t.logprob_chunk_size,
                                temperature=cfg.generation.temperature or 1.0, with_entropy=True)
        adv = advantages[mb].to(device)
        old = out.logprobs.detach()  # on-policy: one update per batch of rollouts
        if t.loss == "bpo":
            loss, ls = bpo_loss(out.logprobs, old, adv, out.mask, eps=t.bpo_eps, cap=t.bpo_cap,
                                clip_low=t.clip_low, clip_high=t.clip_high, num_tokens=total_tokens)
        else:
            loss, ls = ppo_clip_loss(out.logprobs, old, adv, out.mask, clip_low=t.clip_low, clip_high=t.clip_high,
                                     num_tokens=total_tokens)
        if t.kl_coef > 0:
            with torch.no_grad(), model.disable_adapter():
                ref = sequence_logprobs(model, input_ids, attn, cmask, chunk_size=t.logprob_chunk_size).logprobs
            kl = masked_mean(kl_k3(out.logprobs, ref, out.mask), out.mask, num_tokens=total_tokens)
            loss = loss + t.kl_coef * kl
            stats["kl"] += kl.item()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        stats["loss"] += loss.item()
        stats["clip_fraction"] += float(ls["clip_fraction"]) * int(out.mask.sum()) / max(1, total_tokens)
        if out.entropy is not None:
            stats["entropy_sum"] += float((out.entropy * out.mask).sum())
            ent_tokens += int(out.mask.sum())
    params = [p for p in model.parameters() if p.requires_grad]
    if ranks is not None:
        ent_tokens = ranks.reduce_update(params, stats, ent_tokens)
    stats["entropy"] = stats.pop("entropy_sum") / max(1, ent_tokens) if ent_tokens else float("nan")
    trained = stats["trained_sequences"]  # over all ranks
    if scaler is not None and trained:
        scaler.unscale_(optimizer)  # clip the true gradients
    grad_norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm) if trained else torch.tensor(0.0)
    stats["grad_norm"] = float(grad_norm)
    # fp16: an overflow in the scaled gradients is the scaler's business (it skips the step and lowers its scale),
    # not a bad step; only a non-finite loss is
    ok = math.isfinite(stats["loss"]) and (scaler is not None or math.isfinite(stats["grad_norm"]))
    if ok and trained:
        maybe_kill("optimizer", step)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return stats, ok
