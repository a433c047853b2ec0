"""User reward functions for tests/rewards/test_rewards.py (imported by module path, also in the reward worker)."""
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


# --- first call vs later calls (counters live in the process that runs them: the reward worker) ---

_calls = {"raises_after_first": 0, "hangs_after_first": 0}


def raises_after_first(prompts, completions, answers, **kwargs):
    _calls["raises_after_first"] += 1
    if _calls["raises_after_first"] > 1:
        raise RuntimeError("raises_after_first: deliberate failure after a good first call")
    return [0.5] * len(completions)


def hangs_after_first(prompts, completions, answers, **kwargs):
    _calls["hangs_after_first"] += 1
    if _calls["hangs_after_first"] > 1:
        time.sleep(60)
    return [0.5] * len(completions)


# --- TRL's calling convention: only the keyword arguments a function names, data columns by their field names ---

def trl_answer_level(completions, answer, level, **kwargs):
    """1.0 where the completion contains the gold answer, plus level / 10; rejects unexpected arguments."""
    assert "prompts" in kwargs and "completion_ids" in kwargs and "question" in kwargs, sorted(kwargs)
    return [float(a in c) + lv / 10 for c, a, lv in zip(completions, answer, level)]


def strict_prompts_completions(prompts, completions):
    """No **kwargs: called with these two only."""
    return [float(len(p) > len(c)) for p, c in zip(prompts, completions)]


def needs_solution(completions, solution):
    """Asks for a column the data does not have: refused before the first call."""
    return [1.0] * len(completions)


def in_worker_pid(completions, **kwargs):
    return [float(os.getpid())] * len(completions)


def trl_conversational(prompts, completions, solution, difficulty, **kwargs):
    """TRL's documented conversational reward: completions are [{"role": "assistant", "content": ...}] lists and
    prompts the dataset's message lists; `solution` and `difficulty` are data columns. Asserts those shapes (a
    wrong shape fails the call), then scores 1.0 where the completion holds the solution, plus difficulty / 10."""
    assert all(isinstance(p, list) and p[-1]["role"] == "user" for p in prompts), prompts[:1]
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in completions), completions[:1]
    texts = [c[0]["content"] for c in completions]
    return [float(s in t) + d / 10 for t, s, d in zip(texts, solution, difficulty)]
