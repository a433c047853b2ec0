"""Answer checking: the last non-empty ``\\boxed{...}`` of a completion, math-verify's equivalence against a gold
answer (``correctness``) and the format check (``format_reward``). Torch-free; math-verify is imported on first use.
Read by rewards/scorer.py (scoring), data/ (gold answers that parse) and rl/evaluate.py. Meaning and conventions:
rewards/scorer.py.
"""
from __future__ import annotations

import functools
import logging
import re
import threading

_BOXED_RE = re.compile(r"\\boxed\s*\{")

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------------
# \boxed{} extraction and math-verify
# ---------------------------------------------------------------------------------------------------------------

def _boxed_contents(text: str) -> list[str]:
    """Contents of every complete \\boxed{...} (balanced braces, \\{ and \\} escapes skipped), by start position."""
    out = []
    for m in _BOXED_RE.finditer(text):
        depth, i, start = 1, m.end(), m.end()
        while i < len(text):
            c = text[i]
            if c == "\\":
                i += 2
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    out.append(text[start:i])
                    break
            i += 1
    return out


def extract_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` in `text` (nested braces allowed); None if there is none,
    "" if it is empty. A box left unclosed (a truncated completion) is ignored. For nested boxes the innermost,
    last-starting one is returned."""
    if not text:
        return None
    boxes = _boxed_contents(text)
    return boxes[-1] if boxes else None


def last_nonempty_boxed(text: str) -> str | None:
    for content in reversed(_boxed_contents(text or "")):
        if content.strip():
            return content
    return None


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _parse(text: str) -> list:
    from math_verify import parse  # lazy: the reward worker and data-only users do not pay its import

    try:
        if _in_main_thread():
            return parse(text)
        return parse(text, parsing_timeout=None)
    except Exception as e:  # math-verify is defensive already; never let a parse take down a step
        log.debug("math-verify parse failed on %r: %s", text[:200], e)
        return []


def _verify(gold: list, pred: list) -> bool:
    from math_verify import verify

    try:
        if _in_main_thread():
            return bool(verify(gold, pred))
        return bool(verify(gold, pred, timeout_seconds=None))
    except Exception as e:
        log.debug("math-verify verify failed: %s", e)
        return False


def _as_box(answer: str) -> str:
    """Wrap a bare answer in \\boxed{} (math-verify's most reliable anchor); unwrap an existing box or $...$."""
    a = str(answer).strip()
    inner = last_nonempty_boxed(a)
    if inner is not None:
        a = inner.strip()
    if len(a) >= 2 and a.startswith("$") and a.endswith("$"):
        a = a.strip("$").strip()
    return "\\boxed{" + a + "}"


@functools.lru_cache(maxsize=1 << 16)
def _parse_gold_cached(gold: str) -> tuple:
    return tuple(_parse(_as_box(gold)))


def parse_gold(gold: str) -> list:
    """math-verify's parse of a gold answer (wrapped in \\boxed{}), cached; [] when it cannot be parsed."""
    return list(_parse_gold_cached(str(gold)))


def gold_is_parseable(gold: str) -> bool:
    """True when math-verify reads the gold answer as a mathematical object. Wrapped in \\boxed{}, almost any text
    parses to at least its raw string (math-verify's fallback, which only matches the identical string), so an
    answer that yields nothing but strings ("", "???", a dangling "\\text{") counts as unparseable."""
    return any(not isinstance(x, str) for x in _parse_gold_cached(str(gold)))


def extracted_answer(completion: str, require_boxed: bool = True) -> str | None:
    """The answer the correctness check reads in a completion: the last non-empty \\boxed{} content (with
    `require_boxed`), else math-verify's reading of the whole text (its last number when nothing is boxed); None
    when there is none."""
    if require_boxed:
        box = last_nonempty_boxed(completion)
        return None if box is None else box.strip()
    parsed = _parse(completion or "")
    return str(parsed[-1]) if parsed else None


def correctness(completion: str, gold: str, require_boxed: bool = True) -> float:
    """1.0 when math-verify finds the completion's answer equal to `gold`, else 0.0.

    With `require_boxed` only the last non-empty \\boxed{} of the completion is read (no box, or only empty boxes,
    scores 0); without it math-verify reads the whole completion (and falls back to its last number)."""
    g = parse_gold(gold)
    if not g:
        return 0.0
    if require_boxed:
        content = last_nonempty_boxed(completion)
        if content is None:
            return 0.0
        pred = _parse("\\boxed{" + content + "}")
    else:
        pred = _parse(completion or "")
    pred = _no_unevaluated_arithmetic(g, pred)
    if not pred:
        return 0.0
    return 1.0 if _verify(g, pred) else 0.0


def _is_number(x) -> bool:
    """A plain number, or `x = number`, or a set of plain numbers: something the model computed."""
    if isinstance(x, str):
        return False
    if getattr(x, "is_Number", False):
        return True
    if getattr(x, "is_Relational", False):  # "x = 5": math-verify compares the right-hand side
        return _is_number(x.rhs)
    if getattr(x, "is_FiniteSet", False):
        return all(_is_number(e) for e in x)
    return False


def _no_unevaluated_arithmetic(gold: list, pred: list) -> list:
    """When the gold answer is a plain number, only a plain number counts as the prediction.

    math-verify evaluates what it parses: "What is 26 + 54?" answered with "26 + 54" (the question restated, nothing
    computed) parses to 26 + 54 and verifies equal to 80. A policy finds that within a few dozen RL steps (measured
    on the default preset: 100% "accuracy" by echoing the sum). So for a numeric gold answer, a prediction that is
    an arithmetic expression of numbers is dropped; symbolic golds (fractions written with symbols, roots, sets)
    keep math-verify's full equivalence check.
    """
    if not any(_is_number(x) for x in gold):
        return pred
    return [x for x in pred if isinstance(x, str) or _is_number(x)]


def format_reward(completion: str) -> float:
    """1.0 when the completion holds a non-empty \\boxed{...}, else 0.0."""
    return 0.0 if last_nonempty_boxed(completion) is None else 1.0
