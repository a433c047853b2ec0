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

a local file: ``.jsonl``, ``.json`` (a list of objects, or JSON lines), ``.csv``, ``.parquet``, ``.arrow``, or a
    folder written by `datasets`' ``save_to_disk`` (one Dataset; a DatasetDict's split folder). Arrow data is read
    with pyarrow alone (nothing is unpickled).
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
or not valid JSON) are skipped and counted; so are gold answers that math-verify cannot parse. When either share
exceeds ``data.max_bad_fraction`` loading stops with a DataError naming the file, the count, the first bad rows
and the reason; below it, a warning lists them.
"""
from __future__ import annotations

import contextlib
import csv
import difflib
import functools
import io
import json
import logging
import math
import os
import random
import re
import socket
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

from ..errors import DataError
from .example import Example
from .tasks import BUILTIN_TASKS, load_builtin

log = logging.getLogger(__name__)

SPLITS = ("train", "eval")
MAX_GOLD_CHARS = 2000  # a longer gold answer is a bad row (math-verify would spend seconds and log all of it)
LOCAL_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".arrow")
GOLD_STYLES = ("gsm8k", "math", "any")


# ---------------------------------------------------------------------------------------------------------------
# rows from files and the hub: gold answers, validation, bad-row accounting
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Row:
    row: int  # 1-based line (jsonl/csv) or item number (json/parquet/arrow/hub)
    question: str  # the question text; for a conversational row its last user message
    answer: str
    meta: tuple  # sorted (key, value) pairs
    messages: str | None = None  # a conversational row's prompt, as JSON (rows are cached and shared: kept immutable)


# TRL's field names, used when data.question_field / data.answer_field keep their defaults and the data lacks them
DEFAULT_FIELDS = {"question": ("prompt",), "answer": ("solution",)}
# columns never passed to reward functions as data columns (TRL's rule: it passes these separately or not at all)
NOT_COLUMNS = ("prompt", "completion", "completion_ids")
ROLES = ("system", "user", "assistant")


def _as_text(v: Any) -> tuple[str | None, str]:
    """(text, "") for a usable value, (None, reason) otherwise."""
    if v is None:
        return None, "missing"
    if isinstance(v, bool):
        return None, "a boolean, not text"
    if isinstance(v, str):
        if any("\udc80" <= c <= "\udcff" for c in v):
            return None, "not valid UTF-8"
        v = v.strip()
        return (v, "") if v else (None, "empty")
    if isinstance(v, int):
        return str(v), ""
    if isinstance(v, float):
        if not math.isfinite(v):
            return None, "missing (NaN)" if math.isnan(v) else "infinite"
        return (str(int(v)) if v.is_integer() else repr(v)), ""
    if isinstance(v, (Decimal, Fraction)):
        return str(v), ""
    return None, f"a {type(v).__name__}, not text"


def _as_messages(v: list) -> tuple[list | None, str]:
    """(messages, "") for a conversational prompt (TRL's format: a list of {"role", "content"} with at least one
    user message and not ending with an assistant turn), (None, reason) otherwise."""
    if not v:
        return None, "an empty list of messages"
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None, (f"message {i} is not a {{'role': ..., 'content': <text>}} object (a conversational prompt "
                          f"is a list of such messages)")
        if m["role"] not in ROLES:
            return None, f"message {i} has role {m['role']!r}; accepted: {', '.join(ROLES)}"
        if any("\udc80" <= c <= "\udcff" for c in m["content"]):
            return None, "not valid UTF-8"
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" for m in out):
        return None, "a conversation without a user message"
    if out[-1]["role"] == "assistant":
        return None, "a conversation ending with an assistant message (a prefilled answer is not supported)"
    if any(m["role"] == "system" for m in out[1:]):
        return None, "a system message that is not the first message"
    return out, ""


def resolve_fields(keys, qf: str, af: str, where: str) -> tuple[str, str]:
    """(question field, answer field): data.question_field / data.answer_field, or TRL's names (``prompt``,
    ``solution``) when a field keeps its default name, the data lacks it and has TRL's."""
    keys = set(keys)
    out = []
    for field_name, default in ((qf, "question"), (af, "answer")):
        if field_name == default and field_name not in keys:
            alt = next((a for a in DEFAULT_FIELDS[default] if a in keys), None)
            if alt is not None:
                log.info("%s: no field %r; using TRL's field %r (set data.%s_field to choose)", where, field_name,
                         alt, default)
                field_name = alt
        out.append(field_name)
    return out[0], out[1]


