"""TRL's dataset formats and reward calling convention: standard and conversational rows, TRL's field names
(`prompt`, `solution`), extra columns passed to reward functions, `save_to_disk` folders and `.arrow` files, and a
short real training run on conversational data with a TRL-style conversational reward."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SMALL, step_records, train_smoke

from basis_lite.config import DataConfig, RewardConfig
from basis_lite.data import format_prompt, load_examples
from basis_lite.errors import DataError
from basis_lite.rewards.scorer import RewardScorer, column_names, example_columns

SYSTEM = {"role": "system", "content": "You are a careful calculator."}


def _rows(n: int = 12) -> list[dict]:
    """Conversational rows (every third with a system message), TRL's `solution` field, an extra column."""
    rows = []
    for i in range(n):
        user = {"role": "user", "content": f"What is {i} + {i + 3}?"}
        rows.append({"prompt": [SYSTEM, user] if i % 3 == 0 else [user], "solution": str(2 * i + 3),
                     "difficulty": i % 4})
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _by_row(examples):
    return {ex.meta["row"]: ex for ex in examples}


def test_conversational_rows_with_trl_field_names(tmp_path):
    f = _write_jsonl(tmp_path / "conv.jsonl", _rows())
    cfg = DataConfig(dataset=str(f), eval_size=4)
    train, ev = load_examples(cfg, "train"), load_examples(cfg, "eval")
    assert len(train) == 8 and len(ev) == 4
    for ex in train + ev:
        i = ex.meta["row"] - 1
        assert ex.messages == _rows()[i]["prompt"]
        assert ex.prompt is ex.messages
        assert ex.question == f"What is {i} + {i + 3}?"
        assert ex.answer == str(2 * i + 3)
        assert ex.meta["difficulty"] == i % 4 and ex.meta["solution"] == ex.answer
        assert "prompt" not in ex.meta


def test_conversational_prompt_rendering():
    """The conversation goes through the chat template as given; data.instruction ends the last user message; a
    row's own system message is kept and the configured one is used only when the row has none."""
    from transformers import AutoTokenizer

    from basis_lite.model.loading import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("builtin:smollm2-135m-instruct"))
    cfg = DataConfig(instruction="Box it.", system_prompt="Be brief.")
    user = {"role": "user", "content": "What is 2 + 2?"}
    got = format_prompt(tok, [SYSTEM, user], cfg)
    want = tok.apply_chat_template([SYSTEM, {"role": "user", "content": "What is 2 + 2? Box it."}], tokenize=False,
                                   add_generation_prompt=True)
    assert got == want and "Be brief." not in got
    # a single user message renders exactly like the same question given as text (the standard format)
    assert format_prompt(tok, [user], cfg) == format_prompt(tok, "What is 2 + 2?", cfg)
    assert "Be brief." in format_prompt(tok, [user], cfg)


def test_standard_rows_with_trl_field_names_and_extra_columns(tmp_path):
    rows = [{"prompt": f"What is {i} * 2?", "solution": f"It is \\boxed{{{2 * i}}}", "source_id": f"s{i}"}
            for i in range(10)]
    cfg = DataConfig(dataset=str(_write_jsonl(tmp_path / "std.jsonl", rows)), eval_size=2)
    exs = load_examples(cfg, "train") + load_examples(cfg, "eval")
    assert len(exs) == 10
    for ex in exs:
        i = ex.meta["row"] - 1
        assert ex.messages is None and ex.prompt == rows[i]["prompt"]
        assert ex.answer == str(2 * i) and ex.meta["source_id"] == f"s{i}"


@pytest.mark.parametrize("bad, reason", [
    ([], "an empty list of messages"),
    ([{"role": "user"}], "message 0 is not a"),
    ([{"role": "tool", "content": "x"}], "role 'tool'"),
    ([{"role": "system", "content": "x"}], "without a user message"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "ending with an assistant"),
])
def test_malformed_conversations_are_bad_rows_with_a_reason(tmp_path, bad, reason):
    rows = _rows(4) + [{"prompt": bad, "solution": "1"}]
    cfg = DataConfig(dataset=str(_write_jsonl(tmp_path / "c.jsonl", rows)), eval_size=0, max_bad_fraction=0.0)
    with pytest.raises(DataError) as e:
        load_examples(cfg, "train")
    assert "line 5" in str(e.value) and reason in str(e.value)


def test_save_to_disk_folder_and_arrow_file_load_like_the_jsonl(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = _rows()
    jsonl = _write_jsonl(tmp_path / "conv.jsonl", rows)
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = sorted((tmp_path / "saved").glob("*.arrow"))
    assert len(arrow) == 1
    want = None
    for source in (jsonl, tmp_path / "saved", arrow[0]):
        cfg = DataConfig(dataset=str(source), eval_size=4)
        got = [(ex.question, ex.answer, ex.messages, ex.meta["difficulty"], ex.meta["row"])
               for split in ("train", "eval") for ex in load_examples(cfg, split)]
        assert len(got) == 12
        want = want or got
        assert got == want, source
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"DatasetDict.*splits: (train, test|test, train).*dd/"):
        load_examples(DataConfig(dataset=str(tmp_path / "dd")), "train")


@pytest.mark.parametrize("timeout_s", [0, 5.0])
def test_trl_conversational_reward_gets_messages_and_columns(tmp_path, timeout_s):
    """TRL's calling convention on conversational data: prompts are the dataset's message lists, completions
    [{"role": "assistant", "content": ...}], the extra columns by name; the built-in correctness still reads text."""
    cfg = DataConfig(dataset=str(_write_jsonl(tmp_path / "conv.jsonl", _rows())), eval_size=0)
    exs = load_examples(cfg, "train")[:3]
    comps = [f"The answer is \\boxed{{{ex.answer}}}" if j != 1 else "no idea" for j, ex in enumerate(exs)]
    rcfg = RewardConfig(functions=["tests.reward_fns:trl_conversational"], timeout_s=timeout_s)
    with RewardScorer(rcfg, column_names(exs, cfg)) as s:
        rb = s([ex.prompt for ex in exs], comps, [ex.answer for ex in exs], columns=example_columns(exs, cfg))
    assert rb.warnings == 0
    assert rb.correct == [1.0, 0.0, 1.0]
    want = [float(j != 1) + ex.meta["difficulty"] / 10 for j, ex in enumerate(exs)]
    assert rb.per_function["tests.reward_fns:trl_conversational"] == pytest.approx(want)


def test_training_on_conversational_jsonl_with_a_trl_reward(tmp_path):
    """The newcomer's path: TRL conversational JSONL + a TRL-style conversational reward, trained for real."""
    data = _write_jsonl(tmp_path / "conv.jsonl", _rows(24))
    run = train_smoke(tmp_path / "run", *SMALL, f"data.dataset={data}", "train.steps=2",
                      "reward.functions=[tests.reward_fns:trl_conversational]", one_thread=True)
    steps = step_records(run)
    assert len(steps) == 2
    assert all(r["reward_mean"] > 0 for r in steps)  # difficulty / 10 > 0 for most rows: the reward was called
