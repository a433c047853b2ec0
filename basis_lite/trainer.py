"""The RL loop: prompts -> one rollout each -> rewards -> baselines -> policy update, top to bottom.

    run = setup(cfg, run_dir, resume)                 model, engine, optimizer, sampler, prior, ... (a RunState,
                                                        basis_lite.rl.state: saved and restored there too)
    for n in ...:
        step = rollout_step(run, n)                     B prompts -> G completions each -> rewards, gathered over
                                                        the ranks into one record (basis_lite.rl.step.Step)
        step.adv, step.base = baselines(run, step)      the estimator registered under estimator.name
        stats, ok = update(run, step)                   the policy loss, optimizer.step()
        log_step(run, bar, step, stats, ok)             metrics.jsonl and the step's line
        maybe_eval(run, n); maybe_checkpoint(run, n)
    finish(run)                                         final eval, adapter, summary.json

The estimator is looked up by name in `basis_lite.estimators`; this file never branches on which one it is, only
on what it says it uses (prompt features, trajectory features, an offline prior, the per-prompt history, a replay
buffer of earlier steps). Errors a user can fix surface as the exceptions of `basis_lite.errors`.
"""
from __future__ import annotations

import itertools
import json
import logging
import math
import shutil
import time
import warnings
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .config import Config, save_config, to_dict, validate
from .data import PromptSampler, format_prompt, load_examples
from .engines import select_engine
from .engines.base import params_from_config
from .engines.seeded import stream_seed
from .errors import Interrupted, TrainingAborted
from .estimators import EstimatorContext, get_estimator
from .faults import maybe_kill
from .model.loading import cache_root, count_parameters, outputs_finite, peak_memory_mb
from .rewards.scorer import RewardScorer, column_names, example_columns
from .rewards.worker import TrainerState
from .rl import distributed
from .rl.evaluate import evaluate
from .rl.guard import can_defer, check_rollouts, check_trained
from .rl.priors import load_or_compute_prior, load_or_compute_seeded_prior, prior_values
from .rl.state import RunState, checkpoint_state, fresh_learning_state, resume_from, stored_decisions
from .rl.step import Step
from .rl.update import make_optimizer, make_scheduler, policy_update, response_drift
from .runs import checkpoint as ckpt
from .runs.folder import claim_on_main, interrupt_message
from .runs.metrics import MetricsLog
from .runtime import DECIDED_FILE, build_policy, decide_run, seed_everything
from .safeio import atomic_write_text, disk_full_error, is_disk_full, publish_dir

log = logging.getLogger("basis_lite")


def train(cfg: Config, run_dir: str | Path | None = None, resume: bool = False, progress: bool = True) -> dict:
    """Train to `train.steps` (from the newest intact checkpoint with `resume`); returns the run's summary.

    The run folder is locked for the whole call (a second writer gets ConfigError naming this process). A
    KeyboardInterrupt (Ctrl-C, or SIGTERM turned into `Interrupted` by the CLI) comes back as `Interrupted` with a
    message that names the folder, the checkpoint kept and the command that continues the run.

    Under torchrun every rank runs this: each generates, scores and trains on its share of the global batch,
    baselines pool over the whole of it (basis_lite.rl.distributed), and rank 0 alone claims, locks and writes the run
    folder, whose name it sends to the other ranks.
    """
    t_start = time.time()
    validate(cfg)  # a Config built or changed in code is checked like a loaded one, before anything is written
    ranks = distributed.start(cfg)
    run, lock, created = None, None, False
    try:
        run_dir, created, lock, done = claim_on_main(cfg, run_dir, resume, ranks)
        if done is not None:
            log.info("%s finished all %d steps already; nothing to resume (summary.json, adapter/)", run_dir,
                     cfg.train.steps)
            return done
        run = setup(cfg, run_dir, resume, progress and ranks.is_main, ranks)
        created = False  # from here on the folder holds a run worth keeping
        bar = tqdm(total=cfg.train.steps, initial=run.step, desc="train", disable=not run.progress, unit="step")
        for n in range(run.step + 1, cfg.train.steps + 1):
            step = rollout_step(run, n)
            step.adv, step.base = baselines(run, step)
            stats, ok = update(run, step)
            log_step(run, bar, step, stats, ok)
            maybe_eval(run, n)
            maybe_checkpoint(run, n)
        bar.close()
        return finish(run, t_start)
    except KeyboardInterrupt as e:
        raise Interrupted(getattr(e, "signal_name", "SIGINT"), interrupt_message(run_dir, run, e, created)) from None
    finally:
        if run is not None:
            run.metrics.close()
            run.scorer.close()
        if created:  # nothing but the lock was written: leave no trace of a run that never started
            shutil.rmtree(run_dir, ignore_errors=True)
        if lock is not None:
            lock.release()
        ranks.close()


