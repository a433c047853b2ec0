"""The trainer's step functions driven one at a time (rollout, score, baselines, update), as bench/cpu_step.py and
bench/generation.py time them."""
from __future__ import annotations


def make_run_state(**known):
    """A RunState (basis_lite.rl.state) holding what the step functions read; any other required field is None."""
    import dataclasses

    from basis_lite.rl.state import RunState

    kw = {}
    for f in dataclasses.fields(RunState):
        if f.name in known:
            kw[f.name] = known[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kw[f.name] = None
    return RunState(**kw)
