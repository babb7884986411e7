"""What an async run (miles.async_config) will do, predicted before launch from measured rates: the staleness of
every step's samples, its mean and p95, and the step time against the synchronous loop's.

The loop (miles.rollout_window) starts step ``t``'s rollout once the engines hold version ``t - k`` and lands
version ``s + 1`` only after every rollout in flight finished, so staleness needs no rates at all: step ``t`` of a
run starting at ``first`` is sampled whole under version ``max(first, t - k)``, staleness ``min(t - first, k)``.
The step time does: at ``k = 0`` a step is the rollout, then the train step, then the sync; at ``k >= 1`` the next
rollout runs beside the train step, so a steady step is ``max(rollout, train) + sync``, where the two sides have
their own devices (``shared_cores = 0``). Where they share ``shared_cores`` CPU cores and each keeps one busy, they
overlap only as far as the cores allow: ``max(max(rollout, train), (rollout + train) / shared_cores)``.

    p = predict(rollout_s=1.8, train_s=2.4, sync_s=0.1, max_staleness=2, num_steps=100)
    p.staleness_mean, p.staleness_p95, p.step_s, p.speedup
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AsyncPrediction:
    staleness: list[int]  # per RL step: the staleness of every sample of it (version span 0)
    staleness_mean: float
    staleness_p95: float
    step_s: float  # a steady step
    sync_step_s: float  # the synchronous loop's step on the same rates
    speedup: float  # sync_step_s / step_s


def staleness_per_step(max_staleness: int, num_steps: int, first_step: int = 0) -> list[int]:
    """The staleness of step ``t``'s samples, ``first_step <= t < num_steps``: min(t - first_step, max_staleness)."""
    return [min(t - first_step, max_staleness) for t in range(first_step, num_steps)]


def predict(
    rollout_s: float,
    train_s: float,
    sync_s: float,
    max_staleness: int,
    num_steps: int,
    *,
    first_step: int = 0,
    shared_cores: int = 0,
) -> AsyncPrediction:
    """The prediction from one step's measured rollout, train and sync seconds (a synchronous run's medians, or the
    planner's figures); ``shared_cores``: 0 when the rollout and the trainer have devices of their own."""
    if min(rollout_s, train_s, sync_s) < 0 or num_steps <= first_step:
        raise ValueError(
            f"rollout_s = {rollout_s}, train_s = {train_s}, sync_s = {sync_s} must be >= 0 and num_steps = "
            f"{num_steps} > first_step = {first_step}: pass measured seconds and a run with steps left"
        )
    stale = staleness_per_step(max_staleness, num_steps, first_step)
    sync_step = rollout_s + train_s + sync_s
    overlapped = max(rollout_s, train_s)
    if shared_cores:
        overlapped = max(overlapped, (rollout_s + train_s) / shared_cores)
    step = sync_step if max_staleness == 0 else overlapped + sync_s
    return AsyncPrediction(
        staleness=stale,
        staleness_mean=sum(stale) / len(stale),
        staleness_p95=_percentile(stale, 0.95),
        step_s=step,
        sync_step_s=sync_step,
        speedup=sync_step / step if step else 1.0,
    )


def _percentile(values: list[int], q: float) -> float:
    """The nearest-rank percentile (every step has as many samples, so a step's staleness is one value)."""
    ordered = sorted(values)
    return float(ordered[max(0, math.ceil(q * len(ordered)) - 1)])


def measured_rates(metrics_path) -> dict[str, float]:
    """The median rollout, train and sync seconds of a run's RL steps (its metrics.jsonl: a synchronous run of the
    recipe, or the run so far): what ``predict`` takes."""
    import json
    import statistics

    rows = []
    with open(metrics_path) as f:
        rows = [r for r in map(json.loads, filter(str.strip, f)) if "phase" not in r]
    if not rows:
        raise ValueError(f"{metrics_path} holds no RL step: measure with a run of a few steps (miles train)")
    med = lambda key: statistics.median(r.get(key, 0.0) for r in rows)  # noqa: E731
    return {"rollout_s": med("time/rollout"), "train_s": med("train_time"), "sync_s": med("sync/seconds")}


def describe(p: AsyncPrediction, max_staleness: int) -> str:
    """One line for ``miles plan``."""
    line = f"async.max_staleness = {max_staleness}: staleness mean {p.staleness_mean:.2f}, p95 {p.staleness_p95:g}"
    if p.sync_step_s:
        line += f"; step {p.step_s:.3g} s vs {p.sync_step_s:.3g} s synchronous ({p.speedup:.2f}x)"
    return line
