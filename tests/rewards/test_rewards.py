import logging
import math
import os
import sys
import threading
from pathlib import Path

import pytest

from basis_lite.config import RewardConfig
from basis_lite.errors import RewardError
from basis_lite.rewards.answers import correctness, extract_boxed, format_reward, gold_is_parseable, parse_gold
from basis_lite.rewards.scorer import RewardScorer
from basis_lite.rewards.worker import load_reward_function

# the helper module is imported by module path, here and in the spawned reward worker (which inherits sys.path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# -- extract_boxed ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("The answer is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{84}{2}}", "\\frac{84}{2}"),
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{}", ""),
    ("no box here 42", None),
    ("", None),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("\\boxed {7}", "7"),
    ("\\boxed{a^{2}+{b}}", "a^{2}+{b}"),
    ("\\boxed{5} and a truncated \\boxed{12", "5"),
    ("\\boxed{\\boxed{5}}", "5"),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


# -- correctness with real math-verify ------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, gold, expected", [
    ("So 40 + 2 = 42, the answer is \\boxed{42}.", "42", 1.0),
    ("\\boxed{\\frac{84}{2}}", "42", 1.0),
    ("\\boxed{43}", "42", 0.0),
    ("17 + 25 = 42\n\nThe answer is \\boxed{}.", "42", 0.0),  # empty box: math-verify alone would read 42
    ("The answer is 42.", "42", 0.0),  # no box at all
    ("I think \\boxed{41}, no wait, \\boxed{42}", "42", 1.0),  # the last box counts
    ("\\boxed{42} hmm, maybe \\boxed{41}", "42", 0.0),
    ("\\boxed{42} and then \\boxed{}", "42", 1.0),  # the last NON-EMPTY box counts
    ("\\boxed{12.0}", "12", 1.0),
    ("\\boxed{12}", "12.0", 1.0),
    ("\\boxed{-3}", "-3", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
    ("\\boxed{0.75}", "3/4", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{5}", "\\boxed{5}", 1.0),  # a gold that is already boxed
    ("\\boxed{5}", "$5$", 1.0),
    ("\\boxed{{42}}", "42", 1.0),  # nested braces
])
def test_correctness_boxed(completion, gold, expected):
    assert correctness(completion, gold, require_boxed=True) == expected


def test_correctness_without_require_boxed_falls_back_to_last_number():
    text = "17 + 25 = 42\n\nThe answer is \\boxed{}."
    assert correctness(text, "42", require_boxed=False) == 1.0
    assert correctness("The answer is 42.", "42", require_boxed=False) == 1.0
    assert correctness("The answer is 41.", "42", require_boxed=False) == 0.0


def test_unparseable_gold_scores_zero():
    assert not gold_is_parseable("")
    assert parse_gold("") == []
    assert correctness("\\boxed{}", "", require_boxed=True) == 0.0
    assert gold_is_parseable("42") and gold_is_parseable("\\text{(A)}") and gold_is_parseable("(1, 2)")
    assert not gold_is_parseable("???") and not gold_is_parseable("\\text{")


def test_correctness_off_main_thread_disables_signal_timeouts():
    out = {}

    def work():
        out["a"] = correctness("\\boxed{\\frac{84}{2}}", "42")
        out["b"] = correctness("\\boxed{43}", "42")

    t = threading.Thread(target=work)
    t.start()
    t.join(30)
    assert out == {"a": 1.0, "b": 0.0}


def test_format_reward():
    assert format_reward("\\boxed{3}") == 1.0
    assert format_reward("\\boxed{}") == 0.0
    assert format_reward("\\boxed{ }") == 0.0
    assert format_reward("3") == 0.0
    assert format_reward("\\boxed{3} then \\boxed{}") == 1.0


# -- loading user functions ---------------------------------------------------------------------------------------

def test_load_reward_function_ok():
    fn = load_reward_function("reward_fns:length_reward")
    assert fn(prompts=["p"], completions=["x" * 50], answers=["1"]) == [0.5]


