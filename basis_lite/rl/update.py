"""The policy update: one optimizer step from a batch of scored rollouts, and the optimizer and LR schedule.

    stats, ok = policy_update(cfg, model, optimizer, rollouts, advantages, pad_id, device, step, scaler)

The policy loss (`train.loss`) and its aggregation (`train.loss_aggregation`) are looked up by name in
basis_lite.losses.policy; every aggregation divides by counts of the whole step (the default, token-mean: its completion
tokens), so gradient accumulation is exact. `train.ppo_epochs` passes go over the same rollouts, one optimizer step
each, with the same micro-batches. The PPO ratio compares the current policy with `old`: the trainer's own detached log-probs of the
first pass, computed before any step on this batch, i.e. the policy that sampled the rollouts as the trainer scores
it. With one pass the ratio is exactly 1, the clip never acts (`clip_fraction` is 0) and `ppo_clip` and `bpo`'s
ratio part reduce to REINFORCE with the given advantages (tests/losses/test_losses.py shows it); from the second pass on
the ratio moves and the clip acts. BPO's complementary-probability weight applies in every pass.

The engine's own log-probs (`Rollout.logprobs`) are the behaviour policy as sampled. Two weights use them, both
detached and multiplied into every token's loss:
  * mismatch correction (`train.mismatch_correction`, on by default for the engines whose spec says
    `mismatch_correction`: vLLM's): w = min(exp(old - engine), train.mismatch_cap), truncated importance sampling
    between the engine's numerics and the trainer's;
  * EAPO (`eapo.prior_adapter`): importance weights of the completions with tokens from the prior adapter
    (`engines.eapo.importance_weights`).
The engine/trainer log-ratio is reported whenever the engine gave log-probs.

Shared prefix (`train.shared_prefix`, on by default on the CPU): the token prefix every trained rollout shares (the
system prompt and the chat template's head: a third of the default job's tokens) runs once per pass at batch 1
(losses.policy.SharedPrefix); each micro-batch runs its rows from there against its keys and values, and after the
last micro-batch the gradients they sent back go through the prefix pass once. Same gradient up to float rounding.

Where the time goes (stats, per rank): `forward_s` (the forward with the graph, which gives the policy's log-probs),
`logprob_s` (forward-only log-prob passes: the reference policy's, for the KL term and losses that read it, and
the deferred rollout guard's),
`backward_s` and `optimizer_s` (clipping and the optimizer step). What it costs in tokens, independent of the
machine (summed over the ranks): `trained_tokens` (prompt + completion tokens through forward and backward, every
pass; the step's shared prefix counts once per pass, not once per row) and `forward_only_tokens` (tokens through the forward-only passes).
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import torch

from ..config import Config
from ..engines import get_engine
from ..errors import ConfigError
from ..faults import maybe_kill
from ..losses import LOSSES
from ..losses.policy import (
    LossOptions,
    Normalizer,
    PolicyBatch,
    SharedPrefix,
    common_prefix_len,
    compute_policy_loss,
    kl_k3,
    masked_mean,
    sequence_logprobs,
)
from ..model.loading import training_attention
from .distributed import Ranks
from .optimizers import OPTIMIZERS, resolve_optimizer

# step metrics policy_update adds when they apply (the trainer copies those present into metrics.jsonl)
OPTIONAL_STEP_METRICS = ("engine_log_ratio_mean", "engine_log_ratio_max", "mismatch_truncated_fraction",
                         "eapo_injected_fraction", "eapo_injected_rollouts", "eapo_log_ratio_mean",
                         "eapo_weight_mean", "eapo_capped_fraction")


_OPTIMIZERS: dict[str, Callable] = {}


def optimizer(name: str):
    """@optimizer("name") above fn(params, train_config) -> torch optimizer binds it to its row of the torch-free
    table rl/optimizers.py (the `train.optimizer` choices)."""
    def deco(fn):
        if name not in OPTIMIZERS:
            raise ValueError(f"optimizer {name!r} has no row in rl/optimizers.py ({', '.join(OPTIMIZERS)})")
        _OPTIMIZERS[name] = fn
        return fn
    return deco


@optimizer("adamw")
def adamw(params, t):
    return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)


@optimizer("adamw8bit")
def adamw8bit(params, t):
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ConfigError("train.optimizer: adamw8bit needs bitsandbytes (pip install 'basis-lite[gpu]'); "
                          "or use adamw") from None
    return bnb.optim.AdamW8bit(params, lr=t.lr, weight_decay=t.weight_decay)


def make_optimizer(cfg: Config, model, device):
    """The `train.optimizer` optimizer over the trainable parameters (auto: `resolve_optimizer` for the device)."""
    kind = resolve_optimizer(cfg.train.optimizer, device.type)
    if kind not in _OPTIMIZERS:
        raise ConfigError(f"train.optimizer: {kind!r} is not accepted; choose one of auto, {', '.join(_OPTIMIZERS)}")
    return _OPTIMIZERS[kind]([p for p in model.parameters() if p.requires_grad], cfg.train)


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
    """train.mismatch_correction resolved: always, never, or auto (on for engines whose numerics differ from the
    trainer's: their EngineSpec's mismatch_correction)."""
    m = cfg.train.mismatch_correction
    return m == "always" or (m == "auto" and get_engine(cfg.generation.engine).mismatch_correction)


def share_prefix_on(cfg: Config, model) -> bool:
    """train.shared_prefix resolved: always, never, or auto (on when the model is on the CPU and gradient
    checkpointing is off: HF keeps no key/value cache under checkpointing, and GPU kernels and Unsloth's patched
    forward are not checked with it)."""
    m = cfg.train.shared_prefix
    if m == "auto":
        return not cfg.model.gradient_checkpointing and next(model.parameters()).device.type == "cpu"
    return m == "always"


def step_prefix(cfg: Config, rollouts, mbs: list[list[int]]) -> list[int]:
    """The token prefix every rollout that trains shares and no log-prob of theirs reads (common_prefix_len), as
    pack_sequences cuts them; [] when shorter than MIN_SHARED_PREFIX."""
    rows = [(rollouts[i].prompt_ids + rollouts[i].completion_ids)[:cfg.model.max_seq_length]
            for mb in mbs for i in mb]
    needed = [len(rollouts[i].prompt_ids) - 1 for mb in mbs for i in mb]
    return rows[0][:common_prefix_len(rows, needed)] if rows else []


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
    from ..engines.eapo import importance_weights

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


def micro_batches(cfg: Config, rollouts, advantages: torch.Tensor) -> list[list[int]]:
    """The rollouts that train, shortest first, in micro-batches of at most `train.micro_batch_size` rows and, when
    `train.micro_batch_tokens` is set, at most that many padded tokens (rows x the longest row: each micro-batch is
    padded to its longest sequence, so sorting wastes fewer FLOPs, and its activations grow with those tokens). A
    rollout whose advantage is exactly 0 adds nothing to the policy loss and is left out unless a KL term needs it
    or the loss regresses toward the reference (A*-PO's squared error has a gradient at A = 0 too); its tokens still
    count in the divisors."""
    t = cfg.train
    every = t.kl_coef > 0 or LOSSES[t.loss].reference
    idx = [i for i in range(len(rollouts)) if every or advantages[i].item() != 0.0]

    def length(i: int) -> int:
        return len(rollouts[i].prompt_ids) + len(rollouts[i].completion_ids)

    idx.sort(key=length)
    out: list[list[int]] = []
    for i in idx:  # ascending lengths: a row added is the micro-batch's longest (as packed: at most max_seq_length)
        padded = (len(out[-1]) + 1) * min(length(i), cfg.model.max_seq_length) if out else 0
        if not out or len(out[-1]) == t.micro_batch_size or (t.micro_batch_tokens and padded > t.micro_batch_tokens):
            out.append([])
        out[-1].append(i)
    return out


def step_normalizer(cfg: Config, rollouts, ranks: Ranks) -> Normalizer:
    """The counts of the whole step (over the ranks) that every micro-batch's loss divides by."""
    local = sum(max(0, min(len(r.prompt_ids) + len(r.completion_ids), cfg.model.max_seq_length) - len(r.prompt_ids))
                for r in rollouts)
    tokens, seqs = ranks.sum([float(local), float(len(rollouts))])
    return Normalizer(num_tokens=int(round(tokens)), num_sequences=int(round(seqs)), local_tokens=local,
                      num_ranks=ranks.world, max_completion_length=cfg.generation.max_new_tokens)


def reference_logprobs(cfg: Config, model, batch: tuple, temperature: float = 1.0) -> torch.Tensor:
    """The reference policy's token log-probs (the base, adapter disabled) on a packed batch, without a graph."""
    input_ids, attn, cmask = batch
    with torch.no_grad(), model.disable_adapter():
        return sequence_logprobs(model, input_ids, attn, cmask, chunk_size=cfg.train.logprob_chunk_size,
                                 temperature=temperature).logprobs


def reference_kl(cfg: Config, model, batch: tuple, logprobs: torch.Tensor, mask: torch.Tensor,
                 norm: Normalizer) -> torch.Tensor:
    """k3 KL to the reference (the base, adapter disabled; its log-probs at temperature 1), token-mean over the whole
    step."""
    ref = reference_logprobs(cfg, model, batch)
    return masked_mean(kl_k3(logprobs, ref, mask), mask, num_tokens=norm.num_tokens)


def sync_clock(device) -> float:
    """time.time() once the device's queued work is done (CUDA runs asynchronously; elsewhere a plain read)."""
    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)
    return time.time()


