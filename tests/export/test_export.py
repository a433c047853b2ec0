"""`basis-lite export`: adapter export (peft, identical logits), merged 16-bit export with its self-check, refusal to
write over anything, and clean failure (no half-written folder) on a failed check or a full disk.

One real smoke training (tiny random model) per module; its adapter's lora_B weights are then perturbed so that the
adapter changes the logits clearly (the random model earns no reward, so training teaches it nothing): otherwise a
merge that silently dropped the adapter would pass every comparison here.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from conftest import SMALL, train_smoke  # noqa: E402

import cli  # noqa: E402
from basis_lite.export import hf as export_mod  # noqa: E402


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("BASIS_LITE_CACHE", str(tmp_path_factory.mktemp("cache")))
    run = train_smoke(tmp_path_factory.mktemp("export") / "run", *SMALL, "train.steps=1", f"data.system_prompt={SYSTEM!r}",
                      one_thread=True)
    _perturb_lora_b(run / "adapter" / "adapter_model.safetensors")
    from basis_lite.model.loading import resolve_model_path

    yield {"run": run, "base_path": resolve_model_path("builtin:tiny-random")}
    mp.undo()


SYSTEM = "You are a careful calculator."  # the run trains with it; the tiny model's own template has none


def assert_training_prompts_reproduced(template: str, env) -> None:
    """`template` (an export's chat template) renders the run's training prompts byte for byte for a conversation of
    one user message (question + instruction), where the base template alone would not (it has no system turn)."""
    from transformers import AutoTokenizer

    from basis_lite.config import load_config_file
    from basis_lite.data import format_prompt, load_examples

    base_tok = AutoTokenizer.from_pretrained(env["base_path"])
    cfg = load_config_file(env["run"] / "config.yaml")
    examples = load_examples(cfg.data, "eval")
    assert examples
    for ex in examples:
        trained = format_prompt(base_tok, ex.question, cfg.data)
        msgs = [{"role": "user", "content": f"{ex.question} {cfg.data.instruction}"}]
        assert SYSTEM in trained
        assert base_tok.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                            add_generation_prompt=True) == trained
        assert base_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) != trained


def _perturb_lora_b(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(path))
    g = torch.Generator().manual_seed(0)
    n = 0
    for k, v in sd.items():
        if "lora_B" in k:
            sd[k] = v + 0.2 * torch.randn(v.shape, generator=g, dtype=v.dtype)
            n += 1
    assert n > 0, "no lora_B tensors in the adapter"
    save_file(sd, str(path), metadata={"format": "pt"})


def _prompts(tok) -> list[torch.Tensor]:
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             + "The answer is \\boxed{7}." for q in ("What is 3 + 4?", "Solve 2x = 14.", "What is 21 / 3?")]
    return [tok(t, return_tensors="pt", add_special_tokens=False).input_ids for t in texts]


@torch.no_grad()
def _logits(model, ids):
    model.eval()
    return [model(input_ids=x).logits[0].float() for x in ids]


def _maxdiff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _base(base_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)


def _no_leftovers(out: Path) -> None:
    assert not out.exists(), f"{out} was created"
    left = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert not left, f"temporary folders left behind: {left}"


# ----------------------------------------------------------------------------------------------------------------


def test_export_adapter_loads_with_peft_and_gives_identical_logits(env, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoTokenizer

    out = tmp_path / "adapter-out"
    assert cli.main(["export", str(env["run"]), "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    for name in ("adapter_config.json", "adapter_model.safetensors", "README.md", "basis_lite_config.yaml"):
        assert (out / name).is_file(), name
    readme = (out / "README.md").read_text()
    assert "PeftModel.from_pretrained" in readme and str(out) in readme
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template, "the exported tokenizer lost its chat template"
    assert (out / "chat_template.jinja").read_text() == tok.chat_template
    assert_training_prompts_reproduced(tok.chat_template, env)
    # a built-in base travels with the adapter: base/ holds its weights byte for byte, named by a relative path
    # (not this machine's cache folder, not the `builtin:` name stock loaders reject)
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "base"
    assert json.loads((env["run"] / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        "builtin:tiny-random"
    assert (out / "base" / "model.safetensors").read_bytes() == \
        (Path(env["base_path"]) / "model.safetensors").read_bytes()
    assert AutoTokenizer.from_pretrained(out / "base").chat_template == tok.chat_template
    assert f'from_pretrained("{out / "base"}"' in readme and "basis_lite" not in readme.split("## Load")[1]
    modes = {oct(p.stat().st_mode & 0o777) for p in out.rglob("*")}
    assert modes == {oct(0o644), oct(0o755)}, modes  # weights 0644 like the rest, not safetensors' 0600

    ids = _prompts(tok)
    exported = PeftModel.from_pretrained(_base(env["base_path"]), str(out))
    original = PeftModel.from_pretrained(_base(env["base_path"]), str(env["run"] / "adapter"))
    a, b = _logits(exported, ids), _logits(original, ids)
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "exported adapter does not reproduce the run's logits"
    with exported.disable_adapter():
        base = _logits(exported, ids)
    assert _maxdiff(a, base) > 1e-3, "the adapter under test does not change the model (test would be vacuous)"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


STOCK_LOAD = r"""
import json, sys
import torch
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

folder, instruction, max_new = sys.argv[1], sys.argv[2], int(sys.argv[3])
records = [json.loads(line) for line in open(sys.argv[4])]
tok = AutoTokenizer.from_pretrained(folder)
models = {
    # from inside the folder: adapter_config.json's relative base path resolves
    "auto": AutoPeftModelForCausalLM.from_pretrained(".", dtype=torch.float32),
    "peft": PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder + "/base", dtype=torch.float32),
                                      folder),
}
out = {"basis_lite_imported": any(m.split(".")[0] == "basis_lite" for m in sys.modules)}
for name, model in models.items():
    model.eval()
    answers = []
    for r in records:
        msgs = [{"role": "user", "content": r["prompt"] + " " + instruction}]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)
        gen = model.generate(**ids, max_new_tokens=max_new, do_sample=False)
        answers.append({"prompt_text": text,
                        "completion": tok.decode(gen[0][ids.input_ids.shape[1]:], skip_special_tokens=True)})
    out[name] = answers
