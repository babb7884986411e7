"""Offload and onload groups of tensors by tag, keeping tensor identity.

Offloading a tag copies each storage's bytes to a backup (one host arena per tag, a file on disk, or nowhere
when the contents are recomputable or re-sent later), then resizes the storage to zero bytes. Modules and
optimizers keep their references to the same tensor objects; onloading grows the storages back and copies
the bytes in, bit-exactly. Every move is written to the MemoryLedger.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from miles.memory.host_arena import trim_heap
from miles.memory.ledger import MemoryLedger

TRIM_MIN_BYTES = 8 << 20  # below this, handing freed heap pages back to the OS costs more than it frees

POLICIES = ("host", "disk", "discard")
TensorSource = Iterable[torch.Tensor] | Callable[[], Iterable[torch.Tensor]]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # DTensor (FSDP2) shard


def _as_dtensor_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` (a host view of ``like``'s shard) as a DTensor with ``like``'s mesh, placements and global shape;
    copied to the mesh's device first, since a collective (NCCL) cannot read a host view of a device shard."""
    from torch.distributed.tensor import DTensor

    local = local.to(like._local_tensor.device)
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """One entry per distinct storage (tied weights share one), largest first, empty ones skipped."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t is None:
            continue
        s = _local(t).untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen[s.data_ptr()] = s
    return sorted(seen.values(), key=lambda s: -s.nbytes())


ALIGN = 64  # bytes; keeps every tensor in an arena aligned for any dtype view


def _aligned_offsets(sizes: list[int]) -> list[int]:
    """Start offset of each block in an arena, then the arena's total size (the bytes the OS is asked for)."""
    out, off = [], 0
    for n in sizes:
        out.append(off)
        off += -(-n // ALIGN) * ALIGN
    return out + [off]


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def allocate_host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """One contiguous host buffer of exactly ``nbytes`` (pinned when a CUDA device is the source).

    An arena of its own (miles.memory.host_arena): the OS holds the bytes rounded up to a page, not the power of
    two torch's caching pinned allocator would reserve, and the pages go back when the backup is dropped."""
    from miles.memory.host_arena import host_arena

    return host_arena(nbytes, pin=pin)


def allocate_disk_buffer(nbytes: int, path: str) -> torch.Tensor:
    """A file-backed buffer: the kernel may write its pages back and reclaim them."""
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(nbytes, 1))
    buf = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)[:nbytes]
    os.unlink(path)  # the mapping keeps the pages alive; nothing is left behind on exit
    return buf


@dataclass(slots=True)
class _Tag:
    source: TensorSource
    policy: str
    offloaded: list[tuple[torch.UntypedStorage, int, int]] = field(default_factory=list)  # (storage, offset, nbytes)
    backup: torch.Tensor | None = None
    is_offloaded: bool = False
    recorded: int = 0  # device bytes the ledger believes this tag holds


