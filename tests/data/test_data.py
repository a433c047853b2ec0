import csv
import json
import logging

import pytest

from basis_lite.config import DataConfig
from basis_lite.data import DataError, Example, PromptSampler, format_prompt, level_table, load_examples


def cfg(**kw) -> DataConfig:
    return DataConfig(**kw)


# -- built-in tasks -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("task, levels", [("arithmetic", [1, 2, 3, 4, 5, 6, 7, 8]), ("algebra", [1, 2, 3, 4, 5, 6]),
                                         ("wordproblems", [1, 2, 3, 4, 5, 6])])
def test_builtin_deterministic_disjoint_and_sized(task, levels):
    # data.revisit off: every question once, even where a level runs out (arithmetic's levels 1 and 2 here)
    c = cfg(dataset=task, levels=levels, train_size=500, eval_size=100, seed=7, revisit=False)
    tr, ev = load_examples(c, "train"), load_examples(c, "eval")
    assert len(tr) == 500 and len(ev) == 100
    assert [e.question for e in tr] == [e.question for e in load_examples(c, "train")]  # deterministic
    assert [e.id for e in ev] == [e.id for e in load_examples(c, "eval")]
    qt, qe = {e.question for e in tr}, {e.question for e in ev}
    assert len(qt) == 500 and len(qe) == 100  # no repeats within a split
    assert not qt & qe  # disjoint splits
    assert {e.meta["level"] for e in tr} == set(levels)  # every level contributes
    assert all(set(e.meta) >= {"level", "family"} for e in tr)
    other = load_examples(cfg(dataset=task, levels=levels, train_size=500, eval_size=100, seed=8, revisit=False),
                          "train")
    assert [e.question for e in other] != [e.question for e in tr]


def test_arithmetic_answers_are_right_and_plain():
    c = cfg(dataset="arithmetic", levels=[1, 2, 3, 4, 5, 6, 7, 8], train_size=400, eval_size=0)
    for e in load_examples(c, "train"):
        assert e.question.startswith("What is ") and e.question.endswith("?")
        assert "$" not in e.question and "\\" not in e.question  # no LaTeX
        expr = e.question[len("What is "):-1]
        assert eval(expr) == int(e.answer) >= 0, e  # noqa: S307 - our own generated text
        assert e.answer == str(int(e.answer))


def test_algebra_answers_solve_the_equation():
    import re
    c = cfg(dataset="algebra", levels=[1, 2, 3, 4, 5, 6], train_size=300, eval_size=0)
    for e in load_examples(c, "train"):
        m = re.fullmatch(r"Solve for x: (.*) = (.*)\.", e.question)
        assert m, e.question

        def val(side, x):
            return eval(re.sub(r"(\d)x", r"\1*x", side).replace("-x", "-1*x"), {"x": x})  # noqa: S307
        x = int(e.answer)
        assert val(m[1], x) == val(m[2], x), e
        assert val(m[1], x + 1) != val(m[2], x + 1)


