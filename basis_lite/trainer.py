"""The RL loop, top to bottom: prompts -> one rollout each -> rewards -> BASIS baselines -> PPO-clip update.

    for step in range(start, steps):
        batch    = next(sampler)                                  # B prompts (seeded, resumable)
        rollouts = engine.generate(prompts, n=G)                  # G = 1 for basis / reinforce_pp
        rewards  = scorer(prompts, completions, golds)            # math-verify + format + user functions
        A, b     = compute_advantages(estimator, rewards, prior, features)   # b_i never uses r_i
        loss     = sum over micro-batches of ppo_clip(token log-probs, A) / tokens in the step; backward
        clip, optimizer.step(), scheduler.step()                  # a NaN/inf step is skipped, N in a row abort
        metrics.jsonl, checkpoint every save_every steps, eval every eval_every steps

The pieces live in small modules (data, rewards, advantages, losses, engines, checkpoint); this file only wires
them. `train(cfg)` returns a summary dict; errors a user can fix surface as ConfigError/DataError/ModelError.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from .advantages import compute_advantages, explained_variance
from .config import Config, ConfigError, save_config, to_dict
from .data import PromptSampler, format_prompt, load_examples
from .engines.base import params_from_config
from .errors import TrainingAborted
from .evaluate import evaluate
from .faults import maybe_kill
from .losses import bpo_loss, kl_k3, masked_mean, ppo_clip_loss, sequence_logprobs
from .models import cache_root, count_parameters, peak_memory_mb, resolve_device, resolve_dtype
from .priors import load_or_compute_prior, prior_values
from .rewards import RewardScorer

log = logging.getLogger("basis_lite")


# ----------------------------------------------------------------------------------------------------------------
# setup helpers


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_policy(cfg: Config, device, dtype, adapter_path=None):
    """(model, tokenizer, engine) for the configured backend and engine."""
    backend = cfg.model.backend
    if backend == "auto":
        backend = "unsloth" if device.type == "cuda" and _unsloth_importable() else "hf"
    if backend == "unsloth":
        from .unsloth_backend import load_unsloth_policy

        model, tok = load_unsloth_policy(cfg, device, dtype, adapter_path)
    else:
        from .models import load_policy

        model, tok = load_policy(cfg, device, dtype, adapter_path)
    engine = make_engine(cfg, model, tok, backend)
    return model, tok, engine


def _unsloth_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("unsloth") is not None


def make_engine(cfg: Config, model, tok, backend: str = "hf"):
    max_prompt = max(16, cfg.model.max_seq_length - cfg.generation.max_new_tokens)
    if cfg.generation.engine == "hf":
        from .engines.hf import HFEngine

        return HFEngine(model, tok, batch_size=cfg.generation.batch_size, max_prompt_tokens=max_prompt)
    from .engines.vllm import make_vllm_engine

    return make_vllm_engine(cfg, model, tok, backend)


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


def default_run_dir(cfg: Config) -> Path:
    name = Path(cfg.preset).stem if cfg.preset else "run"
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


# ----------------------------------------------------------------------------------------------------------------
# one update


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
                  step: int = 0, scaler=None):
    """Accumulate the token-level loss over micro-batches, then clip and step. Returns (stats, ok).

    Every micro-batch divides by the completion-token count of the WHOLE step, so the accumulated gradient equals
    the full-batch gradient (batch 8 x accumulation 1 == 1 x 8). Rollouts whose advantage is exactly 0 add
    nothing to the policy loss and are skipped (their tokens still count in the divisor) unless a KL term needs
    them.
    """
    t = cfg.train
    total_tokens = sum(max(0, min(len(r.prompt_ids) + len(r.completion_ids), cfg.model.max_seq_length)
                           - len(r.prompt_ids)) for r in rollouts)
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
    stats["entropy"] = stats.pop("entropy_sum") / max(1, ent_tokens) if ent_tokens else float("nan")
    params = [p for p in model.parameters() if p.requires_grad]
    if scaler is not None and idx:
        scaler.unscale_(optimizer)  # clip the true gradients
    grad_norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm) if idx else torch.tensor(0.0)
    stats["grad_norm"] = float(grad_norm)
    # fp16: an overflow in the scaled gradients is the scaler's business (it skips the step and lowers its scale),
    # not a bad step; only a non-finite loss is
    ok = math.isfinite(stats["loss"]) and (scaler is not None or math.isfinite(stats["grad_norm"]))
    if ok and idx:
        maybe_kill("optimizer", step)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return stats, ok


# ----------------------------------------------------------------------------------------------------------------
# the loop


def train(cfg: Config, run_dir: str | Path | None = None, resume: bool = False, progress: bool = True) -> dict:
    t_start = time.time()
    run_dir = Path(run_dir or cfg.output_dir or default_run_dir(cfg))
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    # data first: a bad dataset fails before minutes of model loading
    train_ex = load_examples(cfg.data, "train")
    eval_ex = load_examples(cfg.data, "eval")
    last = ckpt.latest_checkpoint(run_dir) if resume else None
    if resume and last is None:
        raise ConfigError(f"--resume {run_dir}: no complete checkpoint found in {run_dir / 'checkpoints'}")
    if not resume and (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"output folder {run_dir} already holds a run; pass --resume {run_dir} to continue it "
                          f"or choose another --output")
    seed_everything(cfg.train.seed)

    model, tok, engine = build_policy(cfg, device, dtype, adapter_path=str(last / "adapter") if last else None)
    n_train, n_total = count_parameters(model)
    log.info("model %s on %s (%s): %.2fM trainable of %.1fM parameters", cfg.model.name, device, dtype,
             n_train / 1e6, n_total / 1e6)
    scorer = RewardScorer(cfg.reward)  # starts the reward worker process: closed whatever happens
    reporters = None  # TensorBoard / W&B: closed (flushed) whatever happens too
    try:
        optimizer = make_optimizer(cfg, model, device)
        # fp16 compute (a T4 has no bf16): per-token gradients (~A / tokens in the step) fall below fp16's range
        # without loss scaling
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12) if (
            device.type == "cuda" and dtype == torch.float16) else None
        scheduler = make_scheduler(cfg, optimizer)
        # the run folder is written only once model, reward functions and optimizer loaded: a user error leaves no trace
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        sampler = PromptSampler(train_ex, cfg.train.batch_size, seed=cfg.train.seed)
        est = cfg.estimator
        G = est.rollouts_per_prompt
        prompt_of = {ex.id: format_prompt(tok, ex.question, cfg.data) for ex in train_ex}
        metrics_path = run_dir / "metrics.jsonl"
        reporters = Reporters(cfg, run_dir)
        history: dict[str, list[int]] = {}
        start_step, bad_steps = 0, 0
        summary: dict = {"run_dir": str(run_dir)}

        # BASIS prior: K reference rollouts per training prompt, cached across runs
        prior_table = None
        if est.name == "basis" and est.prior_samples > 0:
            rng_before_prior = ckpt.rng_state()  # computing the prior draws samples, loading it from the cache does not;
            prior_table = load_or_compute_prior(
                cfg, cache_root(cfg.model.cache_dir), engine, model, train_ex, [prompt_of[e.id] for e in train_ex],
                scorer, params_from_config(cfg.generation), est.prior_samples, progress=progress)
            ckpt.set_rng_state(rng_before_prior)  # the same seed gives the same run with a cold or a warm cache
            summary["prior_seconds"] = prior_table.get("seconds", 0.0)
            summary["prior_cached"] = prior_table["cached"]

        if last is not None:
            state = ckpt.load_state(last)
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            sampler.load_state_dict(state["sampler"])
            history = state.get("history", {})
            if scaler is not None and state.get("scaler"):
                scaler.load_state_dict(state["scaler"])
            start_step, bad_steps = state["step"], state.get("bad_steps", 0)
            summary["eval_before"] = state.get("eval_before")
            ckpt.set_rng_state(state["rng"])
            ckpt.truncate_metrics(metrics_path, start_step)
            log.info("resumed from %s at step %d", last, start_step)
        else:
            metrics_path.write_text("")
            summary["eval_before"] = run_eval(cfg, engine, tok, eval_ex, progress, "eval (before)")
            _log_metrics(metrics_path, {"step": 0, "event": "eval", **_flat_eval(summary["eval_before"])})

        def checkpoint_state(step: int) -> dict:
            return {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "sampler": sampler.state_dict(), "rng": ckpt.rng_state(), "history": history,
                    "bad_steps": bad_steps, "eval_before": summary.get("eval_before"),
                    "scaler": scaler.state_dict() if scaler is not None else None,
                    "prior_key": prior_table["key"] if prior_table else None}

        config_text = (run_dir / "config.yaml").read_text()
        gen_params = params_from_config(cfg.generation, n=G)
        bar = tqdm(total=cfg.train.steps, initial=start_step, desc="train", disable=not progress, unit="step")
        for step in range(start_step + 1, cfg.train.steps + 1):
            # 1. prompts and rollouts
            batch = next(sampler)
            prompts = [prompt_of[ex.id] for ex in batch]
            t0 = time.time()
            engine.sync(model)
            rollouts = engine.generate(prompts, gen_params, with_features=est.name == "basis" and est.use_features)
            gen_s = time.time() - t0
            maybe_kill("generation", step)

            # 2. rewards (a reward function that raises or hangs scores 0 and is counted, never crashes the run)
            golds = [ex.answer for ex in batch for _ in range(G)]
            rb = scorer([r.prompt for r in rollouts], [r.text for r in rollouts], golds)
            rewards = torch.tensor(rb.total, dtype=torch.float32).view(len(batch), G)

            # 3. baselines: each prompt's baseline from the OTHER prompts (BASIS) or its group (GRPO/RLOO)
            ids = [ex.id for ex in batch]
            prior = prior_values(ids, prior_table, history if est.history else None) if est.name == "basis" else None
            feats = None
            if est.name == "basis" and est.use_features and rollouts[0].feature is not None:
                feats = torch.stack([rollouts[i * G].feature for i in range(len(batch))])
            options = est.options if est.name == "basis" else {}
            adv, base = compute_advantages(est.name, rewards, prior=prior, features=feats, normalize=est.normalize,
                                           **options)
            if est.history:
                for ex, row in zip(batch, rewards):
                    h = history.setdefault(ex.id, [0, 0])
                    h[0] += int(round(float(row.sum())))
                    h[1] += G

            # 4. policy update
            t1 = time.time()
            try:
                stats, ok = policy_update(cfg, model, optimizer, rollouts, adv.view(-1), tok.pad_token_id, device,
                                             step, scaler)
            except torch.OutOfMemoryError:
                raise TrainingAborted(
                    f"CUDA out of memory at step {step} with train.micro_batch_size={cfg.train.micro_batch_size}; "
                    f"try --set train.micro_batch_size={max(1, cfg.train.micro_batch_size // 2)} (gradient "
                    f"accumulation keeps the same effective batch) or a smaller generation.max_new_tokens") from None
            train_s = time.time() - t1
            if ok:
                bad_steps = 0
                with warnings.catch_warnings():  # a step with all-zero advantages skips optimizer.step()
                    warnings.simplefilter("ignore", UserWarning)
                    scheduler.step()
            else:
                bad_steps += 1
                log.warning("step %d: non-finite loss or gradient (loss=%s, grad_norm=%s); step skipped (%d in a row, "
                            "abort at %d)", step, stats["loss"], stats["grad_norm"], bad_steps, cfg.train.max_bad_steps)
                if bad_steps >= cfg.train.max_bad_steps:
                    raise TrainingAborted(f"{bad_steps} non-finite losses in a row at step {step}; lower train.lr "
                                          f"(now {cfg.train.lr}) or check the reward function. The last good "
                                          f"checkpoint is in {run_dir / 'checkpoints'}")

            # 5. metrics
            r_flat = rewards.view(-1)
            comp_tokens = sum(len(r.completion_ids) for r in rollouts)
            rec = {
                "step": step, "reward_mean": r_flat.mean().item(), "accuracy": sum(rb.correct) / len(rb.correct),
                "format_rate": sum(rb.format) / len(rb.format), "baseline_mean": base.mean().item(),
                "advantage_std": adv.std().item() if adv.numel() > 1 else 0.0,
                "explained_variance": explained_variance(rewards, base), "kl": stats["kl"],
                "entropy": stats["entropy"], "completion_len": comp_tokens / len(rollouts),
                "loss": stats["loss"], "grad_norm": stats["grad_norm"], "clip_fraction": stats["clip_fraction"],
                "lr": optimizer.param_groups[0]["lr"], "generation_s": gen_s, "training_s": train_s,
                "tokens_per_s": comp_tokens / max(1e-9, gen_s + train_s), "peak_memory_mb": peak_memory_mb(device),
                "reward_warnings": scorer.warning_count, "skipped": not ok,
            }
            _log_metrics(metrics_path, rec)
            reporters.log(rec)
            bar.update(1)
            bar.set_postfix(reward=f"{rec['reward_mean']:.3f}", ev=f"{rec['explained_variance']:.2f}",
                            gen=f"{gen_s:.0f}s", train=f"{train_s:.0f}s")
            if progress:
                tqdm.write(f"step {step:4d} | reward {rec['reward_mean']:.3f} | acc {rec['accuracy']:.3f} | "
                           f"baseline {rec['baseline_mean']:.3f} | EV {rec['explained_variance']:+.2f} | "
                           f"len {rec['completion_len']:.0f} | gen {gen_s:.1f}s train {train_s:.1f}s")

            # 6. periodic eval and checkpoint
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
                ev = run_eval(cfg, engine, tok, eval_ex, progress, f"eval (step {step})")
                _log_metrics(metrics_path, {"step": step, "event": "eval", **_flat_eval(ev)})
            if step % cfg.train.save_every == 0 or step == cfg.train.steps:
                ckpt.save_checkpoint(run_dir, step, model, checkpoint_state(step), config_text, cfg.train.keep_last)
        bar.close()

        summary["eval_after"] = run_eval(cfg, engine, tok, eval_ex, progress, "eval (after)")
        _log_metrics(metrics_path, {"step": cfg.train.steps, "event": "eval_final", **_flat_eval(summary["eval_after"])})
        final = run_dir / "adapter"
        model.save_pretrained(final)
        save_config(cfg, final / "basis_lite_config.yaml")
        summary.update({"adapter": str(final), "steps": cfg.train.steps, "seconds": time.time() - t_start,
                        "reward_warnings": scorer.warning_count})
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    finally:
        if reporters is not None:
            reporters.close()
        scorer.close()
    return summary


def run_eval(cfg: Config, engine, tok, eval_ex, progress: bool, desc: str) -> dict:
    return evaluate(engine, tok, eval_ex, cfg.data, max_new_tokens=cfg.train.eval_max_new_tokens,
                    require_boxed=cfg.reward.require_boxed, batch_size=cfg.train.eval_batch_size,
                    progress=progress, desc=desc)


def _flat_eval(ev: dict) -> dict:
    out = {"eval_accuracy": ev["accuracy"], "eval_n": ev["n"]}
    for lvl, v in ev.get("by_level", {}).items():
        out[f"eval_accuracy_level{lvl}"] = v["accuracy"]
    return out


class Reporters:
    """Optional TensorBoard / Weights & Biases logging (`train.report_to`); each imported only when asked for."""

    def __init__(self, cfg: Config, run_dir: Path):
        self.tb = self.wandb = None
        if "tensorboard" in cfg.train.report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("train.report_to: tensorboard needs `pip install tensorboard`") from None
            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if "wandb" in cfg.train.report_to:
            try:
                import wandb
            except ImportError:
                raise ConfigError("train.report_to: wandb needs `pip install wandb` (and `wandb login`)") from None
            self.wandb = wandb.init(project="basis-lite", name=run_dir.name, config=to_dict(cfg), resume="allow")

    def log(self, rec: dict) -> None:
        nums = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        if self.tb is not None:
            for k, v in nums.items():
                self.tb.add_scalar(k, v, rec["step"])
        if self.wandb is not None:
            self.wandb.log(nums, step=rec["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _log_metrics(path: Path, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec, default=float) + "\n")
        f.flush()
        os.fsync(f.fileno())
