"""Colocated: the rollout manager and one trainer rank in this process, sharing one device and one MemoryLedger.

It is a cluster the driver runs on (``miles.driver.train(cfg, cluster=Colocated)``) without Ray: the same loop, the
same plan executor (miles.handoff.executor), with every executed step recorded. The plan tests check plan against
execution with it, and the handoff benchmark and notebooks measure real peaks, bytes and copy speed with it (on CPU
here, on one GPU where Ray is not installed).

    rows = train(cfg, cluster=lambda cfg: Colocated(cfg, device="cuda"))   # or keep the instance the lambda made
    co.records   # one StepRecord per executed step: bytes moved, seconds, the ledger events it caused
    co.events    # every ledger event of the run, in order
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from miles.config import RunConfig
from miles.handoff.executor import PlanExecutor
from miles.handoff.plan import TRAIN_ALL, Step
from miles.memory import LedgerEvent
from miles.rollout.manager import RolloutManager
from miles.sources import make_sources
from miles.stall.watchdog import Unwatched
from miles.train.backend import build_backend, read_checkpoint_files, sample_log_probs, write_checkpoint_files
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
        if cfg.async_.partial_rollout:
            raise ValueError(
                "async.partial_rollout = true lands weight updates while a rollout generates, which needs the "
                "rollout running beside the trainer (Ray actors, miles.cluster.Cluster); in one process each "
                "rollout runs to its end before training: run on Ray (`miles train`, miles.driver.train), not in one "
                "process (train_in_process), or set "
                "async.partial_rollout=false"
            )
        self.cfg, self.device = cfg, device
        self.manager = self.rollout = RolloutManager(cfg, device, sources=make_sources)
        self.trainer = LocalTrainer(self)
        self.ledger = self.manager.ledger
        self.disk_dir = disk_dir
        self.backend: TorchBackend | None = None  # built by the plan's trainer.build step (or build_trainer())
        self.records: list[StepRecord] = []
        self.events: list[LedgerEvent] = []  # every ledger event so far, in order (construction included)
        self.samples: list = []  # process samples (RSS) the ledger took
        self._reported = (0, 0)  # events and samples handed to the driver so far (drain_ledgers)
        self.watchdog = Unwatched()  # one process: nothing to watch from outside it
        self.placement = None  # one process on one node: no placement rows (miles.cluster_nodes)
        self.sync_metrics: dict = {}
        self._drain()

    def lost_node(self, e: BaseException) -> None:
        """One process: no node of the run can leave while it runs (Cluster.lost_node's counterpart)."""
        return None

    def __enter__(self) -> "Colocated":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.manager.close()

    def _drain(self) -> list[LedgerEvent]:
        new, samples = self.ledger.drain()
        self.events += new
        self.samples += samples
        return new

    # ---- what the driver calls (the same as miles.cluster.Cluster) ------------------------------------------------
    def generate(self, step: int):
        out = self.manager.generate(step)
        self._drain()  # the rollout's own events: in no plan step's record
        return out

    def submit_generate(self, step: int):
        """In one process the rollout runs at once (miles.rollout_window: the same versions as on a cluster, no
        overlap with training); ``collect`` hands it back."""
        return self.generate(step)

    def collect(self, pending, step: int, untrained: int | None = None):
        return pending

    def evaluate(self, step: int) -> dict[str, float]:
        return self.manager.evaluate(step)

    def sft_batches(self, i: int) -> list:
        return self.manager.sft_batches(i)

    def sample_rows(self, train_log_probs: dict, step: int | None = None) -> list[dict]:
        return self.manager.sample_rows(train_log_probs, step)

    def drain_ledgers(self):
        """The ledger's events and process samples since the last call (those in step records included)."""
        self._drain()
        (e, s), self._reported = self._reported, (len(self.events), len(self.samples))
        return self.events[e:], self.samples[s:]

    def synced(self, metrics: list[dict]) -> None:
        self.sync_metrics = metrics[0]
        if self.cfg.sync.check_weights:
            from miles.sync.check import check_weights

            trainer = dict(self.backend.named_weights())
            for i, engine in enumerate(self.manager.engines):
                check_weights(trainer, engine.named_weights(), label=f"engine {i}")

    def save_checkpoint(self, run_dir, next_step: int):
        tags = list(TRAIN_ALL) if self.cfg.handoff.offload_train != "none" else []
        self.trainer.onload(tags)
        try:
            return run_dir.save_checkpoint(next_step, lambda d: self._write_checkpoint(d, next_step))
        finally:
            self.trainer.offload(tags)

    def _write_checkpoint(self, directory: str, next_step: int) -> None:
        self.trainer.save_checkpoint(directory)
        self.manager.save_data_state(directory, next_step)

    def load_data_state(self, checkpoint) -> None:
        self.manager.load_data_state(str(checkpoint))

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
        named = list(self.co.backend.weights_to_sync())
        for e in self.co.manager.engines:
            e.update_weights_from_tensor(named, version)
        self.co.backend.weights_synced()
        return [{}]

    def train(self, batches, want_log_probs: bool = False, step: int | None = None) -> list[tuple[dict, dict]]:
        metrics = self.co.train(batches, step=step)
        return [(metrics, sample_log_probs(self.co.backend, batches[0]) if want_log_probs else {})]

    def sft(self, batches, lr: float | None = None) -> list[dict]:
        if lr is not None:
            self.co.backend.set_lr(lr)
        return [self.co.backend.sft_step(batches[0])]

    def set_lr(self, lr: float) -> list:
        return [self.co.backend.set_lr(lr)]

    def end_warmup(self) -> list:
        return [self.co.backend.end_warmup()]

    def named_weights(self) -> list[dict]:
        return [{k: v.detach().cpu().clone() for k, v in self.co.backend.named_weights()}]

    def save_checkpoint(self, directory: str) -> list:
        return [write_checkpoint_files(directory, self.co.backend.state_dict())]

    def load_checkpoint(self, directory: str) -> list:
        return [self.co.backend.load_state_dict(read_checkpoint_files(directory))]


def _allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0
