"""Datasets: built-in generated tasks, GSM8K / MATH through `datasets`, local files; prompts and the prompt sampler.

``load_examples(cfg.data, "train" | "eval") -> list[Example]``. What ``data.dataset`` may be:

arithmetic (built in)
    Seeded plain-text questions ("What is 7 + 5?", answer "12"; no LaTeX: the small default model does worse on
    it). Levels (``data.levels`` picks any subset; each level gets an equal share of the problems, and a level
    whose problems run out leaves its share to the others):

    =====  ============================================================  =============
    level  problems                                                      distinct
    =====  ============================================================  =============
    1      single-digit addition, a + b with a, b in 0..9                100
    2      single-digit addition or subtraction (a - b with a >= b)      155
    3      two-digit addition, a, b in 10..99                            8,100
    4      two-digit addition or subtraction (non-negative results)      12,195
    5      two-digit times one-digit, a * b with a in 10..99, b in 2..9  720
    6      three-digit addition or subtraction (non-negative results)    1,215,450
    7      two-digit times two-digit                                     8,100
    8      exact division, (q*d) / d with q in 10..99, d in 2..9         720
    =====  ============================================================  =============

    Levels 2 and 4 contain levels 1 and 3: a question is never used twice, whichever levels drew it.

algebra (built in)
    Seeded one-step linear equations, "Solve for x: 3x + 4 = 19." with answer "5":

    =====  ============================================================  =============
    level  problems                                                      distinct
    =====  ============================================================  =============
    1      x + a = b (a in 1..20, x in 0..20)                            420
    2      a x = b (a in 2..12, x in 1..20)                              220
    3      a x + b = c (a in 2..9, b and x in 1..20)                     3,200
    4      a x - b = c (a in 2..9, b and x in 1..20; c may be negative)  3,200
    5      a x + b = c with negative coefficients, constants, solutions  12,800
    6      x on both sides: a x + b = c x + d (a > c, x in 1..20)        15,120
    =====  ============================================================  =============

wordproblems (built in)
    Seeded one- and two-step stories over 12 names and 10 kinds of objects, "Tom has 3 apples. Tom gets 5 more
    apples. How many apples does Tom have now?" with answer "8"; the prompts differ more from one another than
    the other tasks' (used by ``bench/value_mse.py`` as the second task family):

    =====  ============================================================  =============
    level  problems                                                      distinct
    =====  ============================================================  =============
    1      has a, gets b more (a, b in 2..9)                             7,680
    2      has a, gives b away (a in 10..20, b in 2..9)                  10,560
    3      sold a in the morning and b in the afternoon (10..99)         972,000
    4      a bags of b items (a in 2..9, b in 2..12)                     10,560
    5      has a, buys b, gives c away (a in 10..30, b, c in 2..9)       161,280
    6      shares q*d equally among d friends (q in 2..12, d in 2..9)    10,560
    =====  ============================================================  =============

    For the built-in tasks the eval problems are drawn first (they depend only on data.seed, data.levels and
    data.eval_size, not on data.train_size) and the training problems exclude them: the splits never share a
    question. ``data.train_size`` / ``data.eval_size`` are counts (0 = none); when the chosen levels hold fewer
    distinct questions than asked for, both are scaled down in proportion and a warning says so.

gsm8k, math (Hugging Face hub, through `datasets`, imported lazily)
    gsm8k: ``openai/gsm8k`` config ``main``; the answer is the text after ``####`` with thousands commas removed.
    math: ``DigitalLearningGmbH/MATH-lighteval`` (the Hendrycks MATH problems; the original
    ``hendrycks/competition_math`` was taken down); the answer is the last ``\\boxed{}`` of the solution, and
    meta carries ``level`` (1-5) and ``family`` (the subject). ``hf:owner/name`` or ``hf:owner/name:config``
    loads any other hub dataset with ``data.question_field`` / ``data.answer_field``. Splits are
    ``data.split_train`` / ``data.split_eval``; ``data.train_size`` caps the training rows (0 = all) and
    ``data.eval_size`` the eval rows (0 = none), each a seeded random subset. Without network access this
    raises DataError suggesting a local file.

a local file: ``.jsonl``, ``.json`` (a list of objects, or JSON lines), ``.csv`` or ``.parquet``
    Fields ``data.question_field`` / ``data.answer_field``. One file serves both splits: the questions (duplicates
    dropped) are shuffled with ``data.seed`` and the first ``data.eval_size`` are held out for eval (at most half
    the file); the rest are for training (capped at ``data.train_size``, 0 = all). An answer holding ``####``
    (a GSM8K solution) keeps the text after it; one holding ``\\boxed{}`` (a MATH solution) keeps the box content.
    A ``level`` field (an int or "Level 3") and a ``type``/``subject`` field go to meta for eval breakdowns.

Bad rows (missing or empty question/answer, values that are not text or numbers, lines that are not valid UTF-8
or not valid JSON) are skipped and counted; so are gold answers that math-verify cannot parse. When either share
exceeds ``data.max_bad_fraction`` loading stops with a DataError naming the file, the count, the first bad rows
and the reason; below it, a warning lists them.
"""
from __future__ import annotations

