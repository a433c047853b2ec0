"""The RL loop: prompts -> one rollout each -> rewards -> baselines -> policy update, top to bottom.

    run = setup(cfg, run_dir, resume)                   model, engine, optimizer, sampler, prior, ... (a RunState)
    for step in ...:
        batch    = next(run.sampler)                      B prompts (seeded, resumable)
        rollouts = rollout(run, batch)                    G completions per prompt (G = 1 for basis / reinforce_pp)
        rewards  = score(run, batch, rollouts)            math-verify + format + user functions
        adv, b   = baselines(run, batch, rollouts, rewards)   the estimator registered under estimator.name
        stats    = update(run, rollouts, adv, step)       token-level loss, clip, optimizer.step()
        log, maybe eval, maybe checkpoint
    finish(run)                                           final eval, adapter, summary.json

The estimator is looked up by name in `basis_lite.estimators`; this file never branches on which one it is, only
on what it says it uses (prompt features, trajectory features, an offline prior, the per-prompt history, a replay
buffer of earlier steps). Errors a user can fix surface as the exceptions of `basis_lite.errors`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
import warnings
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from .config import Config, save_config, to_dict
from .data import PromptSampler, format_prompt, load_examples
from .engines.base import params_from_config
from .errors import ConfigError, TrainingAborted
from .estimators import EstimatorContext, get_estimator
from .estimators.base import explained_variance
from .estimators.probe import ReplayBuffer
from .evaluate import evaluate
from .faults import maybe_kill
from .metrics import MetricsLog
from .models import cache_root, count_parameters, peak_memory_mb
from .priors import load_or_compute_prior, prior_values
from .rewards import RewardScorer
from .runtime import build_policy, seed_everything, setup_device
from .update import make_optimizer, make_scheduler, policy_update

log = logging.getLogger("basis_lite")


@dataclasses.dataclass
class RunState:
    """Everything one training run holds, built by `setup` and read by the step functions."""

    cfg: Config
    run_dir: Path
    device: torch.device
    model: object
    tok: object
    engine: object
    scorer: RewardScorer
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: object  # torch GradScaler for fp16 on a GPU, else None
    sampler: PromptSampler
    metrics: MetricsLog
    estimator: object  # the EstimatorSpec registered under cfg.estimator.name
    prompt_of: dict  # example id -> rendered prompt
    eval_examples: list
    prior_table: dict | None = None
    history: dict = dataclasses.field(default_factory=dict)  # example id -> [successes, rollouts] of earlier steps
    replay: ReplayBuffer | None = None  # earlier steps' rollouts, for estimators that keep a buffer
    step: int = 0  # last completed step
    bad_steps: int = 0  # non-finite steps in a row
    summary: dict = dataclasses.field(default_factory=dict)
    progress: bool = True

    @property
    def uses_features(self) -> bool:
        return self.estimator.uses_features and self.cfg.estimator.use_features

    @property
    def uses_history(self) -> bool:
        return self.estimator.uses_history and self.cfg.estimator.history

    @property
    def uses_trajectory(self) -> bool:
        return self.estimator.uses_trajectory


def train(cfg: Config, run_dir: str | Path | None = None, resume: bool = False, progress: bool = True) -> dict:
    """Train to `train.steps` (from the latest checkpoint with `resume`); returns the run's summary."""
    t_start = time.time()
    run = setup(cfg, run_dir, resume, progress)
    try:
        bar = tqdm(total=cfg.train.steps, initial=run.step, desc="train", disable=not progress, unit="step")
        for step in range(run.step + 1, cfg.train.steps + 1):
            batch = next(run.sampler)
            t0 = time.time()
            rollouts = rollout(run, batch)
            gen_s = time.time() - t0
            maybe_kill("generation", step)
            rewards, scored = score(run, batch, rollouts)
            adv, base = baselines(run, batch, rollouts, rewards, step)
            t1 = time.time()
            stats, ok = update(run, rollouts, adv, step)
            train_s = time.time() - t1
            rec = step_record(run, step, rollouts, rewards, scored, adv, base, stats, ok, gen_s, train_s)
            run.metrics.step(rec)
            report_step(run, bar, rec)
            run.step = step
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
                run.metrics.eval(step, run_eval(run, f"eval (step {step})"))
            if step % cfg.train.save_every == 0 or step == cfg.train.steps:
                ckpt.save_checkpoint(run.run_dir, step, run.model, checkpoint_state(run), _config_text(run),
                                     cfg.train.keep_last)
        bar.close()
        return finish(run, t_start)
    finally:
        run.metrics.close()
        run.scorer.close()


