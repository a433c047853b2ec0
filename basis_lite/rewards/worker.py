"""The isolated reward worker: user reward functions (``"package.module:function"``) are imported, their signatures
checked, and called in one persistent "spawn" process, so that the trainer survives code that raises, exits, crashes
or hangs (rewards/scorer.py's docstring says exactly what this guards and what it does not).
``reward.timeout_s: 0`` calls them in this process instead (``load_all`` + ``call_user_fn``).
"""
from __future__ import annotations

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


def call_user_fn(fn: Callable, plan: CallPlan, kwargs: dict) -> tuple[str, Any]:
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
            result = call_user_fn(*fns[spec], kwargs)
        try:
            conn.send(result)
        except Exception as e:  # pragma: no cover - results are plain floats by now
            conn.send(("error", f"result could not be sent back: {e}"))


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
