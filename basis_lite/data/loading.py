"""Examples from files and the Hugging Face hub, and ``load_examples``, the entry point for every data source.

``load_examples(cfg.data, "train" | "eval") -> list[Example]`` dispatches on ``data.dataset``: a built-in task
name (``arithmetic``, ``algebra``, ``wordproblems``: see ``tasks.py``), a hub dataset, or a local file. Any other
value raises DataError naming it and listing what is accepted.

gsm8k, math (Hugging Face hub, through `datasets`, imported lazily)
    gsm8k: ``openai/gsm8k`` config ``main``; the answer is the text after ``####`` with thousands commas removed.
    math: ``DigitalLearningGmbH/MATH-lighteval`` (the Hendrycks MATH problems; the original
    ``hendrycks/competition_math`` was taken down); the answer is the last ``\\boxed{}`` of the solution, and
    meta carries ``level`` (1-5) and ``family`` (the subject). ``hf:owner/name`` or ``hf:owner/name:config``
    loads any other hub dataset with ``data.question_field`` / ``data.answer_field``. Splits are
    ``data.split_train`` / ``data.split_eval``; ``data.train_size`` caps the training rows (0 = all) and
    ``data.eval_size`` the eval rows (0 = none), each a seeded random subset. Without network access this
    raises DataError suggesting a local file.

a local file in one of the formats of ``formats.py`` (by suffix: ``format_suffixes()``), or a folder written by
    `datasets`' ``save_to_disk`` (one Dataset; a DatasetDict's split folder), read as Arrow data with pyarrow alone
    (nothing is unpickled).
    Fields ``data.question_field`` / ``data.answer_field``; when they keep their defaults (question, answer) and
    the data lacks them, TRL's names are used: ``prompt`` for the question, ``solution`` for the answer. The
    question is text (TRL's standard format) or a list of ``{"role", "content"}`` messages (TRL's conversational
    format, optionally with a system message first; the last user message gets ``data.instruction``). Every other
    column goes to the example's meta under its own name, and from there to reward functions (as TRL passes a
    dataset's extra columns), except ``prompt``, ``completion`` and ``completion_ids``. One file serves both splits: the questions (duplicates
    dropped) are shuffled with ``data.seed`` and the first ``data.eval_size`` are held out for eval (at most half
    the file); the rest are for training (capped at ``data.train_size``, 0 = all). An answer holding ``####``
    (a GSM8K solution) keeps the text after it; one holding ``\\boxed{}`` (a MATH solution) keeps the box content.
    A ``level`` field (an int or "Level 3") and a ``type``/``subject`` field go to meta for eval breakdowns.

A question longer than ``data.max_question_chars`` (files and hub datasets) is cut to its last that many characters
when loaded, before anything tokenizes it, with a warning; a gold answer longer than ``MAX_GOLD_CHARS`` makes its
row a bad row. A directory given as ``data.dataset`` is a DataError naming the data files inside it.

Bad rows (missing or empty question/answer, values that are not text or numbers, lines that are not valid UTF-8
or not valid JSON, or nested deeper than the JSON parser reads) are skipped and counted; so are gold answers that math-verify cannot parse. When either share
exceeds ``data.max_bad_fraction`` loading stops with a DataError naming the file, the count, the first bad rows
and the reason; below it, a warning lists them.
"""
from __future__ import annotations

import contextlib
import difflib
import functools
import logging
import os
import random
import socket
from pathlib import Path

from ..errors import DataError
from .example import Example
from .formats import FileRows, arrow_files, check_regular, format_suffixes, get_format, is_datasets_folder
from .rows import (
    Row,
    check_bad,
    check_fields,
    field_keys,
    fmt_bad,
    resolve_fields,
    select_rows,
    to_examples,
    validate_rows,
)
from .tasks import BUILTIN_TASKS, load_builtin

log = logging.getLogger(__name__)

SPLITS = ("train", "eval")


# ---------------------------------------------------------------------------------------------------------------
# local files
# ---------------------------------------------------------------------------------------------------------------

def _read_file(path: Path, qf: str) -> FileRows:
    """The rows of a local file or ``save_to_disk`` folder, read by its format's reader (data/formats.py)."""
    fmt = get_format(".arrow" if path.is_dir() else path.suffix)
    if fmt is None:
        raise DataError(f"data.dataset: {str(path)!r} is not a {'/'.join(format_suffixes())} file")
    return fmt.read(path, qf)


