"""The colocated ``tensor`` transport: flattened buckets handed to the engines by handle, no bytes on the wire.

Use it when trainer and engines share a machine (colocated, or engines on the same host): on GPU the engine
reads the trainer's bucket through CUDA IPC, on CPU through shared memory (/dev/shm). Each bucket is bounded
by ``update_weight_buffer_size`` (a group larger than that grows the buffer, with a warning). Two staging
buffers alternate, so the trainer packs bucket i+1 while the engines copy bucket i; they are allocated once
and reused every sync, so each handle is opened once on the engine side.

With ``sync.source=in_place`` there is no bucket: engines open the trainer's own tensors once and copy from them
(miles.sync.in_place: one copy per sync instead of two, for trainers whose weights stay resident).

``staging_device="cpu"`` with CUDA weights is the host-staged path (device -> shared host memory -> device):
it works between any two processes of a host and is the baseline the benchmark compares against.
"""

from __future__ import annotations

import time

import torch

from miles.config import SyncConfig
from miles.sync.bucket_sync import BucketSync, SyncTimer
from miles.sync.buckets import Piece, fused_group
from miles.sync.calls import submit, wait
from miles.sync.flat_bucket import StagingBuffers

NUM_SLOTS = 2


class TensorSync(BucketSync):
    """sync = TensorSync(cfg.sync, device); sync.connect([engine]); sync.update(backend.named_weights(), version=1)

    Engines expose ``update_weights_from_bucket(handle, version)``, ``pause_generation``, ``flush_cache``,
    ``set_weight_version``, ``continue_generation`` (and ``begin_weight_update`` / ``abort_weight_update`` for
    failure-safe updates): the embedded engine, the RolloutManager, the router and the SGLang client do.
    """

    name = "tensor"

    def __init__(self, cfg: SyncConfig, device, *, is_source: bool = True, staging_device=None, group_of=fused_group):
        super().__init__(cfg, device, is_source=is_source, group_of=group_of)
        self.staging = StagingBuffers(torch.device(staging_device or device))
        self._inflight: dict[int, list] = {}

    def _send(self, index: int, pieces: list[Piece], timer: SyncTimer) -> None:
        slot = index % NUM_SLOTS
        t = time.perf_counter()
        wait(self._inflight.pop(slot, []))
        t = timer.add("engine_wait", t)
        handle = self.staging.pack(slot, [(p.name, p.tensor) for p in pieces])
        timer.add("pack", t)
        self._inflight[slot] = [submit(e.update_weights_from_bucket, handle, None) for e in self.engines]

    def _finish(self, timer: SyncTimer) -> None:
        t = time.perf_counter()
        for slot in list(self._inflight):
            wait(self._inflight.pop(slot))
        timer.add("engine_wait", t)

    def _abort(self) -> None:
        for slot in list(self._inflight):  # let buckets in flight land before the engines drop the update
            try:
                wait(self._inflight.pop(slot))
            except Exception:
                pass
        super()._abort()

    def close(self) -> None:
        self.staging.close()