import contextlib
import csv
import functools
import hashlib
import io
import json
import logging
import math
import os
import random
import re
import socket
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from .errors import DataError

log = logging.getLogger(__name__)

SPLITS = ("train", "eval")
LOCAL_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
_PERMUTE_MAX = 200_000  # level spaces up to this size are drawn as a full seeded permutation


@dataclass
class Example:
    id: str
    question: str
    answer: str
    meta: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------
# built-in generated tasks
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Family:
    name: str
    size: int
    make: Callable[[int], tuple[str, str]]  # index in [0, size) -> (question, answer)


def _grid(*axes: Sequence) -> tuple[int, Callable[[int], tuple]]:
    """Mixed-radix indexing over the cartesian product of `axes` (ranges or lists)."""
    size = 1
    for a in axes:
        size *= len(a)

    def decode(i: int) -> tuple:
        out = []
        for a in reversed(axes):
            i, r = divmod(i, len(a))
            out.append(a[r])
        return tuple(reversed(out))

    return size, decode


def _tri(lo: int, hi: int) -> tuple[int, Callable[[int], tuple[int, int]]]:
    """Pairs (a, b) with lo <= b <= a <= hi, indexed triangularly."""
    n = hi - lo + 1

    def decode(i: int) -> tuple[int, int]:
        a = (math.isqrt(8 * i + 1) - 1) // 2
        return lo + a, lo + i - a * (a + 1) // 2

    return n * (n + 1) // 2, decode


def _binop(name: str, space: tuple[int, Callable], op: str, fn: Callable[[int, int], int]) -> _Family:
    size, decode = space

    def make(i: int) -> tuple[str, str]:
        a, b = decode(i)
        return f"What is {a} {op} {b}?", str(fn(a, b))

    return _Family(name, size, make)


def _division() -> _Family:
    size, decode = _grid(range(10, 100), range(2, 10))

    def make(i: int) -> tuple[str, str]:
        q, d = decode(i)
        return f"What is {q * d} / {d}?", str(q)

    return _Family("div", size, make)


def _lin(a: int, var: str = "x") -> str:
    return var if a == 1 else f"-{var}" if a == -1 else f"{a}{var}"


def _const(b: int) -> str:
    return "" if b == 0 else f" + {b}" if b > 0 else f" - {-b}"


def _equation(name: str, axes: Sequence[Sequence], render: Callable[..., tuple[str, int]]) -> _Family:
    size, decode = _grid(*axes)

    def make(i: int) -> tuple[str, str]:
        lhs_rhs, x = render(*decode(i))
        return f"Solve for x: {lhs_rhs}.", str(x)

    return _Family(name, size, make)


def _arith_families() -> dict[str, _Family]:
    add, sub, mul = (lambda a, b: a + b), (lambda a, b: a - b), (lambda a, b: a * b)
    fams = [
        _binop("add1", _grid(range(10), range(10)), "+", add),
        _binop("sub1", _tri(0, 9), "-", sub),
        _binop("add2", _grid(range(10, 100), range(10, 100)), "+", add),
        _binop("sub2", _tri(10, 99), "-", sub),
        _binop("mul2x1", _grid(range(10, 100), range(2, 10)), "*", mul),
        _binop("add3", _grid(range(100, 1000), range(100, 1000)), "+", add),
        _binop("sub3", _tri(100, 999), "-", sub),
        _binop("mul2x2", _grid(range(10, 100), range(10, 100)), "*", mul),
        _division(),
    ]
    return {f.name: f for f in fams}


