"""User reward functions for tests/test_rewards.py (imported by module path, also in the reward worker)."""
import math
import os
import time


def length_reward(prompts, completions, answers, **kwargs):
    return [len(c) / 100 for c in completions]


def moody(prompts, completions, answers, **kwargs):
    """Behaves according to the first prompt: raise / hang / short / nan / text / exit; otherwise 1.0 each."""
    mode = prompts[0]
    n = len(completions)
    if mode == "raise":
        raise RuntimeError("moody is upset")
    if mode == "hang":
        time.sleep(60)
    if mode == "short":
        return [1.0] * (n - 1)
    if mode == "nan":
        return [math.nan] + [1.0] * (n - 1)
    if mode == "text":
        return ["high"] * n
    if mode == "exit":
        os._exit(3)
    if mode == "none":
        return [None] * n
    return [1.0] * n


def pid_reward(prompts, completions, answers, **kwargs):
    return [float(os.getpid())] * len(completions)


NOT_CALLABLE = 3


# --- for the trainer / resume / bad-input tests (imported as tests.reward_fns:..., by the trainer and its worker) ---

def char_sum_reward(prompts, completions, answers, **kwargs):
    """Deterministic and varied even for the random tiny model (whose arithmetic reward is always 0), so that
    advantages are non-zero and every step really updates the adapter: (sum of code points mod 7) / 6."""
    return [(sum(map(ord, c)) % 7) / 6 for c in completions]


def always_raises(prompts, completions, answers, **kwargs):
    raise ValueError("always_raises: deliberate failure")


def always_hangs(prompts, completions, answers, **kwargs):
    time.sleep(60)
    return [1.0] * len(completions)
