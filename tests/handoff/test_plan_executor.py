"""PlanExecutor (the one executor Cluster and Colocated share): each step becomes one call with the plan's own
tags, over recording handles."""

import pytest

from miles.config import HandoffConfig
from miles.handoff.executor import PlanExecutor
from miles.handoff.plan import HandoffPlan, Step


class Recorder(PlanExecutor):
    def __init__(self):
        self.calls, self.synced_with = [], []
        rec = self

        class Rollout:
            def offload(self, tags):
                rec.calls.append(("engine.offload", tuple(tags)))
                return 10 * len(tags)

            def onload(self, tags):
                rec.calls.append(("engine.onload", tuple(tags)))
                return 10 * len(tags)

        class Trainer:
            def __getattr__(self, verb):
                def method(*args):
                    rec.calls.append((f"trainer.{verb}", *args))
                    return [1, 2] if verb in ("offload", "onload") else [{"sync/bytes": 5}]

                return method

        self.rollout, self.trainer = Rollout(), Trainer()

    def synced(self, metrics):
        self.synced_with.append(metrics)


TRAIN_TAGS = ["params", "grads", "optimizer", "ref", "quant_workspace"]
# the init plan of each mode, written out as the calls it must make (version 7 is the sync's weight version)
EXPECTED_INIT_CALLS = {
    "cpu": [  # the engine frees its KV and weights first, the trainer is built and parked on the host, then back
        ("engine.offload", ("cuda_graph", "kv_cache")),
        ("engine.offload", ("weights",)),
        ("trainer.build",),
        ("trainer.offload", TRAIN_TAGS),
        ("engine.onload", ("weights",)),
        ("trainer.update_weights", 7),
        ("engine.onload", ("cuda_graph", "kv_cache")),
    ],
    "gpu": [  # the engine keeps its weights on the device; the sync happens while the trainer is still there
        ("engine.offload", ("cuda_graph", "kv_cache")),
        ("trainer.build",),
        ("trainer.update_weights", 7),
        ("trainer.offload", TRAIN_TAGS),
        ("engine.onload", ("cuda_graph", "kv_cache")),
    ],
}
EXPECTED_INIT_MOVED = {  # the recording engine moves 10 bytes per tag, each trainer rank (two) 1 and 2 bytes
    "cpu": {
        "engine.offload_kv": 20,
        "engine.offload_weights": 10,
        "trainer.offload": 3,
        "engine.onload_weights": 10,
        "engine.onload_kv": 20,
    },
    "gpu": {"engine.offload_kv": 20, "trainer.offload": 3, "engine.onload_kv": 20},
}


@pytest.mark.parametrize(
    "mode", ["cpu", "gpu"], ids=["peak-on-host", "peak-on-device"]
)  # an id "gpu" reads as the gpu mark
def test_each_plan_step_is_one_call_carrying_the_plans_own_tags(mode):
    cfg = HandoffConfig(colocate_memory_peak_device=mode, offload_train="host", offload_rollout=True)
    ex = Recorder()
    moved = ex.execute(HandoffPlan.from_config(cfg).init, version=7)
    assert ex.calls == EXPECTED_INIT_CALLS[mode]
    assert ex.synced_with == [[{"sync/bytes": 5}]]
    assert moved == EXPECTED_INIT_MOVED[mode]


def test_a_step_with_no_mapping_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="plan step nobody.dance"):
        Recorder().execute((Step("nobody", "dance"),))