def _field_keys(raw_rows: list[tuple[int, Any]], columns=None) -> set[str]:
    keys: set[str] = set(columns or ())
    if columns is None:
        for _, raw in raw_rows[:2000]:
            if isinstance(raw, dict):
                keys.update(k for k in raw if isinstance(k, str))
    return keys


def gold_answer(text: str, style: str = "any") -> str | None:
    """The final answer in an answer field, or None when there is none (the row then counts as bad).

    "gsm8k": the text after the last ``####``, stripped, thousands commas removed. "math": the content of the last
    non-empty ``\\boxed{}`` (``\\fbox{}`` counts as one), stripped. "any" (local files and ``hf:`` datasets): the
    "gsm8k" answer when the text holds ``####``, else the "math" answer when it holds a non-empty box, else the
    whole text."""
    if style not in GOLD_STYLES:
        raise ValueError(f"gold_answer: style must be one of {', '.join(GOLD_STYLES)}, got {style!r}")
    if style != "math" and "####" in text:
        return text.rsplit("####", 1)[1].strip().replace(",", "") or None
    if style != "gsm8k":
        from ..answers import last_nonempty_boxed

        box = last_nonempty_boxed(text.replace("\\fbox", "\\boxed"))
        if box is not None:
            return box.strip()
    return text if style == "any" else None


