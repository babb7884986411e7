"""``sync.source = "in_place"``: engines read the trainer's weights where they live, one copy per sync.

The bucket transports copy every byte twice: into a staging bucket, then out of it into the engine. Here the
trainer exports each weight tensor's own storage once (a CUDA IPC handle on GPU; on CPU the storage moves into
a shared-memory file, once), the engine opens those handles once and keeps them, and every later sync is one
engine call that copies straight from the trainer's tensors into the engine's weights (through the same
transactional receiver as every transport: validated first, shadow or direct, version set at commit). Handles
are exported again only when a tensor's storage moved (a new address), so a sync costs one device copy of the
bytes plus one request to each engine process. On CUDA that request, after the first update, is a doorbell
(miles.sync.doorbell: a Unix socket the engine process serves from a thread) instead of a Ray call, so a sync
costs little more than the device copy itself (``miles bench weight-sync`` measures both against a plain
device-to-device copy; BENCHMARKS.md). On CPU the Ray call stays (a copy on a second thread of the engine process would start a second OpenMP
team there, miles.threads); ``InPlaceSync(doorbell=True/False)`` overrides either default.

When to use it: trainer and engines on one host (one GPU shared by two processes, or colocated), the trainer's
weights resident between steps and at fixed addresses. Not with a trainer that offloads its parameters
(``handoff.offload_train`` host/disk): while an engine holds a handle the exporting process cannot free the
memory (CUDA IPC keeps it alive until the importer lets go), so the offload would free nothing. Not with an FSDP
trainer (world size > 1): its full tensors are gathered anew every sync. ``RunConfig`` refuses both.

    sync = InPlaceSync(cfg.sync, "cuda"); sync.connect([engine_actor])
    sync.update(backend.named_weights(), version=1)   # exports handles (first time), then one call per engine
    sync.update(backend.named_weights(), version=2)   # handles reused: one copy of the bytes, the doorbell rung
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from miles.protocols.engine import ReceivesInPlace, supports
from miles.sync import SyncError
from miles.sync.buckets import WeightManifest, byte_view, fused_group
from miles.sync.calls import submit, wait
from miles.sync.doorbell import Doorbell, DoorbellClient, DoorbellError

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
    doorbell: bool = False  # the engine process opens a doorbell (miles.sync.doorbell) for the updates that follow


# ---- trainer side --------------------------------------------------------------------------------------------
def export(name: str, t: torch.Tensor) -> SharedTensor:
    """Share ``t``'s own storage (no copy). On CPU the storage moves into shared memory once (its address
    changes; the tensor, its parameter and the optimizer keep their identity)."""
    t = t.detach()
    if not t.is_contiguous():
        raise ValueError(
            f"in-place weight sync reads tensors as they are; {name} is not contiguous: use sync.source=bucket"
        )
    if t.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        return SharedTensor(name, "cuda_ipc", tuple(reduce_tensor(t)[1]))
    if t.device.type != "cpu":
        raise ValueError(f"in-place weight sync shares CUDA or CPU tensors; {name} is on {t.device}")
    manager, handle, size = t.untyped_storage()._share_filename_cpu_()
    return SharedTensor(
        name,
        "shm",
        (
            manager,
            handle,
            size,
            t.storage_offset(),
            tuple(t.shape),
            tuple(t.stride()),
            str(t.dtype).removeprefix("torch."),
        ),
    )


def storage_key(named: list[tuple[str, torch.Tensor]]) -> str:
    """Identifies where every tensor's bytes are: equal keys mean handles exported before still point at them.
    (Compared only against keys of the same trainer process; the device is the sync's, one for all tensors.)
    Computed on every sync, so it reads only what it must: name, pointer, size and dtype per tensor."""
    return f"{hash(tuple((n, t.data_ptr(), t.nbytes, t.dtype) for n, t in named)) & (2**64 - 1):016x}"


class InPlaceSync:
    """The trainer side (see the module docstring). Engines expose ``update_weights_in_place(shared, version)``:
    the embedded engine and the RolloutManager do."""

    name = "tensor"

    def __init__(
        self,
        cfg,
        device,
        *,
        is_source: bool = True,
        group_of=fused_group,
        doorbell: bool | None = None,
        timeout_s: float = 600.0,
    ):
        self.cfg, self.device, self.is_source, self.group_of = cfg, torch.device(device), is_source, group_of
        self.doorbell = self.device.type == "cuda" if doorbell is None else doorbell  # see miles.sync.doorbell
        self.timeout_s = timeout_s  # for an engine's answer to a doorbell
        self.engines: list = []
        self._key, self._shared, self._nbytes = "", (), 0
        self._opened_by: set[int] = set()  # engines that hold the handles of self._key
        self._bells: dict[int, DoorbellClient] = {}  # engines rung instead of called, once they hold the handles
        self.exports = 0  # how many times handles were exported (1 while the storages stay put)
        self._moved_last, self._warned = False, False
        self._metrics: dict[str, float] = {}

    def connect(self, engines: list) -> None:
        missing = [e for e in engines if not supports(e, ReceivesInPlace)]
        if missing:
            raise ValueError(
                f"sync.source=in_place needs engines with update_weights_in_place (the embedded engine, the "
                f"RolloutManager); {missing[0]!r} has none: use sync.source=bucket"
            )
        self._drop_bells()
        self.engines, self._opened_by = list(engines), set()

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        t0 = time.perf_counter()
        named = list(named_tensors)  # iterated on every rank (may be collective); detached only when exported
        if not self.is_source:
            return
        phases = {}
        try:
            key = storage_key(named)
            if key != self._key:
                if self._key and self._moved_last and not self._warned:
                    self._warned = True
                    log.warning(
                        "the trainer's weight tensors moved again since the last sync: in-place sync reopens "
                        "every handle each time (and the engine's old mappings hold the old memory until then); "
                        "these weights are not resident at fixed addresses, use sync.source=bucket"
                    )
                self._moved_last = bool(self._key)
                self._shared = tuple(export(n, t) for n, t in named)
                self._nbytes = sum(t.nbytes for _, t in named)
                self._key, self._opened_by = storage_key(named), set()  # CPU export moved the storages once
                self.exports += 1
            known = SharedWeights(self._key, None, None, self.doorbell)
            fresh = (
                known
                if len(self._opened_by) == len(self.engines)
                else SharedWeights(
                    self._key,
                    WeightManifest.of(named, self.group_of, self.cfg.engine_staging),
                    self._shared,
                    self.doorbell,
                )
            )
            t = time.perf_counter()
            phases["export_s"] = t - t0
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the optimizer's last writes land before engines read
            phases["device_wait_s"] = time.perf_counter() - t
            t = time.perf_counter()
            rung = [i for i in range(len(self.engines)) if i in self._opened_by and i in self._bells]
            for i in rung:
                self._bells[i].send(self._key, version)
            called = [i for i in range(len(self.engines)) if i not in rung]
            calls = [
                submit(self.engines[i].update_weights_in_place, known if i in self._opened_by else fresh, version)
                for i in called
            ]
            inside = wait(calls) + [self._bells[i].answer(self.timeout_s) for i in rung]
            # the engines have copied (and synchronized): the trainer may write again
            phases["engine_s"] = time.perf_counter() - t
            phases["rung"] = len(rung)
            for i, r in zip(called, inside):
                if r and r.get("doorbell") and i not in self._bells:
                    self._connect_bell(i, r["doorbell"])
            for k in ("open_s", "begin_s", "copy_s", "commit_s"):  # the slowest engine's phases
                phases[f"engine_{k}"] = max(((r or {}).get(k, 0.0) for r in inside), default=0.0)
            self._opened_by = set(range(len(self.engines)))
            if not fresh.tensors:
                self._moved_last = False
        except Exception as e:
            self._opened_by = set()  # an engine may have dropped its handles: send them again next time
            self._drop_bells()  # and ring no engine before it answered a call again
            raise SyncError(
                f"in-place weight update to version {version} failed ({type(e).__name__}: {e}); the "
                "engines aborted it and keep serving their previous version"
            ) from e
        total = time.perf_counter() - t0
        nbytes = self._nbytes
        self._metrics = {
            "sync/bytes": nbytes,
            "sync/buckets": 0,
            "sync/seconds": total,
            "sync/exports": self.exports,
            "sync/gbps": nbytes / total / 1e9 if total else 0.0,
            **{f"sync/{k}": v for k, v in phases.items()},
        }

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def close(self) -> None:
        self._drop_bells()
        self._shared, self._key = (), ""

    def _connect_bell(self, i: int, address: str) -> None:
        try:
            self._bells[i] = DoorbellClient(address)
        except DoorbellError as e:  # the update itself went through; later ones go by Ray call
            log.warning("in-place sync rings no doorbell, using a Ray call per update instead: %s", e)
            self.doorbell = False

    def _drop_bells(self) -> None:
        for b in self._bells.values():
            b.close()
        self._bells = {}


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
            raise ReceiveError(
                f"in-place update for handles {shared.key} but this engine holds {self.key or 'none'}; "
                "the trainer must send the handles again (it does after a failed update)"
            )
        return self.manifest, self.tensors


class InPlaceEndpoint:
    """What an engine process (an EmbeddedEngine actor, a RolloutManager) keeps for in-place updates of its
    ``engines``: the opened handles and, once a trainer asked for it, a doorbell that runs the same update."""

    def __init__(self, engines: list, hold=None):
        """``hold``: what pauses and continues generation around an update (default each engine; a RolloutManager
        passes itself, whose pause follows async.kv_on_update)."""
        self.engines, self.opened = engines, OpenedWeights()
        self.holds = [hold] if hold is not None else engines
        self.doorbell: Doorbell | None = None
        self._one = threading.Lock()  # a Ray call and a ring never update at once

    def update(self, shared: SharedWeights, version: int) -> dict:
        with self._one:
            for e in self.holds:
                e.pause_generation()
            try:
                phases = receive_in_place(shared, self.opened, self.engines, version)
            finally:
                for e in self.holds:
                    e.continue_generation()
        if shared.doorbell:
            if self.doorbell is None:
                self.doorbell = Doorbell(self._ring)
            phases["doorbell"] = self.doorbell.address
        return phases

    def _ring(self, key: str, version: int) -> dict:
        return self.update(SharedWeights(key, None, None), version)

    def close(self) -> None:
        if self.doorbell is not None:
            self.doorbell.close()
            self.doorbell = None


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
