"""How results are written: number formats, markdown and text tables, JSON result files."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path


def fmt(x, spec: str, none: str = "-") -> str:
    """`x` formatted with `spec`, or `none` for None."""
    return none if x is None else format(x, spec)


def fmt_seconds(s) -> str:
    """'1.23 s' under 10 s, '42 s' under 10 min, '12.5 min' above; '-' for None."""
    if s is None:
        return "-"
    if s < 10:
        return f"{s:.2f} s"
    return f"{s:.0f} s" if s < 600 else f"{s / 60:.1f} min"


def markdown_table(header, rows) -> str:
    """A GitHub table; a '|' inside a cell becomes '/'."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header, rows) -> str:
    """Columns padded to their widest cell, for the console."""
    rows = [list(map(str, r)) for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(list(map(str, header))), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _jsonable(obj):
    """Numbers json does not know (numpy, 0-d tensors) as floats; anything else (paths, dtypes) as its text."""
    try:
        return float(obj)
    except (TypeError, ValueError):
        return str(obj)


def write_json(path, doc, indent: int = 1) -> Path:
    """`doc` as JSON at `path` (parent folders created), through a temporary file and a rename, so an interrupted
    benchmark never leaves half a file where an earlier complete one was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=indent, default=_jsonable))
    os.replace(tmp, path)
    return path


def mean_present(xs) -> float | None:
    """The mean of the values of `xs` that are not None; None when there are none."""
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def fmt_na(x, digits: int = 4) -> str:
    """`x` with `digits` decimals; 'n/a' for None or NaN."""
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"
