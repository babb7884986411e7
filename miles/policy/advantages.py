"""Advantage estimators on outcome rewards: each completion's reward turned into how much better it did than a baseline.

GRPO scores a completion against its group (mean and std), Dr.GRPO drops the std (it up-weights groups that are
nearly solved or nearly failed), RLOO uses the mean of the *other* samples of the group (an unbiased baseline),
REINFORCE++ whitens over the whole batch (no groups needed), and its -baseline variant subtracts the group mean first.
"""

from __future__ import annotations

import torch

from miles.policy.objective import ESTIMATORS, GROUP_ESTIMATORS


def compute_advantages(
    rewards: list[float], groups: list[int], estimator: str = "grpo", eps: float = 1e-6
) -> list[float]:
    """One advantage per sample (float64 arithmetic). A group whose rewards are all equal gets zeros under the
    group estimators; REINFORCE++ gives zeros only when the whole batch is equal."""
    r = torch.tensor(rewards, dtype=torch.float64)
    g = torch.tensor(groups)
    if estimator == "reinforce++":
        return _whiten(r, eps).tolist()
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"advantage estimator {estimator!r} is not one of {list(ESTIMATORS)}")
    adv = torch.zeros_like(r)
    for gid in g.unique():
        m = g == gid
        n = int(m.sum())
        if r[m].max() == r[m].min():
            continue  # exactly zero (r - mean can leave a rounding residue that the std would blow up)
        centred = r[m] - r[m].mean()
        if estimator == "grpo" and n > 1:
            centred = centred / (r[m].std(unbiased=False) + eps)
        elif estimator == "rloo" and n > 1:
            centred = centred * n / (n - 1)  # r_i - mean of the other n-1 samples
        adv[m] = centred
    if estimator == "reinforce++-baseline":
        adv = adv / (adv.std(unbiased=False) + eps)  # group-centred, then scaled by the batch's spread
    return adv.tolist()


def group_advantages(
    rewards: list[float], groups: list[int], *, normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """GRPO's (r - mean of its group) / (std of its group + eps); without std: Dr.GRPO's r - mean."""
    return compute_advantages(rewards, groups, "grpo" if normalize_std else "drgrpo", eps)


def _whiten(x: torch.Tensor, eps: float) -> torch.Tensor:
    if len(x) < 2:
        return torch.zeros_like(x)
    return (x - x.mean()) / (x.std(unbiased=False) + eps)