@functools.lru_cache(maxsize=8)
def _load_file_rows(path_str: str, mtime_ns: int, size: int, qf: str, af: str,
                    max_bad: float, max_question_chars: int = 0) -> tuple[tuple[Row, ...], str]:
    path = Path(path_str)
    raw, bad, total, columns, label = _read_file(path, qf)
    if total == 0:
        raise DataError(f"{path}: no rows")
    qf, af = resolve_fields(field_keys(raw, columns), qf, af, str(path))
    check_fields(raw, qf, af, str(path), columns)
    rows, bad2 = validate_rows(raw, qf, af, str(path), "any", max_question_chars)
    bad = sorted(bad + bad2)
    check_bad(str(path), len(bad), total, fmt_bad(bad, label), "rows are malformed", max_bad,
               "Fix or remove those rows, or raise data.max_bad_fraction.")
    seen, unique = set(), []
    for r in rows:
        key = r.messages or r.question
        if key not in seen:
            seen.add(key)
            unique.append(r)
    if len(unique) < len(rows):
        log.info("%s: dropped %d rows that repeat an earlier question", path, len(rows) - len(unique))
    return tuple(unique), label


def _directory_error(path: Path) -> DataError:
    """A folder given as data.dataset: say so, and name the data files inside it."""
    try:
        inside = sorted(p.name for p in path.iterdir() if p.is_file() and get_format(p.suffix))
    except OSError:
        inside = []
    hint = (f"; data files in it: {', '.join(inside[:10])}" + (", ..." if len(inside) > 10 else "")) if inside else (
        f"; it holds no {'/'.join(format_suffixes())} file")
    return DataError(f"data.dataset: {str(path)!r} is a directory, not a file nor a folder written by "
                     f"save_to_disk; point data.dataset at one {'/'.join(format_suffixes())} file{hint}")


