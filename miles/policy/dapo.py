"""DAPO's rollout-side pieces (Yu et al. 2025): dynamic sampling, overlong filtering and soft overlong punishment.

Dynamic sampling: a group whose rewards are all equal has zero group advantage, so it adds nothing to the gradient
but dilutes the batch; such groups are dropped and the batch refilled from more prompts, for at most
``max_rounds`` generation rounds (a task the model always solves or never solves would otherwise loop forever).
Overlong filtering masks a truncated response out of the loss (its reward says nothing about the answer);
the soft punishment lowers the reward linearly over the last ``buffer_len`` tokens of the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.samples import Sample


def overlong_penalty(response_len: int, max_len: int, buffer_len: int, factor: float = 1.0) -> float:
    """0 up to max_len - buffer_len tokens, then falling linearly to -factor at max_len (and below beyond it)."""
    free = max_len - buffer_len
    if response_len <= free:
        return 0.0
    return max(free - response_len, -buffer_len) / buffer_len * factor


def round_key(step: int, k: int) -> int:
    """The prompt stream of refill round ``k`` of RL step ``step`` (round 0 is the step's own prompts; the others
    start at 20M, clear of the steps and of the SFT warm-up's 10M + i)."""
    return step if k == 0 else 20_000_000 + 1_000_000 * k + step


def step_of_round(key: int) -> int:
    """The RL step whose prompts ``key`` (a ``round_key``) draws."""
    return key if key < 20_000_000 else (key - 20_000_000) % 1_000_000


def shape_overlong(samples: list[Sample], max_len: int, buffer_len: int, factor: float, filter_truncated: bool):
    """Soft overlong punishment added to each reward (buffer_len > 0), and truncated responses masked out of the
    loss (filter_truncated). Returns the fraction of responses cut at the budget."""
    cut = 0
    for s in samples:
        if buffer_len:
            s.metadata["score"] = s.reward  # the task's own score, before the shaping
            s.reward += overlong_penalty(len(s.response_ids), max_len, buffer_len, factor)
        if s.finish_reason == "length":
            cut += 1
            if filter_truncated:
                s.metadata["loss_mask"] = [0] * len(s.response_ids)
    return cut / max(len(samples), 1)


def uniform_groups(samples: list[Sample], tol: float = 1e-9) -> set[int]:
    """Groups whose rewards are all equal (within tol): zero advantage under every group estimator."""
    by_group: dict[int, list[float]] = {}
    for s in samples:
        by_group.setdefault(s.group, []).append(s.reward)
    return {g for g, rs in by_group.items() if max(rs) - min(rs) <= tol}


def fill_groups(
    draw: Callable[[int], list[Sample]], num_groups: int, max_rounds: int
) -> tuple[list[Sample], dict[str, float]]:
    """Call ``draw(round)`` (scored samples of fresh prompts) until ``num_groups`` groups with unequal rewards are
    collected or ``max_rounds`` rounds are spent. If still short, dropped groups fill the rest, so the batch keeps
    its size (they carry zero advantage). Returns the samples renumbered (index, group from 0) and the metrics."""
    kept: list[list[Sample]] = []
    dropped: list[list[Sample]] = []
    rounds = 0
    while len(kept) < num_groups and rounds < max_rounds:
        samples = draw(rounds)
        rounds += 1
        flat = uniform_groups(samples)
        for gid, members in _by_group(samples).items():
            (dropped if gid in flat else kept).append(members)
    num_kept = min(len(kept), num_groups)
    chosen = kept[:num_groups] + dropped[: num_groups - num_kept]
    out: list[Sample] = []
    for g, members in enumerate(chosen):
        for s in members:
            s.group, s.index = g, len(out)
            out.append(s)
    metrics = {
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/dropped_groups": float(len(dropped)),
        "dynamic_sampling/padded_groups": float(num_groups - num_kept),
    }
    return out, metrics


def _by_group(samples: list[Sample]) -> dict[int, list[Sample]]:
    out: dict[int, list[Sample]] = {}
    for s in samples:
        out.setdefault(s.group, []).append(s)
    return out
