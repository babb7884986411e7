"""TrainBatch: the padded tensors one data-parallel rank trains on, built from Samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.rollout.sample import Sample


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
