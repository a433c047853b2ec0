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
import math
import shutil
import time
import warnings
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from . import distributed
from .config import Config, save_config, to_dict, validate
from .data import PromptSampler, format_prompt, load_examples
from .engines.base import params_from_config
from .engines.seeded import stream_seed
from .errors import ConfigError, Interrupted, TrainingAborted
from .estimators import EstimatorContext, get_estimator
from .estimators.base import explained_variance
from .estimators.basis_mix import ValueTracker, selection_probability
from .estimators.probe import ReplayBuffer
from .evaluate import evaluate
from .faults import maybe_kill
from .metrics import MetricsLog
from .models import cache_root, count_parameters, peak_memory_mb, reset_peak_memory
from .priors import load_or_compute_prior, load_or_compute_seeded_prior, prior_values
from .rewards import RewardScorer, column_names, example_columns
from .runtime import DECIDED_FILE, Decided, build_policy, decide_run, read_decided, seed_everything
from .safeio import (
    RunLock,
    atomic_write_text,
    check_run_folder,
    disk_full_error,
    held_by_other,
    is_disk_full,
    publish_dir,
    read_json,
)
from .update import OPTIONAL_STEP_METRICS, make_optimizer, make_scheduler, policy_update

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
    est_state: object = None  # the estimator's own state across steps (EstimatorSpec.state), e.g. basis mix
    value_tracker: ValueTracker | None = None  # data.value_sampling: per-prompt tracked values for the sampler
    step: int = 0  # last completed step
    bad_steps: int = 0  # non-finite steps in a row
    summary: dict = dataclasses.field(default_factory=dict)
    progress: bool = True
    ranks: distributed.Ranks = dataclasses.field(default_factory=distributed.Ranks)  # data-parallel ranks (or one)
    per_prompt_rng: bool = False  # rollouts from per-prompt streams (generation.rng)
    decided: Decided | None = None  # what the run decided at run time (kept on resume)

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
    """Train to `train.steps` (from the newest intact checkpoint with `resume`); returns the run's summary.

    The run folder is locked for the whole call (a second writer gets ConfigError naming this process). A
    KeyboardInterrupt (Ctrl-C, or SIGTERM turned into `Interrupted` by the CLI) comes back as `Interrupted` with a
    message that names the folder, the checkpoint kept and the command that continues the run.

    Under torchrun every rank runs this: each generates, scores and trains on its share of the global batch,
    baselines pool over the whole of it (basis_lite.distributed), and rank 0 alone claims, locks and writes the run
    folder, whose name it sends to the other ranks.
    """
    t_start = time.time()
    validate(cfg)  # a Config built or changed in code is checked like a loaded one, before anything is written
    ranks = distributed.start(cfg)
    run, lock, created = None, None, False
    try:
        run_dir, created, lock, done = _claim_on_main(cfg, run_dir, resume, ranks)
        if done is not None:
            log.info("%s finished all %d steps already; nothing to resume (summary.json, adapter/)", run_dir,
                     cfg.train.steps)
            return done
        run = setup(cfg, run_dir, resume, progress and ranks.is_main, ranks)
        created = False  # from here on the folder holds a run worth keeping
        bar = tqdm(total=cfg.train.steps, initial=run.step, desc="train", disable=not run.progress, unit="step")
        for step in range(run.step + 1, cfg.train.steps + 1):
            t_step = time.time()
            reset_peak_memory(run.device)  # peak_memory_mb of this step's record is this step's own peak
            batch = next(run.sampler)  # the global batch: the same on every rank
            mine = ranks.shard(batch)
            if run.per_prompt_rng:
                ranks.seed_step(cfg.train.seed, step)
            t0 = time.time()
            rollouts = rollout(run, mine, step, first=ranks.bounds(len(batch))[0])
            gen_s = time.time() - t0
            maybe_kill("generation", step)
            rewards, scored = score(run, mine, rollouts)
            data = distributed.gather_step(ranks, rewards, rollouts, scored, cfg.estimator.rollouts_per_prompt,
                                           run.uses_features, gen_s, peak_memory_mb(run.device),
                                           run.scorer.warning_count, uses_trajectory=run.uses_trajectory)
            adv, base = baselines(run, batch, rollouts, data.rewards, step, features=data.features,
                                  trajectory=data.trajectory)
            t1 = time.time()
            stats, ok = update(run, rollouts, ranks.shard(adv), step)
            train_s = time.time() - t1
            rec = step_record(run, step, data, adv, base, stats, ok, data.generation_s, train_s)
            if ranks.active:
                rec.update({"ranks": ranks.world, "gather_wait_s": data.wait_s, "gather_s": data.gather_s,
                            "gather_bytes": data.gather_bytes, "allreduce_s": ranks.last_allreduce_s,
                            "allreduce_bytes": ranks.last_allreduce_bytes, "step_s": time.time() - t_step})
            run.metrics.step(rec)
            report_step(run, bar, rec)
            run.step = step
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
                run.metrics.eval(step, run_eval(run, f"eval (step {step})"))
            if step % cfg.train.save_every == 0 or step == cfg.train.steps:
                ranks.check_in_sync([p for p in run.model.parameters() if p.requires_grad], run.optimizer)
                if ranks.is_main:
                    ckpt.save_checkpoint(run.run_dir, step, run.model, checkpoint_state(run), _config_text(run),
                                         cfg.train.keep_last)
        bar.close()
        return finish(run, t_start)
    except KeyboardInterrupt as e:
        raise Interrupted(getattr(e, "signal_name", "SIGINT"), _interrupt_message(run_dir, run, e)) from None
    finally:
        if run is not None:
            run.metrics.close()
            run.scorer.close()
        if created:  # nothing but the lock was written: leave no trace of a run that never started
            shutil.rmtree(run_dir, ignore_errors=True)
        if lock is not None:
            lock.release()
        ranks.close()