@pytest.mark.parametrize("spec, fragment", [
    ("no_such_module_xyz:fn", "module 'no_such_module_xyz' not found"),
    ("reward_fns:missing_fn", "has no attribute 'missing_fn'"),
    ("reward_fns:NOT_CALLABLE", "not callable"),
    ("reward_fns.length_reward", "expected the form"),
    ("reward_fns:", "expected the form"),
])
def test_load_reward_function_errors(spec, fragment):
    with pytest.raises(RewardError) as ei:
        load_reward_function(spec)
    assert repr(spec) in str(ei.value) or spec in str(ei.value)
    assert fragment in str(ei.value)


def test_scorer_bad_spec_fails_at_construction():
    """The worker imports the functions; the constructor waits for it and raises its error."""
    with pytest.raises(RewardError, match="missing_fn"):
        RewardScorer(RewardConfig(functions=["reward_fns:missing_fn"]))
    with pytest.raises(RewardError, match="missing_fn"):
        RewardScorer(RewardConfig(functions=["reward_fns:missing_fn"], timeout_s=0))


# -- the scorer ---------------------------------------------------------------------------------------------------

def test_scorer_builtin_weights():
    cfg = RewardConfig(correctness_weight=1.0, format_weight=0.5)
    with RewardScorer(cfg) as s:
        rb = s(["q1", "q2", "q3"], ["\\boxed{4}", "\\boxed{5}", "4"], ["4", "4", "4"])
    assert rb.correct == [1.0, 0.0, 0.0]
    assert rb.format == [1.0, 1.0, 0.0]
    assert rb.total == [1.5, 0.5, 0.0]
    assert rb.per_function == {} and rb.warnings == 0


def test_scorer_length_mismatch_is_a_programming_error():
    with RewardScorer(RewardConfig()) as s, pytest.raises(ValueError, match="same length"):
        s(["a"], ["b", "c"], ["1", "2"])


def test_scorer_in_process_failures(caplog):
    """timeout_s=0: user functions run in the main process; failures still give zeros and warnings."""
    cfg = RewardConfig(functions=["reward_fns:moody", "reward_fns:length_reward"], function_weights=[2.0, 1.0],
                       timeout_s=0)
    with RewardScorer(cfg) as s, caplog.at_level(logging.WARNING, logger="basis_lite.rewards.scorer"):
        assert s._worker is None
        comps = ["\\boxed{4}", "x" * 10]
        rb = s(["ok", "ok"], comps, ["4", "4"])
        assert rb.per_function == {"reward_fns:moody": [1.0, 1.0], "reward_fns:length_reward": [0.09, 0.1]}
        assert rb.total == pytest.approx([1.0 + 2.0 + 0.09, 0.0 + 2.0 + 0.1])
        assert rb.warnings == 0

        rb = s(["raise", "ok"], comps, ["4", "4"])
        assert rb.per_function["reward_fns:moody"] == [0.0, 0.0]
        assert rb.total == pytest.approx([1.09, 0.1])
        assert rb.warnings == 1 and s.warning_count == 1
        assert "reward_fns:moody" in caplog.text and "moody is upset" in caplog.text

        for mode in ("short", "text"):
            rb = s([mode, "ok"], comps, ["4", "4"])
            assert rb.per_function["reward_fns:moody"] == [0.0, 0.0]
        assert "returned 1 values for 2 completions" in caplog.text
        assert "non-numeric" in caplog.text

        rb = s(["nan", "ok"], comps, ["4", "4"])  # only the non-finite entry is zeroed
        assert rb.per_function["reward_fns:moody"] == [0.0, 1.0]
        assert all(math.isfinite(t) for t in rb.total)
        assert "non-finite" in caplog.text

        rb = s(["none", "ok"], comps, ["4", "4"])  # None = "does not apply": 0 without a warning
        assert rb.per_function["reward_fns:moody"] == [0.0, 0.0] and rb.warnings == 0
        assert s.warning_count == 4


