"""Run llama.cpp's convert_hf_to_gguf.py from the cached converter folder, in a fresh interpreter.

    python -m basis_lite.export.converter CONVERTER_DIR MODEL_DIR --outfile FILE --outtype f16|q8_0

`export.gguf.convert` starts this as a subprocess. It puts the converter's own `gguf-py` (not the PyPI `gguf`
package) and its `conversion` package first on sys.path, then runs convert_hf_to_gguf.py as `__main__` with the
arguments after CONVERTER_DIR, unchanged but for one case:

builtin:tiny-random's tokenizer (256 byte-level characters, special tokens, and one merge, whose token is special)
needs two adjustments, made for exactly that kind of tokenizer (`single_byte_tokens`) and for no other:

- the converter names a BPE tokenizer's pre-tokenizer (the regex llama.cpp splits text with before BPE) by hashing
  the tokenization of a fixed test string against the tokenizers it knows, and refuses any other. For this one the
  choice cannot matter (every byte is its own token however the text is split first): `default` is recorded. Any
  other unrecognised tokenizer still fails with the converter's own message;
- a merge list of one entry is written twice: transformers' GGUF reader turns any one-element array into a plain
  string and then cannot build the tokenizer; llama.cpp and the tokenizers library ignore a repeated merge.

The export's self-check compares the tokenization of the written file with the source tokenizer either way.
"""
from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path


def single_byte_tokens(tokenizer) -> bool:
    """A byte-level BPE whose non-special tokens are all single characters (every merge makes a special token)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        return False
    spec = json.loads(backend.to_str())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    kinds = [p.get("type") for p in pre.get("pretokenizers", [pre])]
    special = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    text_tokens = [t for t in (model.get("vocab") or {}) if t not in special]
    merges = ["".join(m) if isinstance(m, list) else m.replace(" ", "", 1) for m in model.get("merges") or []]
    return (model.get("type") == "BPE" and "ByteLevel" in kinds and all(len(t) == 1 for t in text_tokens)
            and all(m in special for m in merges))


def main(argv: list[str]) -> None:
    here = Path(__file__).resolve().parent  # run as a script: keep the package's own modules off the import path
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    conv_dir = Path(argv[0]).resolve()
    sys.path[:0] = [str(conv_dir), str(conv_dir / "gguf-py")]
    import gguf

    if not Path(gguf.__file__).resolve().is_relative_to(conv_dir):
        raise SystemExit(f"llama.cpp converter: imported gguf from {gguf.__file__}, not from {conv_dir}/gguf-py")
    from conversion import base

    recognised = base.TextModel.get_vocab_base_pre
    state = {"single_byte_tokens": False}

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return recognised(self, tokenizer)
        except NotImplementedError:
            if single_byte_tokens(tokenizer):
                state["single_byte_tokens"] = True
                base.logger.info("byte-level BPE of single-byte tokens: pre-tokenizer 'default' (any split gives "
                                 "the same tokens)")
                return "default"
            raise

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    add_merges = gguf.GGUFWriter.add_token_merges

    def add_token_merges(self, merges):
        if len(merges) == 1 and state["single_byte_tokens"]:
            merges = [merges[0], merges[0]]
        add_merges(self, merges)

    gguf.GGUFWriter.add_token_merges = add_token_merges
    script = conv_dir / "convert_hf_to_gguf.py"
    sys.argv = [str(script), *argv[1:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
