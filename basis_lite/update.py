"""The policy update: one optimizer step from a batch of scored rollouts, and the optimizer and LR schedule.

    stats, ok = policy_update(cfg, model, optimizer, rollouts, advantages, pad_id, device, step, scaler)

The loss is token-level (every micro-batch divides by the completion-token count of the whole step, so gradient
accumulation is exact). `train.ppo_epochs` passes go over the same rollouts, one optimizer step each, with the same
micro-batches. The PPO ratio compares the current policy with `old`: the trainer's own detached log-probs of the
first pass, computed before any step on this batch, i.e. the policy that sampled the rollouts as the trainer scores
it. With one pass the ratio is exactly 1, the clip never acts (`clip_fraction` is 0) and `ppo_clip` and `bpo`'s
ratio part reduce to REINFORCE with the given advantages (tests/test_losses.py shows it); from the second pass on
the ratio moves and the clip acts. BPO's complementary-probability weight applies in every pass.

The engine's own log-probs (`Rollout.logprobs`) are the behaviour policy as sampled. Two weights use them, both
detached and multiplied into every token's loss:
  * mismatch correction (`train.mismatch_correction`, on by default for vLLM engines): w = min(exp(old - engine),
    train.mismatch_cap), truncated importance sampling between the engine's numerics and the trainer's;
  * EAPO (`eapo.prior_adapter`): importance weights of the completions with tokens from the prior adapter
    (`eapo.importance_weights`).
The engine/trainer log-ratio is reported whenever the engine gave log-probs.
"""
from __future__ import annotations

import math

import torch

from .config import Config
from .errors import ConfigError
from .faults import maybe_kill
from .losses import bpo_loss, kl_k3, masked_mean, ppo_clip_loss, sequence_logprobs
from .models import training_attention

# step metrics policy_update adds when they apply (the trainer copies those present into metrics.jsonl)
OPTIONAL_STEP_METRICS = ("engine_log_ratio_mean", "engine_log_ratio_max", "mismatch_truncated_fraction",
                         "eapo_injected_fraction", "eapo_injected_rollouts", "eapo_log_ratio_mean",
                         "eapo_weight_mean", "eapo_capped_fraction")


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


def mismatch_correction_on(cfg: Config) -> bool:
    """train.mismatch_correction resolved: always, never, or auto (on for vLLM engines, off for the HF engine)."""
    m = cfg.train.mismatch_correction
    return m == "always" or (m == "auto" and cfg.generation.engine != "hf")


def completion_grid(rollouts, values, shape, fill: float) -> torch.Tensor:
    """A float32 tensor of `shape` [n, T-1], aligned with `sequence_logprobs` on `pack_sequences(rollouts)`: the value
    of completion token j of rollout i sits at column len(prompt_ids) - 1 + j, `fill` elsewhere (tokens past the
    packed length are dropped; a None entry leaves its row at `fill`)."""
    out = torch.full(shape, fill, dtype=torch.float32)
    for i, (r, v) in enumerate(zip(rollouts, values)):
        if v is None:
            continue
        start = len(r.prompt_ids) - 1
        k = min(len(v), shape[1] - start)
        if k > 0:
            out[i, start:start + k] = torch.tensor(v[:k], dtype=torch.float32)
    return out


def eapo_token_weights(cfg: Config, rollouts) -> tuple[list, dict]:
    """Per rollout, the EAPO importance weight of every completion token (None for rollouts without injected
    tokens), and the batch's injection metrics."""
    from .eapo import importance_weights

    e = cfg.eapo
    n_tok = sum(len(r.completion_ids) for r in rollouts)
    stats = {"eapo_injected_fraction": sum(len(r.injected) for r in rollouts) / max(1, n_tok),
             "eapo_injected_rollouts": sum(bool(r.injected) for r in rollouts) / max(1, len(rollouts))}
    rows = [i for i, r in enumerate(rollouts) if r.injected and r.logprobs is not None]
    out: list = [None] * len(rollouts)
    if not rows:
        return out, dict(stats, eapo_log_ratio_mean=float("nan"), eapo_weight_mean=float("nan"),
                         eapo_capped_fraction=float("nan"))
    L = max(len(rollouts[i].completion_ids) for i in rows)
    pol = torch.zeros(len(rows), L)
    pri = torch.zeros(len(rows), L)
    inj = torch.zeros(len(rows), L, dtype=torch.bool)
    for k, i in enumerate(rows):
        r = rollouts[i]
        pol[k, :len(r.logprobs)] = torch.tensor(r.logprobs, dtype=torch.float32)
        pri[k, r.injected] = torch.tensor(r.prior_logprobs, dtype=torch.float32)
        inj[k, r.injected] = True
    w, st = importance_weights(pol, pri, inj, e.is_level, e.weight_cap)
    for k, i in enumerate(rows):
        out[i] = w[k, :len(rollouts[i].completion_ids)].tolist()
    stats.update(eapo_log_ratio_mean=st["log_ratio_mean"], eapo_weight_mean=st["weight_mean"],
                 eapo_capped_fraction=st["capped_fraction"])
    return out, stats


