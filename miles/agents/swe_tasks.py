"""SWE-style tasks: a two-file repository (a module with one bug, its failing test), generated from a seed.

The reward is whether the test passes after the agent's edits, checked by running it. A task can also make
its test slow (``slow_s``): a realistic long tail of CPU-side work that an abort must cut.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RepoTask:
    seed: int
    files: dict[str, str]  # relative path -> text
    test_file: str
    description: str  # the user message
    fix: tuple[str, str, str]  # (path, old, new): the one-line edit that makes the test pass

    def with_slow_test(self, slow_s: float) -> "RepoTask":
        if slow_s <= 0:
            return self
        files = dict(self.files)
        files[self.test_file] = (
            f"import time\ntime.sleep({slow_s:.3f})  # a slow integration check\n" + files[self.test_file]
        )
        return RepoTask(
            seed=self.seed, files=files, test_file=self.test_file, description=self.description, fix=self.fix
        )


def _add(rng: random.Random):
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return (
        "def add(a, b):\n    return a - b\n",
        f"assert add({a}, {b}) == {a + b}, add({a}, {b})\n",
        ("return a - b", "return a + b"),
        "add",
    )


def _largest(rng: random.Random):
    xs = rng.sample(range(1, 50), 4)
    return (
        "def largest(xs):\n    return min(xs)\n",
        f"assert largest({xs}) == {max(xs)}, largest({xs})\n",
        ("min(xs)", "max(xs)"),
        "largest",
    )


def _count(rng: random.Random):
    n = rng.randint(3, 7)
    return (
        "def count_up(n):\n    return list(range(1, n))\n",
        f"assert count_up({n}) == {list(range(1, n + 1))}\n",
        ("range(1, n)", "range(1, n + 1)"),
        "count_up",
    )


def _shout(rng: random.Random):
    w = rng.choice(["hello", "agent", "patch", "merge"])
    return (
        "def shout(s):\n    return s.lower() + '!'\n",
        f"assert shout({w!r}) == {w.upper() + '!'!r}\n",
        ("s.lower()", "s.upper()"),
        "shout",
    )


def _minutes(rng: random.Random):
    m = rng.randint(2, 9)
    return (
        "def seconds(minutes):\n    return minutes * 100\n",
        f"assert seconds({m}) == {m * 60}\n",
        ("minutes * 100", "minutes * 60"),
        "seconds",
    )


BUGS = (_add, _largest, _count, _shout, _minutes)


def make_task(seed: int) -> RepoTask:
    rng = random.Random(seed)
    module = rng.choice(["mathx", "util", "core", "lib"])
    source, test, (old, new), fn = rng.choice(BUGS)(rng)
    test_file = f"test_{module}.py"
    files = {f"{module}.py": source, test_file: f"from {module} import {fn}\n\n{test}print('ok')\n"}
    description = (
        f"The test {test_file} fails. Fix the bug in {module}.py so that `python {test_file}` passes. "
        "Use the tools list_files, read_file, edit_file (path, old, new), run_test and submit."
    )
    return RepoTask(
        seed=seed, files=files, test_file=test_file, description=description, fix=(f"{module}.py", old, new)
    )
