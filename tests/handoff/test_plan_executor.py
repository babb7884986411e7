"""PlanExecutor (the one executor Cluster and Colocated share): each step becomes one call with the plan's own
tags, over recording handles."""

import pytest

from miles.config import HandoffConfig
from miles.handoff import HandoffPlan, Step
from miles.plan_executor import PlanExecutor


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


@pytest.mark.parametrize(
    "mode", ["cpu", "gpu"], ids=["peak-on-host", "peak-on-device"]
)  # an id "gpu" reads as the gpu mark
def test_each_plan_step_is_one_call_carrying_the_plans_own_tags(mode):
    cfg = HandoffConfig(colocate_memory_peak_device=mode, offload_train="host", offload_rollout=True)
    plan = HandoffPlan.from_config(cfg)
    ex = Recorder()
    moved = ex.execute(plan.init, version=7)
    expected = []
    for s in plan.init:
        if s.owner == "engine":
            expected.append(("engine." + ("offload" if s.verb.startswith("offload") else "onload"), s.tags))
        elif s.owner == "sync":
            expected.append(("trainer.update_weights", 7))
        elif s.verb in ("offload", "onload"):
            expected.append((f"trainer.{s.verb}", list(s.tags)))
        else:
            expected.append((f"trainer.{s.verb}",))
    assert ex.calls == expected and ex.synced_with == [[{"sync/bytes": 5}]]
    engine = [s for s in plan.init if s.owner == "engine"]
    assert {k for k in moved} == {s.key for s in plan.init if s.owner == "engine" or s.verb in ("offload", "onload")}
    assert sum(v for k, v in moved.items() if k.startswith("engine")) == sum(10 * len(s.tags) for s in engine)


def test_a_step_with_no_mapping_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="plan step nobody.dance"):
        Recorder().execute((Step("nobody", "dance"),))
