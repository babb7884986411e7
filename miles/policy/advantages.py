"""Group-normalised advantages (GRPO): each completion is scored against the others of its prompt."""

from __future__ import annotations

import torch


def group_advantages(
    rewards: list[float], groups: list[int], *, normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """(r - mean of its group) / (std of its group + eps); a group whose rewards are all equal gets zeros."""
    r = torch.tensor(rewards, dtype=torch.float64)
    g = torch.tensor(groups)
    adv = torch.zeros_like(r)
    for gid in g.unique():
        m = g == gid
        centred = r[m] - r[m].mean()
        if normalize_std and m.sum() > 1:
            centred = centred / (r[m].std(unbiased=False) + eps)
        adv[m] = centred
    return adv.tolist()
