"""The isolated reward worker: user reward functions (``"package.module:function"``) are imported, their signatures
checked, and called in one persistent "spawn" process, so that the trainer survives code that raises, exits, crashes
or hangs (rewards/scorer.py's docstring says exactly what this guards and what it does not).
``reward.timeout_s: 0`` calls them in this process instead (``load_all`` + ``call_user_fn``). ``async def``
functions (TRL runs them concurrently, e.g. calls to a judge API) are awaited together with ``asyncio.gather``,
each within the timeout (``call_async_fns``).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import importlib
import importlib.util
import inspect
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import RewardError
from ..safeio import inside

_STARTUP_TIMEOUT_S = 120.0  # a fresh worker must import the user functions within this time
_ASYNC_GRACE_S = 5.0  # async functions time out one by one inside the worker; past this more the worker is replaced


# ---------------------------------------------------------------------------------------------------------------
# user reward functions
# ---------------------------------------------------------------------------------------------------------------

# passed to every user function (when its signature takes them); the data columns follow (see `example_columns`).
# trainer_state, log_extra and log_metric are TRL's: the training progress and two logging callbacks
STANDARD_KWARGS = ("prompts", "completions", "completion_ids", "answers", "trainer_state", "log_extra", "log_metric")


@dataclass(frozen=True)
class TrainerState:
    """The `trainer_state` argument: the part of TRL's TrainerState that reward shaping by progress reads.
    global_step: optimizer steps done before this batch (0 at the first step, as in TRL); max_steps: train.steps."""

    global_step: int = 0
    max_steps: int = 0


def is_async(fn: Callable) -> bool:
    """Whether calling `fn` returns a coroutine: an `async def` function, a functools.partial of one, or an object
    whose __call__ is `async def` (TRL's is_async_callable)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


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
    if not refused_dirs:
        return

    def refused(p) -> bool:
        return any(inside(d, p or os.getcwd()) for d in refused_dirs)

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

    The working directory is searched last (see ``_cwd_on_path``). The RewardScorer calls this only inside its
    worker process (or in this process with ``reward.timeout_s: 0``)."""
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


def _logging_kwargs(metrics: dict) -> dict:
    """TRL's log_metric(name, value) (collected into `metrics`: the scorer averages them into the step's metrics)
    and log_extra(column, values) (TRL's completions table: basis-lite has none, so the values are accepted and
    dropped)."""
    def log_metric(name: str, value: float) -> None:
        metrics.setdefault(str(name), []).append(float(value))

    def log_extra(column: str, values: list) -> None:
        return None

    return {"log_metric": log_metric, "log_extra": log_extra}


def _arguments(plan: CallPlan, kwargs: dict, metrics: dict) -> dict:
    """The keyword arguments of one call: its own deep copy of those the function takes, so that changing them (a
    conversation's message list, a column's values) changes nothing of the dataset or of what the next function
    gets, and the logging functions it asks for."""
    return {**copy.deepcopy(plan.select(kwargs)), **plan.select(_logging_kwargs(metrics))}


def _coerce(out: Any) -> tuple[str, Any]:
    """A user function's output as ("ok", [float | None, ...]) or ("error", message). An array-like result (numpy
    array, pandas Series, torch tensor: anything with `tolist`) is read as its list."""
    if hasattr(out, "tolist") and not isinstance(out, (dict, str, bytes)):
        try:
            out = out.tolist()
        except Exception as e:  # noqa: BLE001 - user objects raise anything
            return "error", f"returned a {type(out).__name__} whose tolist() raised {type(e).__name__}: {e}"
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


def call_user_fn(fn: Callable, plan: CallPlan, kwargs: dict) -> tuple[str, Any, dict]:
    """Call one user function and coerce its output: ("ok", [float | None, ...], metrics) or ("error", message,
    metrics); `metrics` holds what it passed to log_metric ({name: [values]})."""
    metrics: dict = {}
    try:
        out = fn(**_arguments(plan, kwargs, metrics))
    except (Exception, SystemExit) as e:
        return "error", f"raised {type(e).__name__}: {e}{_where(e)}", metrics
    return (*_coerce(out), metrics)


async def _await_user_fn(fn: Callable, plan: CallPlan, kwargs: dict, timeout_s: float) -> tuple[str, Any, dict]:
    metrics: dict = {}
    try:
        coro = fn(**_arguments(plan, kwargs, metrics))
        out = await (asyncio.wait_for(coro, timeout_s) if timeout_s > 0 else coro)
    except asyncio.TimeoutError:
        return "error", f"timed out after {timeout_s:g} s", metrics
    except (Exception, SystemExit) as e:
        return "error", f"raised {type(e).__name__}: {e}{_where(e)}", metrics
    return (*_coerce(out), metrics)


def call_async_fns(calls: list, kwargs: dict, timeout_s: float) -> list:
    """Await the `async def` functions of `calls` ([(fn, CallPlan)]) concurrently on one event loop, each within
    `timeout_s` (0: no limit); one call_user_fn-style result per function, in order. From a thread that already
    runs an event loop (a notebook) the loop runs in a helper thread."""
    async def gather() -> list:
        return list(await asyncio.gather(*(_await_user_fn(fn, plan, kwargs, timeout_s) for fn, plan in calls)))

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, gather()).result()


def load_all(specs: list, available: list, refused_dirs: Sequence = ()) -> tuple[dict, dict]:
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
        f, err = load_all([spec], available, refused_dirs)
        fns.update(f)
        errors.update(err)
    conn.send(("ready", (errors, [spec for spec, (fn, _) in fns.items() if is_async(fn)])))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        spec, kwargs, timeout_s = msg
        group = [spec] if isinstance(spec, str) else list(spec)
        missing = [s for s in group if s not in fns]
        if missing:
            results = [("error", f"could not be loaded in the reward worker: {errors.get(s, 'unknown')}", {})
                       for s in group]
        elif isinstance(spec, str):
            results = [call_user_fn(*fns[spec], kwargs)]
        else:  # async functions, awaited together
            results = call_async_fns([fns[s] for s in group], kwargs, timeout_s)
        try:
            conn.send(results[0] if isinstance(spec, str) else results)
        except Exception as e:  # pragma: no cover - results are plain floats by now
            failed = ("error", f"result could not be sent back: {e}", {})
            conn.send(failed if isinstance(spec, str) else [failed] * len(group))


class Worker:
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
        self.async_specs: set = set()  # the functions that are `async def` (awaited together)

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
        self.ready = True
        self.errors, async_specs = payload
        self.async_specs = set(async_specs)
        return None

    def call(self, spec, kwargs: dict, timeout_s: float):
        """One function (`spec` a string): ("ok", values, metrics) | ("error", message, metrics); a tuple of async
        functions: a list of those, awaited together, each within `timeout_s` inside the worker. ("dead",
        message, {}) when the worker hung past the limit or died: it is unusable after that."""
        err = self.wait_ready()
        if err:
            return "dead", err, {}
        limit = timeout_s if isinstance(spec, str) else timeout_s + _ASYNC_GRACE_S
        try:
            self.conn.send((spec, kwargs, timeout_s))
            if not self.conn.poll(limit):
                return "dead", f"timed out after {timeout_s:g} s (worker restarted)", {}
            return self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            self.proc.join(1)
            return "dead", f"the reward worker died (exit code {self.proc.exitcode}; restarted)", {}

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
