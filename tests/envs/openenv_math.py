"""An OpenEnv MCP environment for the adapter's test: add(a, b) and submit(answer) (reward 1 for the right sum)."""

from __future__ import annotations

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction
from openenv.core.env_server.types import Observation, State


class MathToolsEnvironment(MCPEnvironment):
    def __init__(self, target: int = 5):
        mcp = FastMCP("math")

        @mcp.tool
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @mcp.tool
        def submit(answer: str) -> str:
            """Submit the final answer."""
            return "received"

        super().__init__(mcp)
        self.target, self._state = target, State()

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.target = kwargs.get("target", self.target)
        self._state = State(episode_id=episode_id)
        return Observation(done=False, reward=0.0)

    def step(self, action, timeout_s=None, **kwargs):
        obs = super().step(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction) and action.tool_name == "submit":
            obs.reward, obs.done = float(str(self.target) in str(action.arguments.get("answer"))), True
        return obs

    def _step_impl(self, action, timeout_s=None, **kwargs):
        return Observation(done=True, reward=0.0)

    @property
    def state(self):
        return self._state
