"""GGUF export for llama.cpp, Ollama and LM Studio (`basis-lite export RUN --gguf f16|q8_0 --out DIR`).

    export_gguf(cfg, target, out, gguf_type="q8_0", tolerance=None, merge=export.hf.export_merged) -> report

Step by step:

1. llama.cpp's own converter: `convert_hf_to_gguf.py` with its `conversion` package and its own `gguf-py`, as
   vendored in the llama-cpp-python source distribution on the package index (pinned version and sha256 in
   `model/downloads.py`; only those Python files are extracted, nothing is compiled), fetched once into the cache
   (`llama_cpp_converter`). It needs `sentencepiece` (`pip install 'basis-lite[gguf]'`).
2. The adapter is merged and saved in float32 by the merged export (`export.hf.export_merged`, passed in as
   `merge`, with its own checks against base + adapter), into a temporary folder, with the chat template training
   used.
3. The converter runs on that folder in a fresh interpreter (`converter.py`) and writes `model-<type>.gguf`.
4. SELF-CHECK, against the merged float32 model: the GGUF is reloaded with plain transformers
   (`from_pretrained(DIR, gguf_file=...)`, dequantised to float32) and
   - its tokenizer must give the same ids as the merged model's tokenizer on the check prompts and a set of probe
     texts (digits, whitespace runs, punctuation, non-ASCII, special tokens), and decode them to the same text.
     (transformers' GGUF reader splits text with GPT-2's regex whatever pre-tokenizer the file names, where
     llama.cpp applies the named one; for SmolLM2's `smollm`, which also splits off every numeric character, the two
     differ on non-ASCII numerals such as `½` after a space, so the probes hold none);
   - its logits on the check prompts must be within the tolerance of the merged model's:
         tol = (16 * u + 2^-13) * max |logit|,  u = 2^-11 (f16), 2^-8 (q8_0)
     (the merged export's rounding rule; q8_0 stores each block of 32 weights as 8-bit integers times one fp16
     scale, a rounding step of 2^-7 of the block's largest weight, at most half of it lost per weight);
     `--tolerance` replaces it. The share of positions with the same argmax is reported; where the merged model's
     top two logits are more than 2 * tol apart, the bound above already forces the same argmax;
   - its metadata must name the requested type and hold the training chat template.
   A failure removes everything; nothing is left at DIR.
5. DIR gets the GGUF, `chat_template.jinja` (the training template, also embedded in the GGUF), an Ollama
   `Modelfile` when the training prompt is ChatML (the format Ollama's Go template below reproduces), the run
   config, `basis_lite_export.json` and a README.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path, PurePosixPath

import torch

from ..config import Config, cache_root, save_config
from ..errors import ConfigError, ModelError
from ..model.downloads import LLAMA_CPP_CACHE_DIR, LLAMA_CPP_SDIST, pip_download
from ..runs.saved import ADAPTER_RUN_CONFIG, Target
from .check import (
    ABS_FLOOR,
    CHECK_PROMPTS,
    EXPORT_REPORT,
    FP32_NOISE_REL,
    ROUNDING_FACTOR,
    Staging,
    check_texts,
    logits,
    max_abs_diff,
    need_space,
    run_line,
)

log = logging.getLogger("basis_lite")

GGUF_TYPES = {"f16": 2.0 ** -11, "q8_0": 2.0 ** -8}  # type -> unit roundoff u of the tolerance rule
GGUF_FILE_TYPE = {"f16": 1, "q8_0": 7}  # general.file_type (llama.cpp's LLAMA_FTYPE_MOSTLY_F16 / _Q8_0)
GGUF_BYTES_PER_WEIGHT = {"f16": 2.0, "q8_0": 34 / 32}
CONVERTER_FILES = ("convert_hf_to_gguf.py", "LICENSE")
CONVERTER_DIRS = ("conversion/", "gguf-py/gguf/")
SDIST_ROOT = PurePosixPath("llama_cpp_python-0.3.36/vendor/llama.cpp")
PROBE_TEXTS = [
    "What is 17 + 25? Put the final answer in \\boxed{}.",
    "82 + 71 = 153\n\nThe answer is $\\boxed{153}$.",
    "  two  spaces,\ttab,\n\nnewlines;   and 3.14159 or 1,000,000 or -42 or 2^10 = 1024",
    "Tom's apples: he's got 3 ('three'), they're 'fine' -- isn't it?!",
    "Unicode: café, naïve, Straße, 東京, Привет, 😀 ✓",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
]


def gguf_tolerance(gguf_type: str, max_abs_logit: float) -> float:
    return (ROUNDING_FACTOR * GGUF_TYPES[gguf_type] + FP32_NOISE_REL) * max_abs_logit + ABS_FLOOR


# ----------------------------------------------------------------------------------------------------------------
# the converter: fetched once, cached


def llama_cpp_converter(cache_dir: str = "") -> Path:
    """The cached folder with llama.cpp's convert_hf_to_gguf.py, conversion/ and gguf-py/gguf/ (fetched on first use)."""
    target = cache_root(cache_dir) / LLAMA_CPP_CACHE_DIR
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s (once) into %s", LLAMA_CPP_SDIST.requirement, target)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".llama.cpp-") as tmp:
        sdist = pip_download(LLAMA_CPP_SDIST, tmp)
        out = Path(tmp) / "converter"
        extract_converter(sdist, out)
        if not target.exists():  # another process may have finished first
            os.replace(out, target)
    return target


