"""The built-in generated tasks: arithmetic, algebra and wordproblems.

Each task is a set of problem families (a family maps an index to one question and its answer, so a level's
problems can be drawn without repeats by index) grouped into difficulty levels. ``load_builtin(cfg, split, name)``
draws a config's train or eval split; ``level_table(task)`` gives the level descriptions. A name that is not a
built-in task raises DataError.

arithmetic (built in)
    Seeded plain-text questions ("What is 7 + 5?", answer "12"; no LaTeX: the small default model does worse on
    it). Levels (``data.levels`` picks any subset; each level gets an equal share of the problems, see "Shares"
    below):

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

Shares: each chosen level gets an equal share of each split, drawn round-robin. The eval problems are drawn first (they depend only on data.seed, data.levels and data.eval_size, not on
data.train_size) and the training problems exclude them: the splits never share a question. ``data.train_size`` /
``data.eval_size`` are counts (0 = none); when the chosen levels hold fewer distinct questions than asked for, both
are scaled down in proportion and a warning says so, and every question is used once. Otherwise, when a level runs
out of distinct questions before its share of the TRAINING split is full (e.g. level 1's 100 one-digit sums, 50 of
which went to the eval split), it revisits the training questions it drew, in the same order, so it keeps its share
of the training draw over the whole run (the log says how many distinct questions each such level has and how often
each is seen); ``data.revisit: false`` leaves its share to the other levels instead (how runs drew before). The eval
split never repeats a question.

Two held-out sets: ``data.eval_set: 1`` draws a confirmation set from the questions that set 0 (the default, the
development set) does not hold, with the same share per level, and the training split then leaves out set 1 only
(set 0's questions may be trained on). A level too small for both sets leaves its share of set 1 to the others.
"""
from __future__ import annotations

import functools
import logging
import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..errors import DataError
from .example import Example

log = logging.getLogger(__name__)

_PERMUTE_MAX = 200_000  # level spaces up to this size are drawn as a full seeded permutation


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


def _arithmetic() -> _Task:
    return _Task("arithmetic", _arith_families(), {
        1: ("add1",), 2: ("add1", "sub1"), 3: ("add2",), 4: ("add2", "sub2"), 5: ("mul2x1",),
        6: ("add3", "sub3"), 7: ("mul2x2",), 8: ("div",),
    }, {
        1: "single-digit addition", 2: "single-digit add/subtract", 3: "two-digit addition",
        4: "two-digit add/subtract", 5: "two-digit x one-digit", 6: "three-digit add/subtract",
        7: "two-digit x two-digit", 8: "exact division",
    })


def _algebra() -> _Task:
    return _Task("algebra", _algebra_families(), {
        1: ("x+a=b",), 2: ("ax=b",), 3: ("ax+b=c",), 4: ("ax-b=c",), 5: ("ax+b=c(neg)",), 6: ("ax+b=cx+d",),
    }, {
        1: "x + a = b", 2: "a x = b", 3: "a x + b = c", 4: "a x - b = c", 5: "negative numbers",
        6: "x on both sides",
    })


def _wordproblems() -> _Task:
    return _Task("wordproblems", _word_families(), {
        1: ("get",), 2: ("give",), 3: ("sell",), 4: ("bags",), 5: ("twostep",), 6: ("share",),
    }, {
        1: "gets more (one-digit sum)", 2: "gives away (subtraction)", 3: "two-digit sum",
        4: "bags of items (multiplication)", 5: "two steps (add then subtract)", 6: "equal shares (division)",
    })


_MAKERS: dict[str, Callable[[], _Task]] = {"arithmetic": _arithmetic, "algebra": _algebra,
                                          "wordproblems": _wordproblems}
BUILTIN_TASKS = tuple(_MAKERS)  # ("arithmetic", "algebra", "wordproblems"), in this order in messages


@functools.lru_cache(maxsize=None)
def _task(name: str) -> _Task:
    """The built-in task called `name` (built once, then cached); DataError for any other name."""
    if name not in _MAKERS:
        raise DataError(f"data.dataset: {name!r} is not a built-in task; built-in tasks: {', '.join(BUILTIN_TASKS)}")
    return _MAKERS[name]()


def level_table(task: str) -> dict[int, str]:
    """{level: description} of a built-in task (for help texts and eval breakdowns)."""
    return dict(_task(task).descriptions)


def check_levels(name: str, levels: Any) -> list[int]:
    """data.levels checked for built-in task `name` (config validation calls it); DataError naming what is accepted."""
    return _check_levels(_task(name), levels)


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


def _draw(task: _Task, levels: list[int], n: int, seed: int, tag: str, used: set[str],
          revisit: bool = False) -> list[Example]:
    """n problems, round-robin over the levels, skipping questions in `used` (which is updated). A level whose
    questions run out leaves its share to the others, or with `revisit` (and at least one question drawn) repeats
    the questions it drew in this call, in the same order, so that it keeps its share."""
    streams = {lv: _LevelStream(task, lv, random.Random(f"{task.name}/{seed}/{tag}/{lv}")) for lv in levels}
    out: list[Example] = []
    drawn: dict[int, list[Example]] = {lv: [] for lv in levels}
    repeats: dict[int, int] = {}  # level -> questions drawn again so far
    active = list(levels)
    while len(out) < n and active:
        for lv in list(active):
            if len(out) >= n:
                break
            if lv in repeats:
                out.append(drawn[lv][repeats[lv] % len(drawn[lv])])
                repeats[lv] += 1
                continue
            while True:
                nxt = streams[lv].next()
                if nxt is None and revisit and drawn[lv]:
                    out.append(drawn[lv][0])
                    repeats[lv] = 1
                    break
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
                drawn[lv].append(out[-1])
                break
    for lv, extra in repeats.items():
        k = len(drawn[lv])
        log.info("%s level %d: only %d distinct %s questions are left for it; each is revisited (about %.1f times "
                 "in the %d %s problems) so that the level keeps its share (data.revisit: false gives its share to "
                 "the other levels instead)", task.name, lv, k, tag, (k + extra) / k, n, tag)
    return out


def _eval_tag(eval_set: int) -> str:
    """The stream tag of held-out set `eval_set` (set 0 keeps the draw it always had)."""
    return "eval" if eval_set == 0 else f"eval{eval_set}"


def load_builtin(cfg, split: str, name: str) -> list[Example]:
    """The `split` ("train" or "eval") examples of built-in task `name` for a DataConfig (data.levels, data.seed,
    data.train_size, data.eval_size, data.eval_set)."""
    task = _task(name)
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
    eval_set = int(getattr(cfg, "eval_set", 0))
    for k in range(eval_set):  # the earlier held-out sets: none of their questions is in this one
        _draw(task, levels, eval_n, cfg.seed, _eval_tag(k), used)
    eval_examples = _draw(task, levels, eval_n, cfg.seed, _eval_tag(eval_set), used)
    if split == "eval":
        return eval_examples
    used = {ex.question for ex in eval_examples}  # training leaves out this held-out set only
    # revisiting only when the chosen levels hold enough questions in all (no scaling down above)
    revisit = bool(getattr(cfg, "revisit", True)) and n_eval + n_train <= capacity
    return _draw(task, levels, train_n, cfg.seed, "train", used, revisit=revisit)
