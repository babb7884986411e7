"""The bounded, version-stamped buffer of groups between generation and training, with admission control.

Every group belongs to the RL step that trains on it, fixed before it starts (the step's prompts, as in the
synchronous loop), and the trainer takes a step only once all of that step's groups are finished, oldest step first.
Staleness is bounded by **admission**: a group of step ``t`` starts only while the engine holds a version
``v >= t - max_staleness``. Its tokens are sampled under ``v`` or later versions (an in-flight update only makes them
newer), and the trainer of step ``t`` holds version ``t``, so no trained sample is more than ``max_staleness``
versions old. Finished work is never discarded and a step's batch is exactly its groups, long or short: the accepted
lengths are the generated ones (no bias towards short answers, which a buffer filled by whichever groups finish
first would have). Since version ``v`` exists only once steps ``0 .. v-1`` were taken, the buffer holds at most
``max_staleness + 1`` steps of groups.

    buf = GroupBuffer(max_staleness=2, groups_per_step=32)
    for step, group in buf.admissible(engine_version): ...   # start them: buf.start(step, group, engine_version)
    buf.finish(step, group, versions)          # per sample of the group: the version of each of its tokens
    if buf.ready(step): groups = buf.take(step)                # the trainer of version ``step`` trains them
    buf.metrics(step, groups)                  # async/staleness_*, async/version_span_* (miles.staleness)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from miles.staleness import staleness, staleness_metrics


class AdmissionError(ValueError):
    """A group was started that could exceed the staleness bound (the producer skipped ``admissible``)."""


@dataclass(slots=True)
class Group:
    step: int  # the RL step that trains on it
    index: int  # its position within the step
    start_version: int  # the engine's version when it started
    versions: list[list[int]] | None = None  # per sample, per token: set by finish
    lengths: list[int] = field(default_factory=list)  # per sample: response tokens


class GroupBuffer:
    def __init__(self, max_staleness: int, groups_per_step: int, first_step: int = 0):
        if max_staleness < 0 or groups_per_step < 1:
            raise ValueError(
                f"max_staleness = {max_staleness} must be >= 0 and groups_per_step = {groups_per_step} >= 1"
            )
        self.k, self.groups_per_step = max_staleness, groups_per_step
        self.next_take = first_step  # the oldest step not yet trained
        self.next_start = (first_step, 0)  # the next group to start, in (step, group) order
        self.held: dict[tuple[int, int], Group] = {}  # started and not yet taken
        self.peak_held = 0  # the most groups held at once

    # ---- the producer's side ------------------------------------------------------------------------------------
    def admissible(self, engine_version: int) -> Iterator[tuple[int, int]]:
        """The groups that may start now, in order: every group of the steps ``t <= engine_version + max_staleness``
        not started yet (the caller starts them, or as many as it has room for, in this order)."""
        step, group = self.next_start
        while step <= engine_version + self.k:
            yield step, group
            step, group = (step, group + 1) if group + 1 < self.groups_per_step else (step + 1, 0)

    def start(self, step: int, group: int, engine_version: int) -> None:
        """``group`` of ``step`` starts now, under ``engine_version``; groups start in (step, group) order."""
        if (step, group) != self.next_start:
            raise AdmissionError(f"group {group} of step {step} started out of order; the next is {self.next_start}")
        if step - engine_version > self.k:
            raise AdmissionError(
                f"group {group} of step {step} started under weight version {engine_version}: it would be trained "
                f"{step - engine_version} versions old, over max_staleness = {self.k}; start it once the engine "
                f"holds version {step - self.k}"
            )
        self.held[step, group] = Group(step, group, engine_version)
        self.peak_held = max(self.peak_held, len(self.held))
        self.next_start = (step, group + 1) if group + 1 < self.groups_per_step else (step + 1, 0)

    def finish(self, step: int, group: int, versions: Sequence[Sequence[int]]) -> None:
        """The group's samples are done: ``versions[i]`` are the weight versions of sample i's tokens."""
        g = self.held.get((step, group))
        if g is None or g.versions is not None:
            raise ValueError(f"group {group} of step {step} is not in flight (never started, or finished already)")
        versions = [list(v) or [g.start_version] for v in versions]  # an empty response: its start version
        if any(min(v) < g.start_version for v in versions):
            raise ValueError(
                f"group {group} of step {step} has tokens of a version older than {g.start_version}, the one it "
                "started under; versions only move forward"
            )
        g.lengths = [len(v) for v in versions]
        g.versions = versions

    # ---- the trainer's side -------------------------------------------------------------------------------------
    def ready(self, step: int) -> bool:
        """Every group of ``step`` has finished (and ``step`` is the oldest not yet taken)."""
        if step != self.next_take:
            return False
        groups = [self.held.get((step, g)) for g in range(self.groups_per_step)]
        return all(g is not None and g.versions is not None for g in groups)

    def take(self, step: int) -> list[Group]:
        """The groups of ``step``, in order, for the trainer of version ``step``; checks the bound on every sample."""
        if not self.ready(step):
            raise ValueError(f"step {step} is not ready (the oldest step not taken is {self.next_take})")
        groups = [self.held.pop((step, g)) for g in range(self.groups_per_step)]
        worst = max(staleness(step, v) for g in groups for v in g.versions)
        if worst > self.k:  # admission makes this impossible: a producer that bypassed it
            raise AdmissionError(f"step {step} holds a sample {worst} versions old, over max_staleness = {self.k}")
        self.next_take = step + 1
        return groups

    def metrics(self, step: int, groups: list[Group]) -> dict[str, float]:
        """Staleness and version spans of the groups taken at ``step`` (miles.staleness), and the buffer's fill."""
        return staleness_metrics(step, [v for g in groups for v in g.versions]) | {
            "async/buffer_groups_peak": self.peak_held
        }