def extract_converter(sdist: Path, out: Path) -> None:
    """Extract only the converter's Python files (and llama.cpp's license) from the sdist; regular files only, each
    path checked to stay inside `out`."""
    n = 0
    with tarfile.open(sdist, "r:gz") as tar:
        for m in tar.getmembers():
            p = PurePosixPath(m.name)
            if not m.isfile() or p.parts[:len(SDIST_ROOT.parts)] != SDIST_ROOT.parts:
                continue
            rel = PurePosixPath(*p.parts[len(SDIST_ROOT.parts):])
            if not (str(rel) in CONVERTER_FILES or any(str(rel).startswith(d) for d in CONVERTER_DIRS)):
                continue
            if ".." in rel.parts or rel.is_absolute():
                raise ModelError(f"{sdist}: unexpected path {m.name!r} in the converter's archive")
            dest = out / Path(*rel.parts)
            dest.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(m) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst)
            n += 1
    if not (out / "convert_hf_to_gguf.py").is_file() or not (out / "gguf-py" / "gguf" / "__init__.py").is_file():
        raise ModelError(f"{sdist}: llama.cpp's convert_hf_to_gguf.py or gguf-py not found in the archive "
                         f"({n} files extracted)")


def check_converter_requirements() -> None:
    missing = [m for m in ("sentencepiece",) if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"--gguf needs {', '.join(missing)} (llama.cpp's converter imports it): "
                          f"pip install 'basis-lite[gguf]'")


def convert(converter: Path, model_dir: Path, outfile: Path, gguf_type: str, model_name: str | None = None) -> str:
    """Run llama.cpp's converter on a transformers model folder; returns its log. ModelError when it fails.
    `model_name` becomes the GGUF's general.name (the converter otherwise takes the folder's name)."""
    driver = Path(__file__).with_name("converter.py")
    cmd = [sys.executable, str(driver), str(converter), str(model_dir), "--outfile", str(outfile),
           "--outtype", gguf_type]
    if model_name:
        cmd += ["--model-name", model_name]
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True)
    text = (res.stdout or "") + (res.stderr or "")
    if res.returncode != 0 or not outfile.is_file():
        raise ModelError(f"llama.cpp's converter failed (exit {res.returncode}) on {model_dir}:\n"
                         f"{text.strip()[-1500:]}")
    log.info("llama.cpp converter wrote %s (%.1f MB) in %.1fs", outfile.name, outfile.stat().st_size / 2**20,
             time.time() - t0)
    return text