def _local(cfg, split: str, path: Path) -> list[Example]:
    if path.is_dir() and not is_datasets_folder(path):
        raise _directory_error(path)
    if not path.exists():
        where = "" if path.parent.is_dir() else f" (its folder {str(path.parent)!r} does not exist either)"
        raise DataError(f"data.dataset: file {str(path)!r} not found{where}")
    if not path.is_dir():
        check_regular(path)  # a FIFO or a device behind the name is named before anything reads it
    stats = [f.stat() for f in arrow_files(path)] if path.is_dir() else [path.stat()]
    rows, label = _load_file_rows(str(path.resolve()), max(st.st_mtime_ns for st in stats),
                                  sum(st.st_size for st in stats), cfg.question_field,
                                  cfg.answer_field, float(cfg.max_bad_fraction),
                                  int(getattr(cfg, "max_question_chars", 0) or 0))
    rows = list(rows)
    random.Random(f"local/{cfg.seed}").shuffle(rows)
    n_eval = int(cfg.eval_size)
    if n_eval > len(rows) // 2:
        log.warning("%s: %d distinct questions; holding out %d for eval instead of data.eval_size=%d "
                    "(at most half the file)", path, len(rows), len(rows) // 2, n_eval)
        n_eval = len(rows) // 2
    where = f"{path} ({split} split)"
    # the eval rows are the first n_eval parseable ones in seeded order; the rest (in order) are for training
    from ..rewards.answers import gold_is_parseable
    cut, good = 0, 0
    while cut < len(rows) and good < n_eval:
        good += gold_is_parseable(rows[cut].answer)
        cut += 1
    if split == "eval":
        chosen = select_rows(rows[:cut], None, "", where, cfg.max_bad_fraction, label, shuffle=False)
    else:
        n = int(cfg.train_size) or None
        chosen = select_rows(rows[cut:], n, "", where, cfg.max_bad_fraction, label, shuffle=False)
    return to_examples(chosen, path.name, str(path))


# ---------------------------------------------------------------------------------------------------------------
# the Hugging Face hub
# ---------------------------------------------------------------------------------------------------------------

# name -> where it lives, its question and answer fields, and the gold_answer style that reads its answers
HUB_DATASETS = {
    "gsm8k": dict(path="openai/gsm8k", name="main", question="question", answer="answer", gold="gsm8k"),
    "math": dict(path="DigitalLearningGmbH/MATH-lighteval", name=None, question="problem", answer="solution",
                 gold="math"),
}


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """A quick TCP probe of the hub endpoint (HF_ENDPOINT); True when a proxy is configured (we cannot tell)."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _offline_unless_reachable(datasets_mod):
    """When the hub cannot be reached, run in the libraries' offline mode for this call: a cached copy still
    loads, and a missing one fails at once instead of after ~25 s of retries."""
    import huggingface_hub.constants as hub_constants

    if hub_constants.HF_HUB_OFFLINE or datasets_mod.config.HF_HUB_OFFLINE or _hub_reachable():
        yield
        return
    old = hub_constants.HF_HUB_OFFLINE, datasets_mod.config.HF_HUB_OFFLINE
    hub_constants.HF_HUB_OFFLINE = datasets_mod.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub_constants.HF_HUB_OFFLINE, datasets_mod.config.HF_HUB_OFFLINE = old


def _hub(cfg, split: str, key: str) -> list[Example]:
    if key in HUB_DATASETS:
        spec = HUB_DATASETS[key]
    else:  # hf:owner/name[:config]
        ident = key[3:]
        path, _, name = ident.partition(":")
        spec = dict(path=path, name=name or None, question=cfg.question_field, answer=cfg.answer_field,
                    gold="any")
    hub_split = cfg.split_train if split == "train" else cfg.split_eval
    n = (int(cfg.train_size) or None) if split == "train" else int(cfg.eval_size)
    if n == 0:
        return []
    hint = (f"If the hub is unreachable (an offline machine), get the data elsewhere and point data.dataset at a "
            f"local file instead, e.g. `data.dataset: path/to/{key.replace('hf:', '').replace('/', '_')}.jsonl` "
            f"with data.question_field / data.answer_field naming its fields ({', '.join(format_suffixes())} "
            f"work; one file is split into train and eval).")
    try:
        import datasets
    except ImportError:
        raise DataError(f"data.dataset={key}: loading hub datasets needs the `datasets` package "
                        f"(pip install 'basis-lite[data]'). {hint}") from None
    try:
        with _offline_unless_reachable(datasets):
            ds = datasets.load_dataset(spec["path"], spec["name"], split=hub_split)
    except Exception as e:
        msg = str(e).splitlines()[0][:300] if str(e) else ""
        raise DataError(f"data.dataset={key}: could not load {spec['path']!r} split {hub_split!r} from the Hugging "
                        f"Face hub ({type(e).__name__}: {msg}). {hint}") from None
    where = f"{spec['path']} ({hub_split})"
    raw = [(i, r) for i, r in enumerate(ds)]
    if key not in HUB_DATASETS:
        spec["question"], spec["answer"] = resolve_fields(ds.column_names, spec["question"], spec["answer"], where)
    check_fields(raw, spec["question"], spec["answer"], where, list(ds.column_names))
    rows, bad = validate_rows(raw, spec["question"], spec["answer"], where, spec["gold"],
                               int(getattr(cfg, "max_question_chars", 0) or 0))
    check_bad(where, len(bad), len(raw), fmt_bad(bad, "row"), "rows are malformed", cfg.max_bad_fraction,
               "Raise data.max_bad_fraction or use a cleaned local copy.")
    chosen = select_rows(rows, n, f"hub/{cfg.seed}/{split}", where, cfg.max_bad_fraction, "row")
    source = key if key in HUB_DATASETS else spec["path"]
    return to_examples(chosen, f"{source}/{hub_split}", source)


# ---------------------------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------------------------

def load_examples(cfg, split: str) -> list[Example]:
    """Examples of `split` ("train" or "eval") for a DataConfig; see the module docstring for the sources."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    name = str(cfg.dataset).strip()
    if name in BUILTIN_TASKS:
        return load_builtin(cfg, split, name)
    if name in HUB_DATASETS or name.startswith("hf:"):
        return _hub(cfg, split, name)
    path = Path(os.path.expanduser(name))
    if get_format(path.suffix) or is_datasets_folder(path):
        return _local(cfg, split, path)
    accepted = (f"{', '.join(BUILTIN_TASKS)} (built in), {', '.join(HUB_DATASETS)} (hub), "
                f"hf:owner/name[:config], a path to a {'/'.join(format_suffixes())} file, or a folder written by "
                f"datasets' save_to_disk")
    if name and path.is_dir():
        raise _directory_error(path)
    if name and path.exists():
        raise DataError(f"data.dataset: {name!r} is not a {'/'.join(format_suffixes())} file; choose one of {accepted}")
    close = difflib.get_close_matches(name.lower(), BUILTIN_TASKS + tuple(HUB_DATASETS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise DataError(f"data.dataset: {name!r} is not accepted{hint}; choose one of {accepted}")
