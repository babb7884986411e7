"""How stale a trained sample is: the weight versions its tokens were sampled under, against the version that trains
on it.

The trainer of RL step ``s`` holds weight version ``s`` (version 0 is the initial weights; each step's update makes
the next). A sample trained at step ``s`` whose tokens were sampled under versions ``v_0 .. v_n`` has staleness
``s - min(v)`` (how many updates its oldest token missed) and version span ``max(v) - min(v)`` (how many in-flight
updates it crossed). In the synchronous loop both are 0 for every sample.

    versions = sample_versions(sample)                       # one version per response token
    row |= staleness_metrics(step, samples)                  # async/staleness_mean, async/staleness_max, ...
"""

from __future__ import annotations

from collections.abc import Sequence

from miles.samples import Sample


def sample_versions(s: Sample) -> list[int]:
    """The weight version of each response token (from a source without per-token versions: the sample's one)."""
    if s.token_versions:
        return list(s.token_versions)
    return [s.weight_version] * max(1, len(s.response_ids))


def staleness(trained_at: int, versions: Sequence[int]) -> int:
    """Updates the oldest token missed when the trainer of version ``trained_at`` trains on it."""
    return trained_at - min(versions)


def version_span(versions: Sequence[int]) -> int:
    """Updates that landed while the sample was being generated."""
    return max(versions) - min(versions)


def staleness_metrics(trained_at: int, per_sample: Sequence[Sequence[int]]) -> dict[str, float]:
    """The metrics row's async columns for the samples trained at step ``trained_at`` (each sample's token versions):
    staleness mean and max, version span mean and max, the oldest and newest version in the batch, and the fraction
    of samples that crossed an update (partial rollouts)."""
    stale = [staleness(trained_at, v) for v in per_sample]
    spans = [version_span(v) for v in per_sample]
    return {
        "async/staleness_mean": sum(stale) / len(stale),
        "async/staleness_max": max(stale),
        "async/version_span_mean": sum(spans) / len(spans),
        "async/version_span_max": max(spans),
        "async/version_min": min(min(v) for v in per_sample),
        "async/version_max": max(max(v) for v in per_sample),
        "async/partial_frac": sum(s > 0 for s in spans) / len(spans),
    }
