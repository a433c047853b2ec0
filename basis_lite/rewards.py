"""Rewards: a math-verify answer check, a format check, and user reward functions.

Built-in rewards (always computed, so they can be logged even with weight 0):

- ``correctness(completion, gold)``: 1.0 when math-verify judges the completion's answer equal to the gold answer.
  With ``require_boxed`` (the default) only the content of the LAST non-empty ``\\boxed{...}`` counts; without a
  box, or with only empty boxes, it scores 0 (math-verify on its own falls back to the last number in the text,
  so ``"17 + 25 = 32. The answer is \\boxed{}"`` would otherwise be read as 32). The gold answer is wrapped in
  ``\\boxed{}`` before parsing and its parse is cached.
- ``format_reward(completion)``: 1.0 when a non-empty ``\\boxed{...}`` is present.

User reward functions are given in the config as ``"package.module:function"`` strings and are called batched,
TRL-style, with keyword arguments::

    def my_reward(prompts: list[str], completions: list[str], answers: list[str], **kwargs) -> list[float]:
        ...  # one finite float per completion; None counts as 0 (TRL's "does not apply")

Values are used as returned (nothing is clamped) and weighted by ``reward.function_weights`` (1.0 each by
default). The total reward of a rollout is::

    total = correctness_weight * correct + format_weight * format + sum_k weight_k * f_k

A user function that raises, returns the wrong number of values, returns non-numeric or non-finite values, or
runs longer than ``reward.timeout_s`` for one batch scores 0 for the affected rollouts (all of the batch, or just
the non-finite entries), logs a throttled warning naming the function, and increments
``RewardScorer.warning_count``: it never stops the run.

User functions run in one persistent worker process (multiprocessing "spawn" context: the spawn cost is paid
once; after a hang or a crash the worker is terminated and a fresh one is started for the next call), so the
function must be importable by its module path in a fresh interpreter (``sys.path`` and the working directory are
inherited). With ``reward.timeout_s: 0`` they run in the main process instead, with no hang limit (useful for
debugging). The worker is a daemon process, so a user function cannot start processes of its own. Scripts that
create a RewardScorer need an ``if __name__ == "__main__":`` guard (spawn re-imports the main script).

math-verify always runs in the main process. Its timeouts use ``signal.alarm``, which only works in the main
thread; from other threads it is called with its timeouts disabled.
"""
from __future__ import annotations

import functools
import importlib
import logging
import math
import multiprocessing
import re
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import RewardError

log = logging.getLogger(__name__)

_BOXED_RE = re.compile(r"\\boxed\s*\{")
_LOG_FIRST = 5  # warnings logged per user function before throttling kicks in
_LOG_EVERY = 50  # after that, one warning line per this many
_STARTUP_TIMEOUT_S = 120.0  # a fresh worker must import the user functions within this time


# ---------------------------------------------------------------------------------------------------------------
# \boxed{} extraction and math-verify
# ---------------------------------------------------------------------------------------------------------------

def _boxed_contents(text: str) -> list[str]:
    """Contents of every complete \\boxed{...} (balanced braces, \\{ and \\} escapes skipped), by start position."""
    out = []
    for m in _BOXED_RE.finditer(text):
        depth, i, start = 1, m.end(), m.end()
        while i < len(text):
            c = text[i]
            if c == "\\":
                i += 2
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    out.append(text[start:i])
                    break
            i += 1
    return out


