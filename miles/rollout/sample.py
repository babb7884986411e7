"""A Sample: one completion of one prompt, with what RL needs from it (tokens, log-probs, reward, advantage)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True, slots=True)
class Sample:
    index: int
    group: int  # prompt index within the step; samples of one group share a prompt
    prompt: str  # the prompt as text (for dumps and reward functions)
    target: str  # the reference answer the reward function checks against ("" if none)
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)  # per response token, from the engine
    response_text: str = ""
    finish_reason: str = ""  # "stop", "length" or "abort"
    reward: float = 0.0
    advantage: float = 0.0
    weight_version: int = 0
    metadata: dict = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids
