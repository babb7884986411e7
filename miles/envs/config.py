"""The ``env`` section of a run: which environment drives the episodes, and the bounds every episode runs under."""

from __future__ import annotations

import json
from dataclasses import dataclass

from miles.config_check import check, require_finite

TOOL_FORMATS = ("auto", "hermes", "llama3")


@dataclass(kw_only=True, slots=True)
class EnvConfig:
    # the environment: a built-in name (calculator, python, openenv) or "module:Class"; "" = no environment (the
    # task / dataset sources as before). With a name, data.train rows are the episodes' task rows
    name: str = ""
    args: str = ""  # the class's keyword arguments as a JSON object, e.g. '{"tools": false}'
    max_turns: int = 4  # model turns per episode (a turn = one generation and one env step)
    max_tokens_per_turn: int = 0  # longest model turn, in tokens; 0 = rollout.max_new_tokens
    max_episode_tokens: int = 0  # the whole trajectory (prompt, model and env turns); 0 = the engine's max_seq_len
    step_timeout_s: float = 10.0  # one reset or step of the environment; past it the episode fails (counted)
    # native tool-call format: auto (from the chat template: Hermes/Qwen <tool_call> JSON, Llama-3 JSON), or one of
    # hermes / llama3 (a template without tool support gets the tools listed in a system message, Hermes style)
    tool_format: str = "auto"
    template_args: str = ""  # extra chat-template variables as a JSON object, e.g. '{"enable_thinking": false}'
    check_drift: bool = True  # compare each finished episode with a full re-render (env/drift_* metrics)

    def __post_init__(self):
        require_finite("env", self)
        check("env.max_turns", self.max_turns, ge=1, fix="model turns per episode, e.g. 4")
        check("env.max_tokens_per_turn", self.max_tokens_per_turn, ge=0, fix="0 = rollout.max_new_tokens")
        check("env.max_episode_tokens", self.max_episode_tokens, ge=0, fix="0 = the engine's max_seq_len")
        check("env.step_timeout_s", self.step_timeout_s, gt=0, fix="seconds one env call may take, e.g. 10")
        if self.tool_format not in TOOL_FORMATS:
            raise ValueError(f"env.tool_format = {self.tool_format!r}; use one of {', '.join(TOOL_FORMATS)}")
        self.kwargs("args")
        self.kwargs("template_args")

    def kwargs(self, field: str) -> dict:
        """A JSON-object field (args, template_args) as a dict; {} when empty."""
        text = getattr(self, field)
        if not text:
            return {}
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"env.{field} = {text!r} is not JSON ({e.msg}); give an object like '{{\"k\": 1}}'"
            ) from None
        if not isinstance(value, dict):
            raise ValueError(f"env.{field} = {text!r} must be a JSON object of keyword arguments, e.g. '{{\"k\": 1}}'")
        return value