def extract_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` in `text` (nested braces allowed); None if there is none,
    "" if it is empty. A box left unclosed (a truncated completion) is ignored. For nested boxes the innermost,
    last-starting one is returned."""
    if not text:
        return None
    boxes = _boxed_contents(text)
    return boxes[-1] if boxes else None


def _last_nonempty_boxed(text: str) -> str | None:
    for content in reversed(_boxed_contents(text or "")):
        if content.strip():
            return content
    return None


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _parse(text: str) -> list:
    from math_verify import parse  # lazy: the reward worker and data-only users do not pay its import

    try:
        if _in_main_thread():
            return parse(text)
        return parse(text, parsing_timeout=None)
    except Exception as e:  # math-verify is defensive already; never let a parse take down a step
        log.debug("math-verify parse failed on %r: %s", text[:200], e)
        return []


def _verify(gold: list, pred: list) -> bool:
    from math_verify import verify

    try:
        if _in_main_thread():
            return bool(verify(gold, pred))
        return bool(verify(gold, pred, timeout_seconds=None))
    except Exception as e:
        log.debug("math-verify verify failed: %s", e)
        return False


def _as_box(answer: str) -> str:
    """Wrap a bare answer in \\boxed{} (math-verify's most reliable anchor); unwrap an existing box or $...$."""
    a = str(answer).strip()
    inner = _last_nonempty_boxed(a)
    if inner is not None:
        a = inner.strip()
    if len(a) >= 2 and a.startswith("$") and a.endswith("$"):
        a = a.strip("$").strip()
    return "\\boxed{" + a + "}"


@functools.lru_cache(maxsize=1 << 16)
def _parse_gold_cached(gold: str) -> tuple:
    return tuple(_parse(_as_box(gold)))


def parse_gold(gold: str) -> list:
    """math-verify's parse of a gold answer (wrapped in \\boxed{}), cached; [] when it cannot be parsed."""
    return list(_parse_gold_cached(str(gold)))


def gold_is_parseable(gold: str) -> bool:
    """True when math-verify reads the gold answer as a mathematical object. Wrapped in \\boxed{}, almost any text
    parses to at least its raw string (math-verify's fallback, which only matches the identical string), so an
    answer that yields nothing but strings ("", "???", a dangling "\\text{") counts as unparseable."""
    return any(not isinstance(x, str) for x in _parse_gold_cached(str(gold)))


def correctness(completion: str, gold: str, require_boxed: bool = True) -> float:
    """1.0 when math-verify finds the completion's answer equal to `gold`, else 0.0.

    With `require_boxed` only the last non-empty \\boxed{} of the completion is read (no box, or only empty boxes,
    scores 0); without it math-verify reads the whole completion (and falls back to its last number)."""
    g = parse_gold(gold)
    if not g:
        return 0.0
    if require_boxed:
        content = _last_nonempty_boxed(completion)
        if content is None:
            return 0.0
        pred = _parse("\\boxed{" + content + "}")
    else:
        pred = _parse(completion or "")
    pred = _no_unevaluated_arithmetic(g, pred)
    if not pred:
        return 0.0
    return 1.0 if _verify(g, pred) else 0.0


def _is_number(x) -> bool:
    """A plain number, or `x = number`, or a set of plain numbers: something the model computed."""
    if isinstance(x, str):
        return False
    if getattr(x, "is_Number", False):
        return True
    if getattr(x, "is_Relational", False):  # "x = 5": math-verify compares the right-hand side
        return _is_number(x.rhs)
    if getattr(x, "is_FiniteSet", False):
        return all(_is_number(e) for e in x)
    return False


def _no_unevaluated_arithmetic(gold: list, pred: list) -> list:
    """When the gold answer is a plain number, only a plain number counts as the prediction.

    math-verify evaluates what it parses: "What is 26 + 54?" answered with "26 + 54" (the question restated, nothing
    computed) parses to 26 + 54 and verifies equal to 80. A policy finds that within a few dozen RL steps (measured
    on the default preset: 100% "accuracy" by echoing the sum). So for a numeric gold answer, a prediction that is
    an arithmetic expression of numbers is dropped; symbolic golds (fractions written with symbols, roots, sets)
    keep math-verify's full equivalence check.
    """
    if not any(_is_number(x) for x in gold):
        return pred
    return [x for x in pred if isinstance(x, str) or _is_number(x)]


def format_reward(completion: str) -> float:
    """1.0 when the completion holds a non-empty \\boxed{...}, else 0.0."""
    return 0.0 if _last_nonempty_boxed(completion) is None else 1.0


# ---------------------------------------------------------------------------------------------------------------
# user reward functions
# ---------------------------------------------------------------------------------------------------------------

def load_reward_function(spec: str) -> Callable:
    """Import ``"package.module:function"`` and return the callable; RewardError naming the spec otherwise."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise RewardError(f"reward function {spec!r}: expected the form 'package.module:function'")
    mod_name, attr = (s.strip() for s in spec.split(":"))
    if not mod_name or not attr:
        raise RewardError(f"reward function {spec!r}: expected the form 'package.module:function'")
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        raise RewardError(f"reward function {spec!r}: module {mod_name!r} not found ({e}); make sure it is "
                          f"installed or on PYTHONPATH") from None
    except Exception as e:
        raise RewardError(f"reward function {spec!r}: importing module {mod_name!r} failed: "
                          f"{type(e).__name__}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise RewardError(f"reward function {spec!r}: module {mod_name!r} has no attribute {attr!r}"
                              + (f"; callables there: {', '.join(public[:20])}" if public else ""))
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardError(f"reward function {spec!r}: {attr!r} is a {type(obj).__name__}, not callable")
    return obj


def _call_user_fn(fn: Callable, prompts, completions, answers) -> tuple[str, Any]:
    """Call one user function and coerce its output: ("ok", [float | None, ...]) or ("error", message)."""
    try:
        out = fn(prompts=prompts, completions=completions, answers=answers)
    except (Exception, SystemExit) as e:
        return "error", f"raised {type(e).__name__}: {e}"
    try:
        out = list(out)
    except Exception:
        return "error", f"returned {type(out).__name__}, expected a list of floats"
    vals: list = []
    for i, v in enumerate(out):
        if v is None:
            vals.append(None)
            continue
        try:
            if hasattr(v, "item") and not isinstance(v, (int, float)):
                v = v.item()  # numpy / torch scalars
            if isinstance(v, (str, bytes)):
                raise TypeError
            vals.append(float(v))
        except Exception:
            return "error", f"returned a non-numeric value at index {i}: {v!r:.80}"
    return "ok", vals


def _worker_main(conn, specs: list) -> None:
    """Reward worker loop (runs in a spawned process): load the functions once, then serve calls until EOF/None."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    except Exception:
        pass
    fns, errors = {}, {}
    for spec in specs:
        try:
            fns[spec] = load_reward_function(spec)
        except Exception as e:
            errors[spec] = str(e)
    conn.send(("ready", errors))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        spec, prompts, completions, answers = msg
        if spec not in fns:
            result = ("error", f"could not be loaded in the reward worker: {errors.get(spec, 'unknown')}")
        else:
            result = _call_user_fn(fns[spec], prompts, completions, answers)
        try:
            conn.send(result)
        except Exception as e:  # pragma: no cover - results are plain floats by now
            conn.send(("error", f"result could not be sent back: {e}"))


class _Worker:
    """One spawned process that runs user reward functions; killed and replaced after a hang or a crash."""

    def __init__(self, specs: list):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, list(specs)), daemon=True,
                                name="basis-lite-reward-worker")
        self.proc.start()
        child.close()
        self.ready = False

    def _wait_ready(self) -> str | None:
        if self.ready:
            return None
        try:
            if not self.conn.poll(_STARTUP_TIMEOUT_S):
                return f"the reward worker did not start within {_STARTUP_TIMEOUT_S:.0f} s"
            tag, _errors = self.conn.recv()
        except (EOFError, OSError):
            return f"the reward worker died while starting (exit code {self.proc.exitcode})"
        self.ready = tag == "ready"
        return None if self.ready else "the reward worker sent an unexpected start message"

    def call(self, spec, prompts, completions, answers, timeout_s: float) -> tuple[str, Any]:
        """("ok", values) | ("error", message) | ("dead", message): after "dead" this worker is unusable."""
        err = self._wait_ready()
        if err:
            return "dead", err
        try:
            self.conn.send((spec, list(prompts), list(completions), list(answers)))
            if not self.conn.poll(timeout_s):
                return "dead", f"timed out after {timeout_s:g} s (worker restarted)"
            return self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            self.proc.join(1)
            return "dead", f"the reward worker died (exit code {self.proc.exitcode}; restarted)"

    def close(self, graceful: bool = True) -> None:
        try:
            if graceful and self.proc.is_alive():
                self.conn.send(None)
                self.proc.join(2)
        except Exception:
            pass
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(2)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2)
        try:
            self.conn.close()
        except Exception:
            pass


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


class RewardScorer:
    """Scores completions: ``RewardScorer(cfg.reward)(prompts, completions, answers) -> RewardBatch``.

    Use as a context manager (or call close()) to stop the reward worker."""

    def __init__(self, cfg):
        self.cfg = cfg
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
        # import in the main process too, so a bad spec fails at start with a clear message
        self._fns = {spec: load_reward_function(spec) for spec in dict.fromkeys(self.specs)}
        self.timeout_s = float(cfg.timeout_s)
        self.warning_count = 0
        self.warnings_by_function: dict[str, int] = {k: 0 for k in self.keys}
        self._worker: _Worker | None = None
        self._closed = False
        if self.specs and self.timeout_s > 0:
            self._worker = _Worker(list(self._fns))  # starts now; imports overlap with model loading

    # -- user functions --------------------------------------------------------------------------------------
    def _warn(self, key: str, message: str) -> None:
        self.warning_count += 1
        self.warnings_by_function[key] += 1
        n = self.warnings_by_function[key]
        if n <= _LOG_FIRST or n % _LOG_EVERY == 0:
            extra = "" if n < _LOG_FIRST else f" ({n} warnings for this function so far; further ones are throttled)"
            log.warning("reward function %s %s; its reward is 0 for the affected rollouts%s", key, message, extra)

    def _run_user_fn(self, spec, prompts, completions, answers) -> tuple[str, Any]:
        if self.timeout_s <= 0:
            return _call_user_fn(self._fns[spec], prompts, completions, answers)
        if self._worker is None:
            self._worker = _Worker(list(self._fns))
        status, payload = self._worker.call(spec, prompts, completions, answers, self.timeout_s)
        if status == "dead":
            self._worker.close(graceful=False)
            self._worker = None  # a fresh one is spawned on the next call
            return "error", payload
        return status, payload

    def _score_user_fn(self, key, spec, prompts, completions, answers) -> tuple[list[float], int]:
        n = len(completions)
        status, payload = self._run_user_fn(spec, prompts, completions, answers)
        if status != "ok":
            self._warn(key, str(payload))
            return [0.0] * n, 1
        if len(payload) != n:
            self._warn(key, f"returned {len(payload)} values for {n} completions")
            return [0.0] * n, 1
        vals, bad = [], []
        for i, v in enumerate(payload):
            if v is None:
                vals.append(0.0)
            elif not math.isfinite(v):
                vals.append(0.0)
                bad.append(i)
            else:
                vals.append(v)
        if bad:
            self._warn(key, f"returned non-finite values at {len(bad)} of {n} positions (first: index {bad[0]}, "
                            f"value {payload[bad[0]]})")
            return vals, 1
        return vals, 0

    # -- public ----------------------------------------------------------------------------------------------
    def __call__(self, prompts: list[str], completions: list[str], answers: list[str]) -> RewardBatch:
        if self._closed:
            raise RuntimeError("RewardScorer is closed")
        n = len(completions)
        if len(prompts) != n or len(answers) != n:
            raise ValueError(f"RewardScorer: {len(prompts)} prompts, {n} completions and {len(answers)} answers; "
                             f"they must be the same length")
        cfg = self.cfg
        correct = [correctness(c, a, cfg.require_boxed) for c, a in zip(completions, answers)]
        fmt = [format_reward(c) for c in completions]
        total = [cfg.correctness_weight * c + cfg.format_weight * f for c, f in zip(correct, fmt)]
        per_function: dict[str, list[float]] = {}
        warnings = 0
        for key, spec, w in zip(self.keys, self.specs, self.weights):
            vals, nw = self._score_user_fn(key, spec, prompts, completions, answers)
            warnings += nw
            per_function[key] = vals
            total = [t + w * v for t, v in zip(total, vals)]
        return RewardBatch(total=total, correct=correct, format=fmt, per_function=per_function, warnings=warnings)

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
