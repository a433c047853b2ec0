"""Local data file formats by suffix: the table that ``load_examples``, the config's help of ``data.dataset`` and
the error messages read. Imports no torch (pyarrow only when a parquet or Arrow file is read).

    fmt = get_format(".jsonl")                 # a FileFormat, or None
    rows = fmt.read(path, question_field)      # FileRows: the records with their row numbers, the bad rows, ...

A reader returns every record it could parse as (row number, mapping) and every one it could not as (row number,
reason); data/loading.py then picks the fields, validates the rows and splits train from eval, whatever the format.
A folder written by `datasets`' ``save_to_disk`` is read by the ``.arrow`` reader (``is_datasets_folder``), only
the data files inside it. Every reader reads only regular files (a FIFO or a device is a DataError naming it), and
the text formats at most MAX_TEXT_BYTES.
"""
from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

from ..errors import DataError
from ..safeio import inside, open_regular, read_json, read_regular

__all__ = ["FileRows", "FileFormat", "register_format", "unregister_format", "get_format", "format_suffixes",
           "is_datasets_folder", "arrow_files", "check_regular"]


class FileRows(NamedTuple):
    """What a reader found in a file."""

    rows: list  # [(row number, record)]: the parsed records
    bad: list  # [(row number, reason)]: the rows it could not parse
    total: int  # rows seen, parsed or not
    columns: list | None  # the column names where the format has a schema (CSV header, Arrow schema), else None
    label: str  # what a row number counts, for messages: line | item | row


@dataclass(frozen=True)
class FileFormat:
    """A local file format: its suffix (lower case, with the dot), its reader fn(path, question_field) -> FileRows
    (raising DataError for a file it cannot read at all), and how it is read (one line, for docs and help)."""

    suffix: str
    read: Callable[[Path, str], FileRows]
    description: str


_FORMATS: dict[str, FileFormat] = {}


def register_format(fmt: FileFormat) -> FileFormat:
    """Add a format under its suffix; a suffix can be registered once."""
    if not (fmt.suffix.startswith(".") and fmt.suffix == fmt.suffix.lower() and len(fmt.suffix) > 1):
        raise ValueError(f"format suffix {fmt.suffix!r}: expected a lower-case suffix with its dot, such as '.jsonl'")
    if fmt.suffix in _FORMATS:
        raise ValueError(f"format {fmt.suffix!r} is already registered")
    if not callable(fmt.read):
        raise ValueError(f"format {fmt.suffix!r}: read must be a function, got {fmt.read!r}")
    _FORMATS[fmt.suffix] = fmt
    return fmt


def unregister_format(suffix: str) -> None:
    """Remove a format (for tests that register a throwaway one)."""
    _FORMATS.pop(suffix, None)


def get_format(suffix: str) -> FileFormat | None:
    return _FORMATS.get(suffix.lower())


def format_suffixes() -> tuple:
    """The registered suffixes, in registration order."""
    return tuple(_FORMATS)


# ---------------------------------------------------------------------------------------------------------------
# the built-in readers
# ---------------------------------------------------------------------------------------------------------------

MAX_TEXT_BYTES = 1 << 30  # a .jsonl/.json/.csv file is read whole: at most this much (parquet and arrow: any size)


def check_regular(path: Path) -> None:
    """DataError naming `path` unless it is a regular file (a FIFO would block the reader for ever, a device such as
    /dev/zero would be read until memory runs out)."""
    try:
        open_regular(path, f"data.dataset: {str(path)!r}").close()
    except ValueError as e:
        raise DataError(f"{e}; point data.dataset at a {'/'.join(format_suffixes())} file") from None


def _read_whole(path: Path) -> bytes:
    """The bytes of a text data file: a regular file of at most MAX_TEXT_BYTES, else DataError naming it."""
    try:
        return read_regular(path, MAX_TEXT_BYTES, f"data.dataset: {str(path)!r}")
    except ValueError as e:
        raise DataError(f"{e}; point data.dataset at a {'/'.join(format_suffixes())} file (parquet for larger "
                        f"data)") from None


def _jsonl_records(data: bytes) -> tuple[list[tuple[int, Any]], list[tuple[int, str]], int]:
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
        except RecursionError:
            bad.append((n, "nested too deeply to read"))
    return rows, bad, total


