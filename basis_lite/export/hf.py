"""Export a run's adapter alone (peft format), or as a merged 16-bit model that checks itself (`basis-lite export`).

    export_run(run_dir, out)                  adapter + tokenizer + README (loads with PeftModel)
    export_run(run_dir, out, merged=True,     merged safetensors for plain transformers / vLLM
               dtype="auto", tolerance=None,  (dtype: auto | bfloat16 | float16 | float32; merge_into: trained |
               merge_into="trained")          original, for a run over a 4-bit base)
    export_run(run_dir, out, gguf="q8_0")     a GGUF for llama.cpp / Ollama / LM Studio (export/gguf.py)

Every export ships the chat template training used (`data.prompts.training_chat_template`), and adapter_config.json
names the run's model.name as the base (`builtin:...` resolves with `model.loading.resolve_model_path`).

Merged export, step by step (one function each; `export_merged` runs them):

1. `_base_for_merge`: the base's folder and config. A base folder that is itself stored pre-quantised is refused
   with a message.
2. `_trained_reference`: the model training produced, on the CPU in float32 compute: the adapter (peft) over the
   base as training held it, i.e. NF4 (bitsandbytes, double quantization, as `model.loading.load_base` loads it)
   when the run trained with model.load_in_4bit. Reference logits are taken on a few chat-templated questions of
   the run's own eval set (with a boxed answer appended, so assistant-side positions are covered too), and once
   more with the adapter disabled to report how much the adapter changes the model at all.
3. `_merged_model`: the adapter merged (`merge_and_unload`) into float32 weights, never into 4-bit ones (merging
   into NF4 re-quantises and loses the delta's small entries). Over a full-precision base: the trained model itself.
   Over a 4-bit base (`merge_into`, `--merge-into`): `trained` (the default) merges into a float32 copy of the base
   whose 4-bit layers hold their dequantised NF4 weights, the weights the adapter was trained against, so the result
   is the trained model; `original` merges into the base's original full-precision weights, a model the adapter
   never saw, and the report gives its measured gap to the trained model (max |logit diff|, argmax agreement). The
   merged fp32 model must reproduce its reference (the trained model; for `original`, base + adapter over the
   original weights) up to fp32 summation-order noise (MERGE check, relative tolerance 2^-13 of the largest
   |logit|). A wrong merge fails here, before anything is written.
4. `_rounded`: cast to 16-bit (bfloat16 by default; float16 when asked or when the base config's dtype is float16;
   never re-quantised), the rounded weights' logits kept, then `save_pretrained(..., safe_serialization=True)` with
   the tokenizer and chat template into a temporary folder next to DIR.
5. `_verify_saved`, the ROUND-TRIP check: the folder is reloaded with plain
   `AutoModelForCausalLM.from_pretrained(tmp, dtype=float32)` (no peft), its logits are compared with the reference
   and the largest absolute difference is printed. Above the tolerance the export fails (ModelError) and the
   temporary folder is removed. The reload must also reproduce the logits of the same rounded weights computed in
   memory before saving (expected: exactly; allowed: the MERGE tolerance), which catches a file that does not hold
   the merged model even when the adapter's effect is smaller than the rounding tolerance. The saved tensors must
   all be of the target dtype and hold no LoRA tensors.
6. The temporary folder is renamed to DIR. A failure anywhere (full disk included) leaves no DIR and no temp folder.

Tolerance of the round-trip check (absolute, in logits), by default

    tol = (16 * u + 2^-13) * max |reference logit|

where u is the unit roundoff of the saved dtype (2^-8 bfloat16, 2^-11 float16, 2^-24 float32): rounding a weight
to a p-bit significand perturbs it by at most u relative, and those perturbations add up through the layers into a
logit error proportional to the logit scale. Measured on SmolLM2-135M-Instruct (30 layers, a random r=16 LoRA
merged, weights rounded, fp32 compute) the error was 3.2u (bf16: 0.47 on max |logit| 37) and 5.7u (fp16), so 16u
leaves about 3x headroom for deeper models; 2^-13 covers fp32 summation-order noise (measured 4.5e-6 relative).
A missing, doubled or misscaled LoRA delta is caught by the much tighter MERGE check, and anything lost between
memory and disk by the exact reload comparison; the rounding tolerance bounds what the user finally gets.
`tolerance` (`--tolerance`) replaces the round-trip tolerance with an absolute number.
"""
from __future__ import annotations

