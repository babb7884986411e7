"""Synthetic verifiable tasks and the reward contract.

A task makes prompts with reference answers from a seeded RNG; a reward function scores a completion
(partial credit where it helps learning). Users plug their own reward in with ``task.reward = "module:fn"``
where ``fn(prompt: str, response: str, target: str) -> float`` (the ``RewardFn`` protocol); it runs in a reward
worker under ``data.reward_timeout_s`` (miles.reward), the built-in ones here in the scoring process (linear-time).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from miles.config import TaskConfig
from miles.protocols.reward import Reward, RewardError, RewardFn  # noqa: F401 (RewardError, RewardFn: re-exported)
from miles.reward.catalog import reward_for


@dataclass(frozen=True, slots=True)
class Problem:
    prompt: str  # text given to the model (raw, or a chat user message for chat tasks)
    target: str
    chat: bool = False


def positional_credit(prompt: str, response: str, target: str) -> float:
    """Fraction of target characters produced at the right position; 1.0 only for an exact answer."""
    response = response.strip()
    if response == target:
        return 1.0
    if not target:
        return 0.0
    hits = sum(a == b for a, b in zip(response, target))
    return 0.9 * hits / max(len(target), len(response))


def exact_match(prompt: str, response: str, target: str) -> float:
    return float(response.strip() == target)


def numeric_credit(prompt: str, response: str, target: str) -> float:
    """Exact sum: 1; right number of digits with some right digits: partial credit."""
    response = response.strip()
    if response == target:
        return 1.0
    if not response.isdigit():
        return 0.0
    hits = sum(a == b for a, b in zip(response[::-1], target[::-1]))
    return 0.8 * hits / max(len(target), len(response))


class Task:
    """Seeded problem generator + reward. ``problems(step, n)`` is deterministic in (seed, step)."""

    def __init__(self, cfg: TaskConfig, seed: int):
        self.cfg, self.seed = cfg, seed
        own = DEFAULT_REWARDS[cfg.name]
        self.reward: Reward = reward_for(cfg.reward, "task.reward") if cfg.reward else Reward(own.__name__, quick=own)

    def problems(self, step: int, n: int) -> list[Problem]:
        rng = random.Random(self.seed * 1_000_003 + step)
        return [self.make(rng) for _ in range(n)]

    def make(self, rng: random.Random) -> Problem:
        c = self.cfg
        if c.name == "add":
            a, b = rng.randrange(10**c.max_len), rng.randrange(10**c.max_len)
            return Problem(f"{a}+{b}=", str(a + b))
        word = "".join(rng.choice(c.alphabet) for _ in range(rng.randint(c.min_len, c.max_len)))
        if c.name == "reverse":
            return Problem(f"rev {word}=", word[::-1])
        if c.name == "sort":
            return Problem(f"sort {word}=", "".join(sorted(word)))
        if c.name == "copy":
            return Problem(f"copy {word}=", word)
        if c.name == "chat_reverse":
            return Problem(
                f"Reverse the letters of '{word}'. Answer with the reversed letters only.", word[::-1], chat=True
            )
        raise ValueError(f"task.name = {c.name!r} has no generator here (agent tasks run in miles.agents)")


DEFAULT_REWARDS: dict[str, RewardFn] = {
    "reverse": positional_credit,
    "sort": positional_credit,
    "copy": positional_credit,
    "chat_reverse": positional_credit,
    "add": numeric_credit,
    "swe": exact_match,
}