def _claim_on_main(cfg: Config, run_dir, resume: bool, ranks: distributed.Ranks):
    """(run folder, created by this call, RunLock or None, finished summary or None), the same folder on every
    rank: rank 0 claims and locks it (`claim_run_dir`, `RunLock`) and sends its name; a user error on rank 0 is
    raised on every rank."""
    msg: dict = {}
    folder, created, lock = None, False, None
    if ranks.is_main:
        try:
            folder, created = claim_run_dir(cfg, run_dir, resume)
            check_run_folder(folder)  # no link out of it: nothing below is read or written elsewhere
            lock = _lock(folder)
            done = finished_summary(folder, cfg) if resume else None
            msg = {"dir": str(folder), "done": done is not None}
        except ConfigError as e:
            msg = {"error": str(e)}
            if not ranks.active:
                raise
            ranks.broadcast_text(json.dumps(msg))
            raise
    msg = json.loads(ranks.broadcast_text(json.dumps(msg)))
    if "error" in msg:
        raise ConfigError(f"rank 0: {msg['error']}")
    if ranks.is_main:
        return folder, created, lock, done
    return Path(msg["dir"]), False, None, ({"run_dir": msg["dir"]} if msg["done"] else None)


def _lock(folder: Path) -> RunLock:
    try:
        return RunLock(folder).acquire()
    except OSError as e:
        raise ConfigError(f"run folder {folder}: cannot write there ({type(e).__name__}: {e.strerror or e}); choose "
                          f"a folder you can write with --output") from None


def _interrupt_message(run_dir: Path, run, e) -> str:
    sig = getattr(e, "signal_name", "SIGINT")
    if run_dir is None:
        return f"stopped by {sig} before the run folder was chosen; nothing was written"
    where = f"during step {run.step + 1} of {run.cfg.train.steps}" if run is not None else "while setting up"
    last = ckpt.latest_checkpoint(run_dir, quiet=True)
    kept = (f"the checkpoint {last.name} is kept and the steps after it are redone" if last is not None else
            "there is no checkpoint yet, so resuming starts it again from step 0 with its saved config")
    return (f"stopped by {sig} {where}; {run_dir}: {kept}. Continue with `basis-lite train --resume {run_dir}`")


# ----------------------------------------------------------------------------------------------------------------
# the run folder


