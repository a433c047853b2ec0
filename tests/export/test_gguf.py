"""`basis-lite export RUN --gguf f16|q8_0` with llama.cpp's real converter, checked with a real transformers reload.

Marker `gguf` (deselected by default; CI runs `pytest -m "gguf and not slow"` as a stage after the default suite): the
first export fetches llama.cpp's converter (the pinned llama-cpp-python source distribution, through `pip download`,
which prepares the sdist's metadata in an isolated build environment) into this session's throw-away cache, and needs
`sentencepiece` (in the `test` and `gguf` extras). The built-in SmolLM2 test is marked `slow` as well (it fetches and
converts the built-in model and trains 2 steps; durations are in docs/testing.md).

What is checked, on a smoke run (tiny random model) whose adapter is perturbed so that it changes the logits
clearly, as in tests/export/test_export.py:
  * the GGUF reloads in plain transformers (`gguf_file=`) and its logits are within the tolerance rule of base +
    adapter (float32, computed here independently of the export), not equal to the base's;
  * its tokenizer, as transformers reads it, gives the same ids as the run's tokenizer on the run's own prompts;
  * its embedded chat template and chat_template.jinja render the training prompts byte for byte; the Modelfile;
  * a tolerance the file cannot meet fails the export and leaves nothing behind.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import SMALL, cli_main, train_smoke
from test_export import SYSTEM, _perturb_lora_b, assert_training_prompts_reproduced

pytestmark = pytest.mark.gguf


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    pytest.importorskip("sentencepiece")
    run = train_smoke(tmp_path_factory.mktemp("gguf") / "run", *SMALL, "train.steps=1",
                      f"data.system_prompt={SYSTEM!r}", one_thread=True)
    _perturb_lora_b(run / "adapter" / "adapter_model.safetensors")
    from basis_lite.model.loading import resolve_model_path

    return {"run": run, "base_path": resolve_model_path("builtin:tiny-random")}


@torch.no_grad()
def _logits(model, ids):
    model.eval()
    return [model(input_ids=x).logits[0].float() for x in ids]


def _run_prompts(env) -> list[str]:
    from transformers import AutoTokenizer

    from basis_lite.config import load_config_file
    from basis_lite.data import format_prompt, load_examples

    tok = AutoTokenizer.from_pretrained(env["base_path"])
    cfg = load_config_file(env["run"] / "config.yaml")
    return [format_prompt(tok, ex.question, cfg.data) + f"The answer is \\boxed{{{ex.answer}}}."
            for ex in load_examples(cfg.data, "eval")]


def check_gguf_file(out: Path, gguf_type: str, run: Path, base_path: str, texts: list[str],
                    adapter_clearly_visible: bool = True) -> dict:
    """Reload the GGUF with transformers and compare it with base + adapter (fp32) and the base tokenizer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from basis_lite.export.gguf import gguf_tolerance

    name = f"model-{gguf_type}.gguf"
    assert (out / name).is_file()
    tok = AutoTokenizer.from_pretrained(base_path)
    gguf_tok = AutoTokenizer.from_pretrained(str(out), gguf_file=name, clean_up_tokenization_spaces=False)
    ids = [tok(t, return_tensors="pt", add_special_tokens=False).input_ids for t in texts]
    for t, x in zip(texts, ids):
        assert gguf_tok(t, add_special_tokens=False).input_ids == x[0].tolist(), t
    ref_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32),
                                          str(run / "adapter"))
    ref = _logits(ref_model, ids)
    with ref_model.disable_adapter():
        base = _logits(ref_model, ids)
    got = _logits(AutoModelForCausalLM.from_pretrained(str(out), gguf_file=name, dtype=torch.float32), ids)
    diff = max(float((g - r).abs().max()) for g, r in zip(got, ref))
    tol = gguf_tolerance(gguf_type, max(float(r.abs().max()) for r in ref))
    away_from_base = max(float((g - b).abs().max()) for g, b in zip(got, base))
    assert diff <= tol, (diff, tol)
    if adapter_clearly_visible:
        assert away_from_base > 3 * tol, "the GGUF is not clearly the adapted model (or the test has no power)"
    return {"diff": diff, "tol": tol, "away_from_base": away_from_base}