def _algebra_families() -> dict[str, _Family]:
    nonzero = [v for v in range(-9, 10) if abs(v) >= 2]
    consts = [v for v in range(-20, 21) if v != 0]
    both_sides = [(a, c) for a in range(2, 10) for c in range(1, a)]
    fams = [
        _equation("x+a=b", [range(1, 21), range(0, 21)], lambda a, x: (f"x + {a} = {x + a}", x)),
        _equation("ax=b", [range(2, 13), range(1, 21)], lambda a, x: (f"{a}x = {a * x}", x)),
        _equation("ax+b=c", [range(2, 10), range(1, 21), range(1, 21)],
                  lambda a, b, x: (f"{_lin(a)} + {b} = {a * x + b}", x)),
        _equation("ax-b=c", [range(2, 10), range(1, 21), range(1, 21)],
                  lambda a, b, x: (f"{_lin(a)} - {b} = {a * x - b}", x)),
        _equation("ax+b=c(neg)", [nonzero, consts, range(-20, 0)],
                  lambda a, b, x: (f"{_lin(a)}{_const(b)} = {a * x + b}", x)),
        _equation("ax+b=cx+d", [both_sides, range(0, 21), range(1, 21)],
                  lambda ac, b, x: (f"{_lin(ac[0])}{_const(b)} = {_lin(ac[1])}{_const((ac[0] - ac[1]) * x + b)}",
                                    x)),
    ]
    return {f.name: f for f in fams}


_NAMES = ("Tom", "Anna", "Sam", "Maria", "Ben", "Lucy", "Omar", "Mia", "Leo", "Zoe", "Ravi", "Emma")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells", "cards", "balloons")


def _story(name: str, axes: Sequence[Sequence], render: Callable[..., tuple[str, int]]) -> _Family:
    """A word-problem family: `render(person, items, *numbers) -> (question, answer)` over a grid of names,
    objects and numbers (quantities start at 2, so every noun is plural)."""
    size, decode = _grid(_NAMES, _ITEMS, *axes)

    def make(i: int) -> tuple[str, str]:
        q, x = render(*decode(i))
        return q, str(x)

    return _Family(name, size, make)


def _word_families() -> dict[str, _Family]:
    fams = [
        _story("get", [range(2, 10), range(2, 10)], lambda n, it, a, b: (
            f"{n} has {a} {it}. {n} gets {b} more {it}. How many {it} does {n} have now?", a + b)),
        _story("give", [range(10, 21), range(2, 10)], lambda n, it, a, b: (
            f"{n} has {a} {it} and gives {b} of them to a friend. How many {it} does {n} have left?", a - b)),
        _story("sell", [range(10, 100), range(10, 100)], lambda n, it, a, b: (
            f"{n} sold {a} {it} in the morning and {b} {it} in the afternoon. How many {it} did {n} sell in "
            f"all?", a + b)),
        _story("bags", [range(2, 10), range(2, 13)], lambda n, it, a, b: (
            f"{n} buys {a} bags with {b} {it} in each bag. How many {it} does {n} buy?", a * b)),
        _story("twostep", [range(10, 31), range(2, 10), range(2, 10)], lambda n, it, a, b, c: (
            f"{n} has {a} {it}, buys {b} more, then gives {c} away. How many {it} does {n} have now?", a + b - c)),
        _story("share", [range(2, 13), range(2, 10)], lambda n, it, q, d: (
            f"{n} shares {q * d} {it} equally among {d} friends. How many {it} does each friend get?", q)),
    ]
    return {f.name: f for f in fams}


@dataclass(frozen=True)
class _Task:
    name: str
    families: dict[str, _Family]
    levels: dict[int, tuple[str, ...]]  # level -> family names
    descriptions: dict[int, str]


