"""The reward contract, declared below the verifiers that implement it and the sources, scorer and pool that call
it: the small types they share.

A reward is ``fn(prompt, response, target) -> float``. A built-in one may split itself in two: a ``quick`` part
that runs in the scoring process in linear time and either returns the reward or a ``Deferred`` call (the part
that needs sympy), which a reward worker runs under the time limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol


class RewardFn(Protocol):
    def __call__(self, prompt: str, response: str, target: str) -> float: ...


class RewardError(RuntimeError):
    """A reward failed (raised, timed out, or returned something that is not a finite number) while
    ``data.reward_on_error = raise``; or a dataset row names a reward that does not exist."""


@dataclass(frozen=True, slots=True)
class Deferred:
    """The slow part of a built-in reward: ``call`` ('module:function') on ``args`` in a reward worker; the reward
    is ``if_true`` when it returns a true value, else ``if_false``."""

    call: str
    args: tuple
    if_true: float
    if_false: float


@dataclass(frozen=True, slots=True)
class Reward:
    """A reward by name. ``quick`` (linear-time, run in this process) returns the reward or a Deferred; without
    one, the whole of ``call`` ('module:function', the user's function) runs in a reward worker.
    ``pass_at``: the reward from which an eval sample counts as solved (math_format pays 0.9 for a right answer
    that is not marked)."""

    name: str
    quick: Callable[[str, str, str], float | Deferred] | None = None
    call: str = ""
    pass_at: float = 1.0

    def __post_init__(self):
        if (self.quick is None) == (not self.call):
            raise ValueError(f"reward {self.name!r} needs exactly one of quick and call")


@dataclass(frozen=True, slots=True)
class Call:
    """One function call for a reward worker: ``call`` is 'module:function', ``args`` its (picklable) arguments."""

    call: str
    args: tuple


@dataclass(frozen=True, slots=True)
class CallResult:
    """What became of a Call: ``value`` (a float) when it returned, else ``error`` (one line) and, for a call past
    the time limit, ``timed_out``. ``seconds``: its wall time in the worker (the limit, for a timeout)."""

    value: float | None = None
    error: str = ""
    timed_out: bool = False
    seconds: float = 0.0
    traceback: str = ""

    @property
    def ok(self) -> bool:
        return self.value is not None