def default_run_dir(cfg: Config) -> Path:
    name = Path(cfg.preset).stem if cfg.preset else "run"
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def claim_run_dir(cfg: Config, run_dir, resume: bool) -> tuple[Path, bool]:
    """(the run folder, whether this call created it). Without a folder given, `runs/<preset>-<time>` is claimed
    with an exclusive mkdir (`-2`, `-3`, ... when that name is taken), so two runs started in the same second get
    two folders. A given folder must not hold another run unless `resume`."""
    given = run_dir or cfg.output_dir
    if resume:
        run_dir = Path(given)
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"--resume {run_dir}: no config.yaml there; is it a basis-lite run folder?")
        return run_dir, False
    if given:
        run_dir = Path(given)
        if run_dir.exists() and not run_dir.is_dir():
            raise ConfigError(f"--output {run_dir}: a file of that name exists; the output is a run folder: choose "
                              f"a new folder name (or an empty folder)")
        if (run_dir / "metrics.jsonl").exists() or (run_dir / "config.yaml").exists():
            holder = held_by_other(run_dir)
            if holder:
                raise ConfigError(f"run folder {run_dir} is in use by another basis-lite process ({holder}); "
                                  f"choose another --output")
            raise ConfigError(f"output folder {run_dir} already holds a run; pass --resume {run_dir} to continue "
                              f"it or choose another --output")
        created = not run_dir.exists()
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--output {run_dir}: cannot create the run folder ({type(e).__name__}: "
                              f"{e.strerror or e}); choose a folder you can write") from None
        return run_dir, created
    base = default_run_dir(cfg)
    for i in range(1, 1000):
        cand = base if i == 1 else base.with_name(f"{base.name}-{i}")
        try:
            base.parent.mkdir(parents=True, exist_ok=True)
            cand.mkdir()
        except FileExistsError:
            continue
        except OSError as e:
            raise ConfigError(f"cannot create the run folder {cand} ({type(e).__name__}: {e.strerror or e}); "
                              f"pass --output with a folder you can write") from None
        return cand, True
    raise ConfigError(f"could not find a free run folder name next to {base}; pass --output")


def finished_summary(run_dir: Path, cfg: Config) -> dict | None:
    """The summary of a run that already finished every step (summary.json and the final adapter are written last),
    else None."""
    path = run_dir / "summary.json"
    if not (path.is_file() and (run_dir / "adapter" / "adapter_config.json").is_file()):
        return None
    try:
        summary = read_json(path, "summary.json")
    except ValueError:
        return None
    if not isinstance(summary, dict):
        return None
    return summary if summary.get("steps") == cfg.train.steps and summary.get("eval_after") else None


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
        _fresh_learning_state(run)
        if run.estimator.uses_prior and cfg.estimator.prior_samples > 0:
            load_prior(run, train_ex)
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
    seed gives the same run with a cold or a warm cache.
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


def stored_decisions(run_dir: Path) -> dict | None:
    """What the run decided when it started (`runtime.Decided`): RUN_DIR/decided.json, else the newest intact
    checkpoint's copy; None for a run that stored none (it decides again)."""
    try:
        found = read_decided(read_json(run_dir / DECIDED_FILE, DECIDED_FILE))
    except ValueError:
        found = None
    if found is None:
        last = ckpt.latest_checkpoint(run_dir, quiet=True)
        if last is not None:
            try:
                found = read_decided(read_json(last / ckpt.STATE_JSON).get("decided"))
            except (ValueError, AttributeError):
                found = None
    return found


