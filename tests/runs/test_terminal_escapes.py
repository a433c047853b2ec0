"""Reliability, fourth round (issue 37): `eval --show-misses` prints questions from a dataset and completions from
a model; control characters in them (ESC sequences that set a terminal's title or colours, BEL, CR) are printed
escaped, newlines kept."""
from __future__ import annotations

import json

from conftest import FAST, cli_main, sets

from basis_lite.runs.saved import format_misses, printable

HOSTILE = "\x1b]0;owned\x07\x1b[31mWhat is {i} + 1?\x1b[0m\rcovered\x9b2J"


def test_show_misses_escapes_control_characters_of_the_dataset(tmp_path, capsys):
    data = tmp_path / "esc.jsonl"
    data.write_text("".join(json.dumps({"question": HOSTILE.format(i=i), "answer": str(i + 1)}) + "\n"
                            for i in range(16)))
    run = tmp_path / "run"
    assert cli_main("train", "--preset", "smoke", *sets(FAST + ["train.steps=1", f"data.dataset={data}"]),
                    "--output", str(run), "--no-progress") == 0
    capsys.readouterr()
    assert cli_main("eval", str(run), "--show-misses", "3", "--out", str(tmp_path / "eval.json")) == 0
    out = capsys.readouterr().out
    misses = out[out.index("problems missed"):]
    assert "\\x1b]0;owned\\x07" in misses and "\\r" in misses and "\\x9b" in misses
    assert not any(c in misses for c in "\x1b\x07\r\x9b")


def test_format_misses_keeps_newlines_and_escapes_the_rest():
    record = {"id": "f/1", "prompt": "What\x1b[2J is 2 + 2?", "completion": "line one\nline two\x07\tend",
              "gold": "4", "extracted": None, "correct": False}
    text = format_misses([record], 1)
    assert "\x1b" not in text and "\x07" not in text and "\\x1b[2J" in text and "\\x07" in text
    assert "line one\n" in text and "\tend" in text
    assert printable("caf\u00e9 \u4e2d\n") == "caf\u00e9 \u4e2d\n"  # printable text is left alone
