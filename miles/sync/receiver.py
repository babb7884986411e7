"""The engine side of every weight-sync transport: an update is a transaction that either lands whole or not at all.

``begin(manifest)`` validates every name, dtype and shape before the first byte moves; pieces then arrive from
any transport (a shared-memory / CUDA IPC bucket, a broadcast, an RDT round) and land in a shadow copy
(``staging="shadow"``) or straight in the weights, group by group (``"direct"``); ``commit()`` swaps the shadow
in under the engine's lock. A transport failure before the commit calls ``abort()``: with a shadow the engine
keeps serving exactly its previous weights and version. The shadow costs one extra copy of the weights in
engine memory for the duration of the update (it is freed at commit; in a colocated step the KV cache is
released at that moment, so the shadow takes its place) and one extra device copy of all bytes.

A group (the shards of one fused engine parameter, see ``miles.sync.buckets.fused_group``) is written only once
all of its pieces have arrived, even when a fixed bucket cut it across rounds.

Broadcast (miles.sync.weight_group) and RDT arrive once per engine process and are applied to every engine it
holds, so their entry points take a list of receivers (the RolloutManager passes all its engines').
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from miles.sync.buckets import PieceMeta, WeightManifest, WeightSpec, byte_view

log = logging.getLogger(__name__)


class ReceiveError(ValueError):
    """An update that does not fit the engine's model, or pieces outside an open update."""


