"""Rows of files and hub datasets: the question and answer fields (TRL's names as fallbacks), text or
conversational questions, gold answers (``gold_answer``), validation, bad-row accounting, and the seeded subset
that becomes ``Example``s. Read by loading.py for both sources."""
from __future__ import annotations

import json
import logging
import math
import random
import re
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any

from ..errors import DataError
from .example import Example

log = logging.getLogger("basis_lite.data.loading")  # the warnings of loading data, whichever module finds them

MAX_GOLD_CHARS = 2000  # a longer gold answer is a bad row (math-verify would spend seconds and log all of it)
GOLD_STYLES = ("gsm8k", "math", "any")

@dataclass(frozen=True)
class Row:
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


def field_keys(raw_rows: list[tuple[int, Any]], columns=None) -> set[str]:
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
        from ..rewards.answers import last_nonempty_boxed

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


def validate_rows(raw_rows: list[tuple[int, Any]], qf: str, af: str, where: str,
                   gold_style: str, max_question_chars: int = 0) -> tuple[list[Row], list[tuple[int, str]]]:
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
        rows.append(Row(n, q, gold, _row_meta(raw, qf, af, gold),
                         None if msgs is None else json.dumps(msgs, ensure_ascii=False)))
    if cut:
        log.warning("%s: cut %d question(s) longer than data.max_question_chars=%d characters to their last %d "
                    "(first: row %d, %d characters)", where, len(cut), max_question_chars, max_question_chars,
                    cut[0][0], cut[0][1])
    return rows, bad


def fmt_bad(bad: list[tuple[int, str]], label: str, k: int = 5) -> str:
    return ", ".join(f"{label} {n} ({why})" for n, why in bad[:k]) + (", ..." if len(bad) > k else "")


def check_bad(where: str, n_bad: int, total: int, first: str, what: str, max_bad: float, hint: str) -> None:
    if total == 0 or n_bad == 0:
        return
    frac = n_bad / total
    if frac > max_bad:
        raise DataError(f"{where}: {n_bad} of {total} {what} ({frac:.1%}), more than data.max_bad_fraction="
                        f"{max_bad:g}; first: {first}. {hint}")
    log.warning("%s: skipped %d of %d %s (%.1f%%); first: %s", where, n_bad, total, what, 100 * frac, first)


def check_fields(raw_rows: list[tuple[int, Any]], qf: str, af: str, where: str, columns=None) -> None:
    keys = field_keys(raw_rows, columns)
    if not keys:
        return
    missing = [f for f in (qf, af) if f not in keys]
    if missing:
        names = {qf: "data.question_field", af: "data.answer_field"}
        raise DataError(f"{where}: no field {', '.join(repr(m) for m in missing)} in the data; available fields: "
                        f"{', '.join(sorted(keys)[:30])}. Set " + " / ".join(names[m] for m in missing) + ".")


def select_rows(rows: list[Row], n: int | None, seed_tag: str, where: str, max_bad: float, label: str,
            shuffle: bool = True) -> list[Row]:
    """Take up to n rows (None = all) in seeded order whose gold answer math-verify can parse."""
    from ..rewards.answers import gold_is_parseable

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
    check_bad(where, len(unparseable), checked, fmt_bad(unparseable, label), "gold answers math-verify cannot "
               "parse", max_bad, "Check data.answer_field, or clean the answers (plain numbers or LaTeX).")
    return out


def to_examples(rows: list[Row], prefix: str, source: str) -> list[Example]:
    return [Example(id=f"{prefix}/{r.row}", question=r.question, answer=r.answer,
                    meta={"source": source, "row": r.row, **dict(r.meta)},
                    messages=None if r.messages is None else json.loads(r.messages)) for r in rows]
