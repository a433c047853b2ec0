"""What every benchmark result records about where it was measured: the git commit, the CPU and its flags.

    from provenance import provenance      # bench/ scripts put bench/ on sys.path by running from it
    info = provenance()                    # {"git_commit", "git_dirty", "cpu_model", "cpu_flags", "cores", ...}

CPU flags that decide speed are listed explicitly (without avx512_bf16/amx_bf16, bf16 matmuls are emulated and many
times slower than fp32), so a timing is never quoted without the kind of machine it came from.
"""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_info() -> dict:
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("unknown", "", platform.machine()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags.update(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu_model": model, "cpu_flags": {f: f in flags for f in SPEED_FLAGS}, "cores": os.cpu_count()}


def provenance() -> dict:
    info = {"git_commit": _git("rev-parse", "HEAD") or "unknown",
            "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "python": platform.python_version(), **cpu_info()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


def flags_line(info: dict) -> str:
    """'AMD EPYC, 2 cores; avx2 fma, no avx512f avx512_bf16 ...' for tables and READMEs."""
    have = [f for f, v in info["cpu_flags"].items() if v]
    lack = [f for f, v in info["cpu_flags"].items() if not v]
    return (f"{info['cpu_model']}, {info['cores']} cores; flags: {' '.join(have) or '-'}"
            + (f"; without {' '.join(lack)}" if lack else ""))