class WeightReceiver:
    """receiver = WeightReceiver(engine._target, engine.lock)   # target(name) -> the engine's parameter
    receiver.begin(manifest)                 # validate the whole update first
    receiver.receive([(piece_meta, u8)])     # any number of buckets / rounds, in any transport
    receiver.commit()                        # True: the update is in the weights (or receiver.abort())
    """

    def __init__(self, target: Callable[[str], torch.Tensor], lock: threading.RLock | None = None):
        self.target, self.lock = target, lock or threading.RLock()
        self.manifest: WeightManifest | None = None
        self._specs: dict[str, WeightSpec] = {}
        self._members: dict[str, list[str]] = {}
        self._received: dict[str, int] = {}
        self._landing: dict[str, torch.Tensor] = {}  # shadow (or pending group) bytes per tensor
        self._written_groups: set[str] = set()
        self._mutex = threading.Lock()  # an actor with max_concurrency > 1 may deliver buckets from several threads
        self._validated: tuple = (None, {}, {})  # (manifest, specs by name, members by group) last checked
        self._targets: dict[str, torch.Tensor] = {}

    @property
    def is_open(self) -> bool:
        return self.manifest is not None

    def begin(self, manifest: WeightManifest) -> None:
        if self.is_open:
            log.warning("a weight update was still open when a new one began; aborting the old one")
            self.abort()
        if manifest is not self._validated[0]:  # the same manifest object again (in-place syncs) was checked once
            self._validate(manifest)
        self.manifest = manifest
        self._specs, self._members = self._validated[1], self._validated[2]
        self._received = dict.fromkeys(self._specs, 0)
        self._landing, self._written_groups = {}, set()

    def _validate(self, manifest: WeightManifest) -> None:
        if manifest.staging not in ("shadow", "direct"):
            raise ReceiveError(f"staging {manifest.staging!r} is not supported; use 'shadow' or 'direct'")
        bad = []
        for s in manifest.specs:
            try:
                p = self.target(s.name)
            except (KeyError, ValueError) as e:
                bad.append(str(e))
                continue
            if str(p.dtype).removeprefix("torch.") != s.dtype or tuple(p.shape) != s.shape:
                bad.append(f"{s.name}: sent {s.dtype} {s.shape}, the engine holds {p.dtype} {tuple(p.shape)}")
        if bad:
            raise ReceiveError(f"weight update rejected before any byte moved ({len(bad)} problems): {bad[:3]}")
        members: dict[str, list[str]] = {}
        for s in manifest.specs:
            members.setdefault(s.group, []).append(s.name)
        self._validated = (manifest, {s.name: s for s in manifest.specs}, members)
        self._targets: dict[str, torch.Tensor] = {}  # byte views of the weights, kept while this manifest is in use

    def receive(self, items: list[tuple[PieceMeta, torch.Tensor]]) -> None:
        """Land pieces (metadata + their bytes as a flat uint8 tensor)."""
        if not self.is_open:
            raise ReceiveError("weight pieces arrived outside an update; call begin_weight_update(manifest) first")
        for m, data in items:
            s = self._specs.get(m.name)
            if s is None:
                raise ReceiveError(f"piece of {m.name!r}, which is not in this update's manifest")
            if m.start < 0 or m.start + m.nbytes > s.nbytes or data.numel() != m.nbytes:
                raise ReceiveError(
                    f"piece of {m.name} bytes [{m.start}, {m.start + m.nbytes}) does not fit its "
                    f"{s.nbytes} bytes (got {data.numel()} bytes)"
                )
        with self._mutex:
            if self.manifest.staging == "shadow":
                for m, data in items:
                    self._land(m, data)
            else:
                self._receive_direct(items)
            _sync_device(items)

    def receive_whole(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Land whole tensors (every byte of each; e.g. the trainer's own tensors read in place), one copy_ per
        tensor. When the call holds the whole update, direct staging writes straight into the weights."""
        if not self.is_open:
            raise ReceiveError("weight tensors arrived outside an update; call begin_weight_update(manifest) first")
        for name, t in named:
            s = self._specs.get(name)
            if s is None:
                raise ReceiveError(f"tensor {name!r} is not in this update's manifest")
            if self._received[name] or t.numel() * t.element_size() != s.nbytes:
                raise ReceiveError(
                    f"{name}: {t.numel() * t.element_size()} bytes for a tensor of {s.nbytes} bytes, "
                    f"{self._received[name]} of them already received"
                )
        whole = len(named) == len(self._specs) and len({n for n, _ in named}) == len(named)
        if self.manifest.staging == "direct" and not whole:  # groups may straddle calls: the general path
            return self.receive([(PieceMeta(n, 0, t.numel() * t.element_size()), byte_view(t)) for n, t in named])
        srcs = [byte_view(t) for _, t in named]
        with self._mutex:
            if self.manifest.staging == "shadow":
                dsts = [
                    torch.empty(src.numel(), dtype=torch.uint8, device=self.target(n).device)
                    for (n, _), src in zip(named, srcs)
                ]
                self._landing.update({n: d for (n, _), d in zip(named, dsts)})
                _copy_all(dsts, srcs)
            else:
                with self.lock, torch.no_grad():
                    _copy_all([self._target_bytes(n) for n, _ in named], srcs)
                self._written_groups |= set(self._members)
            for n, t in named:
                self._received[n] = t.numel() * t.element_size()
            _sync_device([(None, x) for x in srcs])

    def _target_bytes(self, name: str) -> torch.Tensor:
        """The weight's bytes as a flat view, made once per validated manifest (a view stays valid across the
        storage resizes of a memory release / resume)."""
        v = self._targets.get(name)
        if v is None:
            v = self._targets[name] = byte_view_of_param(self.target(name))
        return v

    def commit(self) -> bool:
        """Put a complete update into the weights; False if no update was open. Raises (and aborts) if incomplete."""
        if not self.is_open:
            return False
        missing = [n for n, s in self._specs.items() if self._received[n] != s.nbytes]
        if missing:
            self.abort()
            raise ReceiveError(
                f"weight update incomplete at commit: {len(missing)} tensors missing bytes, e.g. "
                f"{missing[:3]}; it was aborted and the engine keeps its previous weights"
            )
        if self.manifest.staging == "shadow":
            with self.lock, torch.no_grad():
                for name, shadow in self._landing.items():
                    byte_view_of_param(self.target(name)).copy_(shadow)
        self._close()
        return True

    def abort(self) -> None:
        if self.is_open and self.manifest.staging == "direct" and self._written_groups:
            log.warning(
                "direct weight update aborted after %d groups were written: the engine holds a mix of "
                "versions until the next complete update (use sync.engine_staging='shadow' to avoid this)",
                len(self._written_groups),
            )
        self._close()

    # ---- internals ------------------------------------------------------------------------------------------
    def _land(self, m: PieceMeta, data: torch.Tensor) -> None:
        buf = self._landing.get(m.name)
        if buf is None:
            p = self.target(m.name)
            buf = self._landing[m.name] = torch.empty(self._specs[m.name].nbytes, dtype=torch.uint8, device=p.device)
        buf[m.start : m.start + m.nbytes].copy_(data, non_blocking=True)
        self._received[m.name] += m.nbytes

    def _receive_direct(self, items: list[tuple[PieceMeta, torch.Tensor]]) -> None:
        after = dict(self._received)
        for m, _ in items:
            after[m.name] += m.nbytes
        done = {
            self._specs[m.name].group
            for m, _ in items
            if all(after[n] == self._specs[n].nbytes for n in self._members[self._specs[m.name].group])
        }
        whole_here = {g for g in done if all(self._received[n] == 0 for n in self._members[g])}
        with self.lock, torch.no_grad():
            for m, data in items:
                if self._specs[m.name].group in whole_here:
                    byte_view_of_param(self.target(m.name))[m.start : m.start + m.nbytes].copy_(data, non_blocking=True)
                    self._received[m.name] += m.nbytes
                else:
                    self._land(m, data)
            for g in done - whole_here:
                for n in self._members[g]:
                    byte_view_of_param(self.target(n)).copy_(self._landing.pop(n), non_blocking=True)
        self._written_groups |= done

    def _close(self) -> None:
        self.manifest = None
        self._specs, self._members, self._received, self._landing = {}, {}, {}, {}
        self._written_groups = set()


def byte_view_of_param(p: torch.Tensor) -> torch.Tensor:
    if not p.is_contiguous():
        raise ReceiveError(f"engine parameter of shape {tuple(p.shape)} is not contiguous; cannot write bytes into it")
    return byte_view(p)


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for all flat uint8 pairs. One copy_ per tensor: for contiguous same-dtype CUDA tensors
    that is a cudaMemcpyAsync, where torch's batched _foreach_copy_ runs a slower elementwise kernel over bytes
    (``miles bench weight-sync`` on a GPU). Memory opened through CUDA IPC copies as fast as the process's own
    (``python benchmarks/ipc_copy_probe.py``; figures in BENCHMARKS.md)."""
    for d, x in zip(dsts, srcs):
        d.copy_(x, non_blocking=True)


def _sync_device(items) -> None:
    for device in {d.device for _, d in items if d.is_cuda}:  # (this thread's current device may be another)
        torch.cuda.current_stream(device).synchronize()  # the sender may reuse its buffer as soon as we return


def receive_flat(flat: torch.Tensor, pieces: list[PieceMeta], receivers: list[WeightReceiver]) -> None:
    """Land pieces of one flat uint8 bucket (an RDT round, an opened shared-memory / IPC bucket) in every receiver."""
    items = [(m, flat[m.offset : m.offset + m.nbytes]) for m in pieces]
    for r in receivers:
        r.receive(items)


_LAST_RDT: list = []


def receive_rdt(tensors: list[torch.Tensor], pieces: list[PieceMeta], receivers: list[WeightReceiver]) -> None:
    """One RDT round: ``[flat uint8 bucket]`` with pieces at offsets in it, or (``sync.source=in_place``) the
    trainer's tensors themselves, one per piece. The last round's tensors are kept: over cuda_ipc they map the
    trainer's memory, and holding them keeps torch's IPC mapping open for the next round and sync."""
    if len(tensors) == 1 and tensors[0].dtype == torch.uint8 and tensors[0].dim() == 1:
        receive_flat(tensors[0], pieces, receivers)
    elif len(tensors) == len(pieces) and all(
        t.is_contiguous() and t.numel() * t.element_size() == m.nbytes for t, m in zip(tensors, pieces)
    ):
        items = [(m, byte_view(t)) for m, t in zip(pieces, tensors)]
        for r in receivers:
            r.receive(items)
    else:
        raise ReceiveError(
            f"an RDT round is one flat uint8 bucket or one whole tensor per piece; got {len(tensors)} "
            f"tensors {[(t.dtype, tuple(t.shape)) for t in tensors[:3]]} for {len(pieces)} pieces"
        )
    _LAST_RDT[:] = tensors
