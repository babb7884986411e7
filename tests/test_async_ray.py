"""The async loop on Ray actors (miles.cluster): the rollout of a step ahead runs in the rollout actor's process while
the trainer's process trains, and the run equals the same seed in one process (miles.colocated, where the rollout
ahead runs before the train step) step for step: the schedule of versions, not the timing, decides the numbers."""

import json

import pytest

from miles.driver import train, train_in_process
from tests.conftest import tiny_run_cfg

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)

ASYNC = [
    "async.max_staleness=2",
    "handoff.offload_train=none",
    "handoff.offload_rollout=false",
    "trainer.rollout_correction=decoupled",
    "num_steps=5",
    "checkpoint_every=0",
    "dump_rollouts=true",
]


def test_an_async_run_on_ray_equals_the_same_seed_in_one_process(tmp_path, ray_session):
    rows = train(tiny_run_cfg(tmp_path / "ray", *ASYNC), progress=False)
    train_in_process(tiny_run_cfg(tmp_path / "one", *ASYNC))
    local = [json.loads(x) for x in (tmp_path / "one" / "run" / "metrics.jsonl").read_text().splitlines()]
    local = [r for r in local if "phase" not in r]
    assert [r["weight_version"] for r in rows] == [0, 0, 0, 1, 2]
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 2, 2, 2]
    assert [r["reward"] for r in rows] == [r["reward"] for r in local]
    assert [r["loss"] for r in rows] == [r["loss"] for r in local]
    # the dump of each step holds that step's samples (several steps are generated before one is dumped)
    for step in range(5):
        versions = (tmp_path / "ray" / "run" / "rollouts" / f"step_{step:06d}" / "weight_versions.int32").read_bytes()
        assert set(memoryview(versions).cast("i")) - {-1} == {max(0, step - 2)}