def _level_of(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        m = re.search(r"\d+", v)
        return int(m.group()) if m else None
    return None


def _row_meta(raw: dict, qf: str, af: str, gold: str) -> tuple:
    """level (an int), family (from type/subject/family), the gold answer under the answer field's name, and every
    other column under its own name (TRL passes a dataset's extra columns to reward functions)."""
    meta = {af: gold}
    lv = _level_of(raw.get("level"))
    if lv is not None:
        meta["level"] = lv
    for k in ("type", "subject", "family"):
        if isinstance(raw.get(k), str) and raw[k].strip():
            meta["family"] = raw[k].strip()
            break
    for k, v in raw.items():
        if isinstance(k, str) and k not in meta and k not in (qf, af) and k not in NOT_COLUMNS:
            meta[k] = v
    return tuple(sorted(meta.items()))


def _validate_rows(raw_rows: list[tuple[int, Any]], qf: str, af: str, where: str,
                   gold_style: str, max_question_chars: int = 0) -> tuple[list[_Row], list[tuple[int, str]]]:
    """Good rows and (row, reason) of bad ones. A question longer than `max_question_chars` (0 = no limit) is cut
    to its last that many characters here, before anything tokenizes it (a 10 MB question would otherwise take
    GBs in the tokenizer, to be cut to model.max_seq_length tokens anyway); a warning counts the cut ones."""
    rows, bad, cut = [], [], []
    for n, raw in raw_rows:
        if not isinstance(raw, dict):
            bad.append((n, f"a JSON {type(raw).__name__}, not an object"))
            continue
        msgs = None
        if isinstance(raw.get(qf), list):
            msgs, why_q = _as_messages(raw[qf])
            q = next((m["content"].strip() for m in reversed(msgs) if m["role"] == "user"), None) if msgs else None
            if msgs is not None and not q:
                q, why_q = None, "a conversation whose last user message is empty"
        else:
            q, why_q = _as_text(raw.get(qf))
        a, why_a = _as_text(raw.get(af))
        if q is None:
            bad.append((n, f"question field {qf!r} {why_q}"))
            continue
        if a is None:
            bad.append((n, f"answer field {af!r} {why_a}"))
            continue
        gold = gold_answer(a, gold_style)
        if not gold:
            bad.append((n, f"no answer found in field {af!r}"))
            continue
        if len(gold) > MAX_GOLD_CHARS:
            bad.append((n, f"answer in field {af!r} longer than {MAX_GOLD_CHARS} characters ({len(gold)})"))
            continue
        if max_question_chars and len(q) > max_question_chars:
            cut.append((n, len(q)))
            if msgs is not None:  # the last user message is cut, as a question is
                last = max(i for i, m in enumerate(msgs) if m["role"] == "user")
                msgs[last]["content"] = msgs[last]["content"][-max_question_chars:].strip()
            q = q[-max_question_chars:].strip()
        rows.append(_Row(n, q, gold, _row_meta(raw, qf, af, gold),
                         None if msgs is None else json.dumps(msgs, ensure_ascii=False)))
    if cut:
        log.warning("%s: cut %d question(s) longer than data.max_question_chars=%d characters to their last %d "
                    "(first: row %d, %d characters)", where, len(cut), max_question_chars, max_question_chars,
                    cut[0][0], cut[0][1])
    return rows, bad


def _fmt_bad(bad: list[tuple[int, str]], label: str, k: int = 5) -> str:
    return ", ".join(f"{label} {n} ({why})" for n, why in bad[:k]) + (", ..." if len(bad) > k else "")


def _check_bad(where: str, n_bad: int, total: int, first: str, what: str, max_bad: float, hint: str) -> None:
    if total == 0 or n_bad == 0:
        return
    frac = n_bad / total
    if frac > max_bad:
        raise DataError(f"{where}: {n_bad} of {total} {what} ({frac:.1%}), more than data.max_bad_fraction="
                        f"{max_bad:g}; first: {first}. {hint}")
    log.warning("%s: skipped %d of %d %s (%.1f%%); first: %s", where, n_bad, total, what, 100 * frac, first)


def _check_fields(raw_rows: list[tuple[int, Any]], qf: str, af: str, where: str, columns=None) -> None:
    keys = _field_keys(raw_rows, columns)
    if not keys:
        return
    missing = [f for f in (qf, af) if f not in keys]
    if missing:
        names = {qf: "data.question_field", af: "data.answer_field"}
        raise DataError(f"{where}: no field {', '.join(repr(m) for m in missing)} in the data; available fields: "
                        f"{', '.join(sorted(keys)[:30])}. Set " + " / ".join(names[m] for m in missing) + ".")


def _select(rows: list[_Row], n: int | None, seed_tag: str, where: str, max_bad: float, label: str,
            shuffle: bool = True) -> list[_Row]:
    """Take up to n rows (None = all) in seeded order whose gold answer math-verify can parse."""
    from ..answers import gold_is_parseable

    order = list(rows)
    if shuffle:
        random.Random(seed_tag).shuffle(order)
    out, unparseable, checked = [], [], 0
    for r in order:
        if n is not None and len(out) >= n:
            break
        checked += 1
        if gold_is_parseable(r.answer):
            out.append(r)
        else:
            unparseable.append((r.row, f"answer {r.answer[:40]!r}"))
    _check_bad(where, len(unparseable), checked, _fmt_bad(unparseable, label), "gold answers math-verify cannot "
               "parse", max_bad, "Check data.answer_field, or clean the answers (plain numbers or LaTeX).")
    return out


def _to_examples(rows: list[_Row], prefix: str, source: str) -> list[Example]:
    return [Example(id=f"{prefix}/{r.row}", question=r.question, answer=r.answer,
                    meta={"source": source, "row": r.row, **dict(r.meta)},
                    messages=None if r.messages is None else json.loads(r.messages)) for r in rows]


# ---------------------------------------------------------------------------------------------------------------
# local files
# ---------------------------------------------------------------------------------------------------------------

def _read_jsonl_bytes(data: bytes) -> tuple[list[tuple[int, Any]], list[tuple[int, str]], int]:
    rows, bad, total = [], [], 0
    for n, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        total += 1
        try:
            text = line.decode("utf-8", errors="strict")
        except UnicodeDecodeError:
            bad.append((n, "not valid UTF-8"))
            continue
        if n == 1:
            text = text.lstrip("\ufeff")
        try:
            rows.append((n, json.loads(text)))
        except json.JSONDecodeError as e:
            bad.append((n, f"not valid JSON: {e.msg}"))
    return rows, bad, total


def is_datasets_folder(path: Path) -> bool:
    """A folder written by `datasets`' ``save_to_disk`` (a Dataset: state.json and .arrow files; or a DatasetDict:
    dataset_dict.json and one folder per split)."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def _arrow_files(path: Path) -> list[Path]:
    """The .arrow files of a file or a ``save_to_disk`` folder, in order (state.json lists them; JSON only)."""
    if not path.is_dir():
        return [path]
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits") or []
        except (OSError, ValueError, AttributeError):
            splits = []
        example = path / (splits[0] if splits else "train")
        raise DataError(f"data.dataset: {str(path)!r} is a DatasetDict saved with save_to_disk (splits: "
                        f"{', '.join(map(str, splits)) or 'unknown'}); point data.dataset at one split's folder, "
                        f"e.g. {str(example)!r} (one split is divided into train and eval like a file)")
    try:
        state = json.loads((path / "state.json").read_text())
        files = [path / str(f["filename"]) for f in state.get("_data_files") or []]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        files = []
    files = [f for f in files if f.is_file()] or sorted(path.glob("*.arrow"))
    if not files:
        raise DataError(f"data.dataset: {str(path)!r} has a state.json but no .arrow data files; save it again "
                        f"with Dataset.save_to_disk")
    return files


def _read_arrow(path: Path):
    """A pyarrow Table from Arrow IPC files (the stream format `datasets` writes, or the file format). Only
    pyarrow reads them: nothing is unpickled."""
    try:
        import pyarrow as pa
    except ImportError:
        raise DataError(f"{path}: reading .arrow data needs pyarrow (pip install pyarrow)") from None
    tables = []
    for f in _arrow_files(path):
        try:
            with pa.memory_map(str(f)) as src:
                try:
                    tables.append(pa.ipc.open_stream(src).read_all())
                except pa.ArrowInvalid:
                    src.seek(0)
                    tables.append(pa.ipc.open_file(src).read_all())
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{f}: not a readable Arrow file ({type(e).__name__}: {e})") from None
    try:
        return pa.concat_tables(tables)
    except pa.ArrowException as e:
        raise DataError(f"{path}: its .arrow files do not share one schema ({e})") from None


def _read_file(path: Path, qf: str) -> tuple[list[tuple[int, Any]], list[tuple[int, str]], int, list | None, str]:
    """(rows, bad, total, columns or None, row label)."""
    suffix = path.suffix.lower()
    if suffix == ".arrow" or path.is_dir():
        table = _read_arrow(path)
        records = table.to_pylist()
        return [(i + 1, r) for i, r in enumerate(records)], [], len(records), table.column_names, "row"
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
        try:
            table = pq.read_table(path)
        except Exception as e:
            raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
        records = table.to_pylist()
        return [(i + 1, r) for i, r in enumerate(records)], [], len(records), table.column_names, "row"
    data = path.read_bytes()
    if suffix == ".csv":
        text = data.decode("utf-8", errors="surrogateescape").lstrip("\ufeff")
        reader = csv.DictReader(io.StringIO(text, newline=""))
        rows, bad, total = [], [], 0
        try:
            for rec in reader:
                total += 1
                n = reader.line_num
                if None in rec:  # more cells than header names
                    bad.append((n, f"{len(rec[None])} more cells than the header has columns"))
                    continue
                if any(isinstance(v, str) and any("\udc80" <= c <= "\udcff" for c in v) for v in rec.values()):
                    bad.append((n, "not valid UTF-8"))
                    continue
                rows.append((n, {k: v for k, v in rec.items()}))
        except csv.Error as e:
            raise DataError(f"{path}: not a readable CSV file (line {reader.line_num}: {e})") from None
        return rows, bad, total, list(reader.fieldnames or []), "line"
    if suffix == ".json":
        try:
            obj = json.loads(data.decode("utf-8-sig"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            obj = None  # JSON lines in a .json file, or a damaged file: read it line by line
        if isinstance(obj, dict):
            lists = [v for v in obj.values() if isinstance(v, list) and v and isinstance(v[0], dict)]
            if len(lists) == 1:
                obj = lists[0]
            elif qf in obj:
                obj = [obj]
            else:
                raise DataError(f"{path}: expected a JSON list of objects (or one object per line), got an object "
                                f"with keys {', '.join(list(obj)[:10])}")
        if isinstance(obj, list):
            return [(i + 1, r) for i, r in enumerate(obj)], [], len(obj), None, "item"
    rows, bad, total = _read_jsonl_bytes(data)
    return rows, bad, total, None, "line"


@functools.lru_cache(maxsize=8)
def _load_file_rows(path_str: str, mtime_ns: int, size: int, qf: str, af: str,
                    max_bad: float, max_question_chars: int = 0) -> tuple[tuple[_Row, ...], str]:
    path = Path(path_str)
    raw, bad, total, columns, label = _read_file(path, qf)
    if total == 0:
        raise DataError(f"{path}: no rows")
    qf, af = resolve_fields(_field_keys(raw, columns), qf, af, str(path))
    _check_fields(raw, qf, af, str(path), columns)
    rows, bad2 = _validate_rows(raw, qf, af, str(path), "any", max_question_chars)
    bad = sorted(bad + bad2)
    _check_bad(str(path), len(bad), total, _fmt_bad(bad, label), "rows are malformed", max_bad,
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
        inside = sorted(p.name for p in path.iterdir() if p.is_file() and p.suffix.lower() in LOCAL_SUFFIXES)
    except OSError:
        inside = []
    hint = (f"; data files in it: {', '.join(inside[:10])}" + (", ..." if len(inside) > 10 else "")) if inside else (
        f"; it holds no {'/'.join(LOCAL_SUFFIXES)} file")
    return DataError(f"data.dataset: {str(path)!r} is a directory, not a file nor a folder written by "
                     f"save_to_disk; point data.dataset at one {'/'.join(LOCAL_SUFFIXES)} file{hint}")


def _local(cfg, split: str, path: Path) -> list[Example]:
    if path.is_dir() and not is_datasets_folder(path):
        raise _directory_error(path)
    if not path.exists():
        where = "" if path.parent.is_dir() else f" (its folder {str(path.parent)!r} does not exist either)"
        raise DataError(f"data.dataset: file {str(path)!r} not found{where}")
    stats = [f.stat() for f in _arrow_files(path)] if path.is_dir() else [path.stat()]
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
    from ..answers import gold_is_parseable
    cut, good = 0, 0
    while cut < len(rows) and good < n_eval:
        good += gold_is_parseable(rows[cut].answer)
        cut += 1
    if split == "eval":
        chosen = _select(rows[:cut], None, "", where, cfg.max_bad_fraction, label, shuffle=False)
    else:
        n = int(cfg.train_size) or None
        chosen = _select(rows[cut:], n, "", where, cfg.max_bad_fraction, label, shuffle=False)
    return _to_examples(chosen, path.name, str(path))


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
            f"with data.question_field / data.answer_field naming its fields (.jsonl, .json, .csv and .parquet "
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
    _check_fields(raw, spec["question"], spec["answer"], where, list(ds.column_names))
    rows, bad = _validate_rows(raw, spec["question"], spec["answer"], where, spec["gold"],
                               int(getattr(cfg, "max_question_chars", 0) or 0))
    _check_bad(where, len(bad), len(raw), _fmt_bad(bad, "row"), "rows are malformed", cfg.max_bad_fraction,
               "Raise data.max_bad_fraction or use a cleaned local copy.")
    chosen = _select(rows, n, f"hub/{cfg.seed}/{split}", where, cfg.max_bad_fraction, "row")
    source = key if key in HUB_DATASETS else spec["path"]
    return _to_examples(chosen, f"{source}/{hub_split}", source)


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
    if path.suffix.lower() in LOCAL_SUFFIXES or is_datasets_folder(path):
        return _local(cfg, split, path)
    accepted = (f"{', '.join(BUILTIN_TASKS)} (built in), {', '.join(HUB_DATASETS)} (hub), "
                f"hf:owner/name[:config], a path to a {'/'.join(LOCAL_SUFFIXES)} file, or a folder written by "
                f"datasets' save_to_disk")
    if name and path.is_dir():
        raise _directory_error(path)
    if name and path.exists():
        raise DataError(f"data.dataset: {name!r} is not a {'/'.join(LOCAL_SUFFIXES)} file; choose one of {accepted}")
    close = difflib.get_close_matches(name.lower(), BUILTIN_TASKS + tuple(HUB_DATASETS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise DataError(f"data.dataset: {name!r} is not accepted{hint}; choose one of {accepted}")