import functools
import gc
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import Config, save_config
from ..errors import ConfigError, ModelError
from ..model.loading import resolve_model_path
from ..runs.saved import ADAPTER_RUN_CONFIG, Target, load_run_config, resolve_target
from ..safeio import sha256_file
from .check import (
    CHECK_PROMPTS,
    EXPORT_REPORT,
    ROUNDING_FACTOR,
    UNIT_ROUNDOFF,
    Staging,
    check_destination,
    check_texts,
    default_tolerance,
    logits,
    max_abs_diff,
    merge_tolerance,
    need_space,
    run_line,
)

log = logging.getLogger("basis_lite")

ADAPTER_FILES_SKIPPED = {"README.md", "eval.json", "eval_base.json"}  # peft's generic README is replaced by ours


# ----------------------------------------------------------------------------------------------------------------
# the entry point


def export_run(run_dir: str | Path, out: str | Path, merged: bool = False, dtype: str = "auto",
               tolerance: float | None = None, gguf: str | None = None, merge_into: str = "trained") -> dict:
    """Export a run's (or an adapter folder's) adapter to `out`: the adapter alone, or with `merged` a merged model
    in `dtype` that passed the self-check within `tolerance` (default: the rounding rule above), or with `gguf`
    (f16 | q8_0) a GGUF file for llama.cpp / Ollama / LM Studio (export/gguf.py). `merge_into` (merged and GGUF
    exports of a run over a 4-bit base): trained (the dequantised NF4 weights) or original (step 3 above).

    Returns the export report (also written to `out`/basis_lite_export.json) plus "out": the folder.
    """
    target = resolve_target(run_dir)
    if target.adapter is None:
        raise ConfigError(f"{target.path}: the run has no adapter yet (no adapter/ and no complete checkpoint); "
                          f"nothing to export")
    if tolerance is not None and not tolerance >= 0:
        raise ConfigError(f"--tolerance: expected a number >= 0 (max absolute logit difference), got {tolerance}")
    if gguf is not None:
        from .gguf import GGUF_TYPES

        if gguf not in GGUF_TYPES:
            raise ConfigError(f"--gguf: {gguf!r} is not a supported type; accepted: {', '.join(GGUF_TYPES)}")
        if merged or dtype != "auto":
            raise ConfigError("--gguf writes a GGUF file instead of a merged safetensors folder; drop --merged and "
                              "--dtype (the type is the value of --gguf)")
    if merge_into not in MERGE_INTO:
        raise ConfigError(f"--merge-into: {merge_into!r} is not accepted; choose one of {', '.join(MERGE_INTO)}")
    if merge_into != "trained" and not (merged or gguf):
        raise ConfigError("--merge-into applies to --merged and --gguf exports; the adapter export copies the adapter")
    out = Path(out).expanduser()
    check_destination(out)
    cfg = load_run_config(target)
    # threads only: the export computes on the CPU in float32 whatever device and dtype the run trained with
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if gguf is not None:
        from .gguf import export_gguf

        report = export_gguf(cfg, target, out, gguf, tolerance=tolerance,
                             merge=functools.partial(export_merged, merge_into=merge_into))
    elif merged:
        report = export_merged(cfg, target, out, dtype_name=dtype, tolerance=tolerance, merge_into=merge_into)
    else:
        if dtype != "auto" or tolerance is not None:
            log.warning("--dtype and --tolerance only apply with --merged; the adapter is copied as trained")
        report = export_adapter(cfg, target, out)
    return {**report, "out": str(out)}


# ----------------------------------------------------------------------------------------------------------------
# adapter export


