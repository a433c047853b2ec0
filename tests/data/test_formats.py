"""The local file formats (basis_lite/data/formats.py): every registered suffix documented and in the config's help,
and the CONTRIBUTING.md recipe "Add a data format" followed with a throwaway format: registered, named by the config,
and loaded through `load_examples`."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from basis_lite.config import FIELDS, load_config
from basis_lite.config.fields import help_text
from basis_lite.data import load_examples
from basis_lite.data.formats import FileFormat, FileRows, format_suffixes, register_format, unregister_format
from basis_lite.errors import DataError

REPO = Path(__file__).resolve().parents[2]


def test_every_format_is_documented_and_in_the_help():
    assert format_suffixes() == (".jsonl", ".json", ".csv", ".parquet", ".arrow")
    table = (REPO / "docs" / "formats-and-export.md").read_text()
    readme = (REPO / "README.md").read_text()
    for suffix in format_suffixes():
        assert re.search(rf"^\| `{re.escape(suffix)}` \|", table, re.M), f"{suffix}: no row in formats-and-export.md"
        assert f"`{suffix}`" in readme, f"{suffix}: not named in the README"
    assert "/".join(format_suffixes()) in help_text(FIELDS["data.dataset"])


# ---------------------------------------------------------------------------------------------------------------
# CONTRIBUTING.md, "Add a data format": a reader, one registration


def read_tsv_file(path: Path, question_field: str) -> FileRows:
    """Tab-separated values with a header row (a throwaway format for the recipe)."""
    lines = path.read_text().splitlines()
    header = lines[0].split("\t")
    rows, bad = [], []
    for n, line in enumerate(lines[1:], start=2):
        cells = line.split("\t")
        if len(cells) != len(header):
            bad.append((n, f"{len(cells)} cells for {len(header)} columns"))
        else:
            rows.append((n, dict(zip(header, cells))))
    return FileRows(rows, bad, len(lines) - 1, header, "line")


@pytest.fixture
def tsv_format():
    register_format(FileFormat(".tsv", read_tsv_file, "tab-separated values with a header row"))
    yield
    unregister_format(".tsv")


def test_recipe_add_a_data_format_loads_a_file(tmp_path, tsv_format):
    path = tmp_path / "sums.tsv"
    want = {f"What is {a} + {b}?": str(a + b) for a in range(4) for b in range(3)}
    rows = [f"{q}\t{a}" for q, a in want.items()]
    path.write_text("\n".join(["question\tanswer", *rows, "a row\twith\tthree cells"]) + "\n")
    assert ".tsv" in help_text(FIELDS["data.dataset"])
    cfg = load_config("smoke", [f"data.dataset={path}", "data.eval_size=2", "data.train_size=0",
                                "data.max_bad_fraction=0.1"])
    train, evals = load_examples(cfg.data, "train"), load_examples(cfg.data, "eval")
    assert len(train) == 10 and len(evals) == 2
    got = {ex.question.split("?")[0] + "?": ex.answer for ex in train + evals}
    assert got == want  # every row once, each question with its own answer
    with pytest.raises(DataError, match="malformed"):  # the bad row counts against data.max_bad_fraction
        load_examples(load_config("smoke", [f"data.dataset={path}", "data.max_bad_fraction=0"]).data, "train")


def test_an_unregistered_suffix_names_the_registered_ones(tmp_path):
    path = tmp_path / "sums.tsv"
    path.write_text("question\tanswer\nWhat is 1 + 1?\t2\n")
    with pytest.raises(DataError, match=r"not a \.jsonl/\.json/\.csv/\.parquet/\.arrow file"):
        load_examples(load_config("smoke", [f"data.dataset={path}"]).data, "train")