def behaviour_weights(cfg: Config, rollouts, eapo_w, old: torch.Tensor, mask: torch.Tensor, acc: dict):
    """The detached per-token loss weights of one micro-batch ([n, T-1], or None for all ones): the truncated
    engine/trainer importance weights when the mismatch correction is on, times the EAPO weights. Accumulates the
    engine/trainer log-ratio statistics into `acc`."""
    w = None
    if any(r.logprobs is not None for r in rollouts):
        eng = completion_grid(rollouts, [r.logprobs for r in rollouts], tuple(old.shape), float("nan")).to(old.device)
        known = mask.bool() & torch.isfinite(eng)
        d = torch.where(known, old - torch.nan_to_num(eng), torch.zeros_like(old))
        acc["sum"] += float(d.sum())
        acc["n"] += int(known.sum())
        if acc["n"]:
            acc["max"] = max(acc["max"], float(d.abs().max()))
        if mismatch_correction_on(cfg):
            log_cap = math.log(cfg.train.mismatch_cap)
            w = torch.where(known, torch.exp(d.clamp(max=log_cap)), torch.ones_like(d))
            acc["truncated"] += int((known & (d >= log_cap)).sum())
    if any(x is not None for x in eapo_w):
        g = completion_grid(rollouts, eapo_w, tuple(old.shape), 1.0).to(old.device)
        w = g if w is None else w * g
    return w


def policy_update(cfg: Config, model, optimizer, rollouts, advantages: torch.Tensor, pad_id: int, device,
                  step: int = 0, scaler=None, ranks=None):
    """See `_policy_update`; runs it with the update's attention kernel (models.training_attention)."""
    with training_attention(model):
        return _policy_update(cfg, model, optimizer, rollouts, advantages, pad_id, device, step, scaler, ranks)


