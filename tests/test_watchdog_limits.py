"""The stall watchdog's limits and its one line, without processes: watchdog_s until three RL steps are measured,
then min(watchdog_s, max(60 s, 10 x the slowest step)) for the phases inside a step; the other phases keep
watchdog_s."""

from pathlib import Path

import pytest

from miles.config import apply_overrides
from miles.recipes import quickstart
from miles.stall.watchdog import Stall, StallLimits


def test_the_limit_is_watchdog_s_until_three_steps_are_measured_then_ten_times_the_slowest_step():
    limits = StallLimits(900)
    for seconds in (2.0, 9.0):
        limits.add_step(seconds)
        assert limits.limit("generate") == 900
    limits.add_step(3.0)
    assert [limits.limit(p) for p in ("generate", "reward", "train", "sync")] == [90.0] * 4
    assert [limits.limit(p) for p in ("eval", "checkpoint", "init", "warm-up", "record")] == [900] * 5


def test_the_derived_limit_stays_between_the_floor_and_watchdog_s():
    fast, slow, small = StallLimits(900), StallLimits(900), StallLimits(5)
    for _ in range(3):
        fast.add_step(0.5)
        slow.add_step(200.0)
        small.add_step(0.1)
    assert (fast.limit("train"), slow.limit("train"), small.limit("train")) == (60.0, 900, 5)


def test_the_stall_line_names_the_phase_the_step_the_limit_and_the_directory():
    s = Stall("reward", 7, 61.4, 60.0, Path("runs/x/stall-20261204T120000Z"), 4)
    assert s.line == (
        "no progress for 61 s in phase reward (RL step 7; the limit is 60 s, watchdog_s): the Python stacks of "
        "its 4 processes are in runs/x/stall-20261204T120000Z"
    )
    assert s.trainer_sound and not Stall("sync", 7, 1, 1, Path("d"), 1).trainer_sound


def test_watchdog_s_is_checked_when_the_config_is_built():
    assert apply_overrides(quickstart(), ["watchdog_s=0"]).watchdog_s == 0  # off
    with pytest.raises(ValueError, match=r"watchdog_s = -1.0 must be >= 0; seconds without progress"):
        apply_overrides(quickstart(), ["watchdog_s=-1"])
