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
see ``_refuse_code_from``) and are called batched with keyword arguments, TRL's
convention::

    def my_reward(completions, answers, **kwargs) -> list[float]:               # basis-lite's names
    def accuracy(completions, answer, level, **kwargs) -> list[float]:          # data columns, as TRL passes them
    def brevity(prompts, completions) -> list[float]:                           # only what it asks for

One finite float per completion; None counts as 0 (TRL's "does not apply"). The keyword arguments, one value per
completion: ``prompts`` (the rendered prompt), ``completions`` (text), ``completion_ids`` (token ids), ``answers``
(the gold answers), and the data columns: the question under ``data.question_field``'s name, the gold answer under
``data.answer_field``'s name and each metadata key of the examples (``level``, ``family``, ...). A function with
``**kwargs`` gets all of them, any other only the parameters it names. Its signature is checked when the scorer
starts (before step 1): a parameter without a default that no argument fills is a RewardError naming what is
passed.

Values are used as returned (nothing is clamped) and weighted by ``reward.function_weights`` (1.0 each by
default). The total reward of a rollout is::

    total = correctness_weight * correct + format_weight * format + sum_k weight_k * f_k

A user function that fails on its FIRST call (raises, returns the wrong number of values or non-numeric ones,
runs longer than ``reward.timeout_s``, or kills its process) stops the run with a RewardError carrying the
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

math-verify always runs in the main process. Its timeouts use ``signal.alarm``, which only works in the main
thread; from other threads it is called with its timeouts disabled.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
import math
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
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

# passed to every user function (when its signature takes them); the data columns follow (see `example_columns`)
STANDARD_KWARGS = ("prompts", "completions", "completion_ids", "answers")


def _cwd_on_path() -> None:
    """Make modules beside the working directory importable (`reward.functions: [myrewards:f]` with myrewards.py
    in the folder the run was started from), as `python -m` and `python script.py` users expect: the console
    script `basis-lite` does not put the working directory on sys.path. Appended, so it never shadows an installed
    package."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.append(cwd)


def _refuse_code_from(mod_name: str, spec: str, refused_dirs: Sequence) -> None:
    """Keep code inside `refused_dirs` (a resumed run's folder) from being imported: a module that would be found
    inside one is a RewardError, raised before anything of it runs, and their entries leave sys.path (the working
    directory too, when it lies inside one), so that nothing a module imports comes from there either."""
    from pathlib import Path

    bases = [Path(d).resolve() for d in refused_dirs]
    if not bases:
        return

    def refused(p) -> bool:
        try:
            r = Path(p or os.getcwd()).resolve()
        except (OSError, RuntimeError):
            return False
        return any(r == b or b in r.parents for b in bases)

    try:
        found = importlib.util.find_spec(mod_name.split(".")[0])  # finds, runs nothing
    except (ImportError, ValueError):
        found = None
    sys.path[:] = [p for p in sys.path if not refused(p)]
    where = [found.origin] if found and found.origin else []
    where += list(found.submodule_search_locations or []) if found else []
    bad = [w for w in where if refused(w)]
    if bad:
        raise RewardError(f"reward function {spec!r}: module {mod_name!r} would be imported from {bad[0]}, inside "
                          f"the run folder being resumed; a resumed run never imports code that came inside its "
                          f"folder. Install the module, or put it on PYTHONPATH outside the run folder")


def load_reward_function(spec: str, refused_dirs: Sequence = ()) -> Callable:
    """Import ``"package.module:function"`` and return the callable; RewardError naming the spec otherwise.

    The working directory is searched last (see ``_cwd_on_path``), unless it lies inside one of `refused_dirs`;
    nothing inside those is imported (``_refuse_code_from``). The RewardScorer calls this only inside its worker
    process (or in this process with ``reward.timeout_s: 0``)."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise RewardError(f"reward function {spec!r}: expected the form 'package.module:function'")
    mod_name, attr = (s.strip() for s in spec.split(":"))
    if not mod_name or not attr:
        raise RewardError(f"reward function {spec!r}: expected the form 'package.module:function'")
    _cwd_on_path()
    _refuse_code_from(mod_name, spec, refused_dirs)
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        raise RewardError(f"reward function {spec!r}: module {mod_name!r} not found ({e}); make sure it is "
                          f"installed, on PYTHONPATH or in the working directory ({os.getcwd()})") from None
    except BaseException as e:  # SystemExit at import too: it must not end the worker's start silently
        raise RewardError(f"reward function {spec!r}: importing module {mod_name!r} failed: "
                          f"{type(e).__name__}: {e}{_where(e)}") from None
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


@dataclass(frozen=True)
class CallPlan:
    """Which keyword arguments a user function takes: all of them (it has **kwargs, or its signature cannot be
    read), or the named ones."""

    takes_all: bool
    names: frozenset = frozenset()

    def select(self, kwargs: dict) -> dict:
        return dict(kwargs) if self.takes_all else {k: v for k, v in kwargs.items() if k in self.names}


def check_signature(spec: str, fn: Callable, available: Sequence[str]) -> CallPlan:
    """How to call `fn` with the keyword arguments in `available`; RewardError when a parameter without a default
    would get no value (so a TRL function asking for `solution` fails before step 1, naming what is passed)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables: nothing to check
        return CallPlan(True)
    takes_all, names, missing = False, set(), []
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            takes_all = True
        elif p.kind is p.VAR_POSITIONAL:
            continue
        elif p.kind is p.POSITIONAL_ONLY:
            if p.default is p.empty:
                missing.append(f"{p.name} (positional-only; arguments are passed by keyword)")
        else:
            names.add(p.name)
            if p.default is p.empty and p.name not in available:
                missing.append(p.name)
    if missing:
        raise RewardError(
            f"reward function {spec!r}: parameter {', '.join(repr(m) for m in missing)} gets no value. User "
            f"functions are called with keyword arguments (TRL's convention): {', '.join(available)} - prompts, "
            f"completions and completion_ids of the batch, the gold answers, and the data columns "
            f"(data.question_field, data.answer_field and the examples' metadata). Rename the parameter, give it a "
            f"default, or take **kwargs")
    return CallPlan(takes_all, frozenset(names))


def _where(e: BaseException) -> str:
    """' (at file.py:12 in fn)': the innermost frame of the exception's traceback, or ''."""
    tb = traceback.extract_tb(e.__traceback__) if e.__traceback__ is not None else []
    if not tb:
        return ""
    f = tb[-1]
    return f" (at {os.path.basename(f.filename)}:{f.lineno} in {f.name})"


def _call_user_fn(fn: Callable, plan: CallPlan, kwargs: dict) -> tuple[str, Any]:
    """Call one user function and coerce its output: ("ok", [float | None, ...]) or ("error", message)."""
    try:
        out = fn(**plan.select(kwargs))
    except (Exception, SystemExit) as e:
        return "error", f"raised {type(e).__name__}: {e}{_where(e)}"
    if isinstance(out, (dict, str, bytes, set, frozenset)) or hasattr(out, "keys"):
        return "error", f"returned a {type(out).__name__}, expected a list of floats (one per completion)"
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


def _load_all(specs: list, available: list, refused_dirs: Sequence = ()) -> tuple[dict, dict]:
    """({spec: (fn, CallPlan)}, {spec: error message}): every function imported and its signature checked."""
    fns, errors = {}, {}
    for spec in specs:
        try:
            fn = load_reward_function(spec, refused_dirs)
            fns[spec] = (fn, check_signature(spec, fn, available))
        except RewardError as e:
            errors[spec] = str(e)
    return fns, errors


def _worker_main(conn, specs: list, available: list, refused_dirs: Sequence = ()) -> None:
    """Reward worker loop (runs in a spawned process): import the functions and check their signatures, then serve
    calls until EOF/None. The only place user reward code is imported and run (unless reward.timeout_s is 0)."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    except Exception:
        pass
    fns, errors = {}, {}
    for spec in specs:
        conn.send(("loading", spec))  # so that a crash during the import names the module
        f, err = _load_all([spec], available, refused_dirs)
        fns.update(f)
        errors.update(err)
    conn.send(("ready", errors))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        spec, kwargs = msg
        if spec not in fns:
            result = ("error", f"could not be loaded in the reward worker: {errors.get(spec, 'unknown')}")
        else:
            result = _call_user_fn(*fns[spec], kwargs)
        try:
            conn.send(result)
        except Exception as e:  # pragma: no cover - results are plain floats by now
            conn.send(("error", f"result could not be sent back: {e}"))


class _Worker:
    """One spawned process that runs user reward functions; killed and replaced after a hang or a crash."""

    def __init__(self, specs: list, available: list, refused_dirs: Sequence = ()):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, list(specs), list(available),
                                                           [str(d) for d in refused_dirs]), daemon=True,
                                name="basis-lite-reward-worker")
        self.proc.start()
        child.close()
        self.ready = False
        self.errors: dict = {}

    def wait_ready(self) -> str | None:
        """None once the worker has imported the functions (their errors are in `self.errors`), else why not."""
        if self.ready:
            return None
        loading = None
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        try:
            while True:
                if not self.conn.poll(max(0.0, deadline - time.monotonic())):
                    what = f" (still importing {loading!r})" if loading else ""
                    return f"the reward worker did not start within {_STARTUP_TIMEOUT_S:.0f} s{what}"
                tag, payload = self.conn.recv()
                if tag == "loading":
                    loading = payload
                    continue
                break
        except (EOFError, OSError):
            self.proc.join(2)
            what = f" while importing {loading!r}" if loading else " while starting"
            return f"the reward worker exited (exit code {self.proc.exitcode}){what}"
        if tag != "ready":
            return f"the reward worker sent an unexpected start message {tag!r}"
        self.ready, self.errors = True, payload
        return None

    def call(self, spec, kwargs: dict, timeout_s: float) -> tuple[str, Any]:
        """("ok", values) | ("error", message) | ("dead", message): after "dead" this worker is unusable."""
        err = self.wait_ready()
        if err:
            return "dead", err
        try:
            self.conn.send((spec, kwargs))
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
        self._worker: _Worker | None = None
        self._closed = False
        unique = list(dict.fromkeys(self.specs))
        if not unique:
            return
        if self.timeout_s <= 0:  # asked for: user code in this process, no isolation
            self._fns, errors = _load_all(unique, self.available, self.refused_dirs)
        else:
            self._worker = _Worker(unique, self.available, self.refused_dirs)
            err = self._worker.wait_ready()
            if err:
                self.close()
                raise RewardError(f"reward.functions: {err}; nothing was trained. Run the import by hand "
                                  f"(python -c 'import MODULE') to see why")
            errors = self._worker.errors
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

    def _run_user_fn(self, spec, kwargs: dict) -> tuple[str, Any]:
        if self.timeout_s <= 0:
            return _call_user_fn(*self._fns[spec], kwargs)
        if self._worker is None:
            self._worker = _Worker(list(dict.fromkeys(self.specs)), self.available, self.refused_dirs)
        status, payload = self._worker.call(spec, kwargs, self.timeout_s)
        if status == "dead":
            self._worker.close(graceful=False)
            self._worker = None  # a fresh one is spawned on the next call
            return "error", payload
        return status, payload

    def _failed(self, key: str, spec: str, message: str, n: int) -> tuple[list[float], int]:
        """A failed call: before the function ever worked it is a bug to fix (RewardError: the run stops), after
        that one bad batch (0 for its rollouts, a warning, the run goes on)."""
        if spec not in self._proven:
            raise RewardError(f"reward function {key} failed on its first call: {message}. The run stops here: a "
                              f"function that never returned valid rewards would train on zeros. (Once it has "
                              f"worked, a failing batch scores 0 with a warning and the run goes on.)")
        self._warn(key, message)
        return [0.0] * n, 1

    def _score_user_fn(self, key, spec, kwargs: dict) -> tuple[list[float], int]:
        n = len(kwargs["completions"])
        status, payload = self._run_user_fn(spec, kwargs)
        if status != "ok":
            return self._failed(key, spec, str(payload), n)
        if len(payload) != n:
            return self._failed(key, spec, f"returned {len(payload)} values for {n} completions", n)
        self._proven.add(spec)
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
    def __call__(self, prompts: list[str], completions: list[str], answers: list[str],
                 columns: dict[str, list] | None = None, completion_ids: list | None = None) -> RewardBatch:
        """Score a batch; `columns` (``example_columns``) and `completion_ids` go to the user functions that ask
        for them, one value per completion."""
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
        if self.specs:
            kwargs = {"prompts": list(prompts), "completions": list(completions), "answers": list(answers), **extra}
            for key, spec, w in zip(self.keys, self.specs, self.weights):
                vals, nw = self._score_user_fn(key, spec, kwargs)
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
