"""Learning-rate schedules as a pure function of the RL step: linear warmup, then constant, linear or cosine decay."""

from __future__ import annotations

import math

from miles.policy.objective import LR_SCHEDULES


def lr_at(
    step: int,
    base_lr: float,
    *,
    schedule: str = "constant",
    warmup_steps: int = 0,
    decay_steps: int = 0,
    min_ratio: float = 0.0,
) -> float:
    """The LR of RL step ``step`` (0-based). Warmup: base_lr * (step + 1) / warmup_steps for the first
    ``warmup_steps`` steps. Then ``constant`` stays at base_lr; ``linear`` / ``cosine`` fall to
    base_lr * min_ratio at step ``decay_steps`` (counted from step 0, warmup included) and stay there."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"LR schedule {schedule!r} is not one of {list(LR_SCHEDULES)}")
    span = max(decay_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return base_lr * (min_ratio + (1.0 - min_ratio) * shape)
