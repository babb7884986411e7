"""A calculator environment: multi-step arithmetic that a small model cannot do in its head and a calculator makes
easy (copy the expression into a call, copy the result into the answer).

Each row is ``{"prompt", "answer", "metadata": {"expression", "level"}}``; the episode asks the prompt with one tool,
``calculate(expression)``, which evaluates + - * / and parentheses exactly (a parsed syntax tree, never ``eval``).
A turn with tool calls gets one ``tool`` message per call (reward 0); a turn without one is the final answer: the
last number in it against the row's answer, reward 1 or 0, and the episode ends. ``tools=False`` is the same task
without the tool (one turn: the baseline of a tool-use run).

    env = CalculatorEnv()
    messages, tools = env.reset(row)
    env.step({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "calculate",
              "arguments": {"expression": "37*48+12"}}}]})      # -> [tool message "1788"], 0.0, False, {...}
    env.step({"role": "assistant", "content": "1788"})            # -> [], 1.0, True, {"passed": True}

    python -m miles.envs.calculator OUT_DIR --train 20000           # calc_train.jsonl, calc_test.jsonl
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import random
import re
from fractions import Fraction
from pathlib import Path

TOOL = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression exactly (+ - * / and parentheses) and return the result.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12 + 7) * 3"}},
            "required": ["expression"],
        },
    },
}
# the same tool without descriptions: a shorter prompt for CPU-sized runs (CalculatorEnv(describe=False))
TOOL_SHORT = {
    "type": "function",
    "function": {
        "name": "calculate",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
ASK = "Give the final answer as a number."
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_EXPRESSION = 200  # characters
MAX_MAGNITUDE = 10**30
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class CalculatorError(ValueError):
    pass


def calculate(expression: str) -> str:
    """The exact value of ``expression`` as text (an integer, or a decimal rounded to 6 places)."""
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION:
        raise CalculatorError(f"expression must be a string of at most {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression!r}; use numbers, + - * / and parentheses") from None
    value = _value(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


def _value(node) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalculatorError("division by zero")
        out = OPS[type(node.op)](left, right)
        if abs(out) > MAX_MAGNITUDE:
            raise CalculatorError("the result is too large")
        return out
    raise CalculatorError(f"{ast.dump(node)[:40]} is not allowed; use numbers, + - * / and parentheses")


class CalculatorEnv:
    """See the module docstring. One instance per episode."""

    def __init__(
        self,
        tools: bool = True,
        max_calls: int = 4,
        describe: bool = True,
        partial_credit: bool = False,
        demo_tool_share: float = 1.0,
    ):
        """``partial_credit``: per-turn rewards for a tiny model's first steps (the CPU recipe): a call earns up to 0.5
        for the share of the expression's characters it copied in place, the answer 0.5 when right (else up to 0.4 for
        the digits in place); the return is 1 only for the right call and the right answer. Off: 1 for the right
        answer, 0 otherwise. ``demo_tool_share``: the share of demonstrations (``expert_reply``, the supervised
        warm-up) that call the tool; the others answer at once, as a model that has not yet learnt the tool would
        (which of the two is fixed by the expression, so one episode is one or the other)."""
        if not 0.0 <= demo_tool_share <= 1.0:
            raise ValueError(f"demo_tool_share = {demo_tool_share}; it is a share of demonstrations, from 0 to 1")
        self.tools, self.max_calls, self.schema = tools, max_calls, TOOL if describe else TOOL_SHORT
        self.partial_credit, self.demo_tool_share = partial_credit, demo_tool_share
        self.answer, self.expression, self.calls = "", "", 0

    def reset(self, row: dict) -> tuple[list[dict], list[dict]]:
        self.answer, self.calls = str(row["answer"]).strip(), 0
        self.expression = (row.get("metadata") or {}).get("expression", "")
        return [{"role": "user", "content": row["prompt"]}], [self.schema] if self.tools else []

    def step(self, message: dict) -> tuple[list[dict], float, bool, dict]:
        calls = message.get("tool_calls") or []
        if self.tools and message.get("tool_call_errors") and not calls:
            why = "; ".join(message["tool_call_errors"])
            return [{"role": "user", "content": f"Your tool call could not be read ({why[:200]})."}], 0.0, False, {}
        if self.tools and calls:
            if self.calls >= self.max_calls:  # a loop of calls never answers: the episode ends unanswered
                return [], 0.0, True, {"passed": False, "tool_calls": self.calls}
            reward = self._call_credit(calls[0]) if self.partial_credit and self.calls == 0 else 0.0
            self.calls += len(calls)
            return [self._result(c) for c in calls], reward, False, {"tool_calls": self.calls}
        found = NUMBER.findall(message.get("content") or "")
        passed = bool(found) and _same_number(found[-1], self.answer)
        reward = float(passed)
        if self.partial_credit and self.tools:
            reward = 0.5 if passed else 0.4 * _in_place(found[-1] if found else "", self.answer)
        return [], reward, True, {"passed": passed, "tool_calls": self.calls}

    def _call_credit(self, call: dict) -> float:
        fn = call.get("function") or {}
        got = (fn.get("arguments") or {}).get("expression")
        if fn.get("name") != TOOL["function"]["name"] or not isinstance(got, str) or not self.expression:
            return 0.0
        return 0.5 * _in_place(got, self.expression)

    def _result(self, call: dict) -> dict:
        fn = call.get("function") or {}
        if fn.get("name") != TOOL["function"]["name"]:
            content = f"error: no tool named {fn.get('name')!r}; the tool is calculate(expression)"
        else:
            try:
                content = calculate((fn.get("arguments") or {}).get("expression"))
            except CalculatorError as e:
                content = f"error: {e}"
        return {"role": "tool", "content": content, "name": TOOL["function"]["name"]}

    # ---- demonstrations (the supervised warm-up plays episodes with this instead of the model) ---------------
    def expert_reply(self, messages: list[dict], fmt) -> str:
        """What a perfect tool user writes next: the call, then the number the tool gave (or, for the demonstrations
        outside ``demo_tool_share``, the right number at once)."""
        last = messages[-1]
        asked = next(m["content"] for m in messages if m["role"] == "user")
        expression = _EXPRESSION.search(asked).group(1)
        if self.tools and last["role"] == "user" and _share_point(expression) < self.demo_tool_share:
            return fmt.call_text(TOOL["function"]["name"], {"expression": expression})
        if last["role"] == "tool":
            return f"The answer is {last['content']}."
        return f"The answer is {self.answer}."


_EXPRESSION = re.compile(r"What is (.+?)\?")


def _share_point(text: str) -> float:
    """A fixed point in [0, 1) for ``text`` (the same in every process: not Python's salted hash)."""
    return random.Random(f"demo/{text}").random()


def _in_place(got: str, want: str) -> float:
    """The share of ``want``'s characters that ``got`` has at the same place (1 only when equal)."""
    if got == want:
        return 1.0
    return 0.9 * sum(a == b for a, b in zip(got, want)) / max(len(got), len(want), 1)


def _same_number(a: str, b: str) -> bool:
    try:
        return Fraction(a) == Fraction(b)
    except (ValueError, ZeroDivisionError):
        return a == b


# ---- problems --------------------------------------------------------------------------------------------------
def problem(rng: random.Random, level: int) -> dict:
    """Level 0: a * b; level 1: a * b + c; level 2: a * b + c * d; level 3: (a + b) * c - d * e (2-3 digit numbers)."""
    n = lambda lo, hi: rng.randint(lo, hi)  # noqa: E731
    if level == 0:
        expression = f"{n(11, 99)} * {n(11, 99)}"
    elif level == 1:
        expression = f"{n(11, 99)} * {n(11, 99)} + {n(100, 999)}"
    elif level == 2:
        expression = f"{n(11, 99)} * {n(11, 99)} + {n(11, 99)} * {n(11, 99)}"
    elif level == 3:
        expression = f"({n(100, 999)} + {n(100, 999)}) * {n(11, 99)} - {n(11, 99)} * {n(11, 99)}"
    else:
        raise ValueError(f"level = {level}; the calculator problems have levels 0, 1, 2 and 3")
    prompt = f"What is {expression}? {ASK}"
    return {"prompt": prompt, "answer": calculate(expression), "metadata": {"expression": expression, "level": level}}


def rows(n: int, *, seed: int, levels=(1, 2, 3), exclude: set[str] = frozenset()) -> list[dict]:
    rng, out = random.Random(f"calculator/{seed}"), []
    for _ in range(100 * n + 1000):
        if len(out) == n:
            return out
        row = problem(rng, rng.choice(levels))
        if row["prompt"] not in exclude:
            out.append(row)
    raise ValueError(f"cannot make {n} calculator rows at levels {levels} outside the {len(exclude)} excluded")


def splits(
    n_train: int, *, seed: int = 1, n_test: int = 128, levels=(1, 2, 3), out_dir: str | os.PathLike | None = None
) -> tuple[str, str]:
    """(train, test) jsonl paths: a fixed held-out test split (seed 0) and ``n_train`` train rows (``seed``) none of
    whose prompts is in it, both at ``levels``; written once under the miles cache (or ``out_dir``)."""
    from miles.data.generate import write_jsonl

    root = Path(out_dir or os.environ.get("MILES_CACHE_DIR", Path.home() / ".cache" / "miles")) / "data"
    tag = "l" + "".join(map(str, levels))
    test = root / f"calc_test_{tag}_n{n_test}.jsonl"
    train = root / f"calc_train_{tag}_n{n_train}_seed{seed}_excl{n_test}.jsonl"
    held_out = rows(n_test, seed=0, levels=levels)
    if not test.exists():
        write_jsonl(held_out, test)
    if not train.exists():
        write_jsonl(rows(n_train, seed=seed, levels=levels, exclude={r["prompt"] for r in held_out}), train)
    return str(train), str(test)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--train", type=int, default=20000)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    train, test = splits(a.train, seed=a.seed, out_dir=a.out_dir)
    print(json.dumps({"train": train, "test": test}))


if __name__ == "__main__":
    main()