@pytest.mark.parametrize("gguf_type", ["q8_0", "f16"])
def test_gguf_export_of_a_smoke_run_reloads_within_tolerance_and_tokenizes_alike(env, tmp_path, gguf_type, capsys):
    from transformers import AutoTokenizer

    from basis_lite.model.loading import gguf_metadata

    out = tmp_path / f"gguf-{gguf_type}"
    assert cli_main("export", str(env["run"]), "--out", str(out), "--gguf", gguf_type) == 0
    printed = capsys.readouterr().out
    assert "self-check" in printed and f"model-{gguf_type}.gguf" in printed
    report = json.loads((out / "basis_lite_export.json").read_text())
    assert report["kind"] == "gguf" and report["check"]["passed"]
    got = check_gguf_file(out, gguf_type, env["run"], env["base_path"], _run_prompts(env))
    if gguf_type == "q8_0":  # q8_0 really is quantised: not the float32 logits
        assert got["diff"] > 1e-4

    meta = gguf_metadata(out / f"model-{gguf_type}.gguf", ["tokenizer.chat_template", "tokenizer.ggml.model",
                                                           "tokenizer.ggml.merges"])
    assert meta["tokenizer.ggml.model"] == "gpt2" and len(meta["tokenizer.ggml.merges"]) >= 2
    assert meta["tokenizer.chat_template"] == (out / "chat_template.jinja").read_text()
    assert_training_prompts_reproduced(meta["tokenizer.chat_template"], env)
    modelfile = (out / "Modelfile").read_text()
    assert f"FROM ./model-{gguf_type}.gguf" in modelfile and f'SYSTEM """{SYSTEM}"""' in modelfile
    assert 'PARAMETER stop "<|im_end|>"' in modelfile
    from basis_lite.config import load_config_file

    ctx = load_config_file(env["run"] / "config.yaml").model.max_seq_length
    assert "PARAMETER temperature 0\n" in modelfile and f"PARAMETER num_ctx {ctx}\n" in modelfile
    assert f'PARAMETER stop "{AutoTokenizer.from_pretrained(env["base_path"]).eos_token}"' in modelfile
    assert gguf_metadata(out / f"model-{gguf_type}.gguf", ["general.name"])["general.name"] == env["run"].name
    assert report["check"]["general_name"] == env["run"].name
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {oct(0o644)}, "files not 0644"
    readme = (out / "README.md").read_text()
    assert "--jinja" in readme and "Self-check" in readme
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_gguf_self_check_fails_above_a_given_tolerance_and_writes_nothing(env, tmp_path, capsys):
    out = tmp_path / "strict"
    assert cli_main("export", str(env["run"]), "--out", str(out), "--gguf", "q8_0", "--tolerance", "1e-9") == 2
    assert "GGUF self-check FAILED" in capsys.readouterr().err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_gguf_export_of_a_two_step_builtin_run(tmp_path, capsys):
    """The built-in SmolLM2 (its standard byte-level BPE tokenizer: llama.cpp's converter recognises it as
    `smollm`), 2 training steps, exported to q8_0."""
    run = tmp_path / "run"
    rc = cli_main("train", "--preset", "cpu-smollm2-arith", "--output", str(run), "--no-progress", "--set",
                  "train.steps=2", "--set", "data.eval_size=8", "--set", "train.batch_size=8", "--set",
                  "train.micro_batch_size=8", "--set", "train.threads=2", "--set", "estimator.prior_samples=0")
    assert rc == 0
    out = tmp_path / "gguf"
    assert cli_main("export", str(run), "--out", str(out), "--gguf", "q8_0") == 0
    report = json.loads((out / "basis_lite_export.json").read_text())
    assert report["check"]["passed"] and report["check"]["tokenizer_pre"] == "smollm"
    from transformers import AutoTokenizer

    from basis_lite.config import load_config_file
    from basis_lite.data import format_prompt, load_examples
    from basis_lite.model.loading import resolve_model_path

    cfg = load_config_file(run / "config.yaml")
    base_path = resolve_model_path(cfg.model.name)
    tok = AutoTokenizer.from_pretrained(base_path)
    texts = [format_prompt(tok, ex.question, cfg.data) + f"{ex.answer}" for ex in load_examples(cfg.data, "eval")]
    check_gguf_file(out, "q8_0", run, base_path, texts, adapter_clearly_visible=False)
