"""The records that pass from rollout to training: a Sample (one completion of one prompt, with what RL needs from
it: tokens, log-probs, reward, advantage) and a TrainBatch (the padded tensors one data-parallel rank trains on).

Both live here, below miles.rollout and miles.train, so that neither package imports the other for its records.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    weight_version: int = 0  # the engine's version when the response finished
    token_versions: list[int] = field(default_factory=list)  # per response token: the version it was sampled under
    metadata: dict = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids


@dataclass(slots=True)
class TrainBatch:
    """Position t of every [N, L] tensor refers to token t (predicted from positions < t); index 0 is unused."""

    tokens: torch.Tensor  # [N, L] int64, right-padded
    loss_mask: torch.Tensor  # [N, L] float32: 1 on response tokens
    rollout_log_probs: torch.Tensor  # [N, L] float32 (engine's log-probs, 0 off-mask)
    advantages: torch.Tensor  # [N] float32
    sample_index: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def split(self, n: int) -> list["TrainBatch"]:
        size = -(-len(self.sample_index) // n)
        return [
            TrainBatch(
                self.tokens[i : i + size],
                self.loss_mask[i : i + size],
                self.rollout_log_probs[i : i + size],
                self.advantages[i : i + size],
                self.sample_index[i : i + size],
            )
            for i in range(0, len(self.sample_index), size)
        ]


def collate(samples: list[Sample], pad_id: int) -> TrainBatch:
    L = max(len(s.tokens) for s in samples)
    N = len(samples)
    tokens = torch.full((N, L), pad_id, dtype=torch.long)
    mask = torch.zeros(N, L)
    rlp = torch.zeros(N, L)
    for i, s in enumerate(samples):
        P, R = len(s.prompt_ids), len(s.response_ids)
        tokens[i, : P + R] = torch.tensor(s.tokens)
        agent_mask = s.metadata.get(
            "loss_mask"
        )  # multi-turn agent samples: 0 on template / tool tokens in the response
        mask[i, P : P + R] = torch.tensor(agent_mask, dtype=torch.float32) if agent_mask else 1.0
        if s.rollout_log_probs:
            rlp[i, P : P + R] = torch.tensor(s.rollout_log_probs)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return TrainBatch(tokens, mask, rlp, adv, [s.index for s in samples])


def shard(samples: list[Sample], num_ranks: int) -> list[list[Sample]]:
    """Contiguous, equal shards (the config guarantees divisibility), balanced by position."""
    per = len(samples) // num_ranks
    return [samples[r * per : (r + 1) * per] for r in range(num_ranks)]