# ----------------------------------------------------------------------------------------------------------------
# setup


def default_run_dir(cfg: Config) -> Path:
    name = Path(cfg.preset).stem if cfg.preset else "run"
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def setup(cfg: Config, run_dir: str | Path | None, resume: bool, progress: bool) -> RunState:
    """Load data, model, engine, reward scorer, optimizer and prior; restore a checkpoint or run the first eval.

    Data loads first, so a bad dataset fails before minutes of model loading; the run folder is written only once
    model, reward functions and optimizer loaded, so a user error leaves no trace.
    """
    run_dir = Path(run_dir or cfg.output_dir or default_run_dir(cfg))
    device, dtype = setup_device(cfg)
    train_ex, eval_ex = load_examples(cfg.data, "train"), load_examples(cfg.data, "eval")
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
    scorer = RewardScorer(cfg.reward)  # starts the reward worker process: closed by train() whatever happens
    run = None
    try:
        optimizer = make_optimizer(cfg, model, device)
        # fp16 compute (a T4 has no bf16): per-token gradients (~A / tokens in the step) fall below fp16's range
        # without loss scaling
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12) if (
            device.type == "cuda" and dtype == torch.float16) else None
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        run = RunState(
            cfg=cfg, run_dir=run_dir, device=device, model=model, tok=tok, engine=engine, scorer=scorer,
            optimizer=optimizer, scheduler=make_scheduler(cfg, optimizer), scaler=scaler,
            sampler=PromptSampler(train_ex, cfg.train.batch_size, seed=cfg.train.seed),
            metrics=MetricsLog(run_dir, cfg.train.report_to, config=to_dict(cfg)),
            estimator=get_estimator(cfg.estimator.name),
            prompt_of={ex.id: format_prompt(tok, ex.question, cfg.data) for ex in train_ex},
            eval_examples=eval_ex, summary={"run_dir": str(run_dir)}, progress=progress)
        if run.estimator.replay_capacity is not None:
            run.replay = ReplayBuffer(run.estimator.replay_capacity(cfg.estimator.options))
        if run.estimator.uses_prior and cfg.estimator.prior_samples > 0:
            load_prior(run, train_ex)
        if last is not None:
            restore(run, last)
        else:
            run.metrics.start()
            run.summary["eval_before"] = run_eval(run, "eval (before)")
            run.metrics.eval(0, run.summary["eval_before"])
    except BaseException:
        if run is not None:
            run.metrics.close()
        scorer.close()
        raise
    return run


def load_prior(run: RunState, train_ex) -> None:
    """The offline prior: K reference rollouts per training prompt, cached across runs.

    Computing it draws samples, loading it from the cache does not: the RNG is restored afterwards, so the same
    seed gives the same run with a cold or a warm cache.
    """
    cfg = run.cfg
    rng_before = ckpt.rng_state()
    run.prior_table = load_or_compute_prior(
        cfg, cache_root(cfg.model.cache_dir), run.engine, run.model, train_ex,
        [run.prompt_of[e.id] for e in train_ex], run.scorer, params_from_config(cfg.generation),
        cfg.estimator.prior_samples, progress=run.progress)
    ckpt.set_rng_state(rng_before)
    run.summary["prior_seconds"] = run.prior_table.get("seconds", 0.0)
    run.summary["prior_cached"] = run.prior_table["cached"]


def restore(run: RunState, last: Path) -> None:
    state = ckpt.load_state(last)
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.sampler.load_state_dict(state["sampler"])
    run.history = state.get("history", {})
    if run.replay is not None and state.get("replay") is not None:
        run.replay.load_state_dict(state["replay"])
    if run.scaler is not None and state.get("scaler"):
        run.scaler.load_state_dict(state["scaler"])
    run.step, run.bad_steps = state["step"], state.get("bad_steps", 0)
    run.summary["eval_before"] = state.get("eval_before")
    ckpt.set_rng_state(state["rng"])
    run.metrics.resume(run.step)
    log.info("resumed from %s at step %d", last, run.step)


