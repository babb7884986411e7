"""The one executor of HandoffPlan steps, over handles that are in-process objects or Ray actors alike.

``miles.cluster.Cluster`` (Ray actors, what a run executes) and ``miles.colocated.Colocated`` (one process, what
the byte-exact plan tests and the handoff notebooks measure) both run their steps through ``PlanExecutor.execute``;
only their handles differ. An engine step moves exactly the tags the plan gives it (``HandoffPlan`` decides them
once); a trainer step calls the trainer group's method of the same name.

    class MyCluster(PlanExecutor):      # self.rollout: a RolloutManager or its actor; self.trainer: a trainer group
        def synced(self, metrics): ...  # after each sync step (the per-rank metrics of update_weights)
    moved = cluster.execute(plan.rollout_to_train)          # {"engine.offload_kv": bytes, ...}
"""

from __future__ import annotations

import time
from collections.abc import Callable

from miles.handoff.plan import Step
from miles.protocols.engine import EngineMemory
from miles.protocols.trainer import TrainerGroup
from miles.sync.calls import call


class PlanExecutor:
    """Subclasses set ``rollout`` (EngineMemory: the RolloutManager, in-process or its Ray actor handle) and
    ``trainer`` (a TrainerGroup: one result per rank), and may override ``synced`` and ``step_done``."""

    rollout: EngineMemory
    trainer: TrainerGroup

    def execute(
        self,
        steps: tuple[Step, ...],
        version: int | None = None,
        phase: str = "",
        *,
        built: Callable[[], None] | None = None,
        warm_up: Callable[[], None] | None = None,
    ) -> dict[str, int]:
        """Run plan steps in order; returns the bytes moved by each engine and trainer offload/onload step
        (``"<owner>.<verb>": bytes``). ``built`` runs right after the ``trainer.build`` step, before any of the
        trainer's memory moves (a resumed run loads its checkpoint there, so the init sync carries the resumed
        weights); ``warm_up`` is the ``trainer.warmup`` step (the driver's supervised warm-up)."""
        moved: dict[str, int] = {}
        for s in steps:
            t0 = time.perf_counter()
            n = self.run_step(s, version, built=built, warm_up=warm_up)
            if n is not None:
                moved[s.key] = moved.get(s.key, 0) + n
            self.step_done(s, n or 0, t0, phase)
        return moved

    def run_step(self, s: Step, version: int | None, *, built=None, warm_up=None) -> int | None:
        """One step; the bytes it moved, or None for a step that moves none by definition (build, clear, sync)."""
        if s.owner == "engine" and s.verb.startswith(("offload", "onload")):
            return call(self.rollout.offload if s.verb.startswith("offload") else self.rollout.onload, list(s.tags))
        if s.owner == "trainer" and s.verb in ("build", "clear_memory"):
            getattr(self.trainer, s.verb)()
            if s.verb == "build" and built is not None:
                built()
            return None
        if s.owner == "trainer" and s.verb == "warmup":
            if warm_up is not None:
                warm_up()
            return None
        if s.owner == "trainer" and s.verb in ("offload", "onload"):
            return sum(getattr(self.trainer, s.verb)(list(s.tags)))
        if s.owner == "sync":
            self.synced(self.trainer.update_weights(version))
            return None
        raise ValueError(f"plan step {s} has no executor mapping; valid owners engine/trainer/sync")

    def synced(self, metrics: list[dict]) -> None:
        """After a sync step, with each rank's sync metrics."""

    def step_done(self, s: Step, moved: int, t0: float, phase: str) -> None:
        """After every step (Colocated records it)."""
