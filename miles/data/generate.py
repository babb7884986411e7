"""Data that ships: a deterministic generator of arithmetic and word problems of graded difficulty, and Countdown.

Each row is ``{"prompt", "answer", "metadata": {"task", "level", "verifier"}}`` (the columns the dataset loader
reads by default). The same (kind, n, seed, levels) always gives the same rows. The fixed test splits under
``miles/data/splits/`` were written by ``python -m miles.data.generate --splits``, so eval figures compare across
runs; train splits are generated on demand and never contain a prompt of the test split they go with.

    python -m miles.data.generate OUT_DIR --train 20000     # mixed_train.jsonl, countdown_train.jsonl + test copies
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

SPLITS_DIR = Path(__file__).parent / "splits"
OPS = ("add", "sub", "mul", "word")
# operand ranges per difficulty level; level 2 is the range of the measured baseline
RANGES = {
    "add": {1: (2, 20), 2: (2, 60), 3: (100, 999)},
    "sub": {1: (2, 20), 2: (2, 60), 3: (100, 999)},
    "mul": {1: (2, 9), 2: (2, 12), 3: (11, 99)},
    "word": {1: (2, 20), 2: (2, 60), 3: (100, 999)},
}
NAMES = ("Tom", "Anna", "Ravi", "Mei", "Lucas", "Sara")
ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies")
NUMBER_ONLY = "Answer with the number only."


def arithmetic(op: str, rng: random.Random, level: int) -> dict:
    lo, hi = RANGES[op][level]
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    if op == "add":
        prompt, answer = f"What is {a} + {b}? {NUMBER_ONLY}", a + b
    elif op == "sub":
        prompt, answer = f"What is {a} - {b}? {NUMBER_ONLY}", a - b
    elif op == "mul":
        prompt, answer = f"What is {a} * {b}? {NUMBER_ONLY}", a * b
    elif op == "word":
        prompt, answer = word_problem(rng, a, b)
    else:
        raise ValueError(f"unknown arithmetic kind {op!r}; use one of {OPS}")
    return {"prompt": prompt, "answer": str(answer), "metadata": {"task": op, "level": level, "verifier": "math"}}


def word_problem(rng: random.Random, a: int, b: int) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    form = rng.randrange(3)
    if form == 0:
        text, answer = (
            f"{name} has {a} {item}. {name} buys {b} more {item}. How many {item} does {name} have now?",
            a + b,
        )
    elif form == 1:
        a, b = max(a, b), min(a, b)
        text, answer = f"{name} has {a} {item} and gives {b} of them away. How many {item} are left?", a - b
    else:
        a, b = rng.randint(2, 9), rng.randint(2, 12)
        text, answer = f"{name} has {a} boxes with {b} {item} in each box. How many {item} are there in total?", a * b
    return f"{text} Give the final answer as a number.", answer


def countdown(rng: random.Random, level: int) -> dict:
    """3 (level 1), 4 (level 2) or 5 (level 3) numbers; the target is the value of a random expression over all of
    them, so every problem has a solution."""
    count = {1: 3, 2: 4, 3: 5}[level]
    nums = [rng.randint(1, 12) for _ in range(count)]
    value = nums[0]
    for x in nums[1:]:
        op = rng.choice("+-*" if value * x <= 200 else "+-")
        value = value + x if op == "+" else value - x if op == "-" else value * x
    shown = sorted(nums)
    prompt = (
        f"Using the numbers {', '.join(map(str, shown))}, each at most once, and + - * / with parentheses, "
        f"write an expression equal to {value}. Give the final expression inside \\boxed{{}}."
    )
    return {
        "prompt": prompt,
        "answer": f"{value} from {' '.join(map(str, shown))}",
        "metadata": {"task": "countdown", "level": level, "verifier": "countdown"},
    }


def generate(kind: str, n: int, *, seed: int, levels=(1, 2), exclude: set[str] = frozenset()) -> list[dict]:
    """``n`` rows of ``kind`` ('add', 'sub', 'mul', 'word', 'mixed' = the four in turn, 'countdown'), levels drawn
    uniformly from ``levels``, skipping prompts in ``exclude``."""
    if kind not in (*OPS, "mixed", "countdown"):
        raise ValueError(f"unknown kind {kind!r}; use one of {[*OPS, 'mixed', 'countdown']}")
    rng = random.Random(f"{kind}/{seed}")
    rows, tries = [], 0
    while len(rows) < n:
        tries += 1
        if tries > 100 * n + 1000:
            raise ValueError(f"cannot make {n} {kind} rows at levels {levels} outside the {len(exclude)} excluded")
        level = rng.choice(levels)
        if kind == "countdown":
            row = countdown(rng, level)
        else:
            row = arithmetic(OPS[len(rows) % 4] if kind == "mixed" else kind, rng, level)
        if row["prompt"] not in exclude:
            rows.append(row)
    return rows


def write_jsonl(rows: list[dict], path: str | os.PathLike) -> Path:
    from miles.atomic import atomic_write_text

    path = Path(path)
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return path


def held_out_rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (SPLITS_DIR / f"{name}_test.jsonl").read_text().splitlines() if line]


def generated_train(name: str, n: int, *, seed: int = 1, out_dir: str | os.PathLike | None = None) -> str:
    """The train split for the committed test split ``name`` ('mixed' or 'countdown') as a jsonl file (written once
    under the miles cache, or ``out_dir``): ``n`` rows at levels 1-2, none of whose prompts is in the test split."""
    root = Path(out_dir or os.environ.get("MILES_CACHE_DIR", Path.home() / ".cache" / "miles")) / "data"
    path = root / f"{name}_train_n{n}_seed{seed}.jsonl"
    if not path.exists():
        exclude = {r["prompt"] for r in held_out_rows(name)}
        write_jsonl(generate(name, n, seed=seed, exclude=exclude), path)
    return str(path)


def split_path(name: str) -> str:
    """A committed test split: 'mixed' (128 problems, 32 per operation, level 2) or 'countdown' (64, levels 1-2)."""
    path = SPLITS_DIR / f"{name}_test.jsonl"
    if not path.exists():
        have = sorted(p.name.removesuffix("_test.jsonl") for p in SPLITS_DIR.glob("*_test.jsonl"))
        raise FileNotFoundError(f"no committed test split {name!r}; available: {have}")
    return str(path)


def write_test_splits(out_dir: str | os.PathLike = SPLITS_DIR) -> None:
    write_jsonl(generate("mixed", 128, seed=0, levels=(2,)), Path(out_dir) / "mixed_test.jsonl")
    write_jsonl(generate("countdown", 64, seed=0, levels=(1, 2)), Path(out_dir) / "countdown_test.jsonl")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir", nargs="?", default=None)
    p.add_argument("--train", type=int, default=20000, help="train rows per split")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--splits", action="store_true", help="rewrite the committed test splits in miles/data/splits")
    a = p.parse_args(argv)
    if a.splits:
        write_test_splits()
    if a.out_dir:
        for name in ("mixed", "countdown"):
            write_jsonl(held_out_rows(name), Path(a.out_dir) / f"{name}_test.jsonl")
            exclude = {r["prompt"] for r in held_out_rows(name)}
            write_jsonl(generate(name, a.train, seed=a.seed, exclude=exclude), Path(a.out_dir) / f"{name}_train.jsonl")


if __name__ == "__main__":
    main()