@functools.lru_cache(maxsize=None)
def _task(name: str) -> _Task:
    if name == "arithmetic":
        return _Task(name, _arith_families(), {
            1: ("add1",), 2: ("add1", "sub1"), 3: ("add2",), 4: ("add2", "sub2"), 5: ("mul2x1",),
            6: ("add3", "sub3"), 7: ("mul2x2",), 8: ("div",),
        }, {
            1: "single-digit addition", 2: "single-digit add/subtract", 3: "two-digit addition",
            4: "two-digit add/subtract", 5: "two-digit x one-digit", 6: "three-digit add/subtract",
            7: "two-digit x two-digit", 8: "exact division",
        })
    if name == "wordproblems":
        return _Task(name, _word_families(), {
            1: ("get",), 2: ("give",), 3: ("sell",), 4: ("bags",), 5: ("twostep",), 6: ("share",),
        }, {
            1: "gets more (one-digit sum)", 2: "gives away (subtraction)", 3: "two-digit sum",
            4: "bags of items (multiplication)", 5: "two steps (add then subtract)", 6: "equal shares (division)",
        })
    return _Task(name, _algebra_families(), {
        1: ("x+a=b",), 2: ("ax=b",), 3: ("ax+b=c",), 4: ("ax-b=c",), 5: ("ax+b=c(neg)",), 6: ("ax+b=cx+d",),
    }, {
        1: "x + a = b", 2: "a x = b", 3: "a x + b = c", 4: "a x - b = c", 5: "negative numbers",
        6: "x on both sides",
    })


BUILTIN_TASKS = ("arithmetic", "algebra", "wordproblems")


def level_table(task: str) -> dict[int, str]:
    """{level: description} of a built-in task (for help texts and eval breakdowns)."""
    return dict(_task(task).descriptions)


def _check_levels(task: _Task, levels: Any) -> list[int]:
    accepted = ", ".join(f"{k} ({v})" for k, v in task.descriptions.items())
    if not isinstance(levels, (list, tuple)) or not levels:
        raise DataError(f"data.levels: expected a non-empty list of levels for data.dataset={task.name}, got "
                        f"{levels!r}; accepted levels: {accepted}")
    bad = [lv for lv in levels if isinstance(lv, bool) or not isinstance(lv, int) or lv not in task.levels]
    if bad:
        raise DataError(f"data.levels: {bad} not accepted for data.dataset={task.name}; accepted levels: {accepted}")
    return list(dict.fromkeys(levels))


class _LevelStream:
    """A level's problems in a seeded random order, without repeats: (family, index) pairs."""

    def __init__(self, task: _Task, level: int, rng: random.Random):
        self.fams = [task.families[n] for n in task.levels[level]]
        self.size = sum(f.size for f in self.fams)
        self.rng = rng
        self.count = 0
        if self.size <= _PERMUTE_MAX:
            self.order: list[int] | None = list(range(self.size))
            rng.shuffle(self.order)
        else:
            self.order, self.seen = None, set()

    def _locate(self, i: int) -> tuple[_Family, int]:
        for f in self.fams:
            if i < f.size:
                return f, i
            i -= f.size
        raise IndexError(i)

    def next(self) -> tuple[_Family, int] | None:
        if self.count >= self.size:
            return None
        if self.order is not None:
            i = self.order[self.count]
        else:
            i = self.rng.randrange(self.size)
            while i in self.seen:
                i = self.rng.randrange(self.size)
            self.seen.add(i)
        self.count += 1
        return self._locate(i)


def _draw(task: _Task, levels: list[int], n: int, seed: int, tag: str, used: set[str]) -> list[Example]:
    """n distinct problems, round-robin over the levels, skipping questions in `used` (which is updated)."""
    streams = {lv: _LevelStream(task, lv, random.Random(f"{task.name}/{seed}/{tag}/{lv}")) for lv in levels}
    out: list[Example] = []
    active = list(levels)
    while len(out) < n and active:
        for lv in list(active):
            if len(out) >= n:
                break
            while True:
                nxt = streams[lv].next()
                if nxt is None:
                    active.remove(lv)
                    log.info("%s level %d: all its %d problems are in use; other levels fill its share",
                             task.name, lv, streams[lv].size)
                    break
                fam, i = nxt
                q, a = fam.make(i)
                if q in used:
                    continue
                used.add(q)
                out.append(Example(id=f"{task.name}/{fam.name}/{i}", question=q, answer=a,
                                   meta={"level": lv, "family": fam.name, "source": task.name}))
                break
    return out