def response_drift(cfg: Config, model, responses: list, pad_id: int, device) -> tuple[list[float], int]:
    """For each kept response (token ids, prompt length, float32 log-probs of its completion tokens when it was
    sampled): the mean |log-prob now - log-prob then| over its completion tokens, scored by the current policy as
    the update's forward scores it (same attention kernel, logits / generation.temperature), without a graph.
    Returns (drifts, tokens forwarded). Used by estimators whose state tracks the policy's drift (spo)."""
    out: list[float] = []
    rolls = [SimpleNamespace(prompt_ids=ids[:n], completion_ids=ids[n:]) for ids, n, _ in responses]
    mbs = cfg.train.micro_batch_size
    was = model.training
    model.eval()
    try:
        with torch.no_grad(), training_attention(model):
            for s in range(0, len(rolls), mbs):
                chunk = rolls[s:s + mbs]
                batch = tuple(x.to(device) for x in pack_sequences(chunk, cfg.model.max_seq_length, pad_id))
                lp = sequence_logprobs(model, *batch, chunk_size=cfg.train.logprob_chunk_size,
                                       temperature=cfg.generation.temperature or 1.0).logprobs.cpu()
                for i, (r, (_, n, then)) in enumerate(zip(chunk, responses[s:s + mbs])):
                    now = lp[i, n - 1:n - 1 + len(then)]
                    out.append(float((now - then.float()).abs().mean()) if len(then) else 0.0)
    finally:
        model.train(was)
    return out, sum(len(ids) for ids, _, _ in responses)