def checkpoint_state(run: RunState) -> dict:
    return {"step": run.step, "optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(),
            "sampler": run.sampler.state_dict(), "rng": ckpt.rng_state(), "history": run.history,
            "bad_steps": run.bad_steps, "eval_before": run.summary.get("eval_before"),
            "scaler": run.scaler.state_dict() if run.scaler is not None else None,
            "prior_key": run.prior_table["key"] if run.prior_table else None,
            "replay": run.replay.state_dict() if run.replay is not None else None}


def _config_text(run: RunState) -> str:
    return (run.run_dir / "config.yaml").read_text()


# ----------------------------------------------------------------------------------------------------------------
# one step


def rollout(run: RunState, batch) -> list:
    """G completions per prompt from the engine, with the current adapter pushed to it first."""
    prompts = [run.prompt_of[ex.id] for ex in batch]
    run.engine.sync(run.model)
    params = params_from_config(run.cfg.generation, n=run.cfg.estimator.rollouts_per_prompt)
    if run.uses_trajectory:
        run.engine.trajectory_seconds = 0.0  # this step's share, for the metrics line
        return run.engine.generate(prompts, params, with_features=run.uses_features, with_trajectory=True)
    return run.engine.generate(prompts, params, with_features=run.uses_features)


def score(run: RunState, batch, rollouts):
    """(rewards [B, G], the scorer's per-rollout breakdown). A reward function that raises or hangs scores 0 and is
    counted in `reward_warnings`; it never stops the run."""
    G = run.cfg.estimator.rollouts_per_prompt
    golds = [ex.answer for ex in batch for _ in range(G)]
    scored = run.scorer([r.prompt for r in rollouts], [r.text for r in rollouts], golds)
    return torch.tensor(scored.total, dtype=torch.float32).view(len(batch), G), scored


def baselines(run: RunState, batch, rollouts, rewards: torch.Tensor, step: int = 0):
    """(advantages [B, G], baselines [B, G]) from the configured estimator, with the side information it uses.

    The per-prompt history and the replay buffer get this batch only after the baselines are computed."""
    est, G = run.cfg.estimator, run.cfg.estimator.rollouts_per_prompt
    ids = [ex.id for ex in batch]
    prior = None
    if run.estimator.uses_prior or run.uses_history:
        prior = prior_values(ids, run.prior_table, run.history if run.uses_history else None)
    features = None
    if run.uses_features and rollouts[0].feature is not None:
        features = torch.stack([rollouts[i * G].feature for i in range(len(batch))])
    trajectory = None
    if run.uses_trajectory and rollouts[0].trajectory is not None:
        trajectory = torch.stack([r.trajectory for r in rollouts]).view(len(batch), G, -1)
    ctx = EstimatorContext(prompt_ids=ids, prior=prior, features=features, history=run.history,
                           trajectory_features=trajectory, replay=run.replay, options=est.options,
                           normalize=est.normalize)
    adv, base = run.estimator.compute(rewards, ctx)
    if run.uses_history:  # after the baselines: a prompt's history never holds its current reward
        for ex, row in zip(batch, rewards):
            h = run.history.setdefault(ex.id, [0, 0])
            h[0] += int(round(float(row.sum())))
            h[1] += G
    if run.replay is not None:
        run.replay.add(step, ids, rewards, features, trajectory)
    return adv, base