def _load_base_tokenizer(base_path: str, cfg: Config | None = None):
    """The base tokenizer; with `cfg`, its chat template replaced by the one that renders the training prompts."""
    from transformers import AutoTokenizer

    from ..data.prompts import training_chat_template

    tok = AutoTokenizer.from_pretrained(base_path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if cfg is not None:
        tok.chat_template = training_chat_template(tok, cfg.data)
    return tok


BASE_DIR = "base"  # the built-in base model's folder inside an adapter export


def _portable_adapter_config(src: Path, dst: Path, name: str) -> None:
    """adapter_config.json with `base_model_name_or_path` set to `name`: the run's model.name, or for a built-in
    base the export's own `base` folder (adapters of older runs hold the absolute folder the base was loaded from
    on the training machine); every other key unchanged."""
    spec = json.loads(src.read_text())
    spec["base_model_name_or_path"] = name
    dst.write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")


def carries_base(cfg: Config) -> bool:
    """A built-in base exists only in basis-lite's cache (SmolLM2 dequantised from a Q4_1 GGUF, not the hub's
    weights): an adapter export carries it, so that stock loaders find it."""
    return cfg.model.name.startswith("builtin:")


def _verified_copy(src: Path, dst: Path) -> None:
    """Copy `src` to `dst` (with its metadata) and check the copy's sha256 against the original."""
    shutil.copy2(src, dst)
    if sha256_file(src) != sha256_file(dst):
        raise ModelError(f"copy of {src} to {dst} differs from the original; disk problem?")


def _copy_base(base_path: str, dst: Path, tok) -> list[str]:
    """The built-in base's model files (config, weights as stored, generation config) into `dst`, with the
    tokenizer and the training chat template; each copy verified."""
    dst.mkdir()
    names = []
    for p in sorted(Path(base_path).iterdir()):
        if p.is_file() and (p.suffix == ".safetensors" or p.name in ("config.json", "generation_config.json")
                            or p.name.endswith(".safetensors.index.json")):
            _verified_copy(p, dst / p.name)
            names.append(p.name)
    tok.save_pretrained(dst)
    return names


def check_adapter_finite(cfg: Config, target: Target, base_path: str, tok) -> None:
    """ModelError naming the adapter when base + adapter (float32, CPU) give non-finite logits on the check texts:
    an adapter blown up by a diverged update is never exported."""
    from transformers import AutoModelForCausalLM

    from ..model.loading import outputs_finite
    from ..runs.checkpoint import load_peft_adapter

    model = load_peft_adapter(AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32), target.adapter)
    finite = outputs_finite(model, tok, check_texts(cfg, tok, 2))
    del model
    if not finite:
        raise ModelError(f"adapter {target.adapter}: base + adapter give non-finite logits (NaN or inf): a diverged "
                         f"update blew it up; nothing was exported. Export a checkpoint from before it "
                         f"(RUN/checkpoints/step-N) or train again with a lower train.lr")


