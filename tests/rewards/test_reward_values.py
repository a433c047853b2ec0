"""Reliability, fourth round (issue 37), reward values that lie: values that are not finite in float32 (the
trainer's reward dtype), weights included, are a failed call: on a function's first call the run stops naming it
(exit 2), later the affected rollouts score 0 with a warning. Array-like results (numpy, pandas, torch) are read as
lists; a function gets its own copy of the arguments, so changing them changes nothing of the dataset."""
from __future__ import annotations

import logging
import textwrap

import pytest
from conftest import FAST, cli_main, sets

from basis_lite.config import RewardConfig
from basis_lite.errors import RewardError
from basis_lite.rewards.scorer import FLOAT32_MAX, RewardScorer

LIES = {  # name: (the expression returned for n completions, the weight)
    "nan_list": ("[math.nan] * n", 1.0),
    "inf_list": ("[math.inf] * n", 1.0),
    "minus_inf_list": ("[-math.inf] * n", 1.0),
    "nan_numpy": ("numpy.full(n, numpy.nan)", 1.0),
    "inf_numpy": ("numpy.full(n, numpy.inf)", 1.0),
    "nan_torch": ("torch.full((n,), float('nan'))", 1.0),
    "beyond_float32": ("[1e300] * n", 1.0),
    "beyond_float32_once_weighted": ("[3e38] * n", 2.0),
    "one_bad_entry": ("[1.0] * (n - 1) + [math.inf]", 1.0),
}


@pytest.fixture
def lies(tmp_path, monkeypatch):
    """A module `lying_rewards` on sys.path with one function per entry of LIES (and a few honest ones)."""
    body = ["import math", ""]
    for name, (expr, _) in LIES.items():  # numpy, pandas and torch imported by the functions that use them
        lib = next((m for m in ("numpy", "torch") if expr.startswith(m)), None)
        body += [f"def {name}(completions, **kw):", f"    import {lib}" if lib else "", "    n = len(completions)",
                 f"    return {expr}", ""]
    body += [textwrap.dedent("""
        def series(completions, **kw):
            import pandas

            return pandas.Series([0.5] * len(completions))

        def near_max(completions, **kw):
            return [2e38] * len(completions)

        def honest_then_nan(completions, prompts, **kw):
            return [math.nan if p == "lie" else 1.0 for p in prompts]

        def mutate(prompts, **kw):
            for p in prompts:
                p[-1]["content"] = "CHANGED"
                p.append({"role": "assistant", "content": "extra"})
            return [1.0] * len(prompts)

        def look(prompts, **kw):
            return [float(p[-1]["content"] == "CHANGED" or len(p) != 2) for p in prompts]
        """)]
    (tmp_path / "lying_rewards.py").write_text("\n".join(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "lying_rewards"


def _scorer(module, *names, weights=None, timeout_s=0.0):
    return RewardScorer(RewardConfig(functions=[f"{module}:{n}" for n in names], function_weights=weights or [],
                                     timeout_s=timeout_s))


@pytest.mark.parametrize("name", sorted(LIES))
def test_values_not_finite_in_float32_on_the_first_call_stop_the_run(lies, name):
    weight = LIES[name][1]
    with _scorer(lies, name, weights=[weight]) as s, pytest.raises(RewardError) as e:
        s(["q", "q"], ["a", "b"], ["1", "1"])
    assert f"{lies}:{name}" in str(e.value) and "first call" in str(e.value) and "float32" in str(e.value)


def test_in_the_worker_too(lies):
    with _scorer(lies, "nan_numpy", timeout_s=30) as s, pytest.raises(RewardError, match="nan_numpy.*first call"):
        s(["q", "q"], ["a", "b"], ["1", "1"])


def test_after_the_first_call_lying_values_score_zero_with_a_warning(lies, caplog):
    with _scorer(lies, "honest_then_nan") as s, caplog.at_level(logging.WARNING, "basis_lite.rewards.scorer"):
        assert s(["ok", "ok"], ["a", "b"], ["1", "1"]).per_function[f"{lies}:honest_then_nan"] == [1.0, 1.0]
        rb = s(["lie", "ok"], ["a", "b"], ["1", "1"])
    assert rb.per_function[f"{lies}:honest_then_nan"] == [0.0, 1.0] and rb.warnings == 1
    assert "non-finite" in caplog.text


def test_a_weighted_sum_beyond_float32_scores_zero_with_a_warning(lies, caplog):
    """Each of two functions fits float32 (2e38), their sum does not: the trainer never sees an inf."""
    with _scorer(lies, "near_max", "near_max") as s, caplog.at_level(logging.WARNING, "basis_lite.rewards.scorer"):
        rb = s(["q", "q"], ["a", "b"], ["1", "1"])
    assert rb.total == [0.0, 0.0] and rb.warnings == 1 and "float32" in caplog.text
    assert all(abs(v) <= FLOAT32_MAX for v in rb.per_function[f"{lies}:near_max"])


def test_a_pandas_series_is_read_as_a_list(lies):
    with _scorer(lies, "series") as s:
        assert s(["q", "q"], ["a", "b"], ["1", "1"]).per_function[f"{lies}:series"] == [0.5, 0.5]


@pytest.mark.parametrize("timeout_s", [0.0, 30.0])
def test_a_function_cannot_change_the_datasets_messages(lies, timeout_s):
    prompts = [[{"role": "system", "content": "S"}, {"role": "user", "content": "What is 1 + 1?"}] for _ in range(2)]
    keep = [[dict(m) for m in p] for p in prompts]
    with _scorer(lies, "mutate", "look", timeout_s=timeout_s) as s:
        rb = s(prompts, ["a", "b"], ["2", "2"])
    assert prompts == keep
    assert rb.per_function[f"{lies}:look"] == [0.0, 0.0]  # the next function got the messages as given


def test_train_stops_with_exit_2_naming_a_function_that_returns_only_nan(lies, tmp_path, capsys):
    run = tmp_path / "run"
    rc = cli_main("train", "--preset", "smoke", *sets(FAST + [f"reward.functions=[{lies}:nan_numpy]"]), "--output",
                  str(run), "--no-progress")
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert f"{lies}:nan_numpy" in err and "first call" in err