# ----------------------------------------------------------------------------------------------------------------
# setup


def setup(cfg: Config, run_dir: Path, resume: bool, progress: bool,
          ranks: distributed.Ranks | None = None) -> RunState:
    """Load data, model, engine, reward scorer, optimizer and prior; restore a checkpoint or run the first eval.

    `run_dir` is claimed and locked by `train`. Data loads first, so a bad dataset fails before minutes of model
    loading; config.yaml and metrics are written only once model, reward functions and optimizer loaded. A run
    resumed before its first checkpoint starts again from step 0 with its saved config. With several `ranks`,
    rank 0 alone writes into the folder and every rank starts from rank 0's adapter.
    """
    ranks = ranks or distributed.Ranks()
    ranks.watch(run_dir)
    decided = decide_run(cfg, ranks.active, stored_decisions(run_dir) if resume else None)
    device, dtype = ranks.device(torch.device(decided.device)), decided.torch_dtype
    train_ex, eval_ex = load_examples(cfg.data, "train"), load_examples(cfg.data, "eval")
    seed_everything(cfg.train.seed)
    with ranks.main_first():  # a built-in model is converted into the cache once
        # a fresh adapter; a resume loads the checkpoint's weights into it once they are checked (`resume_from`)
        model, tok, engine = build_policy(cfg, device, dtype, training=True, backend=decided.backend)
    ranks.broadcast_params([p for p in model.parameters() if p.requires_grad])
    n_train, n_total = count_parameters(model)
    log.info("model %s on %s (%s): %.2fM trainable of %.1fM parameters", cfg.model.name, device, dtype,
             n_train / 1e6, n_total / 1e6)
    # starts the reward worker process and waits until it imported the user functions and checked their signatures
    # (RewardError before anything is written); closed by train() whatever happens
    # a resume never imports a reward module from inside the run folder (a folder handed over is data, not code)
    scorer = RewardScorer(cfg.reward, column_names(train_ex, cfg.data), refused_dirs=[run_dir] if resume else [])
    run = None
    try:
        optimizer = make_optimizer(cfg, model, device)
        # fp16 compute (a T4 has no bf16): per-token gradients (~A / tokens in the step) fall below fp16's range
        # without loss scaling
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12) if (
            device.type == "cuda" and dtype == torch.float16) else None
        if ranks.is_main and not resume:
            save_config(cfg, run_dir / "config.yaml")
        if ranks.is_main and not (run_dir / DECIDED_FILE).is_file():
            atomic_write_text(run_dir / DECIDED_FILE, json.dumps(decided.as_dict(), indent=1) + "\n")
        run = RunState(
            cfg=cfg, run_dir=run_dir, device=device, model=model, tok=tok, engine=engine, scorer=scorer,
            optimizer=optimizer, scheduler=make_scheduler(cfg, optimizer), scaler=scaler,
            sampler=PromptSampler(train_ex, cfg.train.batch_size, seed=cfg.train.seed),
            metrics=(MetricsLog(run_dir, cfg.train.report_to, config=to_dict(cfg),
                                wandb_project=cfg.train.wandb_project) if ranks.is_main
                     else distributed.NullMetrics()),
            estimator=get_estimator(cfg.estimator.name),
            prompt_of={ex.id: format_prompt(tok, ex.prompt, cfg.data) for ex in train_ex},
            eval_examples=eval_ex, summary={"run_dir": str(run_dir)}, progress=progress, ranks=ranks,
            per_prompt_rng=decided.rng == "per_prompt", decided=decided)
        if (run.with_prior or run.estimator.uses_reference) and cfg.estimator.prior_samples > 0:
            load_prior(run, train_ex)
        fresh_learning_state(run)  # after the prior: an estimator's state may read the reference samples
        last = resume_from(run, train_ex) if resume else None
        if last is None:
            if resume:
                log.info("%s has no usable checkpoint: starting it again from step 0 with its saved config", run_dir)
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
    seed gives the same run with a cold or a warm cache. The samples' tokens count in the run's cost
    (`reference_tokens`, `reference_prompt_tokens`) whether this run drew them or read them from the cache
    (`prior_cached` says which).
    """
    cfg = run.cfg
    rng_before = ckpt.rng_state()
    train_ex = list({e.id: e for e in train_ex}.values())  # a revisited question is sampled once
    args = (cfg, cache_root(cfg.model.cache_dir), run.engine, run.model, train_ex,
            [run.prompt_of[e.id] for e in train_ex], run.scorer, params_from_config(cfg.generation),
            cfg.estimator.prior_samples)
    if run.per_prompt_rng:  # split over the ranks, each prompt sampled from its own stream
        run.prior_table = load_or_compute_seeded_prior(*args, ranks=run.ranks, progress=run.progress)
    else:
        run.prior_table = load_or_compute_prior(*args, progress=run.progress)
    ckpt.set_rng_state(rng_before)
    run.summary["prior_seconds"] = run.prior_table.get("seconds", 0.0)
    run.summary["prior_cached"] = run.prior_table["cached"]
    run.totals["reference_tokens"] = int(run.prior_table.get("generated_tokens", 0))
    run.totals["reference_prompt_tokens"] = int(run.prior_table.get("prompt_tokens", 0))


def _config_text(run: RunState) -> str:
    return (run.run_dir / "config.yaml").read_text()


# ----------------------------------------------------------------------------------------------------------------
# one step


def rollout_step(run: RunState, n: int) -> Step:
    """Step n's record: the global batch drawn, this rank's share generated (its own sampling streams with
    generation.rng per_prompt) and scored, then gathered over the ranks (one process: the same path)."""
    started = time.time()
    batch = next(run.sampler)  # the global batch: the same on every rank
    ranks = run.ranks
    mine = ranks.shard(batch)
    if run.per_prompt_rng:
        ranks.seed_step(run.cfg.train.seed, n)
    t0 = time.time()
    rollouts = rollout(run, mine, n, first=ranks.bounds(len(batch))[0])
    gen_s = time.time() - t0
    maybe_kill("generation", n)
    # the engine generated with the adapter being trained, or the run stops here (TrainingAborted)
    spec = select_engine(run.cfg, run.decided.backend if run.decided else "hf", run.device.type)
    guard = check_rollouts(run.cfg, run.model, run.engine, spec, rollouts, n, run.tok.pad_token_id, ranks,
                           run.run_dir, defer=can_defer(run.cfg))  # None: checked in the update (check_trained)
    rewards, scored = score(run, mine, rollouts)
    step = Step.of_rank(n, batch, mine, rollouts, rewards, scored, uses_features=run.uses_features,
                        uses_trajectory=run.uses_trajectory, generation_s=gen_s,
                        reward_warnings=run.scorer.warning_count, started=started).gathered(ranks)
    step.guard_metrics = guard
    return step


def rollout(run: RunState, batch, step: int = 0, first: int = 0) -> list:
    """G completions per prompt from the engine, with the current adapter pushed to it first.

    With per-prompt streams, prompt i of `batch` (index first + i in the step's global batch) samples from the
    stream (train.seed, step, first + i), whichever rank generates it.
    """
    prompts = [run.prompt_of[ex.id] for ex in batch]
    run.engine.sync(run.model)
    params = params_from_config(run.cfg.generation, n=run.cfg.estimator.rollouts_per_prompt)
    params.inject = bool(run.cfg.eapo.prior_adapter)  # EAPO: training rollouts only, never eval or the prior
    if run.per_prompt_rng:
        params.seeds = [stream_seed(run.cfg.train.seed, f"rollout/{step}", first + i) for i in range(len(batch))]
    if run.uses_trajectory:
        run.engine.trajectory_seconds = 0.0  # this step's share, for the metrics line
        return run.engine.generate(prompts, params, with_features=run.uses_features, with_trajectory=True)
    return run.engine.generate(prompts, params, with_features=run.uses_features)


def score(run: RunState, batch, rollouts):
    """(rewards [B, G], the scorer's per-rollout breakdown). A user reward function that fails on its first call
    stops the run (RewardError); after that a failing batch scores 0 and is counted in `reward_warnings`."""
    G = run.cfg.estimator.rollouts_per_prompt
    golds = [ex.answer for ex in batch for _ in range(G)]
    scored = run.scorer([ex.prompt for ex in batch for _ in range(G)], [r.text for r in rollouts], golds,
                        columns=example_columns(batch, run.cfg.data, repeat=G),
                        completion_ids=[r.completion_ids for r in rollouts],
                        state=TrainerState(global_step=run.step, max_steps=run.cfg.train.steps))
    return torch.tensor(scored.total, dtype=torch.float32).view(len(batch), G), scored


def baselines(run: RunState, step: Step):
    """(advantages [B, G], baselines [B, G]) of the step's global batch from the configured estimator, with the
    side information it uses (the step's features and trajectories, the prior, the history, the replay buffer).
    The per-prompt history and the replay buffer get this batch only after the baselines are computed."""
    est, G = run.cfg.estimator, run.cfg.estimator.rollouts_per_prompt
    if step.nonfinite:  # a diverged adapter's rollouts: the step is skipped (`update`), nothing learns from them
        zeros = torch.zeros_like(step.rewards)
        return zeros, zeros.clone()
    ids = [ex.id for ex in step.batch]
    prior = prior_values(ids, run.prior_table, run.history if run.uses_history else None) if run.with_prior else None
    ctx = EstimatorContext(prompt_ids=ids, prior=prior, features=step.features, history=run.history,
                           trajectory_features=step.trajectory, replay=run.replay, options=est.options,
                           normalize=run.estimator.normalizes(est.normalize),
                           state=run.est_state)
    adv, base = run.estimator.compute(step.rewards, ctx)
    if run.est_state is not None:  # after the baselines, like the history and the replay buffer
        drift = {"drift": measure_drift(run, step, ids)} if run.tracks_drift else {}
        run.est_state.observe(step.n, ids, step.rewards, **drift)
    if run.value_tracker is not None:
        run.value_tracker.observe(ids, step.rewards)
    if run.uses_history:  # after the baselines: a prompt's history never holds its current reward
        for ex, row in zip(step.batch, step.rewards):
            h = run.history.setdefault(ex.id, [0, 0])
            h[0] += int(round(float(row.sum())))
            h[1] += G
    if run.replay is not None:
        run.replay.add(step.n, ids, step.rewards, step.features, step.trajectory)
    return adv, base


def measure_drift(run: RunState, step: Step, ids: list) -> dict:
    """{batch position: D} for the prompts whose estimator state kept a response from an earlier visit: the mean
    |log-prob change| of that response between the policy that sampled it and the current one (rl/update.py
    response_drift), the responses split over the ranks and the drifts summed (every rank's state keeps the same
    responses). Its time and tokens count as a forward-only log-prob pass of the step."""
    kept = run.est_state.drift_responses(ids)
    if not kept:
        return {}
    lo, hi = run.ranks.bounds(len(kept))
    t0 = time.time()
    mine, tokens = response_drift(run.cfg, run.model, [k[1:] for k in kept[lo:hi]], run.tok.pad_token_id,
                                  run.device)
    step.logprob_s += time.time() - t0
    drifts = [0.0] * len(kept)
    drifts[lo:hi] = mine
    summed = run.ranks.sum([*drifts, float(tokens)])
    step.forward_only_tokens += int(round(summed[-1]))
    return {k[0]: d for k, d in zip(kept, summed[:-1])}


def keep_responses(run: RunState, step: Step, logprobs: dict) -> None:
    """Hand the estimator state each prompt's response of this step (its first rollout that trained: token ids as
    the update packed them, prompt length, the update's log-probs of its completion tokens; None when none
    trained), gathered over the ranks, for the drift measured at the prompt's next visit."""
    G, max_len = run.cfg.estimator.rollouts_per_prompt, run.cfg.model.max_seq_length
    local = []
    for i in range(len(step.mine)):
        item = None
        for j in range(i * G, (i + 1) * G):
            if j in logprobs:
                r = step.rollouts[j]
                ids = (r.prompt_ids + r.completion_ids)[:max_len]
                item = [float(len(r.prompt_ids)), float(len(ids)), *map(float, ids), *logprobs[j].tolist()]
                break
        local.append(item)
    responses = []
    for item in distributed.gather_items(run.ranks, local, len(step.batch)):
        if item is None:
            responses.append(None)
            continue
        n, n_ids = int(item[0]), int(item[1])  # [prompt length, token count, token ids, log-probs]
        responses.append(([int(x) for x in item[2:2 + n_ids]], n, torch.tensor(item[2 + n_ids:], dtype=torch.float32)))
    run.est_state.keep_responses([ex.id for ex in step.batch], responses)


def update(run: RunState, step: Step):
    """One optimizer step on this rank's rollouts and advantages (timed into `step.training_s`); a non-finite loss,
    or rollouts whose model outputs were not finite (a diverged adapter), skip it, `train.max_bad_steps` of them in
    a row abort the run.

    stats["update_norm"] is the L2 norm of the change of the trainable weights over the step (0 when no update
    happened: every advantage 0, a skipped step, or an optimizer step that moved nothing)."""
    t0 = time.time()
    try:
        return _update(run, step)
    finally:
        step.training_s = time.time() - t0


def _update(run: RunState, step: Step):
    cfg, n = run.cfg, step.n
    if step.nonfinite:
        return _bad_step(run, step, {"loss": float("nan"), "kl": float("nan"), "clip_fraction": 0.0,
                                     "grad_norm": float("nan"), "entropy": float("nan"), "trained_sequences": 0,
                                     "update_norm": 0.0})
    params = [p for p in run.model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    logprobs = {} if run.tracks_drift else None
    guard = None
    if step.guard_metrics is None:  # the rollout guard's log-prob check, deferred into the update's first pass
        def guard(trained: dict) -> None:
            spec = select_engine(cfg, run.decided.backend if run.decided else "hf", run.device.type)
            step.guard_metrics = check_trained(cfg, run.model, spec, step.rollouts, trained, n,
                                               run.tok.pad_token_id, run.ranks, run.run_dir)
    try:
        stats, ok = policy_update(cfg, run.model, run.optimizer, step.rollouts, step.adv_mine(run.ranks),
                                  run.tok.pad_token_id, run.device, n, run.scaler, ranks=run.ranks,
                                  logprobs_out=logprobs, before_step=guard)
    except torch.OutOfMemoryError:
        raise TrainingAborted(
            f"CUDA out of memory at step {n} with train.micro_batch_size={cfg.train.micro_batch_size}; "
            f"try --set train.micro_batch_size={max(1, cfg.train.micro_batch_size // 2)} (gradient "
            f"accumulation keeps the same effective batch) or a smaller generation.max_new_tokens") from None
    with torch.no_grad():
        stats["update_norm"] = math.sqrt(sum(float((p.detach().float() - b.float()).pow(2).sum())
                                             for p, b in zip(params, before)))
    del before
    if logprobs is not None:
        keep_responses(run, step, logprobs)
    if ok:
        run.bad_steps = 0
        with warnings.catch_warnings():  # a step with all-zero advantages skips optimizer.step()
            warnings.simplefilter("ignore", UserWarning)
            run.scheduler.step()
        return stats, ok
    return _bad_step(run, step, stats)


def _bad_step(run: RunState, step: Step, stats: dict):
    """A skipped step (the adapter as it was): counted, and `train.max_bad_steps` of them in a row abort the run,
    naming what to change and the last checkpoint (checkpoints are written only of an adapter whose outputs are
    finite: `maybe_checkpoint`)."""
    cfg, n = run.cfg, step.n
    run.bad_steps += 1
    if step.nonfinite:
        what = (f"non-finite model outputs (NaN or inf logits or features) in {step.nonfinite} rollouts: an earlier "
                f"update blew the adapter up")
    else:
        what = f"non-finite loss or gradient (loss={stats['loss']}, grad_norm={stats['grad_norm']})"
    log.warning("step %d: %s; step skipped (%d in a row, abort at %d)", n, what, run.bad_steps,
                cfg.train.max_bad_steps)
    if run.bad_steps >= cfg.train.max_bad_steps:
        raise TrainingAborted(f"{run.bad_steps} skipped steps in a row at step {n}, the last with {what}. "
                              f"{_what_to_change(cfg, stats)} {_last_good(run)}")
    return stats, False


def _what_to_change(cfg: Config, stats: dict) -> str:
    """Which setting to lower for a run that keeps producing non-finite values."""
    kl, top = stats.get("kl", float("nan")), torch.finfo(torch.float32).max  # the loss is computed in float32
    coef = cfg.train.kl_coef
    if coef > 0 and (coef > top or (math.isfinite(kl) and not abs(coef * kl) <= top)):
        return (f"train.kl_coef={coef:g} times the KL ({kl:.3g}) is not finite in float32: lower train.kl_coef.")
    decay = cfg.train.lr * cfg.train.weight_decay
    if decay > 2:
        return (f"train.lr x train.weight_decay = {decay:g} > 2: each step multiplies the weights by 1 - {decay:g}, "
                f"so they grow without bound; lower train.weight_decay or train.lr.")
    return f"Lower train.lr (now {cfg.train.lr:g}) or check the reward function."


def _last_good(run: RunState) -> str:
    last = ckpt.latest_checkpoint(run.run_dir, quiet=True)
    if last is None:
        return "No checkpoint was written: start a new run with the changed setting."
    return (f"The last checkpoint, {last}, computes finite outputs; a resumed run would repeat the same steps, so "
            f"start a new run with the changed setting.")


def adapter_finite(run: RunState) -> bool:
    """Whether the adapter's forward over two training prompts gives finite logits (`outputs_finite`)."""
    return outputs_finite(run.model, run.tok, list(itertools.islice(run.prompt_of.values(), 2)))


def log_step(run: RunState, bar, step: Step, stats: dict, ok: bool) -> None:
    """The step's metrics.jsonl line and its one-line report; the step counts as done from here."""
    for key, value in step.costs(stats).items():
        run.totals[key] += value
    run.totals["generation_s"] += step.generation_s
    for key in ("training_s", "forward_s", "logprob_s", "backward_s", "optimizer_s"):
        run.totals[key] += getattr(step, key, 0.0) + stats.get(key, 0.0)
    rec = step.metrics(run, stats, ok)
    run.metrics.step(rec)
    report_step(run, bar, rec)
    run.step = step.n


def maybe_eval(run: RunState, n: int) -> None:
    every = run.cfg.train.eval_every
    if every and n % every == 0 and n < run.cfg.train.steps:
        run.metrics.eval(n, run_eval(run, f"eval (step {n})"))


def maybe_checkpoint(run: RunState, n: int) -> None:
    """Every train.save_every steps and at the last: the ranks checked in sync, rank 0 writes the checkpoint, and
    no rank goes on before it is on disk (a rank that dies in the next step then leaves this checkpoint behind)."""
    cfg = run.cfg
    if n % cfg.train.save_every == 0 or n == cfg.train.steps:
        run.ranks.check_in_sync([p for p in run.model.parameters() if p.requires_grad], run.optimizer)
        if run.ranks.is_main and not adapter_finite(run):
            last = ckpt.latest_checkpoint(run.run_dir, quiet=True)
            log.warning("step %d: the adapter computes non-finite outputs (NaN or inf logits); no checkpoint is "
                        "written of it (the last one kept: %s)", n, last.name if last else "none")
        elif run.ranks.is_main:
            ckpt.save_checkpoint(run.run_dir, n, run.model, checkpoint_state(run), _config_text(run),
                                 cfg.train.keep_last)
        run.ranks.barrier()  # no rank goes on before rank 0's write is done


def _loo_ref(rec: dict) -> str:
    ref = rec.get("explained_variance_loo_ref")
    return f" (LOO {ref:+.2f})" if ref is not None and math.isfinite(ref) else ""


def step_line(rec: dict) -> str:
    """The one-line report of a step; a step that left the adapter unchanged says so and why."""
    logp = f" logp {rec['logprob_s']:.1f}s" if rec.get("logprob_s") else ""
    cut = f" ({rec['clipped_fraction']:.0%} cut off)" if rec.get("clipped_fraction") else ""
    line = (f"step {rec['step']:4d} | reward {rec['reward_mean']:.3f} | acc {rec['accuracy']:.3f} | "
            f"baseline {rec['baseline_mean']:.3f} | EV {rec['explained_variance']:+.2f}{_loo_ref(rec)} | "
            f"len {rec['completion_len']:.0f}{cut} | gen {rec['generation_s']:.1f}s train {rec['training_s']:.1f}s "
            f"(fwd {rec.get('forward_s', 0.0):.1f}s{logp} bwd {rec.get('backward_s', 0.0):.1f}s "
            f"opt {rec.get('optimizer_s', 0.0):.1f}s)")
    if rec.get("zero_update"):
        if rec.get("nonfinite_rollouts"):
            why = "non-finite model outputs, step skipped"
        elif rec.get("skipped"):
            why = "non-finite loss, step skipped"
        elif rec.get("trained_sequences") == 0:
            why = "every advantage is 0"
        else:
            why = "the optimizer step did not change the weights"
        line += f" | NO UPDATE ({why})"
    return line


def report_step(run: RunState, bar, rec: dict) -> None:
    """The step's line: above the progress bar, or with --no-progress (logs, schedulers) printed and flushed."""
    bar.update(1)
    bar.set_postfix(reward=f"{rec['reward_mean']:.3f}", ev=f"{rec['explained_variance']:.2f}",
                    gen=f"{rec['generation_s']:.0f}s", train=f"{rec['training_s']:.0f}s")
    if run.progress:
        tqdm.write(step_line(rec))
    else:
        print(step_line(rec), flush=True)


# ----------------------------------------------------------------------------------------------------------------
# eval and the end of the run


def run_eval(run: RunState, desc: str) -> dict | None:
    """Greedy held-out accuracy; None when the eval split is empty (no accuracy to report, none is logged). With
    several ranks each evaluates its share and the counts are summed."""
    cfg = run.cfg
    if not run.eval_examples:
        log.info("%s: skipped, the eval split of %s is empty (data.eval_size=%d)", desc, cfg.data.dataset,
                 cfg.data.eval_size)
        return None
    return distributed.evaluate_sharded(run.ranks, run.eval_examples, lambda examples: evaluate(
        run.engine, run.tok, examples, cfg.data, max_new_tokens=cfg.train.eval_max_new_tokens,
        require_boxed=cfg.reward.require_boxed, batch_size=cfg.train.eval_batch_size, progress=run.progress,
        desc=desc))


def finish(run: RunState, t_start: float) -> dict:
    """The final eval, the adapter (with the config it was trained with) and summary.json."""
    cfg = run.cfg
    run.summary["eval_after"] = run_eval(run, "eval (after)")
    run.metrics.eval(cfg.train.steps, run.summary["eval_after"], final=True)
    final = run.run_dir / "adapter"
    reward_warnings = int(run.ranks.sum([float(run.scorer.warning_count)])[0])
    if run.ranks.active:
        run.summary["ranks"] = run.ranks.world
    run.summary.update({"adapter": str(final), "steps": cfg.train.steps, "seconds": time.time() - t_start,
                        "reward_warnings": reward_warnings, **run.totals})
    run.summary["peak_memory_mb"] = run.ranks.max([peak_memory_mb(run.device)])[0]  # the whole job's, so far
    if not run.ranks.is_main:  # rank 0 writes the adapter and the summary
        return run.summary
    if not adapter_finite(run):
        raise TrainingAborted(f"the trained adapter computes non-finite outputs (NaN or inf logits): an update blew "
                              f"it up; it is not saved. {_what_to_change(cfg, {})} {_last_good(run)}")
    tmp = run.run_dir / ".tmp-adapter"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        run.model.save_pretrained(tmp)
        save_config(cfg, tmp / "basis_lite_config.yaml")
        publish_dir(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e, run.run_dir):
            raise disk_full_error("the final adapter", final, e,
                                  f"The checkpoint of step {cfg.train.steps} is intact: free some space, then "
                                  f"`basis-lite train --resume {run.run_dir}` writes the adapter") from e
        raise
    atomic_write_text(run.run_dir / "summary.json", json.dumps(run.summary, indent=2, default=str))
    return run.summary
