"""What a training run holds (`RunState`), how it is saved into a checkpoint (`checkpoint_state`) and how it is
restored: what the run decided when it started (`stored_decisions`), the newest checkpoint whose content checks out
(`resume_from`: adapter tensors, trainer state, RNG, optimizer moments, data position, history, learning state),
each unusable one logged and skipped, and the learning state as at step 0 (`fresh_learning_state`). The trainer
builds a RunState in `trainer.setup` and its step functions read and update it."""
from __future__ import annotations

import dataclasses
import itertools
import logging
from pathlib import Path

import torch

from ..config import Config
from ..data import PromptSampler
from ..engines.base import Engine
from ..estimators import EstimatorSpec
from ..estimators.basis_mix import ValueTracker, selection_probability
from ..estimators.probe import ReplayBuffer
from ..model.loading import outputs_finite
from ..rewards.scorer import RewardScorer
from ..runs import checkpoint as ckpt
from ..runs.metrics import MetricsLog
from ..runtime import DECIDED_FILE, Decided, read_decided
from ..safeio import read_json
from .distributed import Ranks
from .step import fresh_totals
from .update import make_optimizer, make_scheduler

log = logging.getLogger("basis_lite")


@dataclasses.dataclass
class RunState:
    """Everything one training run holds, built by `trainer.setup` and read and updated by the step functions."""

    cfg: Config
    run_dir: Path
    device: torch.device
    model: object  # the peft model being trained
    tok: object
    engine: Engine
    scorer: RewardScorer
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: object  # torch GradScaler for fp16 on a GPU, else None
    sampler: PromptSampler
    metrics: MetricsLog  # rank 0's; the other ranks hold a distributed.NullMetrics
    estimator: EstimatorSpec  # the one registered under cfg.estimator.name
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
    ranks: Ranks = dataclasses.field(default_factory=Ranks)  # data-parallel ranks (or one)
    per_prompt_rng: bool = False  # rollouts from per-prompt streams (generation.rng)
    decided: Decided | None = None  # what the run decided at run time (kept on resume)
    totals: dict = dataclasses.field(default_factory=fresh_totals)  # the run's token costs and seconds so far

    @property
    def uses_features(self) -> bool:
        return self.estimator.uses_features and self.cfg.estimator.use_features

    @property
    def uses_history(self) -> bool:
        return self.estimator.uses_history and self.cfg.estimator.history

    @property
    def uses_trajectory(self) -> bool:
        return self.estimator.uses_trajectory

    @property
    def with_prior(self) -> bool:
        return self.estimator.with_prior(self.cfg.estimator)

    @property
    def tracks_drift(self) -> bool:
        """The estimator's state measures the policy's drift on responses it keeps (spo)."""
        return bool(getattr(self.est_state, "tracks_drift", False))


def checkpoint_state(run: RunState) -> dict:
    """The trainer state a checkpoint stores next to the adapter; `check_checkpoint` and `restore` read it back."""
    return {"step": run.step, "optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(),
            "sampler": run.sampler.state_dict(), "rng": ckpt.rng_state(), "history": run.history,
            "bad_steps": run.bad_steps, "eval_before": run.summary.get("eval_before"),
            "scaler": run.scaler.state_dict() if run.scaler is not None else None,
            "prior_key": run.prior_table["key"] if run.prior_table else None,
            "ranks": run.ranks.world, "rng_mode": "per_prompt" if run.per_prompt_rng else "global",
            "replay": run.replay.state_dict() if run.replay is not None else None,
            "estimator_state": run.est_state.state_dict() if run.est_state is not None else None,
            "value_tracker": run.value_tracker.state_dict() if run.value_tracker is not None else None,
            "decided": run.decided.as_dict() if run.decided is not None else None, "totals": dict(run.totals)}


def stored_decisions(run_dir: Path) -> dict | None:
    """What the run decided when it started (`runtime.Decided`): the newest intact checkpoint's record (covered by
    its manifest), else RUN_DIR/decided.json; None for a run that stored none (it decides again). "from" names
    where it came from. ConfigError naming decided.json when it is not a regular file (a FIFO, a folder) or
    disagrees with the checkpoint's record (edited after the run started)."""
    from ..errors import ConfigError

    path = run_dir / DECIDED_FILE
    own = None
    if path.exists() or path.is_symlink():
        try:
            own = read_decided(read_json(path, str(path)))
        except ValueError as e:
            if not path.is_file():  # a FIFO, a device, a folder: refused, never waited on or ignored
                raise ConfigError(f"--resume: {e}; decided.json holds what the run decided when it started: remove "
                                  f"it (the checkpoints keep their own copy)") from None
            log.warning("%s is unreadable (%s); ignored", path, e)
    recorded, last = None, ckpt.latest_checkpoint(run_dir, quiet=True)
    if last is not None:
        try:
            recorded = read_decided(read_json(last / ckpt.STATE_JSON).get("decided"))
        except (ValueError, AttributeError):
            recorded = None
    if recorded is not None and own is not None:
        changed = [k for k in recorded if k in own and own[k] != recorded[k]]
        if changed:
            k = changed[0]
            raise ConfigError(f"--resume {run_dir}: {DECIDED_FILE} says {k}={own[k]}, but the checkpoint "
                              f"{last.name} recorded {k}={recorded[k]} when the run decided it; decided.json was "
                              f"changed after the run started. Put it back, or remove it (the checkpoint's record "
                              f"is then used)")
    if recorded is not None:
        return {**recorded, "from": f"checkpoint {last.name}"}
    return {**own, "from": DECIDED_FILE} if own is not None else None


def resume_from(run: RunState, train_ex) -> Path | None:
    """Restore the newest checkpoint whose content is usable (`check_checkpoint`, and an adapter whose forward over
    two training prompts is finite); each newer intact one that is not is logged with the reason and skipped, as a
    damaged one is. None when none is usable (the run starts again
    from step 0: the adapter as initialised, a fresh optimizer)."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    name = run.model.active_adapter
    expected = get_peft_model_state_dict(run.model, adapter_name=name)
    initial = {k: v.detach().clone() for k, v in expected.items()}
    for last in ckpt.intact_checkpoints(run.run_dir):
        try:
            tensors, state = check_checkpoint(run, last, expected, train_ex)
            set_peft_model_state_dict(run.model, tensors, adapter_name=name)
            if not outputs_finite(run.model, run.tok, list(itertools.islice(run.prompt_of.values(), 2))):
                raise ckpt.Unusable("its adapter computes non-finite outputs (NaN or inf logits: a diverged update)")
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
    run.totals = {k: (v if k.startswith("reference_") else type(v)(0)) for k, v in run.totals.items()}
    fresh_learning_state(run)


def fresh_learning_state(run: RunState) -> None:
    """The state the estimator and the sampler learn across steps, as at step 0: the replay buffer, the estimator's
    own state (BASIS mix, A*-PO's V*, SPO's tracker; handed the reference samples when the run has them, and the
    sampler's prompt choice when it makes one), and the value tracker that prompt selection by value reads."""
    cfg = run.cfg
    capacity = run.estimator.replay_capacity(cfg.estimator.options) if run.estimator.replay_capacity else None
    run.replay = ReplayBuffer(capacity) if capacity else None
    run.est_state = run.estimator.make_state(cfg.estimator.options)
    if run.prior_table is not None and hasattr(run.est_state, "set_reference"):
        run.est_state.set_reference(run.prior_table)
    if getattr(run.est_state, "accept", None) is not None:
        run.sampler.accept = run.est_state.accept
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
        run.totals.update({k: v for k, v in (state.get("totals") or {}).items() if k in run.totals})
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
