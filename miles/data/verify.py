"""Math answer checking behind the reward contract ``fn(prompt, response, target) -> float``.

The final answer is taken from the response in a fixed order of trust: the last ``\\boxed{...}``, the text after
``####``, the text after "the answer is", then the last number. Equivalence is numeric or symbolic through
math-verify (sympy underneath); a plain-number fast path compares exact fractions first, because a GRPO step scores
hundreds of short numeric answers and math-verify's parse costs milliseconds each.

Everything here that runs on the whole response is linear-time (no pattern that backtracks: a policy writes
any string), so the scoring process runs it. The sympy part cannot be bounded (``9^{9^{9}}``, ``((10!)!)!``): the
``*_quick`` rewards return it as a ``Deferred`` call of ``symbolic_equal``, which a reward worker runs under
``data.reward_timeout_s`` (miles.reward). ``too_big`` refuses the obvious towers before any parse. math-verify's
own timeouts (``signal.alarm``, whole seconds, main thread only) stay off, and its warning about that is dropped.
``math_reward`` and ``math_reward_with_format`` are the same rewards in one process, without a time limit: the
reference the tests and ``miles bench verify`` compare against.
"""

from __future__ import annotations

import logging
import math
import re
from fractions import Fraction

from miles.protocols.reward import Deferred

MAX_ANSWER_CHARS = 200
MAX_DIGITS = 100_000  # an answer spelling a number longer than this (a tower, a factorial chain) is not parsed
FORMAT_WEIGHT = 0.1  # math_format: the part of the reward paid for marking the answer
FORMAT_PASS = 1 - FORMAT_WEIGHT  # math_format's reward for a right answer that is not marked: a pass in eval
SYMBOLIC = "miles.data.verify:symbolic_equal"  # the Deferred call: run in a reward worker

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_ANSWER_IS_RE = re.compile(r"answer is", re.IGNORECASE)
_PLAIN_RE = re.compile(r"^-?(?:\d+(?:\.\d+)?|\.\d+)(?:/\d+)?$")
# a number, then units: letters, '%' or '°', each '.' right after one of those, spaces anywhere ('12 apples',
# '45 %', '3 ft. 2 in.'). Possessive and with one way to match each character, so it runs in linear time (the
# nested form '(?:[a-zA-Z%°]+\.?\s*)+$' took seconds on '1 ' + 24 letters + '!' and never ended on 40).
_UNIT = "a-zA-Z%°"
_UNIT_TAIL_RE = re.compile(rf"^(-?[\d.,/]++)\s*+[{_UNIT}](?:[{_UNIT}]|(?<=[{_UNIT}])\.|\s)*+$")


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
    found = [g.strip() for g in after_answer_is(response) if g.strip()]
    if found:
        return found[-1].splitlines()[0].rstrip(".").strip(), "answer_is"
    numbers = _NUMBER_RE.findall(normalize(response))
    if numbers:
        return numbers[-1], "last_number"
    return None, "none"


def after_answer_is(text: str) -> list[str]:
    """What the pattern ``answer is[:\\s]*(.+?)\\s*(?:\\.\\s|\\.?$)`` (IGNORECASE, MULTILINE) captures with
    ``finditer``, found in linear time: the lazy group before a whitespace run backtracked over the run at every
    position (quadratic in a long run of spaces)."""
    out, pos, n = [], 0, len(text)
    while m := _ANSWER_IS_RE.search(text, pos):
        i = j = m.end()
        while j < n and (text[j] == ":" or text[j].isspace()):  # [:\s]*, greedy
            j += 1
        if j == n:  # it ate the rest: give back characters until one can start the group (not a newline)
            j = n - 1
            while j >= i and text[j] == "\n":
                j -= 1
            if j < i:
                pos = m.start() + 1
                continue
        end = _group_end(text, j)
        out.append(text[j:end])
        pos = end  # the match's terminator is only whitespace and '.', where 'answer is' cannot start
    return out


