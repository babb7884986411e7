"""``sync.source = "in_place"``: engines read the trainer's weights where they live, one copy per sync.

The bucket transports copy every byte twice: into a staging bucket, then out of it into the engine. Here the
trainer exports each weight tensor's own storage once (a CUDA IPC handle on GPU; on CPU the storage moves into
a shared-memory file, once), the engine opens those handles once and keeps them, and every later sync is one
engine call that copies straight from the trainer's tensors into the engine's weights (through the same
transactional receiver as every transport: validated first, shadow or direct, version set at commit). Handles
are exported again only when a tensor's storage moved (a new address), so a sync costs one device copy of the
bytes plus one Ray round trip per engine process.

When to use it: trainer and engines on one host (one GPU shared by two processes, or colocated), the trainer's
weights resident between steps and at fixed addresses. Not with a trainer that offloads its parameters
(``handoff.offload_train`` host/disk): while an engine holds a handle the exporting process cannot free the
memory (CUDA IPC keeps it alive until the importer lets go), so the offload would free nothing. Not with an FSDP
trainer (world size > 1): its full tensors are gathered anew every sync. ``RunConfig`` refuses both.

    sync = InPlaceSync(cfg.sync, "cuda"); sync.connect([engine_actor])
    sync.update(backend.named_weights(), version=1)   # exports handles (first time), then one call per engine
    sync.update(backend.named_weights(), version=2)   # handles reused: one copy of the bytes
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from miles.sync.base import SyncError, WeightManifest, byte_view, fused_group, submit, wait

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SharedTensor:
    """How another process on this host opens one of the trainer's tensors in place."""

    name: str
    kind: str  # "cuda_ipc" | "shm"
    args: tuple  # cuda_ipc: torch's reduce_tensor arguments; shm: (manager, handle, size, offset, shape, stride, dtype)


@dataclass(frozen=True, slots=True)
class SharedWeights:
    """One in-place update. ``manifest`` and ``tensors`` are None when the engine already holds those of ``key``
    (the key covers every name, dtype and shape, so the manifest cannot have changed)."""

    key: str  # changes whenever a tensor's storage moved or the set of tensors changed
    manifest: WeightManifest | None
    tensors: tuple[SharedTensor, ...] | None


# ---- trainer side --------------------------------------------------------------------------------------------
def export(name: str, t: torch.Tensor) -> SharedTensor:
    """Share ``t``'s own storage (no copy). On CPU the storage moves into shared memory once (its address
    changes; the tensor, its parameter and the optimizer keep their identity)."""
    t = t.detach()
    if not t.is_contiguous():
        raise ValueError(f"in-place weight sync reads tensors as they are; {name} is not contiguous: use "
                         "sync.source=bucket")
    if t.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        return SharedTensor(name, "cuda_ipc", tuple(reduce_tensor(t)[1]))
    if t.device.type != "cpu":
        raise ValueError(f"in-place weight sync shares CUDA or CPU tensors; {name} is on {t.device}")
    manager, handle, size = t.untyped_storage()._share_filename_cpu_()
    return SharedTensor(name, "shm", (manager, handle, size, t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                                      str(t.dtype).removeprefix("torch.")))


def storage_key(named: list[tuple[str, torch.Tensor]]) -> str:
    """Identifies where every tensor's bytes are: equal keys mean handles exported before still point at them.
    (Compared only against keys of the same trainer process.)"""
    return f"{hash(tuple((n, t.data_ptr(), t.dtype, t.shape, t.device.index) for n, t in named)) & (2**64 - 1):016x}"