def test_scorer_worker_failures_and_recovery(caplog):
    """The worker process: raise / wrong length / NaN / hang past the timeout / crash all give zeros and warnings,
    the run goes on, and the next call is served (by a fresh worker after a hang or a crash)."""
    cfg = RewardConfig(functions=["reward_fns:moody", "reward_fns:pid_reward"], timeout_s=1.0)
    comps = ["\\boxed{4}", "\\boxed{5}"]
    gold = ["4", "4"]
    with RewardScorer(cfg) as s, caplog.at_level(logging.WARNING, logger="basis_lite.rewards.scorer"):
        rb = s(["ok", "ok"], comps, gold)
        assert rb.per_function["reward_fns:moody"] == [1.0, 1.0] and rb.warnings == 0
        pid1 = rb.per_function["reward_fns:pid_reward"][0]
        assert pid1 != os.getpid()  # it ran in the worker

        for mode, expected in (("raise", [0.0, 0.0]), ("short", [0.0, 0.0]), ("nan", [0.0, 1.0])):
            rb = s([mode, "ok"], comps, gold)
            assert rb.per_function["reward_fns:moody"] == expected, mode
            assert rb.warnings == 1
            assert rb.per_function["reward_fns:pid_reward"][0] == pid1  # same worker, not restarted
        assert s.warning_count == 3

        rb = s(["hang", "ok"], comps, gold)
        assert rb.per_function["reward_fns:moody"] == [0.0, 0.0]
        assert rb.correct == [1.0, 0.0]
        assert "timed out after 1 s" in caplog.text
        pid2 = rb.per_function["reward_fns:pid_reward"][0]
        assert pid2 not in (0.0, pid1)  # the hung worker was replaced
        assert s.warning_count == 4

        rb = s(["exit", "ok"], comps, gold)
        assert rb.per_function["reward_fns:moody"] == [0.0, 0.0]
        assert "died" in caplog.text
        assert s.warning_count == 5

        rb = s(["ok", "ok"], comps, gold)  # served again
        assert rb.per_function["reward_fns:moody"] == [1.0, 1.0] and rb.warnings == 0
        worker = s._worker
    assert worker is not None and not worker.proc.is_alive()  # close() stopped it


def test_warning_log_is_throttled(caplog):
    cfg = RewardConfig(functions=["reward_fns:moody"], timeout_s=0)
    with RewardScorer(cfg) as s, caplog.at_level(logging.WARNING, logger="basis_lite.rewards.scorer"):
        s(["ok"], ["x"], ["1"])  # a good first call: later failures are warnings, not a stop
        for _ in range(60):
            s(["raise"], ["x"], ["1"])
        assert s.warning_count == 60
        lines = [r for r in caplog.records if "reward_fns:moody" in r.getMessage()]
        assert len(lines) == 6  # the first 5, then every 50th


@pytest.mark.parametrize("completion", ["26 + 54", "The answer is 26 + 54.", "\\boxed{26+54}", "\\boxed{54 + 26}"])
def test_restating_the_question_is_not_an_answer(completion):
    """math-verify evaluates "26 + 54" to 80; the default preset's policy learned to echo the sum within 40 steps.
    For a numeric gold only a number counts (both with and without require_boxed)."""
    assert correctness(completion, "80", require_boxed=False) == 0.0
    assert correctness(completion, "80", require_boxed=True) == 0.0


@pytest.mark.parametrize("completion,gold", [("26 + 54 = 80", "80"), ("\\boxed{80}", "80"), ("\\boxed{80.0}", "80"),
                                             ("\\boxed{\\frac{1}{2}}", "0.5"), ("\\boxed{\\sqrt{2}}", "\\sqrt{2}"),
                                             ("\\boxed{-3}", "-3")])
def test_computed_answers_still_count(completion, gold):
    assert correctness(completion, gold, require_boxed=False) == 1.0


# -- first calls, TRL's calling convention, isolation ---------------------------------------------------------------

@pytest.mark.parametrize("timeout_s", [0, 5.0])
def test_a_failing_first_call_stops_a_later_one_warns(timeout_s, caplog):
    """Before a function ever returned valid values any failure is a RewardError (the run stops with the message);
    after that a failing batch scores 0 with a warning. In the worker and in-process alike."""
    cfg = RewardConfig(functions=["reward_fns:moody"], timeout_s=timeout_s)
    for mode, words in (("raise", "moody is upset"), ("short", "returned 0 values for 1 completions"),
                        ("text", "non-numeric")):
        with RewardScorer(cfg) as s, pytest.raises(RewardError) as e:
            s([mode], ["x"], ["1"])
        assert "reward_fns:moody failed on its first call" in str(e.value) and words in str(e.value)
    assert "reward_fns.py:" in str(e.value) or mode != "raise"  # where it raised
    with RewardScorer(cfg) as s, caplog.at_level(logging.WARNING, logger="basis_lite.rewards.scorer"):
        assert s(["ok"], ["x"], ["1"]).per_function["reward_fns:moody"] == [1.0]
        rb = s(["raise"], ["x"], ["1"])
        assert rb.per_function["reward_fns:moody"] == [0.0] and rb.warnings == 1
    assert "moody is upset" in caplog.text