def _group_end(text: str, start: int) -> int:
    """The first p > start, on the line of ``start``, where ``\\s*(?:\\.\\s|\\.?$)`` matches."""
    n, p = len(text), start + 1
    while p < n and text[p] != "\n":
        if not text[p].isspace():
            if text[p] == "." and (p + 1 == n or text[p + 1].isspace()):
                return p
            p += 1
            continue
        b = p  # a whitespace run [p, b): the same answer for every position in it
        while b < n and text[b].isspace():
            b += 1
        if "\n" in text[p:b] or b == n or (text[b] == "." and (b + 1 == n or text[b + 1].isspace())):
            return p
        p = b
    return p


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
    """Whether ``answer`` equals ``gold`` numerically or symbolically, in this process without a time limit (the
    reference: scoring goes through ``math_quick``). ``fast=False`` skips the plain-number path (tests compare
    both)."""
    if len(answer) > MAX_ANSWER_CHARS or too_big(answer):
        return False
    if fast:
        a, g = _plain_number(answer), _plain_number(gold)
        if a is not None and g is not None:
            return a == g
        if _same_fraction(answer, gold, a, g):
            return True
    return symbolic_equal(answer, gold)


def _check(answer: str | None, gold: str, if_true: float, if_false: float) -> float | Deferred:
    """The reward for ``answer`` against ``gold`` when this process can tell in linear time, else the Deferred
    sympy check."""
    if answer is None or len(answer) > MAX_ANSWER_CHARS or too_big(answer):
        return if_false
    a, g = _plain_number(answer), _plain_number(gold)
    if a is not None and g is not None:
        return if_true if a == g else if_false
    if _same_fraction(answer, gold, a, g):
        return if_true
    return Deferred(SYMBOLIC, (answer, gold), if_true, if_false)


_LATEX_FRACTION_RE = re.compile(r"^(-?)\\frac\{(-?\d{1,30})\}\{(-?\d{1,30})\}$")


def _same_fraction(answer: str, gold: str, a: Fraction | None, g: Fraction | None) -> bool:
    """Whether a ``\\frac{p}{q}`` of integers (either side; the other a plain number or one too) is exactly the
    other: no sympy needed. Only a match is decided here: math-verify calls close decimals equal (1/3 and
    0.3333333), so a miss still goes to sympy."""
    a = a if a is not None else _latex_fraction(answer)
    g = g if g is not None else _latex_fraction(gold)
    return a is not None and g is not None and a == g


def _latex_fraction(text: str) -> Fraction | None:
    m = _LATEX_FRACTION_RE.match(normalize(text))
    if not m or int(m.group(3)) == 0:
        return None
    value = Fraction(int(m.group(2)), int(m.group(3)))
    return -value if m.group(1) else value


def math_quick(prompt: str, response: str, target: str) -> float | Deferred:
    """``math_reward`` without sympy: the reward, or the Deferred sympy check that decides it."""
    answer, _ = extract_answer(response)
    return _check(answer, target, 1.0, 0.0)


def math_format_quick(prompt: str, response: str, target: str) -> float | Deferred:
    """``math_reward_with_format`` without sympy."""
    answer, how = extract_answer(response)
    bonus = FORMAT_WEIGHT * (how in ("boxed", "hashes", "answer_is"))
    return _check(answer, target, FORMAT_PASS + bonus, bonus)


def resolve_here(out: float | Deferred) -> float:
    """A quick reward's result with its Deferred check run in this process (no time limit: the reference path)."""
    if not isinstance(out, Deferred):
        return out
    if out.call != SYMBOLIC:
        raise ValueError(f"resolve_here knows {SYMBOLIC}, not {out.call}")
    return out.if_true if symbolic_equal(*out.args) else out.if_false


def math_reward(prompt: str, response: str, target: str) -> float:
    """1.0 when the response's final answer equals the target, else 0.0."""
    return resolve_here(math_quick(prompt, response, target))


def math_reward_with_format(prompt: str, response: str, target: str) -> float:
    """0.9 for a right answer plus 0.1 when it is marked (boxed, ####, "the answer is") rather than guessed from
    the last number: the format reward, on top of correctness."""
    return resolve_here(math_format_quick(prompt, response, target))


