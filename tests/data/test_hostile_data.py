"""Reliability, fourth round (issue 37), data: the data files of a `save_to_disk` folder are read only inside it
(its state.json naming `../elsewhere.arrow`, or an .arrow file linked out of it, is a DataError naming it)."""
from __future__ import annotations

import json

import pytest

from basis_lite.config import DataConfig
from basis_lite.data import load_examples
from basis_lite.errors import DataError


@pytest.fixture
def saved(tmp_path):
    """A save_to_disk folder (one Dataset) of 12 arithmetic rows, and a copy of its .arrow file outside it."""
    datasets = pytest.importorskip("datasets")
    rows = [{"question": f"What is {i} + 3?", "answer": str(i + 3)} for i in range(12)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    (arrow,) = sorted((tmp_path / "saved").glob("*.arrow"))
    outside = tmp_path / "elsewhere.arrow"
    outside.write_bytes(arrow.read_bytes())
    return tmp_path / "saved", arrow, outside


def test_a_state_json_naming_a_file_outside_the_folder_is_refused(saved):
    folder, arrow, outside = saved
    assert len(load_examples(DataConfig(dataset=str(folder), eval_size=2), "train")) == 10
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"] = [{"filename": "../elsewhere.arrow"}]
    (folder / "state.json").write_text(json.dumps(state))
    arrow.unlink()
    with pytest.raises(DataError, match="outside the folder.*elsewhere.arrow"):
        load_examples(DataConfig(dataset=str(folder), eval_size=2), "train")


def test_an_arrow_file_linked_out_of_the_folder_is_refused(saved):
    folder, arrow, outside = saved
    arrow.unlink()
    arrow.symlink_to(outside)
    with pytest.raises(DataError, match="outside the folder"):
        load_examples(DataConfig(dataset=str(folder), eval_size=2), "train")
