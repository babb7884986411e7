"""The OpenEnv adapter against a real OpenEnv MCP environment (openenv-core + fastmcp): tools listed as OpenAI
function schemas, the model's calls made as CallToolActions, the final reply submitted to the final tool for the
reward. Skipped without openenv-core (pip install 'miles[openenv]')."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "openenv.core.env_server.mcp_environment", reason="needs openenv-core: pip install 'miles[openenv]'"
)
pytest.importorskip("fastmcp", reason="needs openenv-core's fastmcp: pip install 'miles[openenv]'")

from miles.envs.api import check_reset, check_step  # noqa: E402
from miles.envs.openenv import OpenEnvAdapter  # noqa: E402
from miles.envs.registry import env_class, make_env  # noqa: E402


def call(name, **arguments):
    return {"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_an_openenv_mcp_environment_runs_an_episode_through_the_adapter():
    env = make_env(env_class("openenv"), {"env": "openenv_math:MathToolsEnvironment", "final_tool": "submit"})
    messages, tools = check_reset(
        env.reset({"prompt": "What is 2 + 3?", "metadata": {"reset": {"target": 5}}}), "openenv"
    )
    assert messages == [{"role": "user", "content": "What is 2 + 3?"}]
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    assert set(by_name) == {"add", "submit"} and by_name["add"]["parameters"]["required"] == ["a", "b"]
    step = check_step(env.step({"role": "assistant", "content": "", "tool_calls": [call("add", a=2, b=3)]}), "openenv")
    assert step.messages == [{"role": "tool", "content": "5", "name": "add"}] and not step.done and step.reward == 0.0
    step = check_step(env.step({"role": "assistant", "content": "The answer is 5."}), "openenv")
    assert step.done and step.reward == 1.0 and step.info["passed"]
    env.close()


def test_a_wrong_answer_and_an_unknown_tool_are_answered_not_raised():
    env = OpenEnvAdapter(env="openenv_math:MathToolsEnvironment", final_tool="submit")
    env.reset({"prompt": "What is 2 + 3?"})
    step = check_step(
        env.step({"role": "assistant", "content": "", "tool_calls": [call("multiply", a=2, b=3)]}), "openenv"
    )
    assert step.messages[0]["content"].startswith("error") and not step.done
    assert check_step(env.step({"role": "assistant", "content": "7"}), "openenv").reward == 0.0


def test_the_adapter_needs_exactly_one_of_env_or_url():
    with pytest.raises(ValueError, match="give one of 'env'"):
        OpenEnvAdapter()
