"""Weight sync: getting the trainer's weights into every rollout engine after a step, with a version.

Transports (``sync.transport``): ``tensor`` (colocated: shared memory / CUDA IPC buckets, or with
``sync.source=in_place`` the trainer's own tensors opened once by the engines), ``broadcast``
(a torch.distributed group: NCCL / gloo), ``rdt`` (Ray Direct Transport: nixl / cuda_ipc / nccl / gloo),
``disk-delta`` (compressed delta files in a shared directory). All follow ``WeightSync`` below; the bucketed ones share miles.sync.bucket_sync.BucketSync.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class WeightSync(Protocol):
    def connect(self, engines: list[Any]) -> None: ...

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def metrics(self) -> dict[str, float]: ...


class SyncError(RuntimeError):
    """A weight update failed; the engines were told to abort it and keep their previous version."""


def make_sync(cfg, device: str, *, is_source: bool):
    """The transport named by ``cfg.sync.transport`` (a RunConfig), ready to ``connect(engines)``."""
    name = cfg.sync.transport
    if name == "tensor" and cfg.sync.source == "in_place":
        from miles.sync.in_place import InPlaceSync

        return InPlaceSync(cfg.sync, device, is_source=is_source)
    if name == "tensor":
        from miles.sync.tensor import TensorSync

        return TensorSync(cfg.sync, device, is_source=is_source)
    if name == "broadcast":
        from miles.sync.broadcast import BroadcastSync

        return BroadcastSync(cfg.sync, device, is_source=is_source)
    if name == "rdt":
        from miles.sync.rdt import RDTSync

        return RDTSync(cfg.sync, device, is_source=is_source)
    if name == "disk-delta":
        from miles.sync.disk_delta.transport import DiskDeltaSync

        return DiskDeltaSync.from_run_config(cfg)
    raise ValueError(f"sync.transport = {name!r} is unknown; use tensor, broadcast, rdt or disk-delta")
