"""The environment contract: what a multi-turn environment is to miles, and what counts as a broken one.

An environment is a stateful object, one per episode (TRL's ``environment_factory``, NeMo Gym's and OpenEnv's
``reset/step``): ``reset(row)`` opens the episode from a task row and gives the opening chat messages and the tools
(OpenAI function schemas); ``step(message)`` takes the assistant's parsed message (``content``, ``tool_calls`` in
the OpenAI shape with ``arguments`` as a dict, ``tool_call_errors`` when a call could not be parsed) and answers
with the new messages (``tool`` results, ``user`` feedback), a reward for this turn, whether the episode is done,
and an info dict. The episode's return is the sum of its turn rewards; the last one is its final reward.

    env = CalculatorEnv()
    messages, tools = env.reset({"prompt": "What is 17 * 23 + 4?", "answer": "395", "metadata": {}})
    new, reward, done, info = env.step({"role": "assistant", "content": "", "tool_calls": [...]})
    env.close()                                  # optional

Anything else an environment gives back is garbage: ``check_reset`` and ``check_step`` turn it into an
``EnvError`` naming what was wrong, and the episode fails with a counted error (never the run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

ROLES = ("system", "user", "assistant", "tool")
ENV_ROLES = ("user", "tool", "system")  # what an environment may answer with (the assistant's turns are sampled)


@runtime_checkable
class Env(Protocol):
    def reset(self, row: dict) -> tuple[list[dict], list[dict]]:
        """The opening messages and the tools (OpenAI function schemas; [] for none) of one episode."""
        ...

    def step(self, message: dict) -> tuple[list[dict], float, bool, dict]:
        """The assistant's message -> (new messages, this turn's reward, done, info)."""
        ...


class EnvError(RuntimeError):
    """An environment raised, hung past its time limit, or answered with something that is not a step."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind  # "raised" | "timeout" | "garbage"


@dataclass(kw_only=True, slots=True)
class StepResult:
    messages: list[dict]
    reward: float
    done: bool
    info: dict = field(default_factory=dict)


def check_messages(messages: Any, where: str, roles: tuple[str, ...] = ROLES) -> list[dict]:
    """``messages`` when it is a list of {'role', 'content'} dicts with a known role and string content."""
    if not isinstance(messages, list):
        raise EnvError("garbage", f"{where}: messages must be a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in roles:
            raise EnvError("garbage", f"{where}: messages[{i}] = {str(m)[:80]!r} needs a 'role' in {list(roles)}")
        if not isinstance(m.get("content", ""), str):
            raise EnvError(
                "garbage", f"{where}: messages[{i}] ({m['role']}) has content {str(m['content'])[:60]!r}: need a string"
            )
    return [dict(m) for m in messages]


def check_tools(tools: Any, where: str) -> list[dict]:
    """``tools`` when it is a list of OpenAI function schemas ({'type': 'function', 'function': {'name', ...}})."""
    if not isinstance(tools, list):
        raise EnvError("garbage", f"{where}: tools must be a list of function schemas, got {type(tools).__name__}")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise EnvError(
                "garbage",
                f"{where}: tools[{i}] = {str(t)[:80]!r} is not {{'type': 'function', 'function': {{'name': ...}}}}",
            )
    return tools


def check_reset(out: Any, name: str) -> tuple[list[dict], list[dict]]:
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise EnvError("garbage", f"{name}.reset returned {str(out)[:80]!r}; it must return (messages, tools)")
    messages = check_messages(out[0], f"{name}.reset")
    if not messages:
        raise EnvError("garbage", f"{name}.reset returned no messages; the episode needs an opening message")
    return messages, check_tools(out[1], f"{name}.reset")


def check_step(out: Any, name: str) -> StepResult:
    """A step's answer as a StepResult; a tuple (messages, reward, done, info) or a StepResult is accepted."""
    if isinstance(out, StepResult):
        out = (out.messages, out.reward, out.done, out.info)
    if not (isinstance(out, tuple | list) and len(out) == 4):
        raise EnvError(
            "garbage", f"{name}.step returned {str(out)[:80]!r}; it must return (messages, reward, done, info)"
        )
    messages, reward, done, info = out
    messages = check_messages(messages, f"{name}.step", ENV_ROLES)
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise EnvError("garbage", f"{name}.step returned reward {reward!r}; it must be a finite number")
    if not isinstance(done, bool):
        raise EnvError("garbage", f"{name}.step returned done = {done!r}; it must be True or False")
    if not isinstance(info, dict):
        raise EnvError("garbage", f"{name}.step returned info = {str(info)[:60]!r}; it must be a dict")
    if not done and not messages:
        raise EnvError("garbage", f"{name}.step is not done but gave no new message for the next turn")
    return StepResult(messages=messages, reward=float(reward), done=done, info=info)
