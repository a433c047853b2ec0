"""Files a run writes and reads, safely: atomic writes, full disks recognised, one writer per run folder, pinned
readers, paths that stay inside a folder, and a pickle-free format for nested state. Torch-free.

    sha256_file(path)                       hex sha256, read in chunks
    atomic_write_text(path, text) / atomic_write_bytes(path, data)   temp file + fsync + rename + fsync of the folder
    publish_dir(tmp, final)                 fsync a finished folder, then rename it into place (replacing `final`)
    open_file_modes(folder)                 files below `folder` get the umask's mode (0644 by default), not 0600
    is_disk_full(exc, path)                 ENOSPC/EDQUOT, whichever layer raised it (also re-wrapped by C++ code)
    RunLock(run_dir).acquire()              exclusive flock on RUN_DIR/.lock; a second writer gets ConfigError
    pin_fd(path)                            a shared flock that keeps a checkpoint from being pruned while read
    inside(base, path)                      True when `path` resolves inside `base`
    check_run_folder(run_dir)               ConfigError when a symlink in a run folder leads out of it
    read_regular(path, limit, what)         the bytes of a regular file, at most `limit`; ValueError for a FIFO, a
                                            device or a folder (checked on the file opened without blocking)
    open_regular(path, what)                the same check, the file opened for reading line by line
    read_json(path, what)                   JSON of a small file, nesting bounded, ValueError on anything bad
    pack_state(obj) -> (json_tree, arrays)  nested dicts/lists/tuples/ndarrays -> JSON + a flat {name: ndarray}
    unpack_state(json_tree, arrays)         the inverse; nothing in it can run code

The run lock uses flock(2): the kernel drops it when the holding process dies however it dies, so a lock left by a
killed run is free again and the next writer takes it over without any clean-up. The PID written into the lock
file only names the holder in the error message.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import time
from pathlib import Path

from .errors import ConfigError, DiskFullError

LOCK_FILE = ".lock"
# a write that failed on a filesystem with less than this left is reported as a full disk, whatever the exception
# (torch's and other C++ writers turn ENOSPC into `RuntimeError: basic_ios::clear: iostream error`)
LOW_SPACE_BYTES = 1 << 20


# ----------------------------------------------------------------------------------------------------------------
# atomic writes


def fsync_dir(path: Path) -> None:
    """fsync a folder entry (best effort: some filesystems refuse it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file and folder below `path`, so a rename that publishes it is durable."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))


def sha256_file(path: str | os.PathLike) -> str:
    """The hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that a reader sees the old file or the whole new one, never a part of it. The
    temporary file is created anew (a link planted under its name is replaced, never followed) and removed when the
    write fails (a full disk leaves no `.NAME.tmp-PID` behind)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def open_file_modes(folder: str | os.PathLike) -> None:
    """Give every file below `folder` the mode a plain open() gets under the current umask (0644 with umask 022),
    and `folder` and its subfolders the mode of a plain mkdir (0755). safetensors writes its files through a private
    temporary file, so weights came out 0600 beside 0644 files (and mkdtemp folders are 0700)."""
    mask = os.umask(0o022)
    os.umask(mask)
    for root, _dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def publish_dir(tmp: Path, final: Path) -> None:
    """fsync the finished folder `tmp` and rename it to `final`; an existing `final` is replaced only after the new
    folder is complete on disk (moved aside, then removed), so a crash leaves one whole version under some name.
    Its files get the umask's mode (`open_file_modes`)."""
    open_file_modes(tmp)
    fsync_tree(tmp)
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def free_bytes(path: str | os.PathLike) -> int | None:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def is_disk_full(e: BaseException | None, path: str | os.PathLike | None = None) -> bool:
    """True for ENOSPC/EDQUOT anywhere in the cause chain, or for a failed write (OSError/RuntimeError) where the
    filesystem of `path` has almost no space left (C++ writers hide the errno)."""
    first = e
    for _ in range(8):  # a bounded walk down the cause chain
        if e is None:
            break
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(s in str(e) for s in ("No space left on device", "StorageFull", "Disk quota exceeded")):
            return True
        e = e.__cause__ or e.__context__
    if path is not None and isinstance(first, (OSError, RuntimeError)):
        free = free_bytes(path)
        return free is not None and free < LOW_SPACE_BYTES
    return False


def disk_full_error(what: str, path: str | os.PathLike, e: BaseException, kept: str = "") -> DiskFullError:
    where = Path(path)
    free = free_bytes(where)
    left = f"{free / 2**20:.1f} MiB left" if free is not None else "free space unknown"
    return DiskFullError(f"no space left on the disk while writing {what} ({where}; {left}; {type(e).__name__}: "
                         f"{e}). {kept}".strip())


# ----------------------------------------------------------------------------------------------------------------
# one writer per run folder, readers pin what they read


class RunLock:
    """An exclusive lock on a run folder for the lifetime of a training process (flock on RUN_DIR/.lock)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(f"run folder {self.run_dir} is in use by another basis-lite process ({holder}); "
                              f"one run folder takes one writer: wait for it to finish, stop it, or choose "
                              f"another --output") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        os.fsync(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "PID unknown"


def held_by_other(run_dir: str | os.PathLike) -> str | None:
    """The holder's line when another process holds RUN_DIR's lock, else None (nothing is created)."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO planted as .lock must not block
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_holder(fd)
    finally:
        os.close(fd)  # closing drops the probe lock
    return None


def pin_fd(path: str | os.PathLike) -> int | None:
    """A shared flock on `path` held until the returned fd is closed (or the process ends); None when `path` is
    gone (pruned between finding and pinning it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)
    if not Path(path).exists():
        os.close(fd)
        return None
    return fd


def try_exclusive(path: str | os.PathLike) -> int | None:
    """An exclusive, non-blocking flock on `path`: the fd (close it to release) or None when a reader holds it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def inside(base: str | os.PathLike, path: str | os.PathLike) -> bool:
    """True when `path` (symlinks resolved) lies inside `base`."""
    try:
        Path(path).resolve().relative_to(Path(base).resolve())
    except (ValueError, OSError, RuntimeError):  # RuntimeError: a symlink loop
        return False
    return True


def check_run_folder(run_dir: str | os.PathLike) -> None:
    """ConfigError when anything in the run folder `run_dir` is a symlink that resolves outside it (or a loop):
    every file a command reads from or writes to a run folder then lies inside it, whatever the links (a
    `checkpoints/` linked into another run would otherwise be resumed from, saved into and pruned)."""
    base = Path(run_dir)
    if not base.is_dir():
        return
    root = base.resolve()
    for folder, dirs, files in os.walk(base):  # links are not followed: each one is checked where it is
        for name in dirs + files:
            p = Path(folder) / name
            if p.is_symlink() and not inside(root, p):
                try:
                    where = os.readlink(p)
                except OSError:
                    where = "?"
                raise ConfigError(f"{p} is a symbolic link to {where}, outside the run folder {base}: basis-lite "
                                  f"reads and writes a run folder's files only inside it. Replace the link by a "
                                  f"copy of what it points at, or remove it")


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def open_regular(path: str | os.PathLike, what: str = ""):
    """`path` opened for reading (binary) when it is a regular file; ValueError (one line naming `what` or the file)
    when it cannot be opened or is anything else: a FIFO, a device, a folder, a socket. The file is opened without
    blocking (a FIFO with no writer would block an ordinary open) and checked on the open descriptor, so what is
    checked is what is read."""
    name = what or str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"{name}: cannot be read ({type(e).__name__}: {e.strerror or e})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((k for test, k in _KINDS if test(mode)), "a special file")
            raise ValueError(f"{name}: {kind}, not a regular file; basis-lite reads it only from a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, limit: int, what: str = "") -> bytes:
    """The whole content of the regular file `path` (`open_regular`), at most `limit` bytes: ValueError naming it
    when it holds more (read to limit + 1 bytes only, whatever its size claims)."""
    name = what or str(path)
    with open_regular(path, what) as f:
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise ValueError(f"{name}: cannot be read ({type(e).__name__}: {e.strerror or e})") from None
    if len(data) > limit:
        raise ValueError(f"{name}: larger than {_size(limit)}")
    return data


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 and n % (1 << 30) == 0 else (
        f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes")


MAX_JSON_BYTES = 64 << 20
MAX_JSON_DEPTH = 64


def read_json(path: str | os.PathLike, what: str = "", max_depth: int = MAX_JSON_DEPTH):
    """The JSON value in a small regular file (`read_regular`); ValueError (one line, naming `what` or the file) when
    it is unreadable, not a regular file, too big, not UTF-8, not JSON or nested deeper than `max_depth` (the
    parser's recursion limit is never reached)."""
    name = what or str(path)
    data = read_regular(path, MAX_JSON_BYTES, name)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name}: unreadable ({type(e).__name__}: {e})") from None
    if json_depth(text) > max_depth:
        raise ValueError(f"{name}: nested deeper than {max_depth} levels")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{name}: not valid JSON ({type(e).__name__})") from None


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def json_depth(text: str) -> int:
    """The deepest nesting of [ and { in JSON text, strings skipped (a linear scan, no recursion)."""
    depth = best = 0
    for c in re.sub(r"[^\[\]{}]", "", _JSON_STRING.sub("", text)):
        if c in "[{":
            depth += 1
            best = max(best, depth)
        else:
            depth -= 1
    return best


# ----------------------------------------------------------------------------------------------------------------
# nested state without pickle: JSON for the structure, a flat dict of arrays for the numbers


def pack_state(obj, prefix: str = "s") -> tuple[object, dict]:
    """(a JSON-able tree, {name: array}) for nested dicts (any keys), lists, tuples, scalars, numpy arrays and
    torch tensors; a tensor comes back as a tensor, an ndarray as an ndarray."""
    arrays: dict = {}

    def walk(x, key: str):
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if type(x).__module__ == "torch" and type(x).__name__ == "Tensor":
            arrays[key] = x.detach().cpu().contiguous()
            return {"__tensor__": key}
        if type(x).__module__ == "numpy" and type(x).__name__ == "ndarray":
            arrays[key] = x
            return {"__ndarray__": key}
        if hasattr(x, "item") and type(x).__module__ == "numpy":  # a numpy scalar
            return x.item()
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in x):
                return {k: walk(v, f"{key}.{k}") for k, v in x.items()}
            return {"__items__": [[walk(k, f"{key}.k{i}"), walk(v, f"{key}.{i}")]
                                  for i, (k, v) in enumerate(x.items())]}
        if isinstance(x, tuple):
            return {"__tuple__": [walk(v, f"{key}.{i}") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [walk(v, f"{key}.{i}") for i, v in enumerate(x)]
        raise TypeError(f"cannot store {type(x).__name__} at {key} in a checkpoint")

    return walk(obj, prefix), arrays


def unpack_state(tree, arrays: dict):
    """Rebuild what `pack_state` stored; `arrays` maps names to tensors (ndarray entries are converted back)."""

    def walk(x):
        if isinstance(x, list):
            return [walk(v) for v in x]
        if not isinstance(x, dict):
            return x
        if "__tensor__" in x:
            return arrays[x["__tensor__"]]
        if "__ndarray__" in x:
            return arrays[x["__ndarray__"]].numpy()
        if "__tuple__" in x:
            return tuple(walk(v) for v in x["__tuple__"])
        if "__items__" in x:
            return {walk(k): walk(v) for k, v in x["__items__"]}
        return {k: walk(v) for k, v in x.items()}

    return walk(tree)
