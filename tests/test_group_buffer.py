"""The group buffer between generation and training: admission keeps every trained sample within max_staleness
versions, whatever the timings (a property test over random engine, trainer and sync timings, with and without
in-flight updates); finished groups are never dropped and each step trains exactly its own groups, so the accepted
lengths are the generated ones."""

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles.group_buffer import AdmissionError, GroupBuffer
from miles.staleness import staleness, version_span


def simulate(k, groups_per_step, num_steps, slots, partial, seed, max_ticks=20_000):
    """A tick-by-tick engine (``slots`` groups decode at once, one token per sample per tick), a trainer and a sync
    with random durations; returns what was generated and what was taken."""
    rng = random.Random(seed)
    buf = GroupBuffer(k, groups_per_step)
    version, arriving = 0, []  # the engine's version; (tick, version) published by the trainer, in flight
    active = []  # [step, group, lengths, versions per sample]
    generated, taken = {}, {}
    training = None  # (done tick, step)
    for tick in range(max_ticks):
        while arriving and arriving[0][0] <= tick and (partial or not active):
            version = arriving.pop(0)[1]
        for step, group in list(buf.admissible(version)):
            if len(active) == slots or step >= num_steps:
                break
            buf.start(step, group, version)
            active.append([step, group, [rng.randint(1, 12) for _ in range(rng.randint(1, 3))], None])
            active[-1][3] = [[] for _ in active[-1][2]]
        for g in list(active):
            step, group, lengths, versions = g
            for want, got in zip(lengths, versions):
                if len(got) < want and rng.random() < 0.8:  # an uneven decode rate per row
                    got.append(version)
            if all(len(v) == n for v, n in zip(versions, lengths)):
                active.remove(g)
                buf.finish(step, group, versions)
                generated[step, group] = lengths
        if training and training[0] <= tick:
            arriving.append((tick + rng.randint(0, 5), training[1] + 1))
            training = None
        nxt = buf.next_take
        if training is None and nxt < num_steps and buf.ready(nxt):
            for g in buf.take(nxt):
                taken[g.step, g.index] = (g.lengths, g.versions)
            training = (tick + rng.randint(0, 10), nxt)
        if len(taken) == num_steps * groups_per_step:
            return buf, generated, taken
    raise AssertionError(f"no progress after {max_ticks} ticks: taken {sorted(taken)}")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    k=st.integers(0, 3),
    groups_per_step=st.integers(1, 4),
    num_steps=st.integers(1, 8),
    slots=st.integers(1, 6),
    partial=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_no_trained_sample_is_ever_staler_than_the_bound_whatever_the_timings(
    k, groups_per_step, num_steps, slots, partial, seed
):
    buf, generated, taken = simulate(k, groups_per_step, num_steps, slots, partial, seed)
    stale = [staleness(step, v) for (step, _), (_, versions) in taken.items() for v in versions]
    assert max(stale) <= k
    assert buf.peak_held <= (k + 1) * groups_per_step  # bounded: at most k + 1 steps of groups at once
    # finished work is never dropped, and each step trains its own groups: the accepted lengths are the generated
    assert {key: lengths for key, (lengths, _) in taken.items()} == generated
    if not partial:  # without in-flight updates a sample never crosses a version
        assert all(version_span(v) == 0 for _, versions in taken.values() for v in versions)
    if k == 0:
        assert set(stale) == {0}


def test_accepted_lengths_have_the_distribution_of_the_generated_ones():
    """One long run with in-flight updates: the histogram of the lengths trained on equals the generated one."""
    _, generated, taken = simulate(2, 4, 40, 3, True, seed=7)
    assert Counter(n for lengths in generated.values() for n in lengths) == Counter(
        n for lengths, _ in taken.values() for n in lengths
    )


def test_a_group_that_could_exceed_the_bound_is_refused_with_the_version_to_wait_for():
    buf = GroupBuffer(max_staleness=1, groups_per_step=1)
    assert list(buf.admissible(0)) == [(0, 0), (1, 0)]
    buf.start(0, 0, 0)
    buf.start(1, 0, 0)
    with pytest.raises(AdmissionError, match="once the engine holds version 1"):
        buf.start(2, 0, 0)


def test_groups_start_in_order_and_versions_only_move_forward():
    buf = GroupBuffer(max_staleness=0, groups_per_step=2)
    with pytest.raises(AdmissionError, match="out of order"):
        buf.start(0, 1, 0)
    buf.start(0, 0, 3)
    with pytest.raises(ValueError, match="older than 3"):
        buf.finish(0, 0, [[2, 3]])


def test_a_step_is_taken_only_when_all_its_groups_are_done_and_oldest_first():
    buf = GroupBuffer(max_staleness=1, groups_per_step=2)
    for step, group in list(buf.admissible(0)):
        buf.start(step, group, 0)
    buf.finish(1, 0, [[0, 0]])
    buf.finish(1, 1, [[0]])
    buf.finish(0, 0, [[0]])
    assert not buf.ready(1) and not buf.ready(0)  # step 1 waits for step 0, step 0 for its second group
    buf.finish(0, 1, [[0, 0, 0]])
    assert [g.lengths for g in buf.take(0)] == [[1], [3]]
    m = buf.metrics(1, buf.take(1))
    assert m["async/staleness_max"] == 1 and m["async/version_span_max"] == 0 and m["async/buffer_groups_peak"] == 4