@dataclass
class _Step:
    """One policy_update call: its inputs and what its passes share."""

    cfg: Config
    model: Any
    rollouts: list
    advantages: torch.Tensor
    pad_id: int
    device: Any
    scaler: Any
    norm: Normalizer  # the whole step's counts (step_normalizer)
    mbs: list  # micro-batches of rollout indices (micro_batches)
    eapo_w: list  # per rollout: EAPO token weights or None
    acc: dict = field(default_factory=lambda: {"sum": 0.0, "n": 0, "max": 0.0, "truncated": 0})  # engine log-ratio
    first_pass: dict = field(default_factory=dict)  # micro-batch -> (old log-probs, weights, ref) of the first pass
    times: dict = field(default_factory=lambda: {"forward_s": 0.0, "logprob_s": 0.0, "backward_s": 0.0,
                                                 "optimizer_s": 0.0})
    logprobs_out: dict | None = None  # rollout index -> its completion tokens' old log-probs, when the caller asks
    prefix_ids: list = field(default_factory=list)  # the step's shared prefix (step_prefix), [] = none


def run_pass(s: _Step, epoch: int) -> dict:
    """Forward and backward over every micro-batch once; returns the pass's sums (loss, kl, clip_fraction; the
    first pass also entropy_sum, ent_tokens, trained). The first pass records each micro-batch's old log-probs (the
    sampling policy: no step on this batch yet) and weights for the later ones."""
    cfg, t = s.cfg, s.cfg.train
    ep = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "trained_tokens": 0.0, "forward_only_tokens": 0.0}
    if epoch == 0:
        ep.update(entropy_sum=0.0, ent_tokens=0.0, trained=float(sum(map(len, s.mbs))))
    opts = LossOptions.from_train(t)
    temperature = cfg.generation.temperature or 1.0  # the sampling distribution's: logits / T (T = 0 is greedy: 1)
    needs_ref = LOSSES[t.loss].reference
    prefix = None
    if s.prefix_ids:  # once per pass: the policy moved since the last one
        t0 = sync_clock(s.device)
        prefix = SharedPrefix.compute(s.model, torch.tensor(s.prefix_ids, device=s.device))
        s.times["forward_s"] += sync_clock(s.device) - t0
        ep["trained_tokens"] += len(s.prefix_ids)
    for k, mb in enumerate(s.mbs):
        rolls = [s.rollouts[i] for i in mb]
        batch = tuple(x.to(s.device) for x in pack_sequences(rolls, cfg.model.max_seq_length, s.pad_id))
        tokens = float(batch[1].sum())
        t0 = sync_clock(s.device)
        out = sequence_logprobs(s.model, *batch, chunk_size=t.logprob_chunk_size, temperature=temperature,
                                with_entropy=epoch == 0, prefix=prefix)
        t1 = sync_clock(s.device)
        s.times["forward_s"] += t1 - t0
        ep["trained_tokens"] += tokens - (prefix.length * len(mb) if prefix is not None else 0)
        if epoch == 0:
            old = out.logprobs.detach()
            weights = behaviour_weights(cfg, rolls, [s.eapo_w[i] for i in mb], old, out.mask, s.acc)
            ref = None
            if needs_ref:
                r0 = sync_clock(s.device)
                ref = reference_logprobs(cfg, s.model, batch, temperature)
                s.times["logprob_s"] += sync_clock(s.device) - r0
                ep["forward_only_tokens"] += tokens
            if t.ppo_epochs > 1:
                s.first_pass[k] = (old, weights, ref)
            if s.logprobs_out is not None:
                for row, i in enumerate(mb):
                    n, c = len(s.rollouts[i].prompt_ids), int(out.mask[row].sum())
                    s.logprobs_out[i] = old[row, n - 1:n - 1 + c].cpu()
        else:
            old, weights, ref = s.first_pass[k]
        pb = PolicyBatch(out.logprobs, old, s.advantages[mb].to(s.device), out.mask, ref)
        loss, ls = compute_policy_loss(t.loss, t.loss_aggregation, pb, opts, s.norm, weights)
        if t.kl_coef > 0:
            r0 = sync_clock(s.device)
            kl = reference_kl(cfg, s.model, batch, out.logprobs, out.mask, s.norm)
            s.times["logprob_s"] += sync_clock(s.device) - r0
            loss = loss + t.kl_coef * kl
            ep["kl"] += kl.item()
            ep["forward_only_tokens"] += tokens
        t2 = sync_clock(s.device)
        (s.scaler.scale(loss) if s.scaler is not None else loss).backward()
        s.times["backward_s"] += sync_clock(s.device) - t2
        ep["loss"] += loss.item()
        ntok = int(out.mask.sum())
        ep["clip_fraction"] += float(ls["clip_fraction"]) * ntok / max(1, s.norm.num_tokens)
        if out.entropy is not None:
            ep["entropy_sum"] += float((out.entropy * out.mask).sum())
            ep["ent_tokens"] += ntok
    if prefix is not None:  # the micro-batches' gradients w.r.t. the prefix's keys and values, through its pass
        t2 = sync_clock(s.device)
        prefix.backward()
        s.times["backward_s"] += sync_clock(s.device) - t2
    return ep


