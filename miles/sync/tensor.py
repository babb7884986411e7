"""The colocated ``tensor`` transport: flattened buckets handed to the engines by handle, no bytes on the wire.

Use it when trainer and engines share a machine (colocated, or engines on the same host): on GPU the engine
reads the trainer's bucket through CUDA IPC, on CPU through shared memory. Each bucket is bounded by
``update_weight_buffer_size``; the same staging buffers are reused every sync.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from miles.config import SyncConfig
from miles.sync.base import call, plan_buckets
from miles.sync.flat_bucket import StagingBuffers


class TensorSync:
    """sync = TensorSync(cfg, device); sync.connect([engine]); sync.update(backend.named_weights(), version=1)

    Engines expose ``update_weights_from_bucket(handle, version)``, ``pause_generation``, ``flush_cache``,
    ``continue_generation`` (the embedded engine and the RolloutManager do).
    """

    def __init__(self, cfg: SyncConfig, device, *, is_source: bool = True):
        self.cfg, self.is_source = cfg, is_source
        self.staging = StagingBuffers(torch.device(device))
        self.engines: list[Any] = []
        self._metrics: dict[str, float] = {}

    def connect(self, engines: list[Any]) -> None:
        self.engines = list(engines)

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        t0 = time.perf_counter()
        nbytes, nbuckets = 0, 0
        if self.is_source:
            for e in self.engines:
                call(e, "pause_generation", "in_place")
                call(e, "flush_cache")
        for i, bucket in enumerate(plan_buckets(named_tensors, self.cfg.update_weight_buffer_size)):
            if not self.is_source:
                continue
            handle = self.staging.pack(i, bucket)
            for e in self.engines:
                call(e, "update_weights_from_bucket", handle, None)
            nbytes += sum(m.nbytes for m in handle.metas)
            nbuckets += 1
        if self.is_source:
            for e in self.engines:
                call(e, "set_weight_version", version)
                call(e, "continue_generation")
        dt = time.perf_counter() - t0
        self._metrics = {"sync/bytes": nbytes, "sync/buckets": nbuckets, "sync/seconds": dt,
                         "sync/gbps": nbytes / dt / 1e9 if dt else 0.0}

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def close(self) -> None:
        self.staging.close()