def resume_from(run: RunState, train_ex) -> Path | None:
    """Restore the newest checkpoint whose content is usable (`check_checkpoint`); each newer intact one that is
    not is logged with the reason and skipped, as a damaged one is. None when none is usable (the run starts again
    from step 0: the adapter as initialised, a fresh optimizer)."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    name = run.model.active_adapter
    expected = get_peft_model_state_dict(run.model, adapter_name=name)
    initial = {k: v.detach().clone() for k, v in expected.items()}
    for last in ckpt.intact_checkpoints(run.run_dir):
        try:
            tensors, state = check_checkpoint(run, last, expected, train_ex)
            set_peft_model_state_dict(run.model, tensors, adapter_name=name)
            restore(run, state)
        except ckpt.Unusable as e:
            log.warning("skipping checkpoint %s: %s", last, e)
            _fresh_state(run, train_ex, initial, name)
            continue
        log.info("resumed from %s at step %d", last, run.step)
        return last
    return None


def _fresh_state(run: RunState, train_ex, initial: dict, adapter_name: str) -> None:
    """Undo a partly applied checkpoint: the initial adapter weights, a fresh optimizer, schedule, data position,
    history, replay buffer, estimator state and value tracker."""
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(run.model, initial, adapter_name=adapter_name)
    run.optimizer = make_optimizer(run.cfg, run.model, run.device)
    run.scheduler = make_scheduler(run.cfg, run.optimizer)
    run.sampler = PromptSampler(train_ex, run.cfg.train.batch_size, seed=run.cfg.train.seed)
    run.history, run.step, run.bad_steps = {}, 0, 0
    _fresh_learning_state(run)


def _fresh_learning_state(run: RunState) -> None:
    """The state the estimator and the sampler learn across steps, as at step 0: the replay buffer, the estimator's
    own state (BASIS mix), and the value tracker that prompt selection by value reads."""
    cfg = run.cfg
    capacity = run.estimator.replay_capacity(cfg.estimator.options) if run.estimator.replay_capacity else None
    run.replay = ReplayBuffer(capacity) if capacity else None
    run.est_state = run.estimator.make_state(cfg.estimator.options)
    run.value_tracker = None
    if cfg.data.value_sampling > 0:
        run.value_tracker = ValueTracker(decay=0.9)
        run.sampler.accept = selection_probability(run.value_tracker, cfg.data.value_sampling)


def check_checkpoint(run: RunState, last: Path, expected: dict, train_ex) -> tuple[dict, dict]:
    """(adapter tensors, trainer state) of an intact checkpoint once its content is checked; Unusable naming the
    first problem: adapter tensors missing, extra, misshapen or not finite; a state that does not parse or is
    nested too deep; a step that is not the folder's or lies outside [1, train.steps]; RNG states that cannot be
    set; optimizer moments that do not fit the parameters. A checkpoint of other data is a DataError (every
    checkpoint of the run has it)."""
    tensors = ckpt.load_adapter_tensors(last / "adapter")
    ckpt.check_adapter_tensors(tensors, expected)
    state = ckpt.load_state(last)
    if not isinstance(state, dict):
        raise ckpt.Unusable("the trainer state is not a mapping")
    step = ckpt.check_int(state.get("step"), "step", 1, run.cfg.train.steps)
    if step != ckpt.step_of(last):
        raise ckpt.Unusable(f"its state says step {step}, its folder name step {ckpt.step_of(last)}")
    ckpt.check_int(state.get("bad_steps", 0), "bad_steps", 0, run.cfg.train.max_bad_steps)
    ckpt.check_rng_state(state.get("rng"))
    ckpt.check_optimizer_state(state.get("optimizer"), [p for p in run.model.parameters() if p.requires_grad])
    sampler = state.get("sampler")
    if not isinstance(sampler, dict):
        raise ckpt.Unusable("no data position (sampler state)")
    for key in ("epoch", "position"):
        ckpt.check_int(sampler.get(key), f"sampler {key}", 0, 2**62)
    run.sampler.check_state(sampler, run.cfg.data.dataset)  # DataError: the data changed since the checkpoint
    history = state.get("history", {})
    if not isinstance(history, dict) or not all(
            isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and x >= 0 for x in v)
            for v in history.values()):
        raise ckpt.Unusable("the per-prompt history is not {prompt id: [successes, rollouts]}")
    return tensors, state


def restore(run: RunState, state: dict) -> None:
    """Apply a checked trainer state; Unusable when a part of it does not load."""
    try:
        run.optimizer.load_state_dict(state["optimizer"])
        run.scheduler.load_state_dict(state["scheduler"])
        run.sampler.load_state_dict(state["sampler"])
        run.history = state.get("history", {})
        if run.replay is not None and state.get("replay") is not None:
            run.replay.load_state_dict(state["replay"])
        if run.est_state is not None and state.get("estimator_state") is not None:
            run.est_state.load_state_dict(state["estimator_state"])
        if run.value_tracker is not None and state.get("value_tracker") is not None:
            run.value_tracker.load_state_dict(state["value_tracker"])
        if run.scaler is not None and state.get("scaler"):
            run.scaler.load_state_dict(state["scaler"])
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as e:
        raise ckpt.Unusable(f"the trainer state does not load ({type(e).__name__}: {str(e)[:200]})") from None
    run.step, run.bad_steps = state["step"], state.get("bad_steps", 0)
    was = state.get("rng_mode", "global")
    if was != ("per_prompt" if run.per_prompt_rng else "global"):
        log.warning("the checkpoint's rollouts came from %s sampling streams, this run uses %s ones "
                    "(generation.rng): the resumed run will not repeat the interrupted one", was,
                    "per_prompt" if run.per_prompt_rng else "global")
    elif state.get("ranks", 1) != run.ranks.world:
        log.info("resuming a %d-rank run on %d ranks (per-prompt streams: the same rollouts, up to float rounding)",
                 state.get("ranks", 1), run.ranks.world)
    run.summary["eval_before"] = state.get("eval_before")
    ckpt.set_rng_state(state["rng"])
    run.metrics.resume(run.step)


def checkpoint_state(run: RunState) -> dict:
    return {"step": run.step, "optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(),
            "sampler": run.sampler.state_dict(), "rng": ckpt.rng_state(), "history": run.history,
            "bad_steps": run.bad_steps, "eval_before": run.summary.get("eval_before"),
            "scaler": run.scaler.state_dict() if run.scaler is not None else None,
            "prior_key": run.prior_table["key"] if run.prior_table else None,
            "ranks": run.ranks.world, "rng_mode": "per_prompt" if run.per_prompt_rng else "global",
            "replay": run.replay.state_dict() if run.replay is not None else None,
            "estimator_state": run.est_state.state_dict() if run.est_state is not None else None,
            "value_tracker": run.value_tracker.state_dict() if run.value_tracker is not None else None,
            "decided": run.decided.as_dict() if run.decided is not None else None}


def _config_text(run: RunState) -> str:
    return (run.run_dir / "config.yaml").read_text()


# ----------------------------------------------------------------------------------------------------------------
# one step


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
                        completion_ids=[r.completion_ids for r in rollouts])
    return torch.tensor(scored.total, dtype=torch.float32).view(len(batch), G), scored


def baselines(run: RunState, batch, rollouts, rewards: torch.Tensor, step: int = 0,
              features: torch.Tensor | None = None, trajectory: torch.Tensor | None = None):
    """(advantages [B, G], baselines [B, G]) from the configured estimator, with the side information it uses.

    `features` [B, D] and `trajectory` [B, G, D'] replace the rollouts' own (the training loop passes those of the
    global batch). The per-prompt history and the replay buffer get this batch only after the baselines are
    computed."""
    est, G = run.cfg.estimator, run.cfg.estimator.rollouts_per_prompt
    ids = [ex.id for ex in batch]
    prior = None
    if run.estimator.uses_prior or run.uses_history:
        prior = prior_values(ids, run.prior_table, run.history if run.uses_history else None)
    if features is None:
        features = distributed.local_features(rollouts, len(batch), G, run.uses_features)
    if trajectory is None:
        trajectory = distributed.local_trajectory(rollouts, len(batch), G, run.uses_trajectory)
    ctx = EstimatorContext(prompt_ids=ids, prior=prior, features=features, history=run.history,
                           trajectory_features=trajectory, replay=run.replay, options=est.options,
                           normalize=est.normalize, state=run.est_state)
    adv, base = run.estimator.compute(rewards, ctx)
    if run.est_state is not None:  # after the baselines, like the history and the replay buffer
        run.est_state.observe(step, ids, rewards)
    if run.value_tracker is not None:
        run.value_tracker.observe(ids, rewards)
    if run.uses_history:  # after the baselines: a prompt's history never holds its current reward
        for ex, row in zip(batch, rewards):
            h = run.history.setdefault(ex.id, [0, 0])
            h[0] += int(round(float(row.sum())))
            h[1] += G
    if run.replay is not None:
        run.replay.add(step, ids, rewards, features, trajectory)
    return adv, base


def update(run: RunState, rollouts, adv: torch.Tensor, step: int):
    """One optimizer step; a non-finite loss skips it, `train.max_bad_steps` of them in a row abort the run.

    stats["update_norm"] is the L2 norm of the change of the trainable weights over the step (0 when no update
    happened: every advantage 0, a skipped step, or an optimizer step that moved nothing)."""
    cfg = run.cfg
    params = [p for p in run.model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    try:
        stats, ok = policy_update(cfg, run.model, run.optimizer, rollouts, adv.reshape(-1), run.tok.pad_token_id,
                                  run.device, step, run.scaler, ranks=run.ranks)
    except torch.OutOfMemoryError:
        raise TrainingAborted(
            f"CUDA out of memory at step {step} with train.micro_batch_size={cfg.train.micro_batch_size}; "
            f"try --set train.micro_batch_size={max(1, cfg.train.micro_batch_size // 2)} (gradient "
            f"accumulation keeps the same effective batch) or a smaller generation.max_new_tokens") from None
    with torch.no_grad():
        stats["update_norm"] = math.sqrt(sum(float((p.detach().float() - b.float()).pow(2).sum())
                                             for p, b in zip(params, before)))
    del before
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


def step_record(run: RunState, step, data: distributed.StepData, adv, base, stats, ok, gen_s, train_s) -> dict:
    """The metrics.jsonl line of one step, over the global batch."""
    rewards = data.rewards
    r_flat = rewards.view(-1)
    comp_tokens = sum(data.completion_lens)
    return {
        "step": step, "reward_mean": r_flat.mean().item(), "accuracy": sum(data.correct) / len(data.correct),
        "format_rate": sum(data.format) / len(data.format), "baseline_mean": base.mean().item(),
        "advantage_std": adv.std().item() if adv.numel() > 1 else 0.0,
        "explained_variance": explained_variance(rewards, base),
        "explained_variance_loo_ref": loo_reference_ev(r_flat.numel()), "kl": stats["kl"], "entropy": stats["entropy"],
        "completion_len": comp_tokens / len(data.completion_lens), "loss": stats["loss"],
        "grad_norm": stats["grad_norm"], "clip_fraction": stats["clip_fraction"],
        "lr": run.optimizer.param_groups[0]["lr"], "generation_s": gen_s, "training_s": train_s,
        "tokens_per_s": comp_tokens / max(1e-9, gen_s + train_s),
        "peak_memory_mb": max(data.peak_memory_mb, peak_memory_mb(run.device)),
        "reward_warnings": data.reward_warnings, "skipped": not ok,
        "trained_sequences": stats.get("trained_sequences"), "update_norm": stats["update_norm"],
        "zero_update": stats["update_norm"] == 0.0,
        **{k: stats[k] for k in OPTIONAL_STEP_METRICS if k in stats},
        **({"trajectory_feature_s": getattr(run.engine, "trajectory_seconds", 0.0)} if run.uses_trajectory else {}),
        **({"replay_rows": run.replay.rows} if run.replay is not None else {}),
        **(run.est_state.metrics() if hasattr(run.est_state, "metrics") else {}),
        **({"value_sampling_skipped": run.sampler.skipped} if run.value_tracker is not None else {}),
    }


def loo_reference_ev(n: int) -> float:
    """The explained variance of the plain leave-one-out mean over n rollouts, 1 - (n / (n - 1))^2, whatever the
    rewards (b_i = (S - r_i) / (n - 1) leaves r_i scaled by n / (n - 1)); nan for n < 2. A baseline that earns
    something scores above it."""
    return 1.0 - (n / (n - 1)) ** 2 if n >= 2 else float("nan")


def _loo_ref(rec: dict) -> str:
    ref = rec.get("explained_variance_loo_ref")
    return f" (LOO {ref:+.2f})" if ref is not None and math.isfinite(ref) else ""


def step_line(rec: dict) -> str:
    """The one-line report of a step; a step that left the adapter unchanged says so and why."""
    line = (f"step {rec['step']:4d} | reward {rec['reward_mean']:.3f} | acc {rec['accuracy']:.3f} | "
            f"baseline {rec['baseline_mean']:.3f} | EV {rec['explained_variance']:+.2f}{_loo_ref(rec)} | "
            f"len {rec['completion_len']:.0f} | gen {rec['generation_s']:.1f}s train {rec['training_s']:.1f}s")
    if rec.get("zero_update"):
        if rec.get("skipped"):
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
                        "reward_warnings": reward_warnings})
    if not run.ranks.is_main:  # rank 0 writes the adapter and the summary
        return run.summary
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
