"""Colocated: the rollout manager and one trainer rank in this process, sharing one device and one MemoryLedger.

It executes HandoffPlan steps through the same executor as miles.cluster.Cluster (miles.plan_executor), without Ray:
the unit tests check plan against execution with it, and the handoff benchmark and notebooks measure real
peaks, bytes and copy speed with it (on CPU here, on one GPU where Ray is not installed).

    co = Colocated(cfg, device="cuda")
    plan = HandoffPlan.from_config(cfg.handoff)
    co.execute(plan.init, version=0)                    # its trainer.build step creates co.backend
    for step in range(n):
        batches, _ = co.manager.generate(step)
        co.execute(plan.rollout_to_train)
        co.backend.train_step(batches[0])
        co.execute(plan.train_to_rollout, version=step + 1)
    co.records   # one StepRecord per executed step: bytes moved, seconds, the ledger events it caused
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from miles.cluster import sample_source_factory
from miles.config import RunConfig
from miles.handoff import HandoffPlan, Step
from miles.memory import LedgerEvent
from miles.plan_executor import PlanExecutor
from miles.rollout.manager import RolloutManager
from miles.train.backend import build_backend
from miles.train.torch_backend import TorchBackend


@dataclass(slots=True)
class StepRecord:
    phase: str  # "init" | "rollout_to_train" | "train" | "train_to_rollout"
    step: Step
    moved: int  # bytes the call reported
    seconds: float
    events: list[LedgerEvent] = field(default_factory=list)
    device_allocated: int = 0  # torch.cuda.memory_allocated() after the step (0 on CPU)
    held_device: int = 0  # bytes of all tagged tensors resident after the step


class Colocated(PlanExecutor):
    """One engine group + one trainer rank on one device; see the module docstring for the call order."""

    def __init__(self, cfg: RunConfig, device: str = "cpu", disk_dir: str | None = None):
        if cfg.trainer.world_size != 1:
            raise ValueError(
                f"Colocated runs one trainer rank; trainer.world_size = {cfg.trainer.world_size}: use "
                f"miles.cluster.Cluster for more ranks"
            )
        self.cfg, self.device = cfg, device
        self.manager = self.rollout = RolloutManager(cfg, device, source_factory=sample_source_factory(cfg))
        self.trainer = LocalTrainer(self)
        self.ledger = self.manager.ledger
        self.disk_dir = disk_dir
        self.backend: TorchBackend | None = None  # built by the plan's trainer.build step (or build_trainer())
        self.records: list[StepRecord] = []
        self.events: list[LedgerEvent] = []  # every ledger event so far, in order (construction included)
        self._drain()

    def _drain(self) -> list[LedgerEvent]:
        new, _ = self.ledger.drain()
        self.events += new
        return new

    def step_done(self, s: Step, moved: int, t0: float, phase: str) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        self.records.append(
            StepRecord(phase, s, moved, seconds, self._drain(), _allocated(self.device), self.held_device_bytes())
        )

    def build_trainer(self) -> TorchBackend:
        """Create the trainer rank (once): its tags enter the ledger's device pool now."""
        if self.backend is None:
            self.backend = build_backend(self.cfg, self.device, ledger=self.ledger, disk_dir=self.disk_dir)
        return self.backend

    def held_device_bytes(self) -> int:
        """Bytes the tagged tensors of both sides hold on the device now (lazily created optimizer state included)."""
        mems = [e.memory for e in self.manager.engines] + ([self.backend.memory] if self.backend else [])
        return sum(m.resident_bytes(t) for m in mems for t in m.tags)

    def train(self, batches, step: int | None = None) -> dict:
        """One train step on the rank's batch, recorded as a 'train' row (device bytes after it)."""
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        metrics = self.backend.train_step(batches[0], step=step)
        peak = torch.cuda.max_memory_allocated() if self.device == "cuda" else 0
        self.records.append(
            StepRecord(
                "train",
                Step("trainer", "train"),
                0,
                time.perf_counter() - t0,
                self._drain(),
                peak,
                self.held_device_bytes(),
            )
        )
        return metrics

    def run(self, plan: HandoffPlan, num_steps: int) -> list[dict]:
        """init, then ``num_steps`` of generate -> rollout_to_train -> train -> train_to_rollout."""
        self.execute(plan.init, version=0, phase="init")
        rows = []
        for i in range(num_steps):
            batches, metrics = self.manager.generate(i)
            self._drain()
            self.execute(plan.rollout_to_train, phase="rollout_to_train")
            metrics |= self.train(batches, step=i)
            self.execute(plan.train_to_rollout, version=i + 1, phase="train_to_rollout")
            rows.append(metrics)
        return rows


class LocalTrainer:
    """Colocated's trainer rank as a trainer group of one (the methods PlanExecutor calls, one result per rank).
    Its sync copies the trainer's tensors into every engine in process (update_weights_from_tensor)."""

    def __init__(self, co: Colocated):
        self.co = co

    def build(self) -> None:
        self.co.build_trainer()

    def clear_memory(self) -> None:
        self.co.backend.clear_memory()

    def offload(self, tags) -> list[int]:
        return [self.co.backend.offload(tuple(tags))]

    def onload(self, tags) -> list[int]:
        return [self.co.backend.onload(tuple(tags))]

    def update_weights(self, version: int | None) -> list[dict]:
        named = list(self.co.backend.named_weights())
        for e in self.co.manager.engines:
            e.update_weights_from_tensor(named, version)
        return [{}]


def _allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0
