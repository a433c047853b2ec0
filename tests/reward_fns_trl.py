"""A reward file written the way TRL's GRPOTrainer documentation writes them (keyword arguments, data columns by
name, conversational completions, `trainer_state`, `log_metric`, an `async def` judge), run unchanged by
tests/rewards/test_trl_reward_scripts.py. Nothing here imports basis_lite."""
import asyncio
import os
import re


def reward_len(completions, **kwargs):
    """TRL's first example: completions close to 20 characters."""
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """TRL's conversational example: the text is completion[0]["content"]."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    contents = [completion[0]["content"] if isinstance(completion, list) else completion for completion in completions]
    return [1.0 if re.match(pattern, content) else 0.0 for content in contents]


def matches_solution(completions, solution, **kwargs):
    """A data column by its own name (TRL passes every column but `prompt`), here `solution`."""
    return [1.0 if str(sol) in completion else 0.0 for completion, sol in zip(completions, solution)]


def warmup_weighted(completions, trainer_state, log_metric, log_extra, **kwargs):
    """Reward shaping by training progress, and TRL's two logging callbacks."""
    scale = (trainer_state.global_step + 1) / max(1, trainer_state.max_steps)
    log_metric("warmup_scale", scale)
    log_extra("scale", [scale] * len(completions))
    return [scale] * len(completions)


_arrived: dict = {}


async def _meet(tag: str, key: str) -> None:
    """Returns once both `judge_*` functions of the same batch have started: awaited one after the other, the
    first would wait here until its timeout."""
    _arrived.setdefault(key, set()).add(tag)
    while len(_arrived[key]) < 2:
        await asyncio.sleep(0.005)


async def judge_a(prompts, completions, **kwargs):
    """An async reward (a judge API in real use): 1 point per 10 characters."""
    await _meet("a", repr(completions))
    await asyncio.sleep(0)
    return [len(c if isinstance(c, str) else c[0]["content"]) / 10 for c in completions]


async def judge_b(prompts, completions, completion_ids, **kwargs):
    """A second async judge: the process id (where it ran) and the token counts."""
    await _meet("b", repr(completions))
    return [float(os.getpid()) + len(ids) / 1000 for ids in completion_ids]


async def judge_never_answers(completions, **kwargs):
    await asyncio.sleep(3600)
    return [0.0] * len(completions)


async def judge_crashes(completions, **kwargs):
    os._exit(5)


async def judge_raises(completions, **kwargs):
    raise ConnectionError("judge API unreachable")


async def judge_hangs_on_request(prompts, completions, **kwargs):
    """Never answers when the first prompt is "hang" (a judge API that stalls), else 1.0 each."""
    if prompts[0] == "hang":
        await asyncio.sleep(3600)
    return [1.0] * len(completions)