def optimizer_step(cfg: Config, optimizer, params, scaler, loss: float, trained: int, step: int) -> tuple:
    """Clip the gradients and step (when anything trained and the loss is finite); zero them. Returns
    (grad_norm, ok). fp16: an overflow in the scaled gradients is the scaler's business (it skips the step and
    lowers its scale), not a bad step; only a non-finite loss is."""
    if scaler is not None and trained:
        scaler.unscale_(optimizer)  # clip the true gradients
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm)) if trained else 0.0
    ok = math.isfinite(loss) and (scaler is not None or math.isfinite(grad_norm))
    if ok and trained:
        maybe_kill("optimizer", step)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, ok


def engine_ratio_stats(cfg: Config, acc: dict, ranks: Ranks) -> dict:
    """The engine/trainer log-ratio statistics of the step, over the ranks (empty when no engine log-probs)."""
    summed = ranks.sum([acc["sum"], float(acc["n"]), float(acc["truncated"])])
    n, top = int(round(summed[1])), ranks.max([acc["max"]])[0]
    if not n:
        return {}
    out = {"engine_log_ratio_mean": summed[0] / n, "engine_log_ratio_max": top}
    if mismatch_correction_on(cfg):
        out["mismatch_truncated_fraction"] = int(round(summed[2])) / n
    return out


def policy_update(cfg: Config, model, optimizer, rollouts, advantages: torch.Tensor, pad_id: int, device,
                  step: int = 0, scaler=None, ranks: Ranks | None = None, logprobs_out: dict | None = None,
                  before_step: Callable[[dict], None] | None = None):
    """See `_policy_update`; runs it with the update's attention kernel (model.loading.training_attention)."""
    with training_attention(model):
        return _policy_update(cfg, model, optimizer, rollouts, advantages, pad_id, device, step, scaler, ranks,
                              logprobs_out, before_step)