_FLAT = str.maketrans("", "", "{} ")
_TOWER_RE = re.compile(r"\d+(?:\^\d+)+")  # 9^9^9 once braces are gone: linear, one way to match
_FACTORIALS_RE = re.compile(r"(\d+)!(?:\)+!)*")  # 10!, (10!)!, ((10!)!)!
_BRACED = r"\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}"
_BINOM_RE = re.compile(rf"\\[dt]?binom\s*{_BRACED}\s*{_BRACED}")


def too_big(answer: str) -> bool:
    """Whether the answer spells a number of more than MAX_DIGITS digits as an exponent tower, a chain of
    factorials or a binomial of huge numbers (``9^{9^{9}}``, ``((10!)!)!``, ``\\binom{10^{12}}{10^6}``): no gold
    answer is that long, and sympy would compute it for minutes. It only spares a worker; the time limit of the
    reward workers is what guarantees a bound."""
    flat = answer.translate(_FLAT)
    if any(_tower_log10(m.group()) > MAX_DIGITS for m in _TOWER_RE.finditer(flat)):
        return True
    for m in _FACTORIALS_RE.finditer(flat):
        log = _tower_log10(m.group(1))
        for _ in range(m.group().count("!")):
            log = math.inf if log > 15 else math.lgamma(10**log + 1) / math.log(10)
        if log > MAX_DIGITS:
            return True
    for m in _BINOM_RE.finditer(answer):
        n, k = (_tower_log10(x.translate(_FLAT)) for x in m.groups())
        if n == math.inf or (n > 15 and k > 15):  # C(n, k) >= (n/k)^k: both past 10^15 is past any gold answer
            return True
        smaller = 10**k if n > 15 else min(10**k, 10**n - 10**k)
        if smaller * n > MAX_DIGITS:  # log10 C(n, k) <= min(k, n - k) * log10(n)
            return True
    return False


def _tower_log10(text: str) -> float:
    """log10 of an integer or a right-associative tower 'a^b^c' of integers; 0 for anything else (inf when huge)."""
    if not _TOWER_RE.fullmatch(text) and not text.isdigit():
        return 0.0
    parts = text.split("^")
    if any(len(x) > 300 for x in parts):
        return math.inf
    log = math.log10(max(int(parts[-1]), 1))
    for base in map(int, reversed(parts[:-1])):
        if base <= 1:
            log = 0.0
        elif log > 300:
            log = math.inf
        else:
            log = 10**log * math.log10(base)
    return log


def symbolic_equal(answer: str, gold: str) -> bool:
    """math-verify's verdict on ``answer`` against ``gold`` (sympy underneath: run it in a reward worker)."""
    parse, verify = _math_verify()
    a, g = normalize(answer), normalize(gold)
    m = _UNIT_TAIL_RE.match(a)
    if m:
        a = m.group(1)
    gold_parsed = parse(f"${g}$", parsing_timeout=None)
    pred_parsed = parse(f"${a}$", parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


symbolic_equal.warm_up = lambda: symbolic_equal("\\frac{1}{2}", "0.5")  # a worker's imports and parser tables


def _math_verify():
    try:
        from math_verify import parse, verify
    except ImportError as e:  # pragma: no cover
        raise ImportError("math answer checking needs math-verify: pip install 'miles[data]'") from e
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if _QUIET not in logger.filters:
            logger.addFilter(_QUIET)
    return parse, verify


def _quiet(record: logging.LogRecord) -> bool:
    """math-verify warns on every fresh process that its timeouts are off: they are, on purpose (the workers')."""
    return not str(record.msg).startswith("Timeout is disabled")


_QUIET = _quiet


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
    try:  # digits, + - * / ( ) only, each number one of the target's: small and bounded
        value = eval(compile(expr, "<countdown>", "eval"), {"__builtins__": {}}, {})
        return float(abs(value - goal) < 1e-9)
    except (SyntaxError, ZeroDivisionError, TypeError, ValueError, OverflowError):  # '()' is a tuple: TypeError
        return 0.0


REWARDS = {"math": math_reward, "math_format": math_reward_with_format, "countdown": countdown_reward}