def export_adapter(cfg: Config, target: Target, out: Path) -> dict:
    """Copy the adapter (byte-identical, verified) with the base tokenizer and a README into `out`; for a built-in
    base also the base model itself into `out`/base, named by adapter_config.json (see `carries_base`). An adapter
    whose outputs are not finite is refused (`check_adapter_finite`)."""
    src = target.adapter
    files = [p for p in sorted(src.iterdir()) if p.is_file() and p.name not in ADAPTER_FILES_SKIPPED]
    base_path = resolve_model_path(cfg.model.name, cfg.model.cache_dir)
    tok = _load_base_tokenizer(base_path, cfg)
    check_adapter_finite(cfg, target, base_path, tok)
    with_base = carries_base(cfg)
    base_bytes = sum(p.stat().st_size for p in Path(base_path).iterdir() if p.is_file()) if with_base else 0
    need_space(out, sum(p.stat().st_size for p in files) + base_bytes + (32 << 20))
    with Staging(out) as tmp:
        base_files = _copy_base(base_path, tmp / BASE_DIR, tok) if with_base else []
        for p in files:
            if p.name == "adapter_config.json":
                _portable_adapter_config(p, tmp / p.name, BASE_DIR if with_base else cfg.model.name)
                continue
            _verified_copy(p, tmp / p.name)
        if not (tmp / ADAPTER_RUN_CONFIG).exists():
            save_config(cfg, tmp / ADAPTER_RUN_CONFIG)
        tok.save_pretrained(tmp)
        report = {"kind": "adapter", "adapter": str(src), "base_model": cfg.model.name, "base_path": base_path,
                  "files": [p.name for p in files], "base_dir": BASE_DIR if with_base else None,
                  "base_files": base_files, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (tmp / EXPORT_REPORT).write_text(json.dumps(report, indent=2) + "\n")
        (tmp / "README.md").write_text(_adapter_readme(cfg, target, out, base_path))
    return report


# ----------------------------------------------------------------------------------------------------------------
# merged export


def _target_dtype(name: str, base_config) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    declared = getattr(base_config, "dtype", None) or getattr(base_config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return torch.float16 if declared == torch.float16 else torch.bfloat16


def _merge_adapter(peft_model):
    """merge_and_unload with a NaN guard (a separate function: the tests corrupt it to prove the check fails)."""
    try:
        return peft_model.merge_and_unload(safe_merge=True)
    except ValueError as e:
        raise ModelError(f"merging the adapter produced non-finite weights ({e}); the adapter is broken") from None


def _save_model(model, tok, folder: Path) -> None:
    try:
        model.save_pretrained(folder, safe_serialization=True)
    except TypeError:  # a transformers without the argument: safetensors is its only format
        model.save_pretrained(folder)
    tok.save_pretrained(folder)


def _collect(n_params: int) -> None:
    """Free a dropped model's memory before the next one loads (a full gc pass costs ~0.5 s: big models only)."""
    if n_params > 50_000_000:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _saved_tensor_info(folder: Path) -> tuple[set[str], list[str]]:
    """(dtypes of floating tensors, names of any LoRA tensors) over the safetensors files of `folder`."""
    from safetensors import safe_open

    dtypes, lora = set(), []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                dt = sf.get_slice(k).get_dtype()
                if dt in ("BF16", "F16", "F32", "F64"):
                    dtypes.add(dt)
                if "lora_" in k:
                    lora.append(k)
    return dtypes, lora


SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


MERGE_INTO = ("trained", "original")


@dataclass
class _Reference:
    """What the merged model is checked against: the logits of the model training produced (the adapter over the
    base as training held it: NF4 for a 4-bit run) on the check texts, and that model (the merge starts from it)."""

    ids: list  # token ids of the check texts
    trained: list  # logits of the trained model: adapter on the base training used (fp32 compute)
    adapter_effect: float  # largest logit change the adapter makes to that base
    scale: float  # max |logit| of `trained`
    quantized: bool  # the base held 4-bit (NF4) layers
    what: str  # the trained model, in words (README and messages)
    model: object = None  # the trained model itself (peft), until the merge takes it


def _base_for_merge(cfg: Config) -> tuple[str, object]:
    """Step 1: the base's folder and config; ModelError for a base stored pre-quantised on disk."""
    from transformers import AutoConfig

    base_path = resolve_model_path(cfg.model.name, cfg.model.cache_dir)
    try:
        base_config = AutoConfig.from_pretrained(base_path)
    except OSError as e:
        raise ModelError(f"model.name: cannot read the base model config of {cfg.model.name!r} ({e}); the merged "
                         f"export needs the full-precision base model") from None
    quant = getattr(base_config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "quantized") if isinstance(quant, dict) else type(quant).__name__
        raise ModelError(f"the base {cfg.model.name!r} is stored pre-quantised ({method}); merging into quantised "
                         f"weights loses the adapter's precision. Point model.name at the full-precision model "
                         f"(--set model.name=...) and export again")
    return base_path, base_config


def _trained_reference(cfg: Config, target: Target, tok, n_prompts: int) -> _Reference:
    """Step 2: the trained model (the adapter on the base as training held it: NF4 for a 4-bit run; fp32 compute on
    the CPU) and its logits on the check texts, also with the adapter disabled (how much the adapter changes the
    model at all)."""
    from ..model.loading import bnb_available, load_base
    from ..runs.checkpoint import load_peft_adapter

    if cfg.model.load_in_4bit and not bnb_available():
        raise ModelError("the run trained over a 4-bit (NF4) base: exporting the model it trained needs "
                         "bitsandbytes (pip install 'basis-lite[gpu]'); or pass --merge-into original to merge "
                         "into the full-precision weights instead")
    model = load_peft_adapter(load_base(cfg, torch.device("cpu"), torch.float32), target.adapter)
    model.eval()
    texts = check_texts(cfg, tok, n_prompts)
    max_len = cfg.model.max_seq_length
    ids = [tok(t, return_tensors="pt", add_special_tokens=False).input_ids[:, -max_len:] for t in texts]
    trained = logits(model, ids)
    with model.disable_adapter():
        effect = max_abs_diff(trained, logits(model, ids))
    quantized = bool(cfg.model.load_in_4bit)
    what = "the NF4 base + adapter (fp32 compute)" if quantized else "base + adapter (fp32)"
    return _Reference(ids, trained, effect, max(float(r.abs().max()) for r in trained), quantized, what, model)


def _merged_model(cfg: Config, target: Target, base_path: str, ref: _Reference, merge_into: str):
    """Step 3: the adapter merged in float32. Over a full-precision base: into the trained model itself. Over a
    4-bit one: into a float32 copy of the base whose 4-bit layers hold the dequantised weights training computed
    with (merge_into trained), or the base's original weights (original). Returns (merged model, the logits it must
    reproduce, their label, the merge error, the gap to the trained model or None): merged into the trained
    weights it must reproduce the trained model; into the original weights, base + adapter over those, and the gap
    to the trained model is measured for the report."""
    from transformers import AutoModelForCausalLM

    from ..model.loading import dequantized_weights
    from ..runs.checkpoint import load_peft_adapter

    model, ref.model = ref.model, None
    expect, label = ref.trained, ref.what
    if ref.quantized:
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)  # full precision, CPU
        if merge_into == "trained":
            modules = dict(base.named_modules())
            with torch.no_grad():
                for name, w in dequantized_weights(model):  # one layer at a time
                    modules[name].weight.copy_(w.view_as(modules[name].weight))
        del model
        model = load_peft_adapter(base, target.adapter)
        model.eval()
        if merge_into == "original":
            log.info("merging into the base's original full-precision weights, not the NF4 weights the adapter "
                     "was trained against")
            expect, label = logits(model, ref.ids), "base + adapter over the original weights (fp32)"
    merged = _merge_adapter(model)
    got = logits(merged, ref.ids)
    merge_err = max_abs_diff(expect, got)
    merge_tol = merge_tolerance(ref.scale)
    log.info("merge check (fp32): max |logit diff| %.3g (tolerance %.3g)", merge_err, merge_tol)
    if not merge_err <= merge_tol:
        raise ModelError(f"export self-check FAILED before writing: the merged fp32 model differs from {label} by up "
                         f"to {merge_err:.4g} logits (allowed {merge_tol:.3g}, fp32 noise only). The merge is wrong "
                         f"(an adapter the merge does not support, e.g. LoRA on tied embeddings?); use the adapter "
                         f"export instead (without --merged)")
    gap = None
    if ref.quantized and merge_into == "original":
        gap = {"max_abs_diff": max_abs_diff(ref.trained, got), "argmax_agreement": _argmax_agreement(ref.trained, got)}
    return merged, expect, label, merge_err, gap


def _argmax_agreement(a: list, b: list) -> float:
    same = sum(int((x.argmax(-1) == y.argmax(-1)).sum()) for x, y in zip(a, b))
    return same / max(1, sum(x.shape[0] for x in a))


def _rounded(merged, dtype: torch.dtype, ids: list) -> list:
    """Step 4 (in memory): the weights exactly as they will be stored, computed in fp32: what the reloaded folder
    must reproduce (parameters only: non-persistent buffers such as rotary frequencies are recomputed in fp32 on
    reload). Leaves `merged` in `dtype`."""
    for p in merged.parameters():
        p.data = p.data.to(dtype).to(torch.float32)  # rounding happens in the first cast; the second is exact
    out = logits(merged, ids)
    merged.to(dtype)
    if hasattr(merged.config, "quantization_config"):
        del merged.config.quantization_config
    return out


def _verify_saved(tmp: Path, dtype: torch.dtype, expect: list, rounded: list, ids: list, tol: float,
                  merge_tol: float, n_params: int) -> tuple[float, float]:
    """Step 5: the folder as written: every tensor in `dtype`, no LoRA tensors, and reloaded with plain transformers
    its logits within `tol` of `expect` and equal (up to `merge_tol`) to the rounded weights' in memory. Returns
    (max |logit diff| to `expect`, to the rounded weights)."""
    from transformers import AutoModelForCausalLM

    dtypes, lora_keys = _saved_tensor_info(tmp)
    if not dtypes:
        raise ModelError(f"export self-check FAILED: no safetensors weights were written to {tmp}")
    if lora_keys:
        raise ModelError(f"export self-check FAILED: the merged weights still hold LoRA tensors ({lora_keys[:3]}...)")
    if dtypes != {SAFETENSORS_DTYPE[dtype]}:
        raise ModelError(f"export self-check FAILED: weights saved as {sorted(dtypes)}, expected "
                         f"{SAFETENSORS_DTYPE[dtype]}")
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)  # plain transformers
    got = logits(reloaded, ids)
    del reloaded
    _collect(n_params)
    return max_abs_diff(expect, got), max_abs_diff(rounded, got)