def _policy_update(cfg: Config, model, optimizer, rollouts, advantages: torch.Tensor, pad_id: int, device,
                   step: int = 0, scaler=None, ranks: Ranks | None = None, logprobs_out: dict | None = None,
                   before_step: Callable[[dict], None] | None = None):
    """`train.ppo_epochs` optimizer steps on one batch of rollouts; each accumulates the loss over the
    micro-batches, then clips and steps. Returns (stats, ok).

    Every micro-batch divides by counts of the WHOLE step (`step_normalizer`), so the accumulated gradient equals
    the full-batch gradient (batch 8 x accumulation 1 == 1 x 8). Loss, KL, grad_norm and clip_fraction are means
    over the passes; entropy is the first pass's. A non-finite pass stops the update (ok False), and what the passes before it
    changed (weights and optimizer state) is put back: the step is skipped as a whole. `ranks` (data-parallel, basis_lite.rl.distributed; default: one process alone): `rollouts` are
    this rank's share, the counts are the global batch's, and each pass's gradients and statistics are summed over
    the ranks before clipping, so every rank takes the same steps. `logprobs_out` (a dict, optional) receives, per
    index of a rollout that trained, the float32 log-probs of its completion tokens from the first pass's forward
    (the policy that sampled it, as the trainer scores it). `before_step(logprobs)` (optional; the deferred rollout
    guard, rl/guard.py) is called with those log-probs after the first pass and before any optimizer step; what it
    raises stops the update with the weights untouched.
    """
    ranks = ranks if ranks is not None else Ranks()
    stats = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "trained_tokens": 0.0, "forward_only_tokens": 0.0}
    eapo_w: list = [None] * len(rollouts)
    if cfg.eapo.prior_adapter:
        eapo_w, eapo_stats = eapo_token_weights(cfg, rollouts)
        stats.update(eapo_stats)
    mbs = micro_batches(cfg, rollouts, advantages)
    if before_step is not None and logprobs_out is None:
        logprobs_out = {}
    s = _Step(cfg, model, rollouts, advantages, pad_id, device, scaler, norm=step_normalizer(cfg, rollouts, ranks),
              mbs=mbs, eapo_w=eapo_w, logprobs_out=logprobs_out,
              prefix_ids=step_prefix(cfg, rollouts, mbs) if share_prefix_on(cfg, model) else [])
    params = [p for p in model.parameters() if p.requires_grad]
    # with several passes, what the passes before a non-finite one changed is put back: a skipped step moves nothing
    saved = ([p.detach().clone() for p in params], copy.deepcopy(optimizer.state_dict())) \
        if cfg.train.ppo_epochs > 1 else None
    model.train()
    grad_norms: list = []
    for epoch in range(cfg.train.ppo_epochs):
        ep = run_pass(s, epoch)
        ranks.reduce_update(params, ep)  # gradients and this pass's statistics summed over the ranks
        if epoch == 0:
            entropy_sum, ent_tokens = ep.pop("entropy_sum"), int(round(ep.pop("ent_tokens")))
            trained = int(round(ep.pop("trained")))  # over all ranks: every rank steps when any rank trained
            if before_step is not None:  # a forward-only pass of its own: timed as one
                g0 = sync_clock(device)
                try:
                    before_step(logprobs_out)
                except BaseException:
                    optimizer.zero_grad(set_to_none=True)
                    raise
                s.times["logprob_s"] += sync_clock(device) - g0
        t0 = sync_clock(device)
        grad_norm, ok = optimizer_step(cfg, optimizer, params, scaler, ep["loss"], trained, step)
        s.times["optimizer_s"] += sync_clock(device) - t0
        grad_norms.append(grad_norm)
        for key in ep:
            stats[key] += ep[key]
        if not ok or not trained:
            break
    if not ok and saved is not None and len(grad_norms) > 1:
        with torch.no_grad():
            for p, before in zip(params, saved[0]):
                p.copy_(before)
        optimizer.load_state_dict(saved[1])
    del saved
    passes = len(grad_norms)
    for key in ("loss", "kl", "clip_fraction"):
        stats[key] /= passes
    stats["grad_norm"] = sum(grad_norms) / passes
    stats["trained_sequences"] = trained
    stats["entropy"] = entropy_sum / ent_tokens if ent_tokens else float("nan")
    stats.update(engine_ratio_stats(cfg, s.acc, ranks))
    stats.update(s.times)
    return stats, ok