class InPlaceSync:
    """The trainer side (see the module docstring). Engines expose ``update_weights_in_place(shared, version)``:
    the embedded engine and the RolloutManager do."""

    name = "tensor"

    def __init__(self, cfg, device, *, is_source: bool = True, group_of=fused_group):
        self.cfg, self.device, self.is_source, self.group_of = cfg, torch.device(device), is_source, group_of
        self.engines: list = []
        self._key, self._shared = "", ()
        self._opened_by: set[int] = set()  # engines that hold the handles of self._key
        self.exports = 0  # how many times handles were exported (1 while the storages stay put)
        self._moved_last, self._warned = False, False
        self._metrics: dict[str, float] = {}

    def connect(self, engines: list) -> None:
        missing = [e for e in engines if not hasattr(e, "update_weights_in_place")]
        if missing:
            raise ValueError(f"sync.source=in_place needs engines with update_weights_in_place (the embedded engine, the "
                             f"RolloutManager); {missing[0]!r} has none: use sync.source=bucket")
        self.engines, self._opened_by = list(engines), set()

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        t0 = time.perf_counter()
        named = [(n, t.detach()) for n, t in named_tensors]  # iterated on every rank (may be collective)
        if not self.is_source:
            return
        phases = {}
        try:
            key = storage_key(named)
            if key != self._key:
                if self._key and self._moved_last and not self._warned:
                    self._warned = True
                    log.warning("the trainer's weight tensors moved again since the last sync: in-place sync reopens "
                                "every handle each time (and the engine's old mappings hold the old memory until then); "
                                "these weights are not resident at fixed addresses, use sync.source=bucket")
                self._moved_last = bool(self._key)
                self._shared = tuple(export(n, t) for n, t in named)
                self._key, self._opened_by = storage_key(named), set()  # CPU export moved the storages once
                self.exports += 1
            known = SharedWeights(self._key, None, None)
            fresh = known if len(self._opened_by) == len(self.engines) else SharedWeights(
                self._key, WeightManifest.of(named, self.group_of, self.cfg.engine_staging), self._shared)
            if any(t.is_cuda for _, t in named):
                torch.cuda.synchronize(self.device)  # the optimizer's last writes land before engines read
            t = time.perf_counter()
            phases["export_s"] = t - t0
            calls = [submit(e, "update_weights_in_place", known if i in self._opened_by else fresh, version)
                     for i, e in enumerate(self.engines)]
            inside = wait(calls)  # the engines have copied (and synchronized): the trainer may write again
            phases["engine_s"] = time.perf_counter() - t
            for k in ("open_s", "begin_s", "copy_s", "commit_s"):  # the slowest engine's phases
                phases[f"engine_{k}"] = max((r or {}).get(k, 0.0) for r in inside)
            self._opened_by = set(range(len(self.engines)))
            if not fresh.tensors:
                self._moved_last = False
        except Exception as e:
            self._opened_by = set()  # an engine may have dropped its handles: send them again next time
            raise SyncError(f"in-place weight update to version {version} failed ({type(e).__name__}: {e}); the "
                            "engines aborted it and keep serving their previous version") from e
        total = time.perf_counter() - t0
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        self._metrics = {"sync/bytes": nbytes, "sync/buckets": 0, "sync/seconds": total, "sync/exports": self.exports,
                         "sync/gbps": nbytes / total / 1e9 if total else 0.0, **{f"sync/{k}": v for k, v in phases.items()}}

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def close(self) -> None:
        self._shared, self._key = (), ""


# ---- engine side ---------------------------------------------------------------------------------------------
class OpenedWeights:
    """Receiver side: the trainer's tensors (and the update's manifest) opened once per key."""

    def __init__(self):
        self.key, self.manifest, self.tensors = "", None, []

    def get(self, shared: SharedWeights) -> tuple[WeightManifest, list[tuple[str, torch.Tensor]]]:
        from miles.sync.receiver import ReceiveError

        if shared.tensors is not None:
            self.key, self.manifest, self.tensors = "", None, []  # let go of the old mappings first
            self.tensors = [(s.name, byte_view(open_shared(s))) for s in shared.tensors]  # flat bytes, made once
            self.key, self.manifest = shared.key, shared.manifest
        elif shared.key != self.key:
            raise ReceiveError(f"in-place update for handles {shared.key} but this engine holds {self.key or 'none'}; "
                               "the trainer must send the handles again (it does after a failed update)")
        return self.manifest, self.tensors


def open_shared(s: SharedTensor) -> torch.Tensor:
    if s.kind == "cuda_ipc":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor(*s.args)
    if s.kind != "shm":
        raise ValueError(f"unknown shared tensor kind {s.kind!r}")
    manager, handle, size, offset, shape, stride, dtype = s.args
    storage = torch.UntypedStorage._new_shared_filename_cpu(manager, handle, size)
    return torch.empty(0, dtype=getattr(torch, dtype)).set_(storage, offset, shape, stride)


def receive_in_place(shared: SharedWeights, opened: OpenedWeights, engines: list, version: int) -> dict[str, float]:
    """Open (or reuse) the trainer's tensors, land them in every engine's update (``begin_weight_update``
    validates it first) and commit it with ``set_weight_version``. On any failure before the commit every
    engine's update is aborted (with shadow staging its weights are untouched). Returns seconds per phase."""
    t0 = time.perf_counter()
    phases = {}
    try:
        manifest, tensors = opened.get(shared)
        t = time.perf_counter()
        phases["open_s"] = t - t0
        for e in engines:
            e.begin_weight_update(manifest)
        phases["begin_s"] = time.perf_counter() - t
        t = time.perf_counter()
        for e in engines:
            e.weight_receiver().receive_whole(tensors)
        phases["copy_s"] = time.perf_counter() - t
    except Exception:
        for e in engines:
            e.abort_weight_update()
        raise
    t = time.perf_counter()
    for e in engines:
        e.set_weight_version(version)
    phases["commit_s"] = time.perf_counter() - t
    return phases