def test_a_hang_or_crash_on_the_first_call_stops():
    cfg = RewardConfig(functions=["reward_fns:moody"], timeout_s=1.0)
    for mode, words in (("hang", "timed out after 1 s"), ("exit", "died")):
        with RewardScorer(cfg) as s, pytest.raises(RewardError, match="failed on its first call") as e:
            s([mode], ["x"], ["1"])
        assert words in str(e.value)


def _comps():
    return ["The sum is 12.", "I think 7", "12? no: 13"]


@pytest.mark.parametrize("timeout_s", [0, 5.0])
def test_trl_calling_convention(timeout_s):
    """A TRL-style function asks for data columns by name (`answer`, `level`) and gets only what it names when it
    has no **kwargs; basis-lite's own `answers` still works."""
    cfg = RewardConfig(functions=["reward_fns:trl_answer_level", "reward_fns:strict_prompts_completions",
                                  "reward_fns:length_reward"], timeout_s=timeout_s)
    cols = {"question": ["What is 5 + 7?"] * 3, "answer": ["12", "7", "12"], "level": [1, 2, 3]}
    with RewardScorer(cfg, columns=list(cols)) as s:
        rb = s(["a long prompt here"] * 3, _comps(), ["12", "7", "12"], columns=cols,
               completion_ids=[[1, 2], [3], [4, 5, 6]])
    assert rb.warnings == 0
    assert rb.per_function["reward_fns:trl_answer_level"] == pytest.approx([1.1, 1.2, 1.3])
    assert rb.per_function["reward_fns:strict_prompts_completions"] == [1.0, 1.0, 1.0]
    assert rb.per_function["reward_fns:length_reward"] == pytest.approx([len(c) / 100 for c in _comps()])


@pytest.mark.parametrize("timeout_s", [0, 5.0])
def test_signature_checked_before_the_first_call(timeout_s):
    """A parameter no argument fills (TRL's `solution` column on data without it) is refused when the scorer
    starts, naming it and what is passed."""
    cfg = RewardConfig(functions=["reward_fns:needs_solution"], timeout_s=timeout_s)
    with pytest.raises(RewardError) as e:
        RewardScorer(cfg, columns=["question", "answer", "level"])
    msg = str(e.value)
    assert "'solution'" in msg and "reward_fns:needs_solution" in msg
    assert all(name in msg for name in ("prompts", "completions", "completion_ids", "answers", "question", "level"))
    RewardScorer(cfg, columns=["question", "solution"]).close()  # the same function, data with that column: fine


def test_user_code_is_imported_only_in_the_worker():
    """The trainer process never imports a reward module (a module that kills its process at import could
    otherwise take the trainer down): the function ran in another process, and its module is not loaded here."""
    cfg = RewardConfig(functions=["reward_fns_import_probe:probe"], timeout_s=5.0)
    with RewardScorer(cfg) as s:
        rb = s(["p"], ["c"], ["1"])
    assert rb.per_function["reward_fns_import_probe:probe"][0] not in (0.0, float(os.getpid()))
    assert "reward_fns_import_probe" not in sys.modules


def test_a_module_that_exits_at_import_is_reported_not_fatal():
    """os._exit(7) at import ends the worker, not the process that builds the scorer (run in a subprocess of its
    own, so that a regression kills that one and not the test session)."""
    import subprocess

    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "from basis_lite.config import RewardConfig\n"
            "from basis_lite.rewards.scorer import RewardError, RewardScorer\n"
            "if __name__ == '__main__':\n"
            "    try:\n"
            "        RewardScorer(RewardConfig(functions=['reward_fns:length_reward', "
            "'reward_fns_exit_at_import:never'], timeout_s=5.0))\n"
            "    except RewardError as e:\n"
            "        print('RewardError:', e)\n")
    here = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code, str(here)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(here.parent)})
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "RewardError:" in proc.stdout, proc.stdout
    assert "exit code 7" in proc.stdout and "reward_fns_exit_at_import:never" in proc.stdout
