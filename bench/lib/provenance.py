"""Where a result was measured: the one machine record every bench script writes beside its numbers.

    from bench.lib.provenance import machine_record, with_load_after
    machine = machine_record()             # at the start: the load average is read here (loadavg_before)
    ...                                    # measure
    machine = with_load_after(machine)     # at the end: loadavg_after

Fields: git_commit and git_dirty (tracked files changed), python, platform, cpu_model, cpu_flags (each of
SPEED_FLAGS true or false), cores (os.cpu_count), cpus_usable (this process's CPU affinity), torch, torch_threads,
torch_cpu_capability (absent without torch), the version of each of `packages` (None when not installed), env
(each variable of MEASURE_ENV that is set: kernel caps, thread counts, allocator settings; LD_PRELOAD as file
names only), loadavg_before (1/5/15 min) and, after with_load_after, loadavg_after. The CPU model and flags come
from lscpu, else /proc/cpuinfo. The flags that decide speed are listed explicitly (without avx512_bf16/amx_bf16,
bf16 matmuls are emulated and many times slower than fp32), so a timing is never quoted without the kind of machine
it ran on.
"""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from bench.lib.paths import REPO

SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
PACKAGES = ("transformers", "peft")
# variables that change what a bench measures without changing its code: the kernel level of torch, oneDNN and MKL,
# thread counts, glibc's allocator, a preloaded allocator, torch's and oneDNN's caches
MEASURE_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
               "OMP_NUM_THREADS", "MKL_NUM_THREADS", "MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_",
               "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD", "LRU_CACHE_CAPACITY",
               "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def parse_cpu_flags(text: str) -> dict[str, bool]:
    """{flag: present} for SPEED_FLAGS, from lscpu's output ("Flags:") or /proc/cpuinfo ("flags")."""
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, val = line.partition(":")
        if key.strip() in ("flags", "Flags"):
            flags |= set(val.split())
    return {f: f in flags for f in SPEED_FLAGS}


def parse_cpu_model(text: str) -> str | None:
    """The CPU model from lscpu's output ("Model name:") or /proc/cpuinfo ("model name"); None if neither says."""
    for line in text.splitlines():
        key, _, val = line.partition(":")
        if key.strip() in ("model name", "Model name") and val.strip():
            return val.strip()
    return None


def _lscpu() -> str:
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_info() -> dict:
    """cpu_model, cpu_flags, cores, cpus_usable."""
    text = _lscpu()
    if parse_cpu_model(text) is None or not any(parse_cpu_flags(text).values()):
        text = _cpuinfo()
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {"cpu_model": parse_cpu_model(text) or platform.processor() or "unknown",
            "cpu_flags": parse_cpu_flags(text), "cores": os.cpu_count(), "cpus_usable": usable}


def _git(*args: str, repo=REPO) -> str:
    try:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def git_commit(repo=REPO) -> str:
    """The commit checked out in `repo` (this one); "unknown" outside a checkout."""
    return _git("rev-parse", "HEAD", repo=repo) or "unknown"


def git_state(repo=REPO) -> dict:
    """git_commit ("unknown" outside a checkout) and git_dirty (tracked files changed) of `repo` (this one)."""
    return {"git_commit": git_commit(repo),
            "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no", repo=repo))}


def git_diff_sha256(repo=REPO) -> str:
    """sha256 of `git diff HEAD` (the uncommitted changes to tracked files): runs of a dirty tree with the same
    value ran the same code."""
    import hashlib

    return hashlib.sha256(_git("diff", "HEAD", repo=repo).encode()).hexdigest()


def git_changed_files(old: str = "HEAD", new: str | None = None, repo=REPO) -> list[str] | None:
    """Tracked files that differ between commit `old` and commit `new` (None: the working tree); None when `old`
    is not a commit of this checkout."""
    if not _git("rev-parse", "--verify", "-q", f"{old}^{{commit}}", repo=repo):
        return None
    return _git("diff", "--name-only", old, *([new] if new else []), repo=repo).splitlines()


def loadavg() -> list[float] | None:
    """The 1/5/15-minute load average, rounded; None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def machine_record(packages=PACKAGES) -> dict:
    """The machine record (see the module docstring); torch is imported for its version and thread count."""
    info = {**git_state(), "python": platform.python_version(), "platform": platform.platform(), **cpu_info()}
    try:
        import torch

        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                    torch_cpu_capability=torch.backends.cpu.get_cpu_capability())
    except ImportError:
        pass
    info.update({name: package_version(name) for name in packages})
    info["env"] = measurement_env()
    info["loadavg_before"] = loadavg()
    return info


def measurement_env(environ=None) -> dict[str, str]:
    """The MEASURE_ENV variables set in `environ` (default os.environ); LD_PRELOAD keeps file names, not paths."""
    environ = os.environ if environ is None else environ
    env = {k: environ[k] for k in MEASURE_ENV if k in environ}
    if "LD_PRELOAD" in env:
        env["LD_PRELOAD"] = " ".join(Path(p).name for p in env["LD_PRELOAD"].replace(":", " ").split())
    return env


def with_load_after(record: dict) -> dict:
    """The record with loadavg_after: the load average now, at the end of what it measured."""
    return {**record, "loadavg_after": loadavg()}


def flags_line(info: dict) -> str:
    """'AMD EPYC, 2 cores; flags: avx2 fma; without avx512f ...' for tables and READMEs. Reads the keys of older
    records too (cpu, cpu_count, flags), which the committed results of earlier runs hold."""
    flags = info.get("cpu_flags") or info.get("flags") or {}
    have = [f for f, v in flags.items() if v]
    lack = [f for f, v in flags.items() if not v]
    model = info.get("cpu_model") or info.get("cpu") or "?"
    cores = info.get("cores") or info.get("cpu_count") or "?"
    return f"{model}, {cores} cores; flags: {' '.join(have) or '-'}" + (f"; without {' '.join(lack)}" if lack else "")


def header_lines(record: dict, command: str, threads, setting: str = "") -> list[str]:
    """The machine lines a bench's markdown opens with: CPU and flags; torch, threads (and `setting`, e.g. the
    dtype) and the commit; the command and the load average before and after."""
    dirty = " plus uncommitted changes" if record.get("git_dirty") else ""
    return [f"- CPU: {flags_line(record)}",
            f"- torch {record.get('torch')}, {threads} threads{setting}; git {record['git_commit'][:12]}{dirty}",
            f"- command: `{command}`; load average before / after: {record.get('loadavg_before')} / "
            f"{record.get('loadavg_after')}"]
