"""Math answer checking behind the reward contract ``fn(prompt, response, target) -> float``.

The final answer is taken from the response in a fixed order of trust: the last ``\\boxed{...}``, the text after
``####``, the text after "the answer is", then the last number. Equivalence is numeric or symbolic through
math-verify (sympy underneath); a plain-number fast path compares exact fractions first, because a GRPO step scores
hundreds of short numeric answers and math-verify's parse costs milliseconds each. math-verify's own timeouts use
``signal.alarm`` (main thread only) and are switched off: the rollout scores on a compute thread, and the
candidate handed to it is capped at ``MAX_ANSWER_CHARS`` so no parse can run away.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_ANSWER_CHARS = 200

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_ANSWER_IS_RE = re.compile(r"answer is[:\s]*(.+?)\s*(?:\.\s|\.?$)", re.IGNORECASE | re.MULTILINE)
_PLAIN_RE = re.compile(r"^-?(?:\d+(?:\.\d+)?|\.\d+)(?:/\d+)?$")
_UNIT_TAIL_RE = re.compile(r"^(-?[\d.,/]+)\s*(?:[a-zA-Z%°]+\.?\s*)+$")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i : j - 1] if depth == 0 else None


def extract_answer(response: str) -> tuple[str | None, str]:
    """(answer text, how it was found: 'boxed' | 'hashes' | 'answer_is' | 'last_number' | 'none')."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed.strip(), "boxed"
    if "####" in response:
        tail = response.rsplit("####", 1)[1].strip().splitlines()
        if tail and tail[0].strip():
            return tail[0].strip(), "hashes"
    found = [m.group(1).strip() for m in _ANSWER_IS_RE.finditer(response) if m.group(1).strip()]
    if found:
        return found[-1].splitlines()[0].rstrip(".").strip(), "answer_is"
    numbers = _NUMBER_RE.findall(normalize(response))
    if numbers:
        return numbers[-1], "last_number"
    return None, "none"


def normalize(text: str) -> str:
    """Spellings that mean the same number: a Unicode minus, dollar signs, LaTeX spacing, a trailing period."""
    text = text.replace("\u2212", "-").replace("\\$", "").replace("$", "").replace("\\!", "").replace("\\,", "")
    text = text.replace("\\left", "").replace("\\right", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return text.strip().rstrip(".").strip()


def _plain_number(text: str) -> Fraction | None:
    """An exact value for '1,234', '-3.5', '3/4', '12 apples', '45%' style answers; None for anything else."""
    t = normalize(text)
    m = _UNIT_TAIL_RE.match(t)
    if m:
        t = m.group(1)
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", t):
        t = t.replace(",", "")
    if not _PLAIN_RE.match(t):
        return None
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def equivalent(answer: str, gold: str, *, fast: bool = True) -> bool:
    """Whether ``answer`` equals ``gold`` numerically or symbolically. ``fast=False`` skips the plain-number path
    (tests compare both)."""
    if len(answer) > MAX_ANSWER_CHARS:
        return False
    if fast:
        a, g = _plain_number(answer), _plain_number(gold)
        if a is not None and g is not None:
            return a == g
    return _math_verify(answer, gold)


def _math_verify(answer: str, gold: str) -> bool:
    try:
        from math_verify import parse, verify
    except ImportError as e:  # pragma: no cover
        raise ImportError("math answer checking needs math-verify: pip install 'miles[data]'") from e
    a, g = normalize(answer), normalize(gold)
    m = _UNIT_TAIL_RE.match(a)
    if m:
        a = m.group(1)
    gold_parsed = parse(f"${g}$", parsing_timeout=None)
    pred_parsed = parse(f"${a}$", parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def math_reward(prompt: str, response: str, target: str) -> float:
    """1.0 when the response's final answer equals the target, else 0.0."""
    answer, _ = extract_answer(response)
    return float(answer is not None and equivalent(answer, target))


def math_reward_with_format(prompt: str, response: str, target: str, *, format_weight: float = 0.1) -> float:
    """0.9 for a right answer plus 0.1 when it is marked (boxed, ####, "the answer is") rather than guessed from
    the last number: the format reward, on top of correctness."""
    answer, how = extract_answer(response)
    correct = answer is not None and equivalent(answer, target)
    marked = how in ("boxed", "hashes", "answer_is")
    return (1 - format_weight) * correct + format_weight * marked


_COUNTDOWN_TARGET_RE = re.compile(r"^(-?\d+) from ([\d ]+)$")
_EXPR_RE = re.compile(r"[\d+\-*/() ]+")


def countdown_reward(prompt: str, response: str, target: str) -> float:
    """Countdown: ``target`` reads "24 from 3 4 5 6". The response's final expression (boxed, after ####, after
    "the answer is", or its last line) must use each given number at most once and evaluate to the target."""
    m = _COUNTDOWN_TARGET_RE.match(target.strip())
    if not m:
        raise ValueError(f"countdown target {target!r} should read '<target> from <n1> <n2> ...'")
    goal, pool = int(m.group(1)), [int(x) for x in m.group(2).split()]
    answer, how = extract_answer(response)
    if how in ("last_number", "none"):
        answer = response.strip().splitlines()[-1] if response.strip() else ""
    expr = normalize(answer or "").replace("\\times", "*").replace("\\cdot", "*").replace("\\div", "/")
    expr = expr.split("=")[0].strip()
    if not expr or len(expr) > MAX_ANSWER_CHARS or not _EXPR_RE.fullmatch(expr) or "**" in expr:
        return 0.0
    used = [int(x) for x in re.findall(r"\d+", expr)]
    for x in used:
        if x not in pool:
            return 0.0
        pool.remove(x)
    try:
        value = eval(compile(expr, "<countdown>", "eval"), {"__builtins__": {}}, {})  # digits, + - * / ( ) only
    except (SyntaxError, ZeroDivisionError, TypeError, ValueError):
        return 0.0
    return float(abs(value - goal) < 1e-9)


REWARDS = {"math": math_reward, "math_format": math_reward_with_format, "countdown": countdown_reward}