def is_datasets_folder(path: Path) -> bool:
    """A folder written by `datasets`' ``save_to_disk`` (a Dataset: state.json and .arrow files; or a DatasetDict:
    dataset_dict.json and one folder per split)."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def arrow_files(path: Path) -> list[Path]:
    """The .arrow files of a file or a ``save_to_disk`` folder, in order (state.json lists them; JSON only)."""
    if not path.is_dir():
        return [path]
    if (path / "dataset_dict.json").is_file():
        try:
            splits = read_json(path / "dataset_dict.json").get("splits") or []
        except (OSError, ValueError, AttributeError):
            splits = []
        example = path / (splits[0] if splits else "train")
        raise DataError(f"data.dataset: {str(path)!r} is a DatasetDict saved with save_to_disk (splits: "
                        f"{', '.join(map(str, splits)) or 'unknown'}); point data.dataset at one split's folder, "
                        f"e.g. {str(example)!r} (one split is divided into train and eval like a file)")
    try:
        state = read_json(path / "state.json")
        files = [path / str(f["filename"]) for f in state.get("_data_files") or []]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        files = []
    outside = [f for f in files if not inside(path, f)]
    if outside:
        raise DataError(f"data.dataset: {str(path)!r}: its state.json names a data file outside the folder "
                        f"({str(outside[0])!r}); the data files of a save_to_disk folder are read only inside it")
    files = [f for f in files if f.is_file()] or sorted(f for f in path.glob("*.arrow") if inside(path, f))
    if not files:
        raise DataError(f"data.dataset: {str(path)!r} has a state.json but no .arrow data files; save it again "
                        f"with Dataset.save_to_disk")
    return files


def arrow_table(path: Path):
    """A pyarrow Table from Arrow IPC files (the stream format `datasets` writes, or the file format). Only
    pyarrow reads them: nothing is unpickled."""
    try:
        import pyarrow as pa
    except ImportError:
        raise DataError(f"{path}: reading .arrow data needs pyarrow (pip install pyarrow)") from None
    tables = []
    for f in arrow_files(path):
        check_regular(f)
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


def read_jsonl_file(path: Path, question_field: str) -> FileRows:
    rows, bad, total = _jsonl_records(_read_whole(path))
    return FileRows(rows, bad, total, None, "line")


def read_json_file(path: Path, question_field: str) -> FileRows:
    """A list of objects, an object holding one such list, one object with the question field, or JSON lines."""
    data = _read_whole(path)
    try:
        obj = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        obj = None  # JSON lines in a .json file, or a damaged file: read it line by line
    if isinstance(obj, dict):
        lists = [v for v in obj.values() if isinstance(v, list) and v and isinstance(v[0], dict)]
        if len(lists) == 1:
            obj = lists[0]
        elif question_field in obj:
            obj = [obj]
        else:
            raise DataError(f"{path}: expected a JSON list of objects (or one object per line), got an object "
                            f"with keys {', '.join(list(obj)[:10])}")
    if isinstance(obj, list):
        return FileRows([(i + 1, r) for i, r in enumerate(obj)], [], len(obj), None, "item")
    rows, bad, total = _jsonl_records(data)
    return FileRows(rows, bad, total, None, "line")


def read_csv_file(path: Path, question_field: str) -> FileRows:
    text = _read_whole(path).decode("utf-8", errors="surrogateescape").lstrip("\ufeff")
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
    return FileRows(rows, bad, total, list(reader.fieldnames or []), "line")


def _table_rows(table) -> FileRows:
    records = table.to_pylist()
    return FileRows([(i + 1, r) for i, r in enumerate(records)], [], len(records), table.column_names, "row")


def read_parquet_file(path: Path, question_field: str) -> FileRows:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    check_regular(path)
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
    return _table_rows(table)


def read_arrow_file(path: Path, question_field: str) -> FileRows:
    """An Arrow file, or a ``save_to_disk`` folder (its .arrow files)."""
    return _table_rows(arrow_table(path))


register_format(FileFormat(".jsonl", read_jsonl_file, "one JSON object per line"))
register_format(FileFormat(".json", read_json_file, "a list of objects (or JSON lines)"))
register_format(FileFormat(".csv", read_csv_file, "a header row, then one row per example (text fields only)"))
register_format(FileFormat(".parquet", read_parquet_file, "pyarrow"))
register_format(FileFormat(".arrow", read_arrow_file, "an Arrow file as `datasets` writes it (pyarrow's IPC reader; "
                                                 "nothing is unpickled)"))
