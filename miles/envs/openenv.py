"""OpenEnv environments (``pip install 'miles[openenv]'``: openenv-core) as miles environments.

OpenEnv is the one external standard adapted here, over verifiers: its ``reset``/``step(action) -> observation
(reward, done)`` contract is miles' own shape, so the adapter is thin; and openenv-core installs beside this stack
without changing it, where verifiers 0.4 pins ``openai<3`` and ``mcp==2.0.0`` (it would downgrade the installed
openai 3.x) and brings the prime-* sandbox clients. Tool environments in OpenEnv are MCP environments: their tools
are listed by a ``ListToolsAction`` and called by ``CallToolAction(tool_name, arguments)``; this adapter maps them to
OpenAI function schemas and the model's ``tool_calls``.

    env.name = "openenv", env.args = '{"env": "my_pkg.envs:MathToolsEnvironment", "final_tool": "submit"}'
    env.args = '{"url": "http://127.0.0.1:8000", "final_tool": "submit"}'     # a running OpenEnv server

A reply without a tool call ends the episode: with ``final_tool`` set it is passed to that tool as
``{answer_arg: reply text}`` and the observation's reward is the episode's final reward; without one it ends with
reward 0. Each tool call's observation reward (None = 0) is added to that turn's reward; an observation with
``done`` ends the episode. The task row's ``metadata.reset`` (a dict) is passed to ``reset`` as keyword arguments.
"""

from __future__ import annotations

import importlib
import json

HINT = "the openenv environment needs openenv-core: pip install 'miles[openenv]'"


def _openenv():
    try:
        from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction
    except ImportError as e:
        raise ImportError(HINT) from e
    return CallToolAction, ListToolsAction


class OpenEnvAdapter:
    """One OpenEnv environment instance (in this process, or a session with a server) per episode."""

    def __init__(
        self,
        env: str = "",
        url: str = "",
        final_tool: str = "",
        answer_arg: str = "answer",
        env_args: dict | None = None,
    ):
        if bool(env) == bool(url):
            raise ValueError(
                "env.args for openenv: give one of 'env' ('module:Class' of an OpenEnv Environment) or 'url'"
            )
        self.final_tool, self.answer_arg = final_tool, answer_arg
        self.CallToolAction, self.ListToolsAction = _openenv()
        if env:
            module, _, name = env.partition(":")
            self.env = getattr(importlib.import_module(module), name)(**(env_args or {}))
            self.remote = False
        else:
            from openenv.core.generic_client import GenericEnvClient

            self.env = GenericEnvClient(base_url=url).sync()
            self.env.connect()
            self.remote = True

    def reset(self, row: dict) -> tuple[list[dict], list[dict]]:
        self._act("reset", **((row.get("metadata") or {}).get("reset") or {}))
        listed = self._act("step", self.ListToolsAction())
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description", ""),
                    "parameters": t.get("input_schema") or {},
                },
            }
            for t in listed.get("tools", [])
        ]
        return row.get("messages") or [{"role": "user", "content": row["prompt"]}], tools

    def step(self, message: dict) -> tuple[list[dict], float, bool, dict]:
        calls = message.get("tool_calls") or []
        if not calls:
            if not self.final_tool:
                return [], 0.0, True, {}
            obs = self._act(
                "step",
                self.CallToolAction(
                    tool_name=self.final_tool, arguments={self.answer_arg: message.get("content") or ""}
                ),
            )
            reward = float(obs.get("reward") or 0.0)
            return [], reward, True, {"passed": reward >= 1.0, "observation": _text(obs)[:200]}
        out, reward, done = [], 0.0, False
        for call in calls:
            fn = call["function"]
            obs = self._act("step", self.CallToolAction(tool_name=fn["name"], arguments=fn.get("arguments") or {}))
            out.append({"role": "tool", "content": _text(obs), "name": fn["name"]})
            reward += float(obs.get("reward") or 0.0)
            done = done or bool(obs.get("done"))
        return out, reward, done, {}

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()

    def _act(self, what: str, *args, **kwargs) -> dict:
        """An observation as a dict (in process: the Observation model; remote: the StepResult's observation)."""
        if self.remote and what == "step":
            args = (args[0].model_dump(),)
        result = getattr(self.env, what)(*args, **kwargs)
        if hasattr(result, "observation"):  # a client's StepResult
            obs = result.observation
            obs = obs.model_dump() if hasattr(obs, "model_dump") else dict(obs)
            return obs | {"reward": result.reward, "done": result.done}
        return result.model_dump() if hasattr(result, "model_dump") else dict(result or {})


def _text(obs: dict) -> str:
    """A tool observation as the text of a tool message: its error, else its result (MCP content blocks joined)."""
    if obs.get("error"):
        err = obs["error"]
        return f"error: {err.get('message', err) if isinstance(err, dict) else err}"
    result = obs.get("result")
    if isinstance(result, dict) and "content" in result:  # an MCP CallToolResult
        blocks = result.get("content") or []
        texts = [b.get("text", "") for b in blocks if isinstance(b, dict)]
        if texts:
            return "\n".join(texts)
        result = result.get("structured_content") or result.get("data")
    if hasattr(result, "content"):
        return "\n".join(getattr(b, "text", str(b)) for b in result.content)
    return result if isinstance(result, str) else json.dumps(result, default=str)