class TaggedMemory:
    """Owns the tags of one actor (trainer rank or engine) and moves their bytes.

    mem = TaggedMemory("trainer/0", ledger, device)
    mem.register("params", model.parameters(), policy="host")
    mem.register("optimizer", lambda: optimizer_state_tensors(opt), policy="host")
    mem.offload(["params", "optimizer"])   # device bytes -> host arena, storages resized to 0
    mem.onload(["params", "optimizer"])  # back, bit-exact; a second onload is a no-op
    """

    def __init__(self, owner: str, ledger: MemoryLedger, device: torch.device, disk_dir: str | None = None):
        self.owner, self.ledger, self.device = owner, ledger, torch.device(device)
        self.disk_dir = disk_dir
        self.tags: dict[str, _Tag] = {}
        self.last_move_seconds = 0.0

    def register(self, tag: str, source: TensorSource, policy: str = "host", *, record: bool = True) -> None:
        if policy not in POLICIES:
            raise ValueError(f"memory policy {policy!r} for tag {tag!r} is not one of {POLICIES}")
        if not callable(source):
            source = list(source)
        self.tags[tag] = _Tag(source, policy)
        if record:
            self.tags[tag].recorded = self.resident_bytes(tag)
            self.ledger.record(self.owner, tag, "device", self.tags[tag].recorded, "in", phase="init")

    def _tensors(self, tag: str) -> list[torch.Tensor]:
        src = self.tags[tag].source
        return list(src() if callable(src) else src)

    def resident_bytes(self, tag: str) -> int:
        if tag not in self.tags or self.tags[tag].is_offloaded:
            return 0
        return sum(s.nbytes() for s in unique_storages(self._tensors(tag)))

    def is_offloaded(self, tag: str) -> bool:
        return tag in self.tags and self.tags[tag].is_offloaded

    def offload(self, tags: Iterable[str], phase: str | None = None) -> int:
        """Free the device bytes of ``tags``; returns the bytes that left the device. Unknown tags are skipped."""
        moved, t0 = 0, time.perf_counter()
        for name in tags:
            tag = self.tags.get(name)
            if tag is None or tag.is_offloaded:
                continue
            storages = unique_storages(self._tensors(name))
            total = sum(s.nbytes() for s in storages)
            if total != tag.recorded:  # allocated (or freed) since the last move, e.g. optimizer state after step 1
                self.ledger.record(
                    self.owner,
                    name,
                    "device",
                    abs(total - tag.recorded),
                    "in" if total > tag.recorded else "out",
                    "alloc",
                )
            offsets = _aligned_offsets([s.nbytes() for s in storages])
            if tag.policy != "discard" and total:
                tag.backup = self._allocate_backup(name, tag.policy, offsets[-1])
            for s, offset in zip(storages, offsets):
                n = s.nbytes()
                if tag.backup is not None:
                    tag.backup[offset : offset + n].copy_(_bytes_view(s), non_blocking=True)
                tag.offloaded.append((s, offset, n))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            for s, _, _ in tag.offloaded:
                s.resize_(0)
            tag.is_offloaded, tag.recorded = True, 0
            pool = {"host": "host", "disk": "disk"}.get(tag.policy)
            self.ledger.record(self.owner, name, "device", total, "out", phase)
            if pool:
                self.ledger.record(self.owner, name, pool, total, "in", phase)
            moved += total
        if self.device.type == "cpu" and moved >= TRIM_MIN_BYTES:
            trim_heap()  # the CPU "device" bytes leave the process, as the ledger says they do
        self.last_move_seconds = time.perf_counter() - t0
        return moved

    def onload(self, tags: Iterable[str], phase: str | None = None) -> int:
        """Give ``tags`` their device bytes back (restoring contents unless discarded); returns the bytes."""
        moved, t0 = 0, time.perf_counter()
        for name in tags:
            tag = self.tags.get(name)
            if tag is None or not tag.is_offloaded:
                continue
            total = 0
            for s, offset, n in tag.offloaded:
                s.resize_(n)
                if tag.backup is not None:
                    _bytes_view(s).copy_(tag.backup[offset : offset + n], non_blocking=True)
                total += n
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            pool = {"host": "host", "disk": "disk"}.get(tag.policy)
            if pool:
                self.ledger.record(self.owner, name, pool, total, "out", phase)
            self.ledger.record(self.owner, name, "device", total, "in", phase)
            tag.offloaded, tag.backup, tag.is_offloaded, tag.recorded = [], None, False, total
            moved += total
        self.last_move_seconds = time.perf_counter() - t0
        return moved

    def backup_view(self, tag: str, t: torch.Tensor) -> torch.Tensor:
        """The offloaded tensor ``t`` read from its backup (same dtype, shape and strides), without onloading it.

        For a DTensor (an FSDP2 shard) the backup holds only the local shard: the view takes the local tensor's
        shape and strides (the global ones run past the shard's bytes) and is wrapped back into a DTensor on the
        same mesh, so ``full_tensor()`` gathers the whole weight as it does for a resident parameter."""
        entry = self.tags[tag]
        if not entry.is_offloaded:
            return t
        if entry.backup is None:
            raise ValueError(f"tag {tag!r} was discarded on offload (policy 'discard'); its contents cannot be read")
        local = _local(t)
        key = local.untyped_storage()._cdata  # the StorageImpl; data_ptr() is 0 once resized to 0
        for s, offset, n in entry.offloaded:
            if s._cdata == key:
                raw = entry.backup[offset : offset + n].view(t.dtype)
                view = raw.as_strided(local.shape, local.stride(), raw.storage_offset() + local.storage_offset())
                return view if local is t else _as_dtensor_like(view, t)
        raise KeyError(f"tensor is not part of tag {tag!r}")

    def _allocate_backup(self, tag: str, policy: str, nbytes: int) -> torch.Tensor:
        if policy == "disk":
            if not self.disk_dir:
                raise ValueError(f"tag {tag!r} has policy 'disk' but no disk_dir was given to TaggedMemory")
            os.makedirs(self.disk_dir, exist_ok=True)
            path = os.path.join(self.disk_dir, f"{self.owner.replace('/', '_')}.{tag}.{os.getpid()}.bin")
            return allocate_disk_buffer(nbytes, path)
        return allocate_host_buffer(nbytes, pin=self.device.type == "cuda")