def _builtin(cfg, split: str) -> list[Example]:
    task = _task(cfg.dataset)
    levels = _check_levels(task, cfg.levels)
    fam_names = {n for lv in levels for n in task.levels[lv]}
    capacity = sum(task.families[n].size for n in fam_names)
    n_eval, n_train = int(cfg.eval_size), int(cfg.train_size)
    if n_eval + n_train > capacity:
        if n_eval == 0:
            eval_n, train_n = 0, capacity
        elif n_train == 0:
            eval_n, train_n = capacity, 0
        else:
            eval_n = min(n_eval, capacity - 1, max(1, round(capacity * n_eval / (n_eval + n_train))))
            train_n = min(n_train, capacity - eval_n)
        log.warning("%s levels %s hold only %d distinct questions; using %d train + %d eval instead of the "
                    "requested %d + %d (data.train_size + data.eval_size)", task.name, levels, capacity,
                    train_n, eval_n, n_train, n_eval)
    else:
        eval_n, train_n = n_eval, n_train
    used: set[str] = set()
    eval_examples = _draw(task, levels, eval_n, cfg.seed, "eval", used)
    if split == "eval":
        return eval_examples
    return _draw(task, levels, train_n, cfg.seed, "train", used)


# ---------------------------------------------------------------------------------------------------------------
# rows from files and the hub: validation, bad-row accounting
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Row:
    row: int  # 1-based line (jsonl/csv) or item number (json/parquet/hub)
    question: str
    answer: str
    meta: tuple  # sorted (key, value) pairs


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


def _gold_from_solution(text: str) -> str:
    """GSM8K solutions keep the text after the last ####; MATH solutions keep the last \\boxed{} content."""
    from .rewards import _boxed_contents

    if "####" in text:
        return text.rsplit("####", 1)[1].strip().replace(",", "")
    if "\\boxed" in text or "\\fbox" in text:
        boxes = [b for b in _boxed_contents(text.replace("\\fbox", "\\boxed")) if b.strip()]
        if boxes:
            return boxes[-1].strip()
    return text


def _level_of(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        m = re.search(r"\d+", v)
        return int(m.group()) if m else None
    return None


def _row_meta(raw: dict) -> tuple:
    meta = {}
    lv = _level_of(raw.get("level"))
    if lv is not None:
        meta["level"] = lv
    for k in ("type", "subject", "family"):
        if isinstance(raw.get(k), str) and raw[k].strip():
            meta["family"] = raw[k].strip()
            break
    return tuple(sorted(meta.items()))


def _validate_rows(raw_rows: list[tuple[int, Any]], qf: str, af: str, where: str,
                   answer_fn: Callable[[str], str | None]) -> tuple[list[_Row], list[tuple[int, str]]]:
    rows, bad = [], []
    for n, raw in raw_rows:
        if not isinstance(raw, dict):
            bad.append((n, f"a JSON {type(raw).__name__}, not an object"))
            continue
        q, why_q = _as_text(raw.get(qf))
        a, why_a = _as_text(raw.get(af))
        if q is None:
            bad.append((n, f"question field {qf!r} {why_q}"))
            continue
        if a is None:
            bad.append((n, f"answer field {af!r} {why_a}"))
            continue
        gold = answer_fn(a)
        if not gold:
            bad.append((n, f"no answer found in field {af!r}"))
            continue
        rows.append(_Row(n, q, gold, _row_meta(raw)))
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
    keys: set[str] = set(columns or ())
    if columns is None:
        for _, raw in raw_rows[:2000]:
            if isinstance(raw, dict):
                keys.update(k for k in raw if isinstance(k, str))
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
    from .rewards import gold_is_parseable

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
                    meta={"source": source, "row": r.row, **dict(r.meta)}) for r in rows]


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


def _read_file(path: Path, qf: str) -> tuple[list[tuple[int, Any]], list[tuple[int, str]], int, list | None, str]:
    """(rows, bad, total, columns or None, row label)."""
    suffix = path.suffix.lower()
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
                    max_bad: float) -> tuple[tuple[_Row, ...], str]:
    path = Path(path_str)
    raw, bad, total, columns, label = _read_file(path, qf)
    if total == 0:
        raise DataError(f"{path}: no rows")
    _check_fields(raw, qf, af, str(path), columns)
    rows, bad2 = _validate_rows(raw, qf, af, str(path), _gold_from_solution)
    bad = sorted(bad + bad2)
    _check_bad(str(path), len(bad), total, _fmt_bad(bad, label), "rows are malformed", max_bad,
               "Fix or remove those rows, or raise data.max_bad_fraction.")
    seen, unique = set(), []
    for r in rows:
        if r.question not in seen:
            seen.add(r.question)
            unique.append(r)
    if len(unique) < len(rows):
        log.info("%s: dropped %d rows that repeat an earlier question", path, len(rows) - len(unique))
    return tuple(unique), label