print(json.dumps(out))
"""


def test_exported_adapter_loads_with_stock_peft_and_answers_as_basis_lite_eval(env, tmp_path):
    """The adapter export of a built-in base, loaded by plain peft + transformers in a fresh interpreter that never
    imports basis_lite (AutoPeftModelForCausalLM from inside the folder; PeftModel over its base/ from elsewhere),
    gives the same greedy completions, from the same prompt text, as `basis-lite eval` on the export."""


    out = tmp_path / "adapter-out"
    assert cli.main(["export", str(env["run"]), "--out", str(out)]) == 0
    res = tmp_path / "eval.json"
    assert cli.main(["eval", str(out), "--limit", "3", "--out", str(res), "--set", "model.dtype=float32"]) == 0
    recs = [json.loads(line) for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    assert len(recs) == 3 and all(r["completion"] for r in recs)
    _assert_stock_tools_answer_alike(env["run"], out, tmp_path, recs, timeout=300)


def test_export_merged_bf16_reloads_in_plain_transformers_within_tolerance(env, tmp_path, capsys):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    assert cli.main(["export", str(env["run"]), "--out", str(out), "--merged"]) == 0
    printed = capsys.readouterr().out
    assert "max |logit diff|" in printed

    shards = sorted(out.glob("*.safetensors"))
    assert shards, "no safetensors written"
    for f in shards:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                assert "lora_" not in k, k
                assert sf.get_slice(k).get_dtype() == "BF16", (k, sf.get_slice(k).get_dtype())
    assert json.loads((out / "config.json").read_text()).get("dtype") == "bfloat16"
    report = json.loads((out / export_mod.EXPORT_REPORT).read_text())
    check = report["check"]
    assert check["passed"] and check["max_abs_diff"] <= check["tolerance"]

    # independent comparison: plain transformers (no peft) vs base + adapter, both fp32
    tok = AutoTokenizer.from_pretrained(out)
    assert (out / "chat_template.jinja").read_text() == tok.chat_template
    assert_training_prompts_reproduced(tok.chat_template, env)
    ids = _prompts(tok)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    got = _logits(merged, ids)
    ref_model = PeftModel.from_pretrained(_base(env["base_path"]), str(env["run"] / "adapter"))
    ref = _logits(ref_model, ids)
    with ref_model.disable_adapter():
        base = _logits(ref_model, ids)
    diff = _maxdiff(got, ref)
    tol = export_mod.default_tolerance(torch.bfloat16, max(float(r.abs().max()) for r in ref))
    assert 0 < diff <= tol, (diff, tol)  # > 0: the weights really are bf16-rounded
    # the check has power here: the merged model is far from the base, and the adapter's effect is above tolerance
    assert _maxdiff(got, base) > 3 * tol
    assert check["adapter_effect"] > check["tolerance"]
    assert check["merge_max_abs_diff"] <= check["merge_tolerance"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_export_merged_float16_into_existing_empty_folder(env, tmp_path):
    from safetensors import safe_open

    out = tmp_path / "merged16"
    out.mkdir()
    assert cli.main(["export", str(env["run"]), "--out", str(out), "--merged", "--dtype", "float16"]) == 0
    with safe_open(str(next(out.glob("*.safetensors"))), framework="pt") as sf:
        assert {sf.get_slice(k).get_dtype() for k in sf.keys()} == {"F16"}
    check = json.loads((out / export_mod.EXPORT_REPORT).read_text())["check"]
    assert check["max_abs_diff"] <= check["tolerance"]


def test_default_tolerance_rule():
    # (16 u + 2^-13) * max|logit|: bf16 about 6.3% of the logit scale, fp16 about 0.8%, fp32 about 1e-4
    assert export_mod.default_tolerance(torch.bfloat16, 40.0) == pytest.approx(40 * (16 / 256 + 2 ** -13), rel=1e-3)
    assert export_mod.default_tolerance(torch.float16, 40.0) == pytest.approx(40 * (16 / 2048 + 2 ** -13), rel=1e-3)
    assert export_mod.default_tolerance(torch.float32, 40.0) < 1e-2
    assert export_mod._target_dtype("auto", type("C", (), {"dtype": "float16"})()) == torch.float16
    assert export_mod._target_dtype("auto", type("C", (), {"dtype": torch.float32})()) == torch.bfloat16
    assert export_mod._target_dtype("float32", None) == torch.float32


def test_self_check_fails_on_a_corrupted_merge(env, tmp_path, monkeypatch, capsys):
    real_merge = export_mod._merge_adapter

    def corrupted_merge(peft_model):
        merged = real_merge(peft_model)
        with torch.no_grad():
            merged.model.layers[0].self_attn.q_proj.weight.mul_(1.05)  # a 5% error in one matrix
        return merged

    monkeypatch.setattr(export_mod, "_merge_adapter", corrupted_merge)
    out = tmp_path / "bad-merge"
    assert cli.main(["export", str(env["run"]), "--out", str(out), "--merged"]) == 2
    assert "self-check FAILED" in capsys.readouterr().err
    _no_leftovers(out)


def test_self_check_fails_when_the_saved_weights_are_wrong(env, tmp_path, monkeypatch, capsys):
    real_save = export_mod._save_model

    def corrupted_save(model, tok, folder):
        with torch.no_grad():
            model.model.layers[1].mlp.down_proj.weight.mul_(1.5)
        real_save(model, tok, folder)

    monkeypatch.setattr(export_mod, "_save_model", corrupted_save)
    out = tmp_path / "bad-save"
    assert cli.main(["export", str(env["run"]), "--out", str(out), "--merged"]) == 2
    err = capsys.readouterr().err
    assert "self-check FAILED" in err and "nothing was written" in err
    _no_leftovers(out)


def test_self_check_fails_above_a_given_tolerance(env, tmp_path, capsys):
    out = tmp_path / "strict"
    assert cli.main(["export", str(env["run"]), "--out", str(out), "--merged", "--tolerance", "1e-9"]) == 2
    assert "self-check FAILED" in capsys.readouterr().err  # bf16 rounding alone exceeds 1e-9
    _no_leftovers(out)


@pytest.mark.parametrize("merged", [False, True])
def test_refuses_a_non_empty_out_and_writes_nothing(env, tmp_path, merged, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    argv = ["export", str(env["run"]), "--out", str(out)] + (["--merged"] if merged else [])
    assert cli.main(argv) == 2
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_full_disk_while_writing_gives_a_clear_error_and_removes_the_temp_folder(env, tmp_path, monkeypatch,
                                                                                 capsys):
    def full_disk(model, tok, folder):
        (Path(folder) / "model.safetensors").write_bytes(b"\0" * 1000)  # a partial file, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(export_mod, "_save_model", full_disk)
    out = tmp_path / "full"
    assert cli.main(["export", str(env["run"]), "--out", str(out), "--merged"]) == 2
    err = capsys.readouterr().err
    assert "no space left" in err and "partial export was removed" in err
    _no_leftovers(out)


def test_a_corrupted_adapter_copy_is_refused_and_nothing_is_left(env, tmp_path, monkeypatch, capsys):
    """The adapter's files are copied and each copy is checked against its original's sha256: a copy that comes out
    different (a failing disk) stops the export with an error naming the file, and no folder is left."""
    real_copy = shutil.copy2

    def flipping_copy(src, dst, *a, **k):
        real_copy(src, dst, *a, **k)
        if Path(dst).name == "adapter_model.safetensors":
            data = bytearray(Path(dst).read_bytes())
            data[-1] ^= 0xFF
            Path(dst).write_bytes(bytes(data))

    monkeypatch.setattr(export_mod.shutil, "copy2", flipping_copy)
    out = tmp_path / "bad-copy"
    assert cli.main(["export", str(env["run"]), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "adapter_model.safetensors" in err and "differs from the original" in err
    _no_leftovers(out)


def test_too_little_free_space_is_refused_before_writing(env, tmp_path, monkeypatch, capsys):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(export_mod.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    out = tmp_path / "tiny-disk"
    assert cli.main(["export", str(env["run"]), "--out", str(out)]) == 2
    assert "not enough free space" in capsys.readouterr().err
    _no_leftovers(out)


def test_gguf_argument_errors_name_the_accepted_values(env, tmp_path, capsys, monkeypatch):
    out = tmp_path / "g"
    with pytest.raises(SystemExit) as e:
        cli.main(["export", str(env["run"]), "--out", str(out), "--gguf", "q4_0"])
    assert e.value.code == 2 and "invalid choice: 'q4_0'" in capsys.readouterr().err
    from basis_lite.errors import ConfigError

    with pytest.raises(ConfigError, match="accepted: f16, q8_0"):
        export_mod.export_run(env["run"], out, gguf="q4_0")
    assert cli.main(["export", str(env["run"]), "--out", str(out), "--gguf", "q8_0", "--merged"]) == 2
    assert "drop --merged" in capsys.readouterr().err
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sentencepiece"
                        else real_find_spec(name, *a))
    assert cli.main(["export", str(env["run"]), "--out", str(out), "--gguf", "f16"]) == 2
    assert "pip install 'basis-lite[gguf]'" in capsys.readouterr().err
    _no_leftovers(out)


def test_export_errors_exit_2(env, tmp_path, capsys):
    assert cli.main(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "no such run folder" in capsys.readouterr().err
    (tmp_path / "notarun").mkdir()
    assert cli.main(["export", str(tmp_path / "notarun"), "--out", str(tmp_path / "o")]) == 2
    assert "not a basis-lite run folder" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_builtin_smollm2_adapter_export_answers_like_basis_lite_eval_in_stock_peft(tmp_path):
    """The same check on the real built-in SmolLM2 (dequantised from Q4_1: only the carried base/ reproduces it):
    one training step, export, `basis-lite eval` on 6 problems, and plain peft + transformers from the folder."""

    from conftest import sets


    run = tmp_path / "run"
    over = ["train.steps=1", "train.batch_size=4", "train.micro_batch_size=4", "data.eval_size=6",
            "model.dtype=float32", "generation.max_new_tokens=16", "train.eval_max_new_tokens=48",
            "train.eval_every=0"]
    assert cli.main(["train", "--preset", "cpu-smollm2-arith", "--output", str(run), "--no-progress",
                     *sets(over)]) == 0
    _perturb_lora_b(run / "adapter" / "adapter_model.safetensors")  # one step barely moves it
    out = tmp_path / "adapter-out"
    assert cli.main(["export", str(run), "--out", str(out)]) == 0
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "base"
    assert cli.main(["eval", str(out), "--out", str(tmp_path / "eval.json"), "--set", "model.dtype=float32"]) == 0
    recs = [json.loads(line) for line in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    _assert_stock_tools_answer_alike(run, out, tmp_path, recs, timeout=900)


def _assert_stock_tools_answer_alike(run, out, tmp_path, recs: list, timeout: int) -> None:
    """Load the export `out` in a fresh interpreter without basis-lite (transformers' AutoPeftModel and plain peft)
    and check its greedy answers to the eval's prompts are basis-lite eval's (`recs`, eval_samples.jsonl)."""
    from basis_lite.config import load_config_file

    cfg = load_config_file(run / "config.yaml")
    script = tmp_path / "stock_load.py"
    script.write_text(STOCK_LOAD)
    proc = subprocess.run([sys.executable, str(script), str(out), cfg.data.instruction,
                           str(cfg.train.eval_max_new_tokens), str(tmp_path / "eval_samples.jsonl")], cwd=out,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["basis_lite_imported"] is False
    for name in ("auto", "peft"):
        assert [a["prompt_text"] for a in got[name]] == [r["prompt_text"] for r in recs], name
        assert [a["completion"] for a in got[name]] == [r["completion"] for r in recs], name