# ----------------------------------------------------------------------------------------------------------------
# the self-check


def _tokenization_mismatch(ref_tok, gguf_tok, texts: list[str]) -> str | None:
    """The first text the two tokenizers encode (or decode back) differently, described; None when all agree."""
    for t in texts:
        a = ref_tok(t, add_special_tokens=False).input_ids
        b = gguf_tok(t, add_special_tokens=False).input_ids
        if a != b:
            i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return (f"{t[:80]!r}: {len(a)} tokens in the merged model, {len(b)} in the GGUF; first difference at "
                    f"token {i}: {ref_tok.convert_ids_to_tokens(a[i:i + 3])} vs "
                    f"{gguf_tok.convert_ids_to_tokens(b[i:i + 3])}")
        for skip in (False, True):
            x, y = ref_tok.decode(a, skip_special_tokens=skip), gguf_tok.decode(a, skip_special_tokens=skip)
            if x != y:
                return f"{t[:80]!r} decodes to {x[:80]!r} in the merged model and to {y[:80]!r} from the GGUF"
    return None


def self_check(merged_dir: Path, folder: Path, gguf_name: str, cfg: Config, gguf_type: str,
               tolerance: float | None, template: str, n_prompts: int = CHECK_PROMPTS) -> dict:
    """Compare the GGUF, reloaded by transformers, with the merged float32 model; ModelError on any failure."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..model.loading import gguf_metadata

    meta = gguf_metadata(folder / gguf_name, ["general.file_type", "general.name", "tokenizer.ggml.model",
                                              "tokenizer.ggml.pre", "tokenizer.chat_template"])
    if meta.get("general.file_type") != GGUF_FILE_TYPE[gguf_type]:
        raise ModelError(f"GGUF self-check FAILED: the file's type is {meta.get('general.file_type')}, expected "
                         f"{GGUF_FILE_TYPE[gguf_type]} ({gguf_type})")
    if meta.get("tokenizer.chat_template") != template:
        raise ModelError("GGUF self-check FAILED: the chat template in the file is not the one training used")

    ref_tok = AutoTokenizer.from_pretrained(str(merged_dir))
    # transformers ignores clean-up for BPE tokenizers and warns when it is on, as its GGUF loader sets it
    gguf_tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_name, clean_up_tokenization_spaces=False)
    texts = check_texts(cfg, ref_tok, n_prompts)
    bad = _tokenization_mismatch(ref_tok, gguf_tok, texts + PROBE_TEXTS)
    if bad:
        raise ModelError(f"GGUF self-check FAILED: the GGUF's tokenizer (as transformers reads it; llama.cpp reads "
                         f"the same vocabulary, merges and tokenizer type `{meta.get('tokenizer.ggml.model')}`) "
                         f"differs from the merged model's: {bad}")

    ids = [ref_tok(t, return_tensors="pt", add_special_tokens=False).input_ids[:, -cfg.model.max_seq_length:]
           for t in texts]
    ref_model = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32)
    ref = logits(ref_model, ids)
    del ref_model
    gguf_model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf_name, dtype=torch.float32)
    got = logits(gguf_model, ids)
    del gguf_model
    scale = max(float(r.abs().max()) for r in ref)
    tol = float(tolerance) if tolerance is not None else gguf_tolerance(gguf_type, scale)
    diff = max_abs_diff(ref, got)
    same = sum(int((r.argmax(-1) == g.argmax(-1)).sum()) for r, g in zip(ref, got) if r.shape == g.shape)
    positions = sum(x.shape[1] for x in ids)
    check = {"max_abs_diff": diff, "tolerance": tol,
             "tolerance_rule": "given with --tolerance" if tolerance is not None else
             f"({ROUNDING_FACTOR}*u + 2^-13) * max|logit|, u={GGUF_TYPES[gguf_type]:.3g} ({gguf_type})",
             "max_abs_logit": scale, "argmax_agreement": same / positions, "prompts": len(ids),
             "positions": positions, "tokenization_texts": len(texts) + len(PROBE_TEXTS),
             "tokenizer_model": meta.get("tokenizer.ggml.model"), "tokenizer_pre": meta.get("tokenizer.ggml.pre"),
             "general_name": meta.get("general.name")}
    if not diff <= tol:
        raise ModelError(f"GGUF self-check FAILED: the {gguf_type} GGUF's logits differ from the merged float32 "
                         f"model's by up to {diff:.4g} (tolerance {tol:.3g}, max |logit| {scale:.3g}; argmax agrees "
                         f"at {same}/{positions} positions). Try --gguf f16, or a larger --tolerance if that is "
                         f"the rounding of a very deep model")
    check["passed"] = True
    return check


# ----------------------------------------------------------------------------------------------------------------
# Ollama


def gguf_model_name(cfg: Config, target: Target) -> str:
    """general.name of the GGUF: the run folder's name, or for an adapter folder outside a run, the base model's
    name with "-basis-lite"."""
    if (target.run_dir / "config.yaml").is_file():
        return target.run_dir.name
    return cfg.model.name.replace("builtin:", "").rstrip("/").rsplit("/", 1)[-1] + "-basis-lite"


def ollama_modelfile(cfg: Config, tok, gguf_name: str) -> str | None:
    """A Modelfile whose Go template renders the training prompt, when that prompt is ChatML; None otherwise.

    Sampling is greedy (temperature 0), as `basis-lite eval` scores the model, so `ollama run` gives the answers
    eval_samples.jsonl holds (up to the GGUF's rounding) instead of Ollama's default sampling; the training
    temperature and top_p are written as a comment to switch to. num_ctx is model.max_seq_length (prompt +
    completion in training); the stop tokens are <|im_end|> and the tokenizer's end-of-sequence token."""
    from ..data import format_prompt

    system = (cfg.data.system_prompt or "").strip()
    question = "What is 17 + 25?"
    content = question + (" " + cfg.data.instruction.strip() if (cfg.data.instruction or "").strip() else "")
    chatml = ((f"<|im_start|>system\n{system}<|im_end|>\n" if system else "")
              + f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n")
    if format_prompt(tok, question, cfg.data) != chatml or '"""' in system:
        return None
    lines = [
        "# Ollama: ollama create NAME -f Modelfile && ollama run NAME",
        "# The template renders the prompt format training used (ChatML"
        + (", with the system message below)" if system else ", no system message)"),
        f"# Send the question plus `{cfg.data.instruction.strip()}` as the user message, as in training",
        f"FROM ./{gguf_name}",
        'TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}',
        "{{ .Content }}<|im_end|>",
        '{{ end }}<|im_start|>assistant',
        '"""',
    ]
    if system:
        lines.append(f'SYSTEM """{system}"""')
    g = cfg.generation
    lines += [f"# Greedy, as `basis-lite eval` scores the model. Training sampled at temperature {g.temperature:g}, "
              f"top_p {g.top_p:g}: set those to sample as training did",
              "PARAMETER temperature 0",
              f"PARAMETER num_ctx {int(cfg.model.max_seq_length)}"]
    stops = ["<|im_end|>"]
    eos = getattr(tok, "eos_token", None)
    if isinstance(eos, str) and eos and eos not in stops and '"' not in eos:
        stops.append(eos)
    lines += [f'PARAMETER stop "{t}"' for t in stops] + [""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# the export


def export_gguf(cfg: Config, target: Target, out: Path, gguf_type: str = "q8_0",
                tolerance: float | None = None, *, merge) -> dict:
    """Write the GGUF export of `target` to `out` (see the module docstring). `merge(cfg, target, folder,
    dtype_name="float32")` writes the checked fp32 merged model the converter reads (export.hf.export_merged)."""
    if gguf_type not in GGUF_TYPES:
        raise ConfigError(f"--gguf: {gguf_type!r} is not a supported type; accepted: {', '.join(GGUF_TYPES)}")
    check_converter_requirements()
    t0 = time.time()
    converter = llama_cpp_converter(cfg.model.cache_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.gguf-work-") as work:
        merged_dir = Path(work) / "merged"
        merged = merge(cfg, target, merged_dir, dtype_name="float32")
        n_params = merged["size_mb"] * 2**20 / 4
        need_space(out, int(n_params * GGUF_BYTES_PER_WEIGHT[gguf_type]) + (64 << 20))
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(merged_dir))
        template = tok.chat_template
        gguf_name = f"model-{gguf_type}.gguf"
        with Staging(out) as tmp:
            model_name = gguf_model_name(cfg, target)
            convert(converter, merged_dir, tmp / gguf_name, gguf_type, model_name)
            check = self_check(merged_dir, tmp, gguf_name, cfg, gguf_type, tolerance, template)
            (tmp / "chat_template.jinja").write_text(template)
            modelfile = ollama_modelfile(cfg, tok, gguf_name)
            if modelfile:
                (tmp / "Modelfile").write_text(modelfile)
            save_config(cfg, tmp / ADAPTER_RUN_CONFIG)
            if check["general_name"] != model_name:
                raise ModelError(f"GGUF self-check FAILED: general.name is {check['general_name']!r}, expected "
                                 f"{model_name!r}")
            report = {"kind": "gguf", "gguf_type": gguf_type, "file": gguf_name, "adapter": str(target.adapter),
                      "base_model": cfg.model.name, "converter": LLAMA_CPP_SDIST.requirement, "check": check,
                      "merge_check": merged["check"], "modelfile": bool(modelfile),
                      "size_mb": (tmp / gguf_name).stat().st_size / 2**20, "seconds": round(time.time() - t0, 1),
                      "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
            (tmp / EXPORT_REPORT).write_text(json.dumps(report, indent=2) + "\n")
            (tmp / "README.md").write_text(_gguf_readme(cfg, target, out, report))
    return report


def _gguf_readme(cfg: Config, target: Target, out: Path, report: dict) -> str:
    c, name = report["check"], report["file"]
    system = (cfg.data.system_prompt or "").strip()
    ollama = ("`ollama create NAME -f Modelfile && ollama run NAME` (the Modelfile's template renders the training "
              "prompt format" + (" with its system message" if system else ", without a system message") + ")"
              if report["modelfile"] else "no Modelfile was written: the training prompt is not ChatML, which is "
              "the only format this export writes an Ollama template for; give Ollama a TEMPLATE by hand")
    return f"""# GGUF (basis-lite export, {report['gguf_type']})

{run_line(cfg, target.run_dir)}

`{name}`: the LoRA adapter merged into a float32 copy of the base, converted by llama.cpp's own
`convert_hf_to_gguf.py` ({report['converter']}) to {report['gguf_type']}. The file embeds the tokenizer
(`{c['tokenizer_model']}`, pre-tokenizer `{c['tokenizer_pre']}`) and the chat template training used (also in
`chat_template.jinja`); it renders exactly the training prompts for a conversation without a system message.

- llama.cpp: `llama-cli -m {name} --jinja -cnv` (`--jinja` renders the embedded template) or
  `llama-server -m {name} --jinja`
- Ollama: {ollama}
- LM Studio: load `{name}`; it uses the embedded template

Send the question plus `{cfg.data.instruction}` as the user message, as in training.

## Self-check at export

Reloaded with transformers (`from_pretrained(..., gguf_file="{name}")`, float32) and compared with the merged
float32 model on {c['prompts']} chat-templated eval questions ({c['positions']} positions): max |logit diff|
{c['max_abs_diff']:.4g}, tolerance {c['tolerance']:.4g} ({c['tolerance_rule']}), max |logit| {c['max_abs_logit']:.4g};
the same argmax at {100 * c['argmax_agreement']:.1f}% of positions. The GGUF's tokenizer gave the same ids and text
as the merged model's on {c['tokenization_texts']} texts. Details in `{EXPORT_REPORT}`.
"""
