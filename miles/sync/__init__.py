"""Weight sync: getting the trainer's weights into every rollout engine after a step, with a version.

Transports (``sync.transport``): ``tensor`` (colocated: shared memory / CUDA IPC buckets, or with
``sync.source=in_place`` the trainer's own tensors opened once by the engines), ``broadcast``
(a torch.distributed group: NCCL / gloo), ``rdt`` (Ray Direct Transport: nixl / cuda_ipc / nccl / gloo),
``disk-delta`` (compressed delta files in a shared directory). All follow miles.sync.base.WeightSync.
"""

from __future__ import annotations


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
        from miles.sync.disk_delta import DiskDeltaSync

        return DiskDeltaSync.from_run_config(cfg)
    raise ValueError(f"sync.transport = {name!r} is unknown; use tensor, broadcast, rdt or disk-delta")
