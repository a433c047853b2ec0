"""A reward for cost measurements on models that earn no real reward (bench/cost_scaling.py's `shapes:` models, random
weights): deterministic and varied, so that a step's advantages are not all 0 and its update runs as it does in a run
that learns (a batch whose rewards are all alike trains nothing and takes no update time)."""
from __future__ import annotations


def varied(prompts, completions, **kwargs):
    """(sum of the completion's code points mod 7) / 6: in [0, 1], different across random completions."""
    return [(sum(map(ord, c)) % 7) / 6 for c in completions]