def _local(cfg, split: str, path: Path) -> list[Example]:
    if not path.is_file():
        raise DataError(f"data.dataset: file {str(path)!r} not found")
    st = path.stat()
    rows, label = _load_file_rows(str(path.resolve()), st.st_mtime_ns, st.st_size, cfg.question_field,
                                  cfg.answer_field, float(cfg.max_bad_fraction))
    rows = list(rows)
    random.Random(f"local/{cfg.seed}").shuffle(rows)
    n_eval = int(cfg.eval_size)
    if n_eval > len(rows) // 2:
        log.warning("%s: %d distinct questions; holding out %d for eval instead of data.eval_size=%d "
                    "(at most half the file)", path, len(rows), len(rows) // 2, n_eval)
        n_eval = len(rows) // 2
    where = f"{path} ({split} split)"
    # the eval rows are the first n_eval parseable ones in seeded order; the rest (in order) are for training
    from .rewards import gold_is_parseable
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

def _gsm8k_answer(a: str) -> str | None:
    if "####" not in a:
        return None
    return a.rsplit("####", 1)[1].strip().replace(",", "") or None


def _math_answer(solution: str) -> str | None:
    from .rewards import _boxed_contents

    boxes = [b for b in _boxed_contents(solution.replace("\\fbox", "\\boxed")) if b.strip()]
    return boxes[-1].strip() if boxes else None


HUB_DATASETS = {
    "gsm8k": dict(path="openai/gsm8k", name="main", question="question", answer="answer", extract=_gsm8k_answer),
    "math": dict(path="DigitalLearningGmbH/MATH-lighteval", name=None, question="problem", answer="solution",
                 extract=_math_answer),
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
                    extract=_gold_from_solution)
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
    _check_fields(raw, spec["question"], spec["answer"], where, list(ds.column_names))
    extract = spec["extract"]
    rows, bad = _validate_rows(raw, spec["question"], spec["answer"], where, extract)
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
        return _builtin(cfg, split)
    if name in HUB_DATASETS or name.startswith("hf:"):
        return _hub(cfg, split, name)
    path = Path(os.path.expanduser(name))
    if path.suffix.lower() in LOCAL_SUFFIXES:
        return _local(cfg, split, path)
    if path.exists():
        raise DataError(f"data.dataset: {name!r} has an unsupported file type; accepted: "
                        f"{', '.join(LOCAL_SUFFIXES)}")
    raise DataError(f"data.dataset: {name!r} is not accepted; choose one of {', '.join(BUILTIN_TASKS)} (built in), "
                    f"{', '.join(HUB_DATASETS)} (hub), hf:owner/name[:config], or a path to a "
                    f"{'/'.join(LOCAL_SUFFIXES)} file")


# ---------------------------------------------------------------------------------------------------------------
# prompts
# ---------------------------------------------------------------------------------------------------------------

_CHATML_SYSTEM = "<|im_start|>system\n{}<|im_end|>\n"
_SENT_SYS, _SENT_USER = "BASISLITE-SYSTEM-SENTINEL", "BASISLITE-USER-SENTINEL"


@dataclass(frozen=True)
class _TemplateInfo:
    supports_system: bool
    default_system: str | None  # the text the template inserts when no system message is given
    strip_block: str | None  # the rendered default system turn, removed from prompts (ChatML templates)


_template_cache: dict[tuple, _TemplateInfo] = {}


def _render(tokenizer, messages: list[dict]) -> str:
    out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return out if isinstance(out, str) else str(out)


def _template_info(tokenizer) -> _TemplateInfo:
    key = (tokenizer.chat_template, getattr(tokenizer, "bos_token", None), getattr(tokenizer, "eos_token", None))
    if key in _template_cache:
        return _template_cache[key]
    r0 = _render(tokenizer, [{"role": "user", "content": _SENT_USER}])
    try:
        rs = _render(tokenizer, [{"role": "system", "content": _SENT_SYS}, {"role": "user", "content": _SENT_USER}])
        supports = _SENT_SYS in rs
    except Exception:
        supports, rs = False, ""
    default = strip = None
    if supports:
        pre, post = rs.split(_SENT_SYS, 1)
        if r0.startswith(pre) and r0.endswith(post) and len(r0) > len(pre) + len(post):
            default = r0[len(pre):len(r0) - len(post)]
            block = _CHATML_SYSTEM.format(default)
            if block in r0 and _SENT_USER in r0.replace(block, "", 1):
                strip = block
            else:
                log.warning("the chat template inserts a default system prompt (%r) and is not ChatML; an empty "
                            "system message is passed instead", default[:80])
    info = _TemplateInfo(supports, default, strip)
    _template_cache[key] = info
    return info


def format_prompt(tokenizer, question: str, cfg) -> str:
    """The prompt text for one question: the tokenizer's chat template with a generation prompt.

    The user message is the question plus data.instruction; data.system_prompt becomes a system message only when
    non-empty. With an empty system prompt no system text appears at all: a default system prompt that the
    template inserts by itself (SmolLM2, Qwen2.5) is removed for ChatML templates (or replaced by an empty system
    message for others). A template that rejects the system role gets the system prompt prepended to the user
    message. Without a chat template: "Question: ...\\nAnswer:"."""
    instruction = (cfg.instruction or "").strip()
    content = question.strip() + (" " + instruction if instruction else "")
    system = (cfg.system_prompt or "").strip()
    if not getattr(tokenizer, "chat_template", None):
        head = f"{system}\n\n" if system else ""
        return f"{head}Question: {content}\nAnswer:"
    info = _template_info(tokenizer)
    user = {"role": "user", "content": content}
    if system:
        if info.supports_system:
            return _render(tokenizer, [{"role": "system", "content": system}, user])
        return _render(tokenizer, [{"role": "user", "content": f"{system}\n\n{content}"}])
    if info.default_system is None:
        return _render(tokenizer, [user])
    if info.strip_block is not None:
        return _render(tokenizer, [user]).replace(info.strip_block, "", 1)
    return _render(tokenizer, [{"role": "system", "content": ""}, user])


# ---------------------------------------------------------------------------------------------------------------
# the prompt sampler
# ---------------------------------------------------------------------------------------------------------------

class PromptSampler:
    """Endless batches of examples: each epoch is a fresh permutation seeded with seed + epoch, and a batch that
    runs past the end of an epoch continues into the next one (every batch is full).

    ``state_dict()`` / ``load_state_dict()`` carry (epoch, position), so a resumed run continues with exactly the
    prompts the interrupted run would have drawn next."""

    def __init__(self, examples: Sequence[Example], batch_size: int, seed: int = 0):
        if not examples:
            raise ValueError("PromptSampler: no examples to sample from")
        if batch_size <= 0:
            raise ValueError(f"PromptSampler: batch_size must be > 0, got {batch_size}")
        self.examples = list(examples)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._order_epoch: int | None = None
        self._order: list[int] = []

    def _order_for(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            order = list(range(len(self.examples)))
            random.Random(self.seed + epoch).shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def __iter__(self) -> Iterator[list[Example]]:
        return self

    def __next__(self) -> list[Example]:
        n = len(self.examples)
        batch: list[Example] = []
        while len(batch) < self.batch_size:
            order = self._order_for(self.epoch)
            take = min(self.batch_size - len(batch), n - self.position)
            batch.extend(self.examples[i] for i in order[self.position:self.position + take])
            self.position += take
            if self.position >= n:
                self.epoch, self.position = self.epoch + 1, 0
        return batch

    def _fingerprint(self) -> str:
        h = hashlib.sha1()
        for ex in self.examples:
            h.update(ex.id.encode("utf-8", "surrogatepass") + b"\0")
        return h.hexdigest()[:16]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "batch_size": self.batch_size,
                "num_examples": len(self.examples), "fingerprint": self._fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        n = state.get("num_examples", len(self.examples))
        if n != len(self.examples):
            raise ValueError(f"PromptSampler: the checkpoint was taken over {n} examples, this run has "
                             f"{len(self.examples)}; resume with the same data settings")
        if state.get("fingerprint") not in (None, self._fingerprint()):
            log.warning("PromptSampler: the examples differ from the checkpoint's (same count, other ids); the "
                        "resumed prompt order will not match the interrupted run")
        if state.get("seed", self.seed) != self.seed:
            log.warning("PromptSampler: checkpoint seed %s differs from this run's %s; using the checkpoint's",
                        state.get("seed"), self.seed)
            self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order_epoch = None