def _policy_update(cfg: Config, model, optimizer, rollouts, advantages: torch.Tensor, pad_id: int, device,
                   step: int = 0, scaler=None, ranks=None):
    """`train.ppo_epochs` optimizer steps on one batch of rollouts; each accumulates the token-level loss over the
    micro-batches, then clips and steps. Returns (stats, ok).

    Every micro-batch divides by the completion-token count of the WHOLE step, so the accumulated gradient equals
    the full-batch gradient (batch 8 x accumulation 1 == 1 x 8). Rollouts whose advantage is exactly 0 add
    nothing to the policy loss and are skipped (their tokens still count in the divisor) unless a KL term needs
    them. Loss, KL, grad_norm and clip_fraction are means over the passes; entropy is the first pass's. A
    non-finite pass stops the update (ok False); the passes before it have stepped. With `ranks` (data-parallel,
    basis_lite.distributed) `rollouts` are this rank's share: the divisor is the token count of the global batch, and
    each pass's gradients and statistics are summed over the ranks before clipping, so every rank takes the same steps.
    """
    t = cfg.train
    total_tokens = sum(max(0, min(len(r.prompt_ids) + len(r.completion_ids), cfg.model.max_seq_length)
                           - len(r.prompt_ids)) for r in rollouts)
    if ranks is not None:
        total_tokens = int(round(ranks.sum([float(total_tokens)])[0]))
    idx = [i for i in range(len(rollouts)) if t.kl_coef > 0 or advantages[i].item() != 0.0]
    # micro-batches of similar lengths: each is padded to its longest sequence, so sorting wastes fewer FLOPs
    idx.sort(key=lambda i: len(rollouts[i].prompt_ids) + len(rollouts[i].completion_ids))
    mbs = [idx[s:s + t.micro_batch_size] for s in range(0, len(idx), t.micro_batch_size)]
    stats = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0}  # entropy and trained_sequences: set by the first pass
    eapo_w: list = [None] * len(rollouts)
    if cfg.eapo.prior_adapter:
        eapo_w, eapo_stats = eapo_token_weights(cfg, rollouts)
        stats.update(eapo_stats)
    acc = {"sum": 0.0, "n": 0, "max": 0.0, "truncated": 0}
    first_pass: dict = {}  # micro-batch -> (old log-probs, weights) of the first pass, for the later ones
    model.train()
    ok, grad_norms, passes = True, [], 0
    params = [p for p in model.parameters() if p.requires_grad]
    for epoch in range(t.ppo_epochs):
        ep = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0}
        if epoch == 0:
            ep.update(entropy_sum=0.0, ent_tokens=0.0, trained=float(len(idx)))
        for k, mb in enumerate(mbs):
            input_ids, attn, cmask = pack_sequences([rollouts[i] for i in mb], cfg.model.max_seq_length, pad_id)
            input_ids, attn, cmask = input_ids.to(device), attn.to(device), cmask.to(device)
            # log-probs of the distribution the rollouts were sampled from: logits / T (T = 0 is greedy: use 1)
            out = sequence_logprobs(model, input_ids, attn, cmask, chunk_size=t.logprob_chunk_size,
                                    temperature=cfg.generation.temperature or 1.0, with_entropy=epoch == 0)
            adv = advantages[mb].to(device)
            if epoch == 0:
                old = out.logprobs.detach()  # the sampling policy: no step on this batch yet
                weights = behaviour_weights(cfg, [rollouts[i] for i in mb], [eapo_w[i] for i in mb], old, out.mask,
                                            acc)
                if t.ppo_epochs > 1:
                    first_pass[k] = (old, weights)
            else:
                old, weights = first_pass[k]
            if t.loss == "bpo":
                loss, ls = bpo_loss(out.logprobs, old, adv, out.mask, eps=t.bpo_eps, cap=t.bpo_cap,
                                    clip_low=t.clip_low, clip_high=t.clip_high, num_tokens=total_tokens,
                                    weights=weights)
            else:
                loss, ls = ppo_clip_loss(out.logprobs, old, adv, out.mask, clip_low=t.clip_low,
                                         clip_high=t.clip_high, num_tokens=total_tokens, weights=weights)
            if t.kl_coef > 0:
                with torch.no_grad(), model.disable_adapter():
                    ref = sequence_logprobs(model, input_ids, attn, cmask, chunk_size=t.logprob_chunk_size).logprobs
                kl = masked_mean(kl_k3(out.logprobs, ref, out.mask), out.mask, num_tokens=total_tokens)
                loss = loss + t.kl_coef * kl
                ep["kl"] += kl.item()
            (scaler.scale(loss) if scaler is not None else loss).backward()
            ep["loss"] += loss.item()
            ep["clip_fraction"] += float(ls["clip_fraction"]) * int(out.mask.sum()) / max(1, total_tokens)
            if out.entropy is not None:
                ep["entropy_sum"] += float((out.entropy * out.mask).sum())
                ep["ent_tokens"] += int(out.mask.sum())
        if ranks is not None:
            ranks.reduce_update(params, ep)  # gradients and this pass's statistics summed over the ranks
        if epoch == 0:
            stats["entropy_sum"], ent_tokens = ep.pop("entropy_sum"), int(round(ep.pop("ent_tokens")))
            trained = int(round(ep.pop("trained")))  # over all ranks: every rank steps when any rank trained
            stats["trained_sequences"] = trained
        if scaler is not None and trained:
            scaler.unscale_(optimizer)  # clip the true gradients
        grad_norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm) if trained else torch.tensor(0.0)
        grad_norms.append(float(grad_norm))
        passes += 1
        for key in ep:
            stats[key] += ep[key]
        # fp16: an overflow in the scaled gradients is the scaler's business (it skips the step and lowers its
        # scale), not a bad step; only a non-finite loss is
        ok = math.isfinite(ep["loss"]) and (scaler is not None or math.isfinite(grad_norms[-1]))
        if ok and trained:
            maybe_kill("optimizer", step)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not ok or not trained:
            break
    for key in ("loss", "kl", "clip_fraction"):
        stats[key] /= passes
    stats["grad_norm"] = sum(grad_norms) / passes
    stats["entropy"] = stats.pop("entropy_sum") / max(1, ent_tokens) if ent_tokens else float("nan")
    if ranks is not None and ranks.active:
        summed = ranks.sum([acc["sum"], float(acc["n"]), float(acc["truncated"])])
        acc.update(sum=summed[0], n=int(round(summed[1])), truncated=int(round(summed[2])),
                   max=ranks.max([acc["max"]])[0])
    if acc["n"]:
        stats["engine_log_ratio_mean"] = acc["sum"] / acc["n"]
        stats["engine_log_ratio_max"] = acc["max"]
        if mismatch_correction_on(cfg):
            stats["mismatch_truncated_fraction"] = acc["truncated"] / acc["n"]
    return stats, ok
