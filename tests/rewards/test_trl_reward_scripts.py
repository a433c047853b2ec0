"""TRL reward scripts run unchanged: tests/reward_fns_trl.py is written the way TRL's documentation writes reward
functions (data columns by name, conversational completions, `trainer_state`, `log_metric` / `log_extra`, `async
def` judges). The async ones are awaited together (each would wait for the other forever if they ran one after
the other), inside the same worker, with the same per-function timeout and crash isolation as the others."""
from __future__ import annotations

import os

import pytest

from basis_lite.config import RewardConfig
from basis_lite.errors import RewardError
from basis_lite.rewards.scorer import RewardScorer
from basis_lite.rewards.worker import TrainerState, is_async

M = "reward_fns_trl"
COLS = {"question": ["What is 5 + 7?", "What is 2 + 2?"], "solution": ["12", "4"], "level": [1, 2]}
COMPS = ["<think>5+7</think><answer>12</answer>", "it is 5"]


def _score(functions, timeout_s, prompts=None, state=None):
    cfg = RewardConfig(functions=[f"{M}:{f}" for f in functions], timeout_s=timeout_s)
    with RewardScorer(cfg, columns=list(COLS)) as s:
        rb = s(prompts or ["q1", "q2"], COMPS, COLS["solution"], columns=COLS, completion_ids=[[1, 2, 3], [4]],
               state=state)
        return rb, s


@pytest.mark.parametrize("timeout_s", [0, 10.0])
def test_a_trl_reward_file_runs_unchanged(timeout_s):
    funcs = ["reward_len", "format_reward_func", "matches_solution", "warmup_weighted", "judge_a", "judge_b"]
    rb, s = _score(funcs, timeout_s, state=TrainerState(global_step=4, max_steps=10))
    f = {k.split(":")[1]: v for k, v in rb.per_function.items()}
    assert rb.warnings == 0
    assert f["reward_len"] == [-abs(20 - len(c)) for c in COMPS]
    assert f["format_reward_func"] == [1.0, 0.0]
    assert f["matches_solution"] == [1.0, 0.0]
    assert f["warmup_weighted"] == [0.5, 0.5]  # (global_step + 1) / max_steps
    assert rb.metrics == {"warmup_scale": 0.5}  # log_metric
    assert f["judge_a"] == [len(c) / 10 for c in COMPS]
    pid = int(f["judge_b"][0])
    assert f["judge_b"] == pytest.approx([pid + 0.003, pid + 0.001])
    assert (pid == os.getpid()) == (timeout_s == 0)  # in the worker unless reward.timeout_s is 0
    assert s._async == {f"{M}:judge_a", f"{M}:judge_b"}
    assert rb.total == pytest.approx([sum(v[i] for v in f.values()) for i in range(2)])


def test_conversational_rows_get_messages():
    """A conversational prompt (a list of messages) gets its completion as [{"role": "assistant", ...}], as in
    TRL; the TRL function reads completion[0]["content"]."""
    prompts = [[{"role": "user", "content": "What is 5 + 7?"}], [{"role": "user", "content": "What is 2 + 2?"}]]
    rb, _ = _score(["format_reward_func", "judge_a", "judge_b"], 0, prompts=prompts)
    f = {k.split(":")[1]: v for k, v in rb.per_function.items()}
    assert f["format_reward_func"] == [1.0, 0.0] and f["judge_a"] == [len(c) / 10 for c in COMPS]


def test_is_async():
    import functools

    import reward_fns_trl as m

    class Judge:
        async def __call__(self, completions, **kwargs):
            return [0.0] * len(completions)

    assert is_async(m.judge_a) and is_async(functools.partial(m.judge_a)) and is_async(Judge())
    assert not is_async(m.reward_len) and not is_async(functools.partial(m.reward_len))


@pytest.mark.parametrize("timeout_s", [0, 10.0])
def test_a_failing_async_function_stops_on_its_first_call(timeout_s):
    with pytest.raises(RewardError, match=r"judge_raises failed on its first call: raised ConnectionError: judge API "
                                          r"unreachable \(at reward_fns_trl.py"):
        _score(["judge_a", "judge_b", "judge_raises"], timeout_s)


def test_async_timeout_and_crash_are_isolated():
    """An async function that never answers times out alone (the worker stays); one that kills its process takes
    the worker down and the trainer gets a RewardError, not a crash; after a first good batch a timeout is a
    warning and zeros for that function while the others keep their values, in the same worker."""
    with pytest.raises(RewardError, match="judge_never_answers failed on its first call: timed out after 1 s"):
        _score(["judge_never_answers", "reward_len"], 1.0)
    with pytest.raises(RewardError, match="judge_crashes failed on its first call: the reward worker died"):
        _score(["judge_crashes"], 1.0)

    cfg = RewardConfig(functions=[f"{M}:{f}" for f in ("reward_len", "judge_a", "judge_b", "judge_hangs_on_request")],
                       timeout_s=1.0)
    with RewardScorer(cfg, columns=list(COLS)) as s:
        kw = dict(columns=COLS, completion_ids=[[1, 2, 3], [4]])
        good = s(["q1", "q2"], COMPS, COLS["solution"], **kw)
        bad = s(["hang", "q2"], COMPS, COLS["solution"], **kw)
    assert good.warnings == 0 and bad.warnings == 1
    assert bad.per_function[f"{M}:judge_hangs_on_request"] == [0.0, 0.0]
    for name in ("reward_len", "judge_a", "judge_b"):  # judge_b's value holds the worker's pid: the same worker
        assert bad.per_function[f"{M}:{name}"] == good.per_function[f"{M}:{name}"]
