"""The notebooks in notebooks/, executed top to bottom in a real Jupyter kernel with the smoke preset's parameters.

Marker `notebooks` (deselected by default; CI runs `pytest -m notebooks` as a stage of its own, after the GGUF stage
has warmed pip's cache for llama.cpp's converter). Needs the `notebooks` extra (nbclient, nbformat, ipykernel) and,
for the GGUF export of the Colab notebook, `sentencepiece` (test extra).

Parameters are injected the way papermill does it: a cell tagged `injected-parameters` is inserted right after the
cell tagged `parameters`, so `papermill -p PRESET smoke -p INSTALL False ...` runs them the same way. Each notebook
runs in its own temporary folder (its working directory), with this session's throw-away model cache
(BASIS_LITE_CACHE, set by conftest and inherited by the kernel and by the `basis-lite` commands it starts). A cell
that raises fails the test; the `!basis-lite ...` shell lines report no error themselves, so every notebook reads
what each command wrote (summary.json, eval.json, the exported folders) in the cell that ran it, and this test
checks those files again afterwards.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.notebooks

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
SMOKE = {"PRESET": "smoke", "INSTALL": False, "TRAIN_ARGS": "--set train.seed=7"}  # TRAIN_ARGS reaches train
CELL_TIMEOUT_S = 600


def _with_parameters(nb, params: dict):
    """A copy of `nb` with a papermill-style `injected-parameters` cell after its `parameters` cell."""
    import nbformat

    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{len(tagged)} cells tagged 'parameters'; a notebook needs exactly one"
    i = tagged[0]
    names = {line.split("=", 1)[0].strip() for line in nb.cells[i].source.splitlines() if "=" in line}
    assert set(params) <= names, f"parameters {sorted(set(params) - names)} are not in the parameters cell"
    cell = nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in params.items()))
    cell.metadata["tags"] = ["injected-parameters"]
    cell.id = "injected-parameters"
    nb = nbformat.from_dict(nb)
    nb.cells.insert(i + 1, cell)
    return nb


def _execute(name: str, params: dict, workdir: Path):
    import nbformat
    from nbclient import NotebookClient

    nb = _with_parameters(nbformat.read(NOTEBOOKS / name, as_version=4), params)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(workdir)}})
    client.execute()
    return nb


def _text_outputs(nb) -> str:
    out = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            out.append(o.get("text", "") if o.get("output_type") == "stream" else
                       o.get("data", {}).get("text/plain", ""))
    return "\n".join(out)


def _one_run(work: Path) -> Path:
    """The notebook's training run: `smoke-<date>-<time>` (its exports and second run add a suffix to that name)."""
    runs = [p for p in work.iterdir() if re.fullmatch(r"smoke-\d{8}-\d{6}", p.name)]
    assert len(runs) == 1, sorted(p.name for p in work.iterdir())
    assert (runs[0] / "summary.json").is_file()
    return runs[0]


def test_cpu_quickstart_runs_with_the_smoke_preset(tmp_path):
    pytest.importorskip("nbclient")
    pytest.importorskip("matplotlib")
    nb = _execute("cpu_quickstart.ipynb", {**SMOKE, "OWN_DATA_STEPS": 2}, tmp_path)
    work = tmp_path / "basis-lite-quickstart"
    run = _one_run(work)
    text = _text_outputs(nb)
    assert "held-out accuracy:" in text
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["seed"] == 7
    assert (run / "eval.json").is_file() and (run / "plots" / "training.png").is_file()
    merged = run.with_name(run.name + "-merged")
    assert (merged / "config.json").is_file() and list(merged.glob("*.safetensors"))
    # the own-data run trained on the notebook's file with its reward function, for the steps asked
    own = run.with_name(run.name + "-own-data")
    cfg = yaml.safe_load((own / "config.yaml").read_text())
    assert cfg["data"]["dataset"] == "my_data.jsonl" and cfg["reward"]["functions"] == ["my_rewards:short_answer"]
    steps = [json.loads(line) for line in (own / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in steps if "reward_mean" in m]
    assert [m["step"] for m in trained] == [1, 2]
    # the random model is never right (correctness 0), so a reward above 0 is the notebook's short_answer at work
    assert all(m["reward_mean"] > 0 for m in trained), trained
    assert "held-out accuracy on my_data.jsonl:" in text


def test_colab_t4_quickstart_runs_with_the_smoke_preset(tmp_path):
    pytest.importorskip("nbclient")
    pytest.importorskip("sentencepiece")
    nb = _execute("colab_t4_quickstart.ipynb", SMOKE, tmp_path)
    work = tmp_path / "basis-lite-t4"
    run = _one_run(work)
    assert (run / "eval.json").is_file()
    merged = run.with_name(run.name + "-merged")
    assert (merged / "config.json").is_file()
    gguf = run.with_name(run.name + "-gguf")
    assert (gguf / "model-q8_0.gguf").is_file() and (gguf / "Modelfile").is_file()
    text = _text_outputs(nb)
    assert "merged:" in text and "gguf:" in text
