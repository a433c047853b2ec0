"""The trainer's step functions driven one at a time (rollout, score, baselines, update), as bench/cpu_step.py and
bench/generation.py time them."""
from __future__ import annotations


def make_run_state(trainer_mod, **known):
    """A trainer.RunState holding what the step functions read; any other required field is None."""
    import dataclasses

    kw = {}
    for f in dataclasses.fields(trainer_mod.RunState):
        if f.name in known:
            kw[f.name] = known[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kw[f.name] = None
    return trainer_mod.RunState(**kw)