def update(run: RunState, rollouts, adv: torch.Tensor, step: int):
    """One optimizer step; a non-finite loss skips it, `train.max_bad_steps` of them in a row abort the run."""
    cfg = run.cfg
    try:
        stats, ok = policy_update(cfg, run.model, run.optimizer, rollouts, adv.view(-1), run.tok.pad_token_id,
                                  run.device, step, run.scaler)
    except torch.OutOfMemoryError:
        raise TrainingAborted(
            f"CUDA out of memory at step {step} with train.micro_batch_size={cfg.train.micro_batch_size}; "
            f"try --set train.micro_batch_size={max(1, cfg.train.micro_batch_size // 2)} (gradient "
            f"accumulation keeps the same effective batch) or a smaller generation.max_new_tokens") from None
    if ok:
        run.bad_steps = 0
        with warnings.catch_warnings():  # a step with all-zero advantages skips optimizer.step()
            warnings.simplefilter("ignore", UserWarning)
            run.scheduler.step()
        return stats, ok
    run.bad_steps += 1
    log.warning("step %d: non-finite loss or gradient (loss=%s, grad_norm=%s); step skipped (%d in a row, "
                "abort at %d)", step, stats["loss"], stats["grad_norm"], run.bad_steps, cfg.train.max_bad_steps)
    if run.bad_steps >= cfg.train.max_bad_steps:
        raise TrainingAborted(f"{run.bad_steps} non-finite losses in a row at step {step}; lower train.lr "
                              f"(now {cfg.train.lr}) or check the reward function. The last good checkpoint is in "
                              f"{run.run_dir / 'checkpoints'}")
    return stats, ok


def step_record(run: RunState, step, rollouts, rewards, scored, adv, base, stats, ok, gen_s, train_s) -> dict:
    """The metrics.jsonl line of one step."""
    r_flat = rewards.view(-1)
    comp_tokens = sum(len(r.completion_ids) for r in rollouts)
    return {
        "step": step, "reward_mean": r_flat.mean().item(), "accuracy": sum(scored.correct) / len(scored.correct),
        "format_rate": sum(scored.format) / len(scored.format), "baseline_mean": base.mean().item(),
        "advantage_std": adv.std().item() if adv.numel() > 1 else 0.0,
        "explained_variance": explained_variance(rewards, base), "kl": stats["kl"], "entropy": stats["entropy"],
        "completion_len": comp_tokens / len(rollouts), "loss": stats["loss"], "grad_norm": stats["grad_norm"],
        "clip_fraction": stats["clip_fraction"], "lr": run.optimizer.param_groups[0]["lr"],
        "generation_s": gen_s, "training_s": train_s, "tokens_per_s": comp_tokens / max(1e-9, gen_s + train_s),
        "peak_memory_mb": peak_memory_mb(run.device), "reward_warnings": run.scorer.warning_count,
        "skipped": not ok,
        **({"trajectory_feature_s": getattr(run.engine, "trajectory_seconds", 0.0)} if run.uses_trajectory else {}),
        **({"replay_rows": run.replay.rows} if run.replay is not None else {}),
    }


def report_step(run: RunState, bar, rec: dict) -> None:
    bar.update(1)
    bar.set_postfix(reward=f"{rec['reward_mean']:.3f}", ev=f"{rec['explained_variance']:.2f}",
                    gen=f"{rec['generation_s']:.0f}s", train=f"{rec['training_s']:.0f}s")
    if run.progress:
        tqdm.write(f"step {rec['step']:4d} | reward {rec['reward_mean']:.3f} | acc {rec['accuracy']:.3f} | "
                   f"baseline {rec['baseline_mean']:.3f} | EV {rec['explained_variance']:+.2f} | "
                   f"len {rec['completion_len']:.0f} | gen {rec['generation_s']:.1f}s "
                   f"train {rec['training_s']:.1f}s")


# ----------------------------------------------------------------------------------------------------------------
# eval and the end of the run


def run_eval(run: RunState, desc: str) -> dict:
    cfg = run.cfg
    return evaluate(run.engine, run.tok, run.eval_examples, cfg.data, max_new_tokens=cfg.train.eval_max_new_tokens,
                    require_boxed=cfg.reward.require_boxed, batch_size=cfg.train.eval_batch_size,
                    progress=run.progress, desc=desc)


def finish(run: RunState, t_start: float) -> dict:
    """The final eval, the adapter (with the config it was trained with) and summary.json."""
    cfg = run.cfg
    run.summary["eval_after"] = run_eval(run, "eval (after)")
    run.metrics.eval(cfg.train.steps, run.summary["eval_after"], final=True)
    final = run.run_dir / "adapter"
    run.model.save_pretrained(final)
    save_config(cfg, final / "basis_lite_config.yaml")
    run.summary.update({"adapter": str(final), "steps": cfg.train.steps, "seconds": time.time() - t_start,
                        "reward_warnings": run.scorer.warning_count})
    (run.run_dir / "summary.json").write_text(json.dumps(run.summary, indent=2, default=str))
    return run.summary