def test_wordproblem_answers_follow_the_story():
    import re
    c = cfg(dataset="wordproblems", levels=[1, 2, 3, 4, 5, 6], train_size=600, eval_size=0)
    rules = {"get": lambda a, b: a + b, "give": lambda a, b: a - b, "sell": lambda a, b: a + b,
             "bags": lambda a, b: a * b, "twostep": lambda a, b, c: a + b - c, "share": lambda total, d: total // d}
    seen = set()
    for e in load_examples(c, "train"):
        nums = [int(v) for v in re.findall(r"\d+", e.question)]
        fam = e.meta["family"]
        seen.add(fam)
        assert int(e.answer) == rules[fam](*nums) > 0, e
        if fam == "share":
            assert nums[0] % nums[1] == 0, e  # equal shares are whole
        assert e.question.endswith("?") and " 1 " not in e.question  # plural nouns: no quantity of one
    assert seen == set(rules)


def test_revisit_keeps_each_level_share_of_the_training_draw(caplog):
    """Levels [1, 3, 5] (the default preset): level 1 holds 100 questions, 50 go to the eval split, so its third of
    2000 training problems revisits the other 50; the eval split never repeats and never meets the training one."""
    from collections import Counter

    c = cfg(dataset="arithmetic", levels=[1, 3, 5], train_size=2000, eval_size=150)
    with caplog.at_level(logging.INFO, logger="basis_lite.data"):
        tr, ev = load_examples(c, "train"), load_examples(c, "eval")
    assert Counter(e.meta["level"] for e in tr) == {1: 667, 3: 667, 5: 666}
    assert Counter(e.meta["level"] for e in ev) == {1: 50, 3: 50, 5: 50}
    assert len({e.question for e in ev}) == 150 and not {e.question for e in tr} & {e.question for e in ev}
    lv1 = [e for e in tr if e.meta["level"] == 1]
    assert len({e.question for e in lv1}) == 50  # every level-1 question the eval split left, each about 13 times
    assert [e.id for e in lv1[50:100]] == [e.id for e in lv1[:50]]  # revisited in the order first drawn
    for lv in (3, 5):
        qs = [e.question for e in tr if e.meta["level"] == lv]
        assert len(qs) == len(set(qs))  # levels with questions to spare never repeat
    assert "level 1: only 50 distinct train questions" in caplog.text and "revisited" in caplog.text
    assert [e.id for e in tr] == [e.id for e in load_examples(c, "train")]  # seeded


def test_eval_set_1_shares_no_problem_with_set_0_and_training_leaves_it_out():
    """data.eval_set: 1 (the confirmation set) on the default preset's data: as many problems per level as set 0,
    none of them in set 0; set 0 is unchanged by the key, and the training split of a set-1 run never meets set 1."""
    from collections import Counter

    from basis_lite.config import load_config
    from basis_lite.errors import ConfigError

    base = dict(dataset="arithmetic", levels=[1, 3, 5], train_size=2000, eval_size=150)
    dev, conf = load_examples(cfg(**base), "eval"), load_examples(cfg(**base, eval_set=1), "eval")
    assert [e.id for e in dev] == [e.id for e in load_examples(cfg(**base, eval_set=0), "eval")]
    assert Counter(e.meta["level"] for e in conf) == {1: 50, 3: 50, 5: 50}
    assert len({e.question for e in conf}) == 150
    assert not {e.question for e in dev} & {e.question for e in conf}
    train = load_examples(cfg(**base, eval_set=1), "train")
    assert not {e.question for e in train} & {e.question for e in conf}
    # level 1 (100 questions) is split between the two sets: set 1's run trains on set 0's 50
    assert {e.question for e in train if e.meta["level"] == 1} == {e.question for e in dev if e.meta["level"] == 1}
    assert load_config("smoke", ["data.eval_set=1"]).data.eval_set == 1
    with pytest.raises(ConfigError, match=r"data\.eval_set"):
        load_config("smoke", ["data.eval_set=2"])
    with pytest.raises(ConfigError, match=r"data\.eval_set: 1 .* one eval split"):
        load_config("smoke", ["data.dataset=rows.jsonl", "data.eval_set=1"])


def test_revisit_off_gives_the_old_crowded_out_draw_and_changes_nothing_where_nothing_runs_out():
    from collections import Counter

    old = cfg(dataset="arithmetic", levels=[1, 2, 3], train_size=2000, eval_size=150, revisit=False)
    assert Counter(e.meta["level"] for e in load_examples(old, "train")) == {1: 18, 2: 37, 3: 1945}
    new = cfg(dataset="arithmetic", levels=[1, 2, 3], train_size=2000, eval_size=150)
    assert Counter(e.meta["level"] for e in load_examples(new, "train")) == {1: 667, 2: 667, 3: 666}
    # the smoke preset's data (nothing runs out): the same draw either way
    for levels, n_train, n_eval in (([1, 2], 64, 8), ([3, 4], 500, 50)):
        a = load_examples(cfg(dataset="arithmetic", levels=levels, train_size=n_train, eval_size=n_eval), "train")
        b = load_examples(cfg(dataset="arithmetic", levels=levels, train_size=n_train, eval_size=n_eval,
                              revisit=False), "train")
        assert [e.id for e in a] == [e.id for e in b]


def test_eval_split_does_not_depend_on_train_size():
    a = load_examples(cfg(dataset="arithmetic", levels=[3, 4], train_size=100, eval_size=50), "eval")
    b = load_examples(cfg(dataset="arithmetic", levels=[3, 4], train_size=3000, eval_size=50), "eval")
    assert [e.question for e in a] == [e.question for e in b]


def test_level_validation_error_names_accepted_levels():
    with pytest.raises(DataError) as ei:
        load_examples(cfg(dataset="arithmetic", levels=[1, 9]), "train")
    msg = str(ei.value)
    assert "data.levels" in msg and "[9]" in msg and "1 (single-digit addition)" in msg and "8 (" in msg
    with pytest.raises(DataError, match="non-empty list"):
        load_examples(cfg(dataset="algebra", levels=[]), "train")
    with pytest.raises(DataError, match="accepted levels"):
        load_examples(cfg(dataset="algebra", levels=[7]), "train")
    assert set(level_table("algebra")) == {1, 2, 3, 4, 5, 6}


def test_level1_cap_warns_and_splits_in_proportion(caplog):
    c = cfg(dataset="arithmetic", levels=[1], train_size=2000, eval_size=200)
    with caplog.at_level(logging.WARNING, logger="basis_lite.data"):
        tr, ev = load_examples(c, "train"), load_examples(c, "eval")
    assert len(tr) + len(ev) == 100  # 10 x 10 single-digit additions
    assert len(ev) == 9 and len(tr) == 91
    assert not {e.question for e in tr} & {e.question for e in ev}
    assert "only 100 distinct questions" in caplog.text


def test_overlapping_levels_never_repeat_a_question():
    c = cfg(dataset="arithmetic", levels=[1, 2], train_size=1000, eval_size=20)
    tr, ev = load_examples(c, "train"), load_examples(c, "eval")
    qs = [e.question for e in tr + ev]
    assert len(qs) == len(set(qs)) == 155  # 100 additions + 55 subtractions with a >= b
    assert len(ev) == 3  # capped in proportion to 1000 : 20


def test_unknown_dataset_and_split():
    with pytest.raises(DataError, match="arithmetic, algebra, wordproblems"):
        load_examples(cfg(dataset="nonsense"), "train")
    with pytest.raises(ValueError, match="split"):
        load_examples(cfg(), "validation")
    with pytest.raises(DataError, match="not found"):
        load_examples(cfg(dataset="/nonexistent/file.jsonl"), "train")


def test_unknown_task_name_is_an_error_not_another_task(tmp_path):
    accepted = "arithmetic, algebra, wordproblems (built in), gsm8k, math (hub), hf:owner/name[:config]"
    for name in ("arithmetics", "Algebra", "word_problems", "gsm8", ""):
        with pytest.raises(DataError) as ei:
            load_examples(cfg(dataset=name), "train")
        msg = str(ei.value)
        assert f"data.dataset: {name!r} is not accepted" in msg and accepted in msg, msg
        assert ".jsonl/.json/.csv/.parquet" in msg
    with pytest.raises(DataError, match="did you mean 'arithmetic'"):
        load_examples(cfg(dataset="arithmetics"), "train")
    (tmp_path / "d.txt").write_text("What is 1 + 1?,2\n")
    with pytest.raises(DataError, match=r"is not a \.jsonl/\.json/\.csv/\.parquet/\.arrow file; choose one of arithmetic"):
        load_examples(cfg(dataset=str(tmp_path / "d.txt")), "train")
    with pytest.raises(DataError, match="'nonsense' is not a built-in task; built-in tasks: arithmetic, algebra, "
                                        "wordproblems"):
        level_table("nonsense")  # once silently the algebra table
    # surrounding spaces are ignored for every source: " arithmetic " is the arithmetic task, not another one
    padded = load_examples(cfg(dataset=" arithmetic ", train_size=20, eval_size=0), "train")
    plain = load_examples(cfg(dataset="arithmetic", train_size=20, eval_size=0), "train")
    assert [e.id for e in padded] == [e.id for e in plain] and padded[0].id.startswith("arithmetic/")


def test_public_names_are_reexported():
    import basis_lite.data as data
    from basis_lite import errors
    from basis_lite.data import BUILTIN_TASKS, HUB_DATASETS
    assert data.DataError is errors.DataError
    assert BUILTIN_TASKS == ("arithmetic", "algebra", "wordproblems") and set(HUB_DATASETS) == {"gsm8k", "math"}
    for name in data.__all__:
        assert getattr(data, name) is not None, name


@pytest.mark.parametrize("text, style, gold", [
    ("3 + 4 = 7\n#### 1,007", "gsm8k", "1007"), ("no marker", "gsm8k", None), ("####  ", "gsm8k", None),
    ("We get $\\boxed{\\frac{1}{2}}$.", "math", "\\frac{1}{2}"), ("\\boxed{ 2 } then \\fbox{ }", "math", "2"),
    ("\\fbox{x}", "math", "x"), ("no box", "math", None), ("\\boxed{3} #### 5", "math", "3"),
    ("\\boxed{3} #### 5", "any", "5"), ("$\\boxed{4}$", "any", "4"), ("\\boxed{}", "any", "\\boxed{}"), ("42", "any", "42"),
])
def test_gold_answer_styles(text, style, gold):
    from basis_lite.data import gold_answer
    assert gold_answer(text, style) == gold


# -- local files --------------------------------------------------------------------------------------------------

def _rows(n):
    return [{"question": f"What is {i} + 1?", "answer": str(i + 1), "level": 1 + i % 3} for i in range(n)]


def _write_jsonl(path, rows, extra_lines=()):
    with open(path, "wb") as f:
        for r in rows:
            f.write((json.dumps(r) + "\n").encode())
        for line in extra_lines:
            f.write(line + b"\n")


def test_local_jsonl_split_deterministic_disjoint(tmp_path):
    p = tmp_path / "d.jsonl"
    _write_jsonl(p, _rows(100))
    c = cfg(dataset=str(p), eval_size=20, train_size=0, seed=3)
    tr, ev = load_examples(c, "train"), load_examples(c, "eval")
    assert len(ev) == 20 and len(tr) == 80
    assert not {e.question for e in tr} & {e.question for e in ev}
    assert [e.id for e in tr] == [e.id for e in load_examples(c, "train")]
    assert {e.meta["level"] for e in tr} == {1, 2, 3}
    assert tr[0].id.startswith("d.jsonl/")
    assert len(load_examples(cfg(dataset=str(p), eval_size=20, train_size=30), "train")) == 30


def test_local_jsonl_bad_rows_skipped_and_counted(tmp_path, caplog):
    p = tmp_path / "d.jsonl"
    bad = [b'{"question": "What is 1 + 1?", "answer": ""}',  # empty answer
           b'{"question": "caf\xe9 \xff", "answer": "2"}',  # not valid UTF-8
           b'{"question": "What is 2 + 2?"',  # broken JSON
           b'',  # blank lines are not rows
           b'["a list"]']
    _write_jsonl(p, _rows(96), bad)
    c = cfg(dataset=str(p), eval_size=10, train_size=0, max_bad_fraction=0.05)
    with caplog.at_level(logging.WARNING, logger="basis_lite.data"):
        tr, ev = load_examples(c, "train"), load_examples(c, "eval")
    assert len(tr) + len(ev) == 96
    assert "skipped 4 of 100 rows" in caplog.text
    assert "not valid UTF-8" in caplog.text and "line 98" in caplog.text


def test_local_bad_rows_over_threshold_abort_with_details(tmp_path):
    p = tmp_path / "broken.jsonl"
    _write_jsonl(p, _rows(10), [b'{"question": null, "answer": "1"}', b'{"question": "q", "answer": true}',
                                b'not json at all', b'{"question": "x", "answer": "1", "\xc3\x28": 1}'])
    with pytest.raises(DataError) as ei:
        load_examples(cfg(dataset=str(p), eval_size=2, max_bad_fraction=0.1), "train")
    msg = str(ei.value)
    assert str(p) in msg and "4 of 14 rows are malformed" in msg
    assert "line 11 (question field 'question' missing)" in msg
    assert "line 12 (answer field 'answer' a boolean" in msg
    assert "line 13 (not valid JSON" in msg and "line 14 (not valid UTF-8)" in msg
    assert "data.max_bad_fraction=0.1" in msg


def test_local_missing_field_is_named(tmp_path):
    p = tmp_path / "d.jsonl"
    _write_jsonl(p, [{"problem": "What is 1 + 1?", "solution": "2"}])
    with pytest.raises(DataError) as ei:
        load_examples(cfg(dataset=str(p)), "train")
    assert "'question'" in str(ei.value) and "problem, solution" in str(ei.value)
    assert "data.question_field" in str(ei.value)
    ok = load_examples(cfg(dataset=str(p), question_field="problem", answer_field="solution", eval_size=0), "train")
    assert ok[0].answer == "2"


def test_unparseable_gold_answers_reported(tmp_path, caplog):
    p = tmp_path / "d.jsonl"
    rows = _rows(60) + [{"question": "Which?", "answer": "\\text{"}]  # math-verify cannot parse this
    _write_jsonl(p, rows)
    with caplog.at_level(logging.WARNING, logger="basis_lite.data"):
        tr = load_examples(cfg(dataset=str(p), eval_size=0, max_bad_fraction=0.05), "train")
    assert len(tr) == 60 and all(e.question != "Which?" for e in tr)
    assert "gold answers math-verify cannot parse" in caplog.text and "'\\\\text{'" in caplog.text
    rows = _rows(10) + [{"question": f"Q{i}", "answer": "\\text{"} for i in range(3)]
    p2 = tmp_path / "e.jsonl"
    _write_jsonl(p2, rows)
    with pytest.raises(DataError, match="3 of 13 gold answers math-verify cannot parse"):
        load_examples(cfg(dataset=str(p2), eval_size=0, max_bad_fraction=0.05), "train")


def test_local_gsm8k_and_math_style_answers(tmp_path):
    p = tmp_path / "g.jsonl"
    _write_jsonl(p, [{"question": "How many?", "answer": "3 + 4 = <<3+4=7>>7 apples\n#### 1,007"},
                     {"question": "Simplify.", "answer": "We get $\\boxed{\\frac{1}{2}}$."}])
    ex = {e.question: e.answer for e in load_examples(cfg(dataset=str(p), eval_size=0), "train")}
    assert ex == {"How many?": "1007", "Simplify.": "\\frac{1}{2}"}


def test_local_csv(tmp_path, caplog):
    p = tmp_path / "d.csv"
    with open(p, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=["q", "a"])
        w.writeheader()
        for i in range(40):
            w.writerow({"q": f"What is {i} * 2?", "a": str(2 * i)})
        w.writerow({"q": "multi\nline question, with comma", "a": "5"})
        w.writerow({"q": "", "a": "3"})
    with open(p, "ab") as f:
        f.write(b"bad \xff bytes,4\n")
    c = cfg(dataset=str(p), question_field="q", answer_field="a", eval_size=5, train_size=0, max_bad_fraction=0.1)
    with caplog.at_level(logging.WARNING, logger="basis_lite.data"):
        tr, ev = load_examples(c, "train"), load_examples(c, "eval")
    assert len(tr) + len(ev) == 41 and len(ev) == 5
    assert any(e.question.startswith("multi\nline") for e in tr + ev)
    assert "skipped 2 of 43 rows" in caplog.text and "not valid UTF-8" in caplog.text


def test_local_parquet_and_json(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    qs = [f"What is {i} + 2?" for i in range(30)] + [None, "What is 9 + 9?"]
    ans = [i + 2 for i in range(30)] + [3, None]  # integer answers are fine; nulls are bad rows
    pq.write_table(pa.table({"question": qs, "answer": ans}), tmp_path / "d.parquet")
    c = cfg(dataset=str(tmp_path / "d.parquet"), eval_size=4, train_size=0, max_bad_fraction=0.1)
    tr, ev = load_examples(c, "train"), load_examples(c, "eval")
    assert len(tr) == 26 and len(ev) == 4
    assert {e.answer for e in tr + ev} == {str(i + 2) for i in range(30)}
    with pytest.raises(DataError, match="2 of 32 rows"):
        load_examples(cfg(dataset=str(tmp_path / "d.parquet"), max_bad_fraction=0.05), "train")

    j = tmp_path / "d.json"
    j.write_text(json.dumps([{"question": f"Q{i}?", "answer": i} for i in range(10)]))
    assert len(load_examples(cfg(dataset=str(j), eval_size=2), "train")) == 8
    j2 = tmp_path / "lines.json"  # JSON lines in a .json file also work
    j2.write_text("\n".join(json.dumps({"question": f"Q{i}?", "answer": i}) for i in range(10)))
    assert len(load_examples(cfg(dataset=str(j2), eval_size=2), "eval")) == 2


def test_small_local_file_holds_out_at_most_half(tmp_path, caplog):
    p = tmp_path / "d.jsonl"
    _write_jsonl(p, _rows(10))
    with caplog.at_level(logging.WARNING, logger="basis_lite.data"):
        ev = load_examples(cfg(dataset=str(p), eval_size=200), "eval")
        tr = load_examples(cfg(dataset=str(p), eval_size=200), "train")
    assert len(ev) == 5 and len(tr) == 5
    assert "at most half" in caplog.text


# -- hub datasets ---------------------------------------------------------------------------------------------------

def _force_offline(monkeypatch, tmp_path):
    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(k, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants as hc
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")
    return datasets


@pytest.mark.parametrize("name", ["gsm8k", "math"])
def test_hub_offline_is_a_helpful_data_error(monkeypatch, tmp_path, name):
    _force_offline(monkeypatch, tmp_path)
    with pytest.raises(DataError) as ei:
        load_examples(cfg(dataset=name), "train")
    msg = str(ei.value)
    assert "hub" in msg and "unreachable" in msg
    assert "data.dataset: path/to/" in msg and "data.question_field" in msg


def test_unreachable_hub_fails_fast_without_offline_env(monkeypatch, tmp_path):
    datasets = pytest.importorskip("datasets")
    import basis_lite.data.loading as loading
    monkeypatch.setattr(loading, "_hub_reachable", lambda timeout_s=3.0: False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")
    import huggingface_hub.constants as hc
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    with pytest.raises(DataError, match="unreachable"):
        load_examples(cfg(dataset="gsm8k"), "train")
    assert hc.HF_HUB_OFFLINE is False and datasets.config.HF_HUB_OFFLINE is False  # offline mode was restored


def test_gsm8k_rows_through_a_stubbed_hub(monkeypatch):
    datasets = pytest.importorskip("datasets")
    rows = [{"question": f"Tom has {i} apples and buys 1000 more. How many?",
             "answer": f"{i} + 1000 = <<{i}+1000={i + 1000}>>{i + 1000}\n#### {i + 1000:,}"} for i in range(50)]
    rows.append({"question": "Broken", "answer": "no marker"})
    calls = []

    def fake_load(path, name=None, split=None, **kw):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    import basis_lite.data.loading as loading
    monkeypatch.setattr(loading, "_hub_reachable", lambda timeout_s=3.0: True)
    tr = load_examples(cfg(dataset="gsm8k", train_size=20, eval_size=5), "train")
    ev = load_examples(cfg(dataset="gsm8k", train_size=20, eval_size=5), "eval")
    assert calls[0] == ("openai/gsm8k", "main", "train") and calls[1][2] == "test"
    assert len(tr) == 20 and len(ev) == 5
    for e in tr:
        i = int(e.question.split()[2])
        assert e.answer == str(i + 1000)  # commas stripped
    assert len(load_examples(cfg(dataset="gsm8k", train_size=0, eval_size=5), "train")) == 50


# -- prompts ------------------------------------------------------------------------------------------------------

SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
PLAIN_CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
NO_SYSTEM_ROLE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<start_of_turn>{{ message['role'] }}\n{{ message['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
ODD_DEFAULT = (  # not ChatML, and inserts a default system prompt
    "{% if messages[0]['role'] != 'system' %}[SYS]Default helper text[/SYS]{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}[SYS]{{ message['content'] }}[/SYS]"
    "{% else %}[{{ message['role'] }}]{{ message['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}")


def make_tokenizer(template):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", chat_template=template)


def test_format_prompt_removes_the_default_system_prompt():
    tok = make_tokenizer(SMOL_TEMPLATE)
    c = cfg()
    p = format_prompt(tok, "What is 7 + 5?", c)
    assert p == ("<|im_start|>user\nWhat is 7 + 5? Put the final answer in \\boxed{}.<|im_end|>\n"
                 "<|im_start|>assistant\n")
    assert "SmolLM" not in p and "system" not in p
    p = format_prompt(tok, "What is 7 + 5?", cfg(system_prompt="Be brief."))
    assert p.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 7 + 5?")
    assert "SmolLM" not in p
    p = format_prompt(tok, "Q?", cfg(instruction=""))
    assert "<|im_start|>user\nQ?<|im_end|>" in p


def test_format_prompt_other_templates():
    c = cfg()
    p = format_prompt(make_tokenizer(PLAIN_CHATML), "What is 7 + 5?", c)
    assert p == ("<|im_start|>user\nWhat is 7 + 5? Put the final answer in \\boxed{}.<|im_end|>\n"
                 "<|im_start|>assistant\n")
    tok = make_tokenizer(NO_SYSTEM_ROLE)
    p = format_prompt(tok, "Q?", cfg(system_prompt="Be brief."))
    assert p == "<s><start_of_turn>user\nBe brief.\n\nQ? Put the final answer in \\boxed{}.<end_of_turn>\n" \
                "<start_of_turn>model\n"
    p = format_prompt(make_tokenizer(ODD_DEFAULT), "Q?", c)
    assert "Default helper text" not in p and p.endswith("[user]Q? Put the final answer in \\boxed{}.[assistant]")
    p = format_prompt(make_tokenizer(None), "Q?", c)
    assert p == "Question: Q? Put the final answer in \\boxed{}.\nAnswer:"


# -- the prompt sampler ---------------------------------------------------------------------------------------------

def _examples(n):
    return [Example(id=str(i), question=f"q{i}", answer=str(i), meta={}) for i in range(n)]


def test_prompt_sampler_epochs_and_determinism():
    ex = _examples(10)
    s = PromptSampler(ex, batch_size=4, seed=1)
    batches = [next(s) for _ in range(5)]  # 20 draws = two full epochs
    assert all(len(b) == 4 for b in batches)
    flat = [e.id for b in batches for e in b]
    assert sorted(flat[:10]) == sorted(flat[10:]) == [str(i) for i in range(10)]  # each epoch is a permutation
    assert flat[:10] != flat[10:]  # reshuffled
    assert s.state_dict()["epoch"] == 2 and s.state_dict()["position"] == 0
    again = [e.id for b in (next(PromptSampler(ex, 4, seed=1)) for _ in range(1)) for e in b]
    assert again == flat[:4]
    other = PromptSampler(ex, 4, seed=2)
    assert [e.id for _ in range(2) for e in next(other)] != flat[:8]
    big = PromptSampler(ex, batch_size=25, seed=1)  # a batch larger than the data spans epochs
    assert [e.id for e in next(big)][:20] == flat and big.state_dict()["epoch"] == 2


def test_prompt_sampler_state_round_trip():
    ex = _examples(7)
    a = PromptSampler(ex, batch_size=3, seed=5)
    for _ in range(4):
        next(a)
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    expected = [[e.id for e in next(a)] for _ in range(6)]
    b = PromptSampler(ex, batch_size=3, seed=5)
    b.load_state_dict(state)
    assert [[e.id for e in next(b)] for _ in range(6)] == expected
    with pytest.raises(ValueError, match="7 examples"):
        PromptSampler(_examples(8), 3, seed=5).load_state_dict(state)
    with pytest.raises(ValueError):
        PromptSampler([], 3)


def test_value_sampling_draws_prompts_near_0_or_1_less_and_stays_resumable():
    """data.value_sampling: a prompt the tracker has seen succeed (or fail) every time is kept less often; one never
    seen, or seen half right, always; the coins are seeded by (seed, epoch, position), so the draw resumes."""
    import torch

    from basis_lite.estimators.basis_mix import ValueTracker, selection_probability

    ex = _examples(20)
    tracker = ValueTracker(decay=1.0)
    for rnd in range(6):  # ids 0-4 always right, 5-9 always wrong, 10-14 half right, 15-19 never seen
        tracker.observe([str(i) for i in range(15)],
                        torch.tensor([[1.0]] * 5 + [[0.0]] * 5 + [[float((k + rnd) % 2)] for k in range(5)]))
    accept = selection_probability(tracker, 1.0)
    v = 7 / 8  # (6 + 1) / (6 + 2)
    assert accept(ex[0]) == pytest.approx(2 * (v * (1 - v)) ** 0.5) == pytest.approx(accept(ex[7]))
    assert accept(ex[19]) == 1.0 and accept(ex[11]) == pytest.approx(1.0, abs=0.01)
    assert selection_probability(tracker, 0.0)(ex[0]) == 1.0
    assert selection_probability(tracker, 0.5)(ex[0]) == pytest.approx(1 - 0.5 * (1 - accept(ex[0])))

    s = PromptSampler(ex, batch_size=4, seed=3, accept=accept)
    drawn = [e.id for _ in range(100) for e in next(s)]
    counts = {k: drawn.count(str(k)) for k in range(20)}
    near = sum(counts[k] for k in range(10)) / 10
    mid = sum(counts[k] for k in range(10, 20)) / 10
    assert near < 0.8 * mid  # accept ~0.66 vs ~1
    assert s.skipped > 0 and s.state_dict()["skipped"] == s.skipped
    state = json.loads(json.dumps(s.state_dict()))
    expected = [[e.id for e in next(s)] for _ in range(5)]
    t = PromptSampler(ex, batch_size=4, seed=3, accept=accept)
    t.load_state_dict(state)
    assert [[e.id for e in next(t)] for _ in range(5)] == expected and t.skipped == s.skipped
    # everything kept: the same order as without selection
    plain, every = PromptSampler(ex, 4, seed=3), PromptSampler(ex, 4, seed=3, accept=lambda e: 1.0)
    assert [[e.id for e in next(plain)] for _ in range(12)] == [[e.id for e in next(every)] for _ in range(12)]


def test_value_sampling_config_range():
    from basis_lite.config import load_config
    from basis_lite.errors import ConfigError

    assert load_config("smoke", ["data.value_sampling=0.5"]).data.value_sampling == 0.5
    with pytest.raises(ConfigError, match=r"data\.value_sampling"):
        load_config("smoke", ["data.value_sampling=1.5"])
