"""Rewards: a math-verify answer check, a format check, and user reward functions.

Built-in rewards (always computed, so they can be logged even with weight 0):

- ``correctness(completion, gold)``: 1.0 when math-verify judges the completion's answer equal to the gold answer.
  With ``require_boxed`` (the default) only the content of the LAST non-empty ``\\boxed{...}`` counts; without a
  box, or with only empty boxes, it scores 0 (math-verify on its own falls back to the last number in the text,
  so ``"17 + 25 = 32. The answer is \\boxed{}"`` would otherwise be read as 32). The gold answer is wrapped in
  ``\\boxed{}`` before parsing and its parse is cached.
- ``format_reward(completion)``: 1.0 when a non-empty ``\\boxed{...}`` is present.

User reward functions are given in the config as ``"package.module:function"`` strings (a module in the
working directory is found without ``PYTHONPATH=.``; a resumed run never imports one from inside its run folder,
see ``rewards.worker._refuse_code_from``) and are called batched with keyword arguments, TRL's
convention::

    def my_reward(completions, answers, **kwargs) -> list[float]:               # basis-lite's names
    def accuracy(completions, answer, level, **kwargs) -> list[float]:          # data columns, as TRL passes them
    def brevity(prompts, completions) -> list[float]:                           # only what it asks for

One float per completion, finite in float32 (the trainer's reward dtype) also once weighted; None counts as 0
(TRL's "does not apply"). A list, tuple, numpy array, pandas Series or torch tensor of them is accepted. The keyword arguments, one value per
completion: ``prompts`` (the dataset's prompt, as TRL passes it: the question text, or for a conversational row
its list of messages; not the chat-templated string), ``completions`` (text; for a conversational row TRL's
``[{"role": "assistant", "content": text}]``), ``completion_ids`` (token ids), ``answers`` (the gold answers), and
the data columns: the question under ``data.question_field``'s name, the gold answer under ``data.answer_field``'s
name and each metadata key of the examples (``level``, ``family``, and a file's other columns); and TRL's three:
``trainer_state`` (``global_step``: steps done before this batch, ``max_steps``), ``log_metric(name, value)`` (the
values of a step are averaged into its metrics line as ``reward/<name>``) and ``log_extra(column, values)``
(accepted; basis-lite keeps no completions table, so the values are dropped). A function with ``**kwargs`` gets all
of them, any other only the parameters it names. ``async def`` functions (a judge API, say) are awaited together
on one event loop after the synchronous ones, each within ``reward.timeout_s``, in the same worker. Its signature
is checked when the scorer starts (before step 1): a parameter without a default that no argument fills is a
RewardError naming what is passed.

Values are used as returned (nothing is clamped) and weighted by ``reward.function_weights`` (1.0 each by
default). The total reward of a rollout is::

    total = correctness_weight * correct + format_weight * format + sum_k weight_k * f_k

A user function that fails on its FIRST call (raises, returns the wrong number of values, non-numeric ones or
values that are not finite in float32, runs longer than ``reward.timeout_s``, or kills its process) stops the run with a RewardError carrying the
message: it has never worked, and training on its zeros would be silent garbage. Once it has returned valid
values, a failing batch scores 0 for the affected rollouts (all of the batch, or just the non-finite entries),
logs a throttled warning naming the function and increments ``RewardScorer.warning_count``: the run goes on.

Isolation, exactly: user functions are imported and run ONLY in one persistent worker process (multiprocessing
"spawn": a fresh interpreter, which inherits ``sys.path``, the working directory and the environment); the
trainer process never imports them. That is a crash and hang guard, not a sandbox. What it protects: the trainer
survives user code that raises, calls ``os._exit`` / ``sys.exit`` or segfaults (at import or in a call), and a
call that hangs past ``reward.timeout_s`` (the worker is terminated, then killed, and a fresh one started for the
next call). What it does not: the worker runs as the same user with the same files, network, environment
variables and credentials; it can read and write anything the trainer can, start processes of its own with
``subprocess`` or ``os.fork`` (only ``multiprocessing`` children are refused, it is a daemon process) and those are
not killed with it; it can use up memory, CPU and disk. Trust reward code as you trust the training script. With
``reward.timeout_s: 0`` the functions are imported and run in the trainer process itself (no guard at all; for
debugging). Scripts that create a RewardScorer need an ``if __name__ == "__main__":`` guard (spawn re-imports the
main script).

Where the code is: rewards/answers.py (the answer check: boxed extraction, math-verify, correctness, format;
torch-free), rewards/worker.py (loading user functions, their signature check, the isolated worker), this module
(the scorer and the data columns).

math-verify always runs in the main process. Its timeouts use ``signal.alarm``, which only works in the main
thread; from other threads it is called with its timeouts disabled.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import RewardError
from .answers import correctness, format_reward
from .worker import STANDARD_KWARGS, TrainerState, Worker, call_async_fns, call_user_fn, is_async, load_all

log = logging.getLogger(__name__)

FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: the trainer's rewards are a float32 tensor
_LOG_FIRST = 5  # warnings logged per user function before throttling kicks in
_LOG_EVERY = 50  # after that, one warning line per this many


def fits_float32(v: float) -> bool:
    """True when `v` is finite and stays finite as a float32."""
    return math.isfinite(v) and abs(v) <= FLOAT32_MAX


def column_names(examples, data_cfg) -> list[str]:
    """The names ``example_columns`` gives for these examples (what user functions may ask for beyond
    STANDARD_KWARGS)."""
    names = [data_cfg.question_field, data_cfg.answer_field, *(str(k) for ex in examples for k in (ex.meta or {}))]
    return [n for n in dict.fromkeys(names) if n and n not in STANDARD_KWARGS]


def example_columns(examples, data_cfg, repeat: int = 1) -> dict[str, list]:
    """The data columns passed to user functions, one value per completion (each example `repeat` times): the
    question under data.question_field's name, the gold answer under data.answer_field's name, and each metadata
    key of the examples (level, family, ...; None where an example lacks it). Names that clash with
    STANDARD_KWARGS are left out."""
    cols: dict[str, list] = {}

    def put(name: str, values: list) -> None:
        if name and name not in STANDARD_KWARGS and name not in cols:
            cols[name] = [v for v in values for _ in range(repeat)]

    put(data_cfg.question_field, [ex.question for ex in examples])
    put(data_cfg.answer_field, [ex.answer for ex in examples])
    for key in dict.fromkeys(k for ex in examples for k in (ex.meta or {})):
        put(str(key), [(ex.meta or {}).get(key) for ex in examples])
    return cols


# ---------------------------------------------------------------------------------------------------------------
# the scorer
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class RewardBatch:
    total: list[float]
    correct: list[float]
    format: list[float]
    per_function: dict[str, list[float]] = field(default_factory=dict)  # unweighted values, 0 where they failed
    warnings: int = 0  # user-function failures in this call
    metrics: dict[str, float] = field(default_factory=dict)  # log_metric(name, value) calls, averaged per name


class RewardScorer:
    """Scores completions: ``RewardScorer(cfg.reward, columns)(prompts, completions, answers, ...) -> RewardBatch``.

    `columns`: the names of the data columns the calls will pass (``example_columns``); with STANDARD_KWARGS they
    are what a user function's parameters may ask for. Constructing the scorer starts the worker and waits until it
    has imported every function and checked its signature: a bad spec, an import that fails or kills the worker,
    or a parameter that would get no value raises RewardError here, before training. Use as a context manager
    (or call close()) to stop the worker."""

    def __init__(self, cfg, columns: Sequence[str] = (), refused_dirs: Sequence = ()):
        self.cfg = cfg
        self.refused_dirs = [str(d) for d in refused_dirs]  # nothing is imported from inside these (a resumed run)
        self.specs: list[str] = list(cfg.functions or [])
        weights = list(cfg.function_weights or [])
        if weights and len(weights) != len(self.specs):
            raise RewardError(f"reward.function_weights: {len(weights)} weights for {len(self.specs)} functions; "
                              f"give one weight per function or none")
        self.weights = [float(w) for w in weights] if weights else [1.0] * len(self.specs)
        self.keys: list[str] = []
        for spec in self.specs:
            key, n = spec, 2
            while key in self.keys:
                key, n = f"{spec}#{n}", n + 1
            self.keys.append(key)
        self.available = list(STANDARD_KWARGS) + [c for c in dict.fromkeys(columns) if c not in STANDARD_KWARGS]
        self.timeout_s = float(cfg.timeout_s)
        self.warning_count = 0
        self.warnings_by_function: dict[str, int] = {k: 0 for k in self.keys}
        self._proven: set[str] = set()  # functions that returned valid values at least once
        self._fns: dict = {}  # in-process mode only (reward.timeout_s: 0)
        self._worker: Worker | None = None
        self._async: set[str] = set()  # the `async def` functions: awaited together, after the others
        self._closed = False
        unique = list(dict.fromkeys(self.specs))
        if not unique:
            return
        if self.timeout_s <= 0:  # asked for: user code in this process, no isolation
            self._fns, errors = load_all(unique, self.available, self.refused_dirs)
            self._async = {spec for spec, (fn, _) in self._fns.items() if is_async(fn)}
        else:
            self._worker = Worker(unique, self.available, self.refused_dirs)
            err = self._worker.wait_ready()
            if err:
                self.close()
                raise RewardError(f"reward.functions: {err}; nothing was trained. Run the import by hand "
                                  f"(python -c 'import MODULE') to see why")
            errors, self._async = self._worker.errors, set(self._worker.async_specs)
        if errors:
            self.close()
            raise RewardError("; ".join(errors.values()))

    # -- user functions --------------------------------------------------------------------------------------
    def _warn(self, key: str, message: str) -> None:
        self.warning_count += 1
        self.warnings_by_function[key] += 1
        n = self.warnings_by_function[key]
        if n <= _LOG_FIRST or n % _LOG_EVERY == 0:
            extra = "" if n < _LOG_FIRST else f" ({n} warnings for this function so far; further ones are throttled)"
            log.warning("reward function %s %s; its reward is 0 for the affected rollouts%s", key, message, extra)

    def _run_user_fns(self, group, kwargs: dict) -> list:
        """Run one function (`group` a spec) or await several async ones together (a tuple of specs); one result
        (status, payload, metrics) per function. A worker that hung or died is replaced for the next call."""
        specs = [group] if isinstance(group, str) else list(group)
        if self.timeout_s <= 0:
            if isinstance(group, str):
                return [call_user_fn(*self._fns[group], kwargs)]
            return call_async_fns([self._fns[s] for s in specs], kwargs, 0.0)
        if self._worker is None:
            self._worker = Worker(list(dict.fromkeys(self.specs)), self.available, self.refused_dirs)
        out = self._worker.call(group, kwargs, self.timeout_s)
        if isinstance(out, tuple) and out[0] == "dead":
            self._worker.close(graceful=False)
            self._worker = None  # a fresh one is spawned on the next call
            return [("error", out[1], {})] * len(specs)
        return [out] if isinstance(group, str) else list(out)

    def _failed(self, key: str, spec: str, message: str, n: int) -> tuple[list[float], int]:
        """A failed call: before the function ever worked it is a bug to fix (RewardError: the run stops), after
        that one bad batch (0 for its rollouts, a warning, the run goes on)."""
        if spec not in self._proven:
            raise RewardError(f"reward function {key} failed on its first call: {message}. The run stops here: a "
                              f"function that never returned valid rewards would train on zeros. (Once it has "
                              f"worked, a failing batch scores 0 with a warning and the run goes on.)")
        self._warn(key, message)
        return [0.0] * n, 1

    def _score_user_fn(self, key, spec, result: tuple, n: int, weight: float) -> tuple[list[float], int]:
        """(the function's values, 0 where None or failed; 1 when the call failed or some values did not fit). A
        value fits when it and its weighted value are finite in float32, the dtype the trainer's rewards have (a
        Python float of 1e300 is finite, and inf once there). Before the function ever worked, a value that does
        not fit fails the call (RewardError); after, those rollouts score 0 with a warning."""
        status, payload = result[0], result[1]
        if status != "ok":
            return self._failed(key, spec, str(payload), n)
        if len(payload) != n:
            return self._failed(key, spec, f"returned {len(payload)} values for {n} completions", n)
        vals, bad = [], []
        for i, v in enumerate(payload):
            if v is None:
                vals.append(0.0)
            elif not (fits_float32(v) and fits_float32(weight * v)):
                vals.append(0.0)
                bad.append(i)
            else:
                vals.append(v)
        if bad:
            why = (f"returned non-finite values (in float32, the trainer's reward dtype, weight {weight:g} applied) "
                   f"at {len(bad)} of {n} positions (first: index {bad[0]}, value {payload[bad[0]]!r})")
            if spec not in self._proven:
                return self._failed(key, spec, why, n)
            self._warn(key, why)
            return vals, 1
        self._proven.add(spec)
        return vals, 0

    # -- public ----------------------------------------------------------------------------------------------
    def __call__(self, prompts: list, completions: list[str], answers: list[str],
                 columns: dict[str, list] | None = None, completion_ids: list | None = None,
                 state: TrainerState | None = None) -> RewardBatch:
        """Score a batch; `prompts` are the dataset's prompts (``Example.prompt``: text, or a list of messages),
        `columns` (``example_columns``) and `completion_ids` go to the user functions that ask for them, one value
        per completion; `state` is their `trainer_state` (the trainer's step; TrainerState() elsewhere). The
        synchronous functions run one after the other, then the async ones are awaited together."""
        if self._closed:
            raise RuntimeError("RewardScorer is closed")
        n = len(completions)
        if len(prompts) != n or len(answers) != n:
            raise ValueError(f"RewardScorer: {len(prompts)} prompts, {n} completions and {len(answers)} answers; "
                             f"they must be the same length")
        extra = {k: list(v) for k, v in (columns or {}).items() if k not in STANDARD_KWARGS}
        if completion_ids is not None:
            extra["completion_ids"] = [list(c) for c in completion_ids]
        for k, v in extra.items():
            if len(v) != n:
                raise ValueError(f"RewardScorer: column {k!r} has {len(v)} values for {n} completions")
        cfg = self.cfg
        correct = [correctness(c, a, cfg.require_boxed) for c, a in zip(completions, answers)]
        fmt = [format_reward(c) for c in completions]
        total = [cfg.correctness_weight * c + cfg.format_weight * f for c, f in zip(correct, fmt)]
        per_function: dict[str, list[float]] = {}
        warnings = 0
        logged: dict[str, list] = {}
        if self.specs:
            # TRL's convention: a conversational prompt (a list of messages) gets its completion as messages too
            user_completions = [[{"role": "assistant", "content": c}] if isinstance(p, list) else c
                                for p, c in zip(prompts, completions)]
            kwargs = {"prompts": list(prompts), "completions": user_completions, "answers": list(answers),
                      "trainer_state": state or TrainerState(), **extra}
            results = {spec: self._run_user_fns(spec, kwargs)[0]
                       for spec in dict.fromkeys(self.specs) if spec not in self._async}
            group = tuple(spec for spec in dict.fromkeys(self.specs) if spec in self._async)
            if group:
                results.update(zip(group, self._run_user_fns(group, kwargs)))
            for key, spec, w in zip(self.keys, self.specs, self.weights):
                vals, nw = self._score_user_fn(key, spec, results[spec], n, w)
                warnings += nw
                per_function[key] = vals
                total = [t + w * v for t, v in zip(total, vals)]
            over = [i for i, t in enumerate(total) if not fits_float32(t)]
            if over:  # each weighted value fits, their sum does not
                warnings += 1
                self.warning_count += 1
                log.warning("the weighted sum of the rewards is not finite in float32 at %d of %d rollouts (first: "
                            "%r); those rollouts score 0", len(over), n, total[over[0]])
                over = set(over)
                total = [0.0 if i in over else t for i, t in enumerate(total)]
            for *_, metrics in results.values():
                for name, values in metrics.items():
                    logged.setdefault(name, []).extend(values)
        return RewardBatch(total=total, correct=correct, format=fmt, per_function=per_function, warnings=warnings,
                           metrics={name: sum(v) / len(v) for name, v in logged.items() if v})

    def close(self) -> None:
        self._closed = True
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # best effort; daemon workers also die with the parent
        try:
            if self._worker is not None:
                self._worker.close(graceful=False)
        except Exception:
            pass
