"""What both exporters share (export/hf.py: merged safetensors, export/gguf.py: GGUF): the logit self-check (its
tolerance rule, the check texts, logits and their largest difference), staged writing that never leaves a partial
export, the free-space check and the README's run line. The tolerance rule is explained in export/hf.py's docstring.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

import torch

from ..config import Config
from ..errors import ConfigError, DiskFullError
from ..safeio import fsync_dir, fsync_tree, open_file_modes, read_json

log = logging.getLogger("basis_lite")

UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}
ROUNDING_FACTOR = 16  # round-trip tolerance in units of u (measured 3.2u bf16 / 5.7u fp16 on SmolLM2-135M)
FP32_NOISE_REL = 2.0 ** -13  # fp32 summation-order noise allowance, relative to max |logit|
ABS_FLOOR = 1e-6  # keeps the tolerance positive for a model whose logits are all ~0
CHECK_PROMPTS = 4
EXPORT_REPORT = "basis_lite_export.json"
FALLBACK_QUESTIONS = [("What is $17 + 25$?", "42"), ("What is $9 \\times 7$?", "63"),
                      ("Solve for $x$: $3x + 4 = 19$.", "5"), ("What is $128 \\div 4$?", "32")]


def default_tolerance(dtype: torch.dtype, max_abs_logit: float) -> float:
    """Round-trip tolerance (absolute logits) for weights saved in `dtype`; see the module docstring."""
    return (ROUNDING_FACTOR * UNIT_ROUNDOFF[dtype] + FP32_NOISE_REL) * max_abs_logit + ABS_FLOOR


def merge_tolerance(max_abs_logit: float) -> float:
    """The fp32 merged model against base + adapter (fp32, unmerged): only summation order differs."""
    return FP32_NOISE_REL * max_abs_logit + ABS_FLOOR


def check_destination(out: Path) -> None:
    """Never write over anything, and fail before any work: --out must not exist or be an empty folder, must not
    be a symbolic link, and its parent folder must be creatable and writable (a probe file is created and removed
    there, as the export's temporary folder will be)."""
    if out.is_symlink():
        raise ConfigError(f"--out {out}: a symbolic link (to {os.readlink(out)}); the export folder is renamed into "
                          f"place, which a link would not follow: give the real path, or a new folder")
    if out.exists():
        if not out.is_dir():
            raise ConfigError(f"--out {out}: exists and is not a folder; choose a new folder")
        if any(out.iterdir()):
            raise ConfigError(f"--out {out}: folder exists and is not empty; basis-lite never writes over an "
                              f"export; choose a new folder or remove it first")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = out.parent / f".{out.name}.probe-{os.getpid()}"
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write there ({type(e).__name__}: {e.strerror or e}); choose a "
                          f"folder you can write") from None


# ----------------------------------------------------------------------------------------------------------------
# staging: write into a temp folder next to DIR, rename at the end, clean up on any failure


class Staging:
    """`with Staging(out) as tmp:` writes into a temp folder next to `out`, renamed to `out` at the end; removed on
    any failure (a full disk raises DiskFullError)."""

    def __init__(self, out: Path):
        self.out = out
        out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = out.parent / f".{out.name}.export-tmp-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> Path:
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:  # publish: the temp folder becomes `out`
            try:
                open_file_modes(self.tmp)  # weights 0644 like every other file (safetensors writes 0600)
                fsync_tree(self.tmp)
                check_destination(self.out)  # another process may have filled it meanwhile
                if self.out.exists():
                    self.out.rmdir()  # empty: checked above
                os.replace(self.tmp, self.out)
                fsync_dir(self.out.parent)
                return False
            except BaseException as e:
                exc = e
        shutil.rmtree(self.tmp, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise self._disk_full(exc) from None
        if exc_type is None:
            raise exc
        return False

    def _disk_full(self, exc: OSError) -> DiskFullError:
        return DiskFullError(f"no space left on the device while writing the export to {self.out} ({exc}); the "
                             f"partial export was removed. Free some space or choose --out on another disk")


def need_space(out: Path, nbytes: int) -> None:
    """DiskFullError unless `nbytes` fit on the disk that will hold `out`."""
    where = out.parent if out.parent.exists() else Path(".")
    free = shutil.disk_usage(where).free
    if free < nbytes:
        raise DiskFullError(f"not enough free space for the export in {where}: about "
                            f"{nbytes / 2**20:.0f} MB needed, {free / 2**20:.0f} MB free. Free some space or "
                            f"choose --out on another disk")


# ----------------------------------------------------------------------------------------------------------------
# the logit self-check


def check_texts(cfg: Config, tok, n: int = CHECK_PROMPTS) -> list[str]:
    """Chat-templated questions of the run's eval set with a boxed gold answer appended (the assistant side)."""
    from ..data import format_prompt, load_examples

    items: list[tuple[str, str]] = []
    try:
        items = [(ex.question, str(ex.answer)) for ex in load_examples(cfg.data, "eval")[:n]]
    except Exception as e:  # noqa: BLE001 - the check must not depend on the dataset being reachable here
        log.warning("self-check: cannot read the run's eval set (%s); using built-in arithmetic questions", e)
    if not items:
        items = FALLBACK_QUESTIONS[:n]
    return [format_prompt(tok, q, cfg.data) + f"The answer is \\boxed{{{a}}}." for q, a in items]


@torch.no_grad()
def logits(model, ids: list[torch.Tensor]) -> list[torch.Tensor]:
    model.eval()
    return [model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits[0].float() for x in ids]


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    d = 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape:
            return float("inf")
        diff = (x - y).abs()
        if not torch.isfinite(diff).all():
            return float("inf")
        d = max(d, float(diff.max()))
    return d


def run_line(cfg: Config, run_dir: Path) -> str:
    """The README line saying how the exported adapter was trained, with the held-out accuracy when known."""
    line = (f"Trained by basis-lite (RL from verifiable rewards, {cfg.estimator.name} baseline, one rollout per "
            f"prompt) on `{cfg.data.dataset}` for {cfg.train.steps} steps over the base model `{cfg.model.name}`"
            f"{' (4-bit NF4 while training)' if cfg.model.load_in_4bit else ''}. Run folder: `{run_dir}`.")
    summary = Path(run_dir) / "summary.json"
    try:
        s = read_json(summary, "summary.json")
        before, after = (s.get("eval_before") or {}), (s.get("eval_after") or {})
        if "accuracy" in after:
            line += (f"\n\nHeld-out greedy accuracy (n={after.get('n')}): "
                     f"{before.get('accuracy', float('nan')):.3f} before training, {after['accuracy']:.3f} after.")
    except (OSError, ValueError, TypeError, AttributeError, RecursionError):
        pass
    return line
