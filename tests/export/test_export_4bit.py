"""The merged export of a run trained over a 4-bit (NF4) base, on the CPU with bitsandbytes: by default it merges
into the dequantised NF4 weights the adapter was trained against and checks the saved 16-bit model against the
trained model (NF4 base + adapter); `--merge-into original` merges into the original full-precision weights and
prints the measured gap, which on this model is far above the default export's error.

One real smoke training over the NF4 tiny model; its lora_B weights are then perturbed so that the adapter changes
the logits clearly (as in test_export.py)."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import SMALL, train_smoke

import cli
from basis_lite.export import hf as export_mod

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    from test_export import _perturb_lora_b

    run = train_smoke(tmp_path_factory.mktemp("export4") / "run", *SMALL, "train.steps=1", "model.load_in_4bit=true",
                      one_thread=True)
    _perturb_lora_b(run / "adapter" / "adapter_model.safetensors")
    return run


def _check_ids(run):
    from transformers import AutoTokenizer

    from basis_lite.config import load_config_file
    from basis_lite.export.check import check_texts

    cfg = load_config_file(run / "config.yaml")
    tok = AutoTokenizer.from_pretrained(export_mod.resolve_model_path(cfg.model.name))
    return cfg, [tok(t, return_tensors="pt", add_special_tokens=False).input_ids for t in check_texts(cfg, tok)]


def _trained_and_original_logits(run):
    """Logits of the trained model (the adapter on the NF4 base, fp32 compute) and of the adapter on the original
    float32 weights, on the export's check texts."""
    from transformers import AutoModelForCausalLM

    from basis_lite.export.check import logits
    from basis_lite.model.loading import load_base
    from basis_lite.runs.checkpoint import load_peft_adapter

    cfg, ids = _check_ids(run)
    nf4 = load_peft_adapter(load_base(cfg, torch.device("cpu"), torch.float32), run / "adapter")
    original = load_peft_adapter(AutoModelForCausalLM.from_pretrained(
        export_mod.resolve_model_path(cfg.model.name), dtype=torch.float32), run / "adapter")
    return ids, logits(nf4, ids), logits(original, ids)


def test_merged_export_is_the_trained_model_and_the_original_merge_is_not(run4, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from basis_lite.export.check import logits, max_abs_diff

    trained_out, original_out = tmp_path / "trained", tmp_path / "original"
    assert cli.main(["export", str(run4), "--out", str(trained_out), "--merged"]) == 0
    printed = capsys.readouterr().out
    assert "vs the NF4 base + adapter (fp32 compute)" in printed and "ORIGINAL" not in printed
    assert cli.main(["export", str(run4), "--out", str(original_out), "--merged", "--merge-into", "original"]) == 0
    printed = capsys.readouterr().out
    assert "merged into the ORIGINAL full-precision weights" in printed and "differs from the trained one" in printed

    t = json.loads((trained_out / export_mod.EXPORT_REPORT).read_text())["check"]
    o = json.loads((original_out / export_mod.EXPORT_REPORT).read_text())["check"]
    assert t["merged_into"] == "trained" and t["reference"] == "the NF4 base + adapter (fp32 compute)"
    assert o["merged_into"] == "original" and "original weights" in o["reference"]
    assert "gap_to_trained" not in t and o["gap_to_trained"]["max_abs_diff"] > 0
    assert json.loads((trained_out / "config.json").read_text()).get("quantization_config") is None  # 16-bit
    assert "dequantised NF4 weights" in (trained_out / "README.md").read_text()
    assert "ORIGINAL full-precision weights" in (original_out / "README.md").read_text()

    # independently: reload both exports with plain transformers and compare with the trained model
    ids, nf4, orig = _trained_and_original_logits(run4)
    got_t = logits(AutoModelForCausalLM.from_pretrained(trained_out, dtype=torch.float32), ids)
    got_o = logits(AutoModelForCausalLM.from_pretrained(original_out, dtype=torch.float32), ids)
    err_t, gap_o = max_abs_diff(got_t, nf4), max_abs_diff(got_o, nf4)
    assert err_t <= t["tolerance"]  # the default export is the trained model up to bf16 rounding
    assert max_abs_diff(got_o, orig) <= o["tolerance"]  # the original merge is base + adapter over the originals
    # the two merges differ measurably: the original merge is several times further from the trained model than
    # bf16 rounding takes the default one, and far beyond the fp32 merge check's allowance; the report says so
    assert gap_o > 5 * err_t and gap_o > 100 * t["merge_tolerance"] > 100 * t["merge_max_abs_diff"]
    assert o["gap_to_trained"]["max_abs_diff"] == pytest.approx(max_abs_diff(orig, nf4), rel=1e-3, abs=1e-4)


def test_merging_into_the_original_weights_fails_the_trained_check(run4, tmp_path, monkeypatch, capsys):
    """The check has power: with the dequantisation skipped (the merge starts from the original weights while
    claiming the trained ones), the export fails before writing."""
    import basis_lite.model.loading as loading

    monkeypatch.setattr(loading, "dequantized_weights", lambda model: iter(()))
    out = tmp_path / "wrong"
    assert cli.main(["export", str(run4), "--out", str(out), "--merged"]) == 2
    err = capsys.readouterr().err
    assert "self-check FAILED before writing" in err and "the NF4 base + adapter" in err
    assert not out.exists()


def test_merge_into_is_refused_for_the_adapter_export(run4, tmp_path, capsys):
    assert cli.main(["export", str(run4), "--out", str(tmp_path / "a"), "--merge-into", "original"]) == 2
    assert "--merge-into applies to --merged and --gguf exports" in capsys.readouterr().err
