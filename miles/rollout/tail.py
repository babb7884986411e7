"""The rollout tail: what happens to a step's samples after a source produced them, written once for every source.

    samples, source_metrics = source.samples(step)      # miles.rollout.sources.SampleSource
    scoring = source.score(samples, step)               # rewards; reward/timeouts, reward/errors, time/reward
    cut = shape_overlong_of(samples, cfg.rollout)       # DAPO's overlong shaping (off by default)
    assign_advantages(samples, "grpo")                  # rollout.advantage_estimator
    metrics = rollout_metrics(samples) | source_metrics | {"overlong_frac": cut}
    batches = to_shards(samples, pad_id, world_size)    # one TrainBatch per data-parallel rank

Each step is a named function so that a new objective (other advantages, a sample filter) replaces one of them
in ``RolloutManager.generate`` instead of writing a second tail. With DAPO's dynamic sampling the manager draws
several rounds (miles.policy.dapo.fill_groups); ``RoundLog`` adds their metrics up.
"""

from __future__ import annotations

import torch

from miles.config import RolloutConfig
from miles.policy.advantages import compute_advantages
from miles.policy.dapo import shape_overlong
from miles.samples import Sample, TrainBatch, collate, shard


def assign_advantages(samples: list[Sample], estimator: str) -> None:
    """Each sample's advantage by ``estimator`` (rollout.advantage_estimator, miles.policy.advantages)."""
    rewards, groups = [s.reward for s in samples], [s.group for s in samples]
    for s, a in zip(samples, compute_advantages(rewards, groups, estimator)):
        s.advantage = a


def shape_overlong_of(samples: list[Sample], r: RolloutConfig) -> float:
    """DAPO's soft overlong punishment and truncation filter as ``rollout`` configures them (both off by default);
    returns the fraction of responses cut at max_new_tokens."""
    return shape_overlong(
        samples, r.max_new_tokens, r.overlong_buffer_len, r.overlong_penalty_factor, r.overlong_filter
    )


class RoundLog:
    """The metrics the sampling rounds of one step add: generation time and the scoring's counts summed over rounds,
    the source's other metrics from the last round, and the fraction of responses cut at the budget
    (``overlong_frac``)."""

    def __init__(self):
        self.source_metrics: dict[str, float] = {}
        self.scoring: dict[str, float] = {}
        self.seconds, self.cut = 0.0, []

    def add(self, source_metrics: dict[str, float], cut: float, scoring: dict[str, float] | None = None) -> None:
        self.source_metrics = source_metrics
        self.seconds += source_metrics["time/generate"]
        self.cut.append(cut)
        for k, v in (scoring or {}).items():
            self.scoring[k] = self.scoring.get(k, 0) + v

    def metrics(self) -> dict[str, float]:
        return (
            self.source_metrics
            | self.scoring
            | {"time/generate": self.seconds, "overlong_frac": sum(self.cut) / len(self.cut)}
        )


def rollout_metrics(samples: list[Sample]) -> dict[str, float]:
    """Reward and length figures of one step's samples (the metrics row's rollout columns)."""
    rewards = torch.tensor([s.reward for s in samples])
    resp_len = sum(len(s.response_ids) for s in samples)
    return {
        "reward": rewards.mean().item(),
        "reward_std": rewards.std().item() if len(samples) > 1 else 0.0,
        "score": sum(s.metadata.get("score", s.reward) for s in samples) / len(samples),  # before DAPO's shaping
        "exact": sum(s.reward == 1.0 for s in samples) / len(samples),
        "response_len": resp_len / len(samples),
        "rollout_tokens": resp_len,
        "total_tokens": resp_len + sum(len(s.prompt_ids) for s in samples),
    }


def to_shards(samples: list[Sample], pad_id: int, num_ranks: int) -> list[TrainBatch]:
    """One padded TrainBatch per data-parallel rank, contiguous shards in sample order."""
    return [collate(part, pad_id) for part in shard(samples, num_ranks)]