def export_merged(cfg: Config, target: Target, out: Path, dtype_name: str = "auto",
                  tolerance: float | None = None, n_prompts: int = CHECK_PROMPTS, merge_into: str = "trained") -> dict:
    """The merged export, in the steps of this module's docstring. `merge_into`: trained (the weights the adapter
    was trained against: the dequantised NF4 weights of a 4-bit run) or original (the base's full-precision
    weights; for a 4-bit run the report gives the measured gap to the trained model)."""
    if merge_into not in MERGE_INTO:
        raise ConfigError(f"--merge-into: {merge_into!r} is not accepted; choose one of {', '.join(MERGE_INTO)}")
    t0 = time.time()
    base_path, base_config = _base_for_merge(cfg)
    dtype = _target_dtype(dtype_name, base_config)
    tok = _load_base_tokenizer(base_path, cfg)  # with the chat template that renders the training prompts
    ref = _trained_reference(cfg, target, tok, n_prompts)
    merged, expect, label, merge_err, gap = _merged_model(cfg, target, base_path, ref, merge_into)
    merge_tol = merge_tolerance(ref.scale)
    tol = float(tolerance) if tolerance is not None else default_tolerance(dtype, ref.scale)
    # an adapter whose effect is below `tol` would pass the comparison with the reference even if it were lost on
    # the way to disk; the fp32 merge check above and the exact reload check below still see that
    log.info("adapter effect on the logits: %.3g (round-trip tolerance %.3g)", ref.adapter_effect, tol)
    rounded = _rounded(merged, dtype, ref.ids)
    rounding_err = max_abs_diff(expect, rounded)
    n_params = sum(p.numel() for p in merged.parameters())
    need_space(out, n_params * torch.tensor([], dtype=dtype).element_size() + (64 << 20))

    with Staging(out) as tmp:  # step 6: renamed to `out` only when every check passed
        _save_model(merged, tok, tmp)
        del merged
        _collect(n_params)
        diff, roundtrip_err = _verify_saved(tmp, dtype, expect, rounded, ref.ids, tol, merge_tol, n_params)
        check = {"max_abs_diff": diff, "tolerance": tol, "tolerance_rule": "given with --tolerance"
                 if tolerance is not None else f"({ROUNDING_FACTOR}*u + 2^-13) * max|logit|, "
                 f"u={UNIT_ROUNDOFF[dtype]:.3g}", "max_abs_logit": ref.scale, "merge_max_abs_diff": merge_err,
                 "merge_tolerance": merge_tol, "rounding_max_abs_diff": rounding_err,
                 "roundtrip_max_abs_diff": roundtrip_err, "roundtrip_tolerance": merge_tol,
                 "adapter_effect": ref.adapter_effect, "saved_dtype": SAFETENSORS_DTYPE[dtype], "prompts": len(ref.ids),
                 "positions": sum(x.shape[1] for x in ref.ids), "reference": label,
                 "merged_into": (merge_into if ref.quantized else "trained (a full-precision base: the original "
                                                                   "weights)")}
        if gap is not None:
            check["gap_to_trained"] = gap
        if not diff <= tol:
            raise ModelError(f"export self-check FAILED: the saved model's logits differ from {label} by up to "
                             f"{diff:.4g} (tolerance {tol:.3g}, max |logit| {ref.scale:.3g}; rounding to "
                             f"{SAFETENSORS_DTYPE[dtype]} alone accounts for {rounding_err:.3g}); nothing was "
                             f"written to {out}. If that is rounding (a very deep model), retry with "
                             f"--dtype float32 or a larger --tolerance")
        if not roundtrip_err <= merge_tol:
            raise ModelError(f"export self-check FAILED: the reloaded folder differs from the weights that were "
                             f"saved by up to {roundtrip_err:.4g} logits (allowed {merge_tol:.3g}, expected 0): "
                             f"the saved files do not hold the merged model; nothing was written to {out}")
        check["passed"] = True
        save_config(cfg, tmp / ADAPTER_RUN_CONFIG)
        size = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
        report = {"kind": "merged", "adapter": str(target.adapter), "base_model": cfg.model.name,
                  "base_path": base_path, "dtype": str(dtype).replace("torch.", ""), "check": check,
                  "size_mb": size / 2**20, "seconds": round(time.time() - t0, 1),
                  "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (tmp / EXPORT_REPORT).write_text(json.dumps(report, indent=2) + "\n")
        (tmp / "README.md").write_text(_merged_readme(cfg, target, out, report))
    return report


# ----------------------------------------------------------------------------------------------------------------
# READMEs


def _prompt_note(cfg: Config) -> str:
    sys_note = (f"the system message `{cfg.data.system_prompt}`" if cfg.data.system_prompt.strip()
                else "no system message (a default system turn the base template inserts, if any, was removed)")
    answer = ("the answer is read from the last `\\boxed{...}`" if cfg.reward.require_boxed else
              "the answer is read by math-verify from the whole completion (its last number when nothing is boxed)")
    return (f"Prompts in training were the base's chat template with {sys_note}, and the user message "
            f"`<question> {cfg.data.instruction}`; {answer}. The chat template shipped here (`chat_template.jinja`) "
            f"renders exactly those prompts, byte for byte, for a conversation without a system message: send the "
            f"question plus the instruction as the user message.")


def _base_loader(cfg: Config, out: Path) -> str:
    """The line of a README snippet that loads the base model named in adapter_config.json."""
    if carries_base(cfg):
        return f"base = AutoModelForCausalLM.from_pretrained(\"{out / BASE_DIR}\", dtype=\"auto\")"
    return f"base = AutoModelForCausalLM.from_pretrained({cfg.model.name!r}, dtype=\"auto\")"


def _base_note(cfg: Config) -> str:
    name = cfg.model.name
    if carries_base(cfg):
        return (f"The base is the built-in `{name}`, which exists only in basis-lite's cache (not the hub's "
                f"weights), so it is included: `{BASE_DIR}/` holds it as a plain transformers folder (weights as "
                f"trained over, tokenizer with the training chat template), and `base_model_name_or_path` in "
                f"adapter_config.json is `{BASE_DIR}`, a path relative to the working directory: "
                f"`AutoPeftModelForCausalLM.from_pretrained(\".\")` works from inside this folder; from anywhere "
                f"else load `{BASE_DIR}/` first, as below. vLLM: `LLM(model=\"<this folder>/{BASE_DIR}\", "
                f"enable_lora=True)` with `LoRARequest(\"adapter\", 1, \"<this folder>\")`.")
    return (f"`base_model_name_or_path` in adapter_config.json is the run's `model.name`, `{name}`: a hub id or "
            f"folder that loads as it is.")


def _generate_snippet(cfg: Config, out: Path) -> str:
    """The lines both export READMEs share: tokenizer, one chat-templated question, generate, decode."""
    question = repr(("What is 17 + 25? " + (cfg.data.instruction or "")).strip())
    return f"""tok = AutoTokenizer.from_pretrained("{out}")
messages = [{{"role": "user", "content": {question}}}]
inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**inputs, max_new_tokens=64)
print(tok.decode(out[0][inputs["input_ids"].shape[1]:], skip_special_tokens=True))"""


def _adapter_readme(cfg: Config, target: Target, out: Path, base_path: str) -> str:
    return f"""# LoRA adapter (basis-lite export)

{run_line(cfg, target.run_dir)}

This folder holds the adapter in peft format (`adapter_config.json`, `adapter_model.safetensors`), the base
model's tokenizer with the chat template training used, and the basis-lite run config (`{ADAPTER_RUN_CONFIG}`).
{_base_note(cfg)}

## Load

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

{_base_loader(cfg, out)}
model = PeftModel.from_pretrained(base, "{out}")
{_generate_snippet(cfg, out)}
```

{_prompt_note(cfg)}

The base may also be loaded in 4-bit (`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`) for
inference. For a single merged model that needs neither peft nor the base: `basis-lite export {target.path} --out
DIR --merged`. Evaluate with `basis-lite eval {out}`.
"""


def _merged_readme(cfg: Config, target: Target, out: Path, report: dict) -> str:
    c = report["check"]
    if c["merged_into"] == "trained" and cfg.model.load_in_4bit:
        into = ("a float32 copy of the base holding the dequantised NF4 weights the adapter was trained against (the "
                "model training produced, not the original weights)")
    elif c["merged_into"] == "original":
        gap = c["gap_to_trained"]
        into = (f"a float32 copy of the base's ORIGINAL full-precision weights (`--merge-into original`); the run "
                f"trained over NF4 weights, and this model differs from the trained one (NF4 base + adapter) by up "
                f"to {gap['max_abs_diff']:.4g} logits, same argmax at {100 * gap['argmax_agreement']:.1f}% of the "
                f"positions")
    else:
        into = "a float32 copy of the base"
    return f"""# Merged model (basis-lite export)

{run_line(cfg, target.run_dir)}

The LoRA adapter `{target.adapter}` was merged into {into}, and saved as {report['dtype']} safetensors with the base
tokenizer and the chat template training used. It loads in plain transformers or vLLM; no peft needed.

## Load

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{out}", dtype="auto")
{_generate_snippet(cfg, out)}
```

vLLM: `vllm serve {out}` or `vllm.LLM(model="{out}")`.

{_prompt_note(cfg)}

## Self-check at export

Reloaded with `AutoModelForCausalLM.from_pretrained` (float32 compute) and compared with {c['reference']},
unmerged, on {c['prompts']} chat-templated eval questions ({c['positions']} positions): max |logit diff|
{c['max_abs_diff']:.4g}, tolerance {c['tolerance']:.4g} ({c['tolerance_rule']}), max |logit| {c['max_abs_logit']:.4g}.
The merged float32 model before rounding differed by {c['merge_max_abs_diff']:.3g}. Details in `{EXPORT_REPORT}`.
"""
