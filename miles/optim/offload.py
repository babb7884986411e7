"""Optimizer state (and optionally FP32 master weights) moved out of device memory between steps, in chunks.

After ``optimizer.step()`` the state's bytes are copied into host buffers of at most ``chunk_bytes`` each and the
device storages are resized to zero; before the next step they come back chunk by chunk while the next chunk is
prefetched on a worker thread. Tensor identity is kept, so the optimizer never notices. The buffer allocator is
one method, ``_allocate_chunk``: the disk subclass (``miles/optim/disk_offload.py``) overrides only it to hand out
file-backed pages the kernel can write back and reclaim.

Chunks smaller than one tensor work: a tensor then spans several chunks and is copied piecewise. The chunk size
bounds the host staging memory and the transfer granularity, not the device peak: Muon orthogonalises each
momentum matrix as a whole, so ``restore()`` brings every matrix back completely before the step, and the device
holds the whole state while it runs (the cost of a small chunk is only more, smaller copies).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from miles.memory.host_arena import trim_heap
from miles.memory.ledger import MemoryLedger
from miles.memory.tagged import unique_storages


class MasterWeightsNotResidentError(RuntimeError):
    """Raised instead of letting ``optimizer.step()`` run on weights whose storage is not on the device."""


class HostChunk:
    """One host buffer holding up to ``chunk_bytes`` of offloaded state, and how bytes get in and out of it.

    ``store``/``load`` move a list of ``(chunk_offset, uint8 view)`` pieces (contiguous in the chunk, in order);
    the page hints are no-ops here. The file-backed chunk in ``disk_offload.py`` overrides them.
    """

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor  # uint8, 1-D, on the CPU

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def store(self, pieces: list[tuple[int, torch.Tensor]]) -> None:
        for offset, src in pieces:
            self.tensor[offset : offset + src.numel()].copy_(src, non_blocking=True)

    def load(self, pieces: list[tuple[int, torch.Tensor]]) -> None:
        for offset, dst in pieces:
            dst.copy_(self.tensor[offset : offset + dst.numel()], non_blocking=True)

    def written(self) -> None:
        """The offload has finished writing this chunk."""

    def prefetch(self) -> None:
        """This chunk is read soon: start bringing its pages in, without waiting."""

    def consumed(self) -> None:
        """The restore has finished reading this chunk."""

    def flush(self) -> None:
        """Make the chunk's contents durable (before a checkpoint)."""

    def close(self) -> None:
        self.tensor = None


@dataclass(frozen=True, slots=True)
class _Piece:
    storage: torch.UntypedStorage
    storage_offset: int
    chunk_offset: int
    nbytes: int

    def view(self) -> tuple[int, torch.Tensor]:
        return self.chunk_offset, _bytes(self.storage)[self.storage_offset : self.storage_offset + self.nbytes]


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind ``optimizer`` (a composite such as MuonWithAdamW exposes ``.optimizers``)."""
    return list(getattr(optimizer, "optimizers", [optimizer]))


def _state_tensors(optimizer) -> list[torch.Tensor]:
    return [
        v
        for opt in torch_optimizers(optimizer)
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    ]


def _optimizer_params(optimizer) -> list[torch.Tensor]:
    return [p for opt in torch_optimizers(optimizer) for g in opt.param_groups for p in g["params"]]


def _plan_chunks(storages: list[torch.UntypedStorage], chunk_bytes: int) -> list[list[_Piece]]:
    """Lay the storages end to end in one flat byte range and cut it into chunks of ``chunk_bytes``."""
    plan: list[list[_Piece]] = [[]]
    used = 0
    for s in storages:
        offset, left = 0, s.nbytes()
        while left:
            if used == chunk_bytes:
                plan.append([])
                used = 0
            n = min(left, chunk_bytes - used)
            plan[-1].append(_Piece(s, offset, used, n))
            offset, left, used = offset + n, left - n, used + n
    return plan


class ChunkedOptimizerStateOffloader:
    """Moves an optimizer's state (and optional master weights) to host chunks after each step and back before it.

    offloader = ChunkedOptimizerStateOffloader(optimizer, chunk_bytes=64 << 20)
    for batch in batches:
        loss(batch).backward()
        offloader.restore()          # chunked, prefetching the next chunk; a no-op before the first step
        optimizer.step()             # a step pre-hook calls assert_master_weights_resident()
        optimizer.zero_grad()
        offloader.offload()          # state -> host chunks, device storages resized to 0
    offloader.flush(); torch.save(optimizer.state_dict(), path)   # state_dict() restores first (a hook)

    ``optimizer.state_dict()`` and ``optimizer.load_state_dict()`` work whether the state is offloaded or not:
    hooks on the torch optimizers call ``restore()`` first, so the returned tensors are the live, resident
    state (save them before the next ``offload()``), and a load replaces resident tensors; the next
    ``offload()`` re-plans the chunks. A step while offloaded raises instead of reading freed storages.
    """

    pool = "host"  # the MemoryLedger pool that holds the chunks

    def __init__(
        self,
        optimizer,
        *,
        chunk_bytes: int = 64 << 20,
        master_params: Iterable[torch.Tensor] | None = None,
        ledger: MemoryLedger | None = None,
        owner: str = "trainer/0",
    ):
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes = {chunk_bytes} must be >= 1, e.g. 64 << 20")
        self.optimizer, self.chunk_bytes = optimizer, int(chunk_bytes)
        self.master_params = list(master_params or [])
        self.ledger, self.owner = ledger, owner
        self.chunks: list[HostChunk] = []
        self._plan: list[list[_Piece]] = []
        self._layout: tuple = ()
        self._staging: list[torch.Tensor] = []
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="optim-offload")
        self.is_offloaded = False
        self.offloaded_bytes = 0
        self.last_offload_seconds = self.last_restore_seconds = 0.0
        for opt in torch_optimizers(optimizer):
            opt.register_step_pre_hook(self._before_step)
            opt.register_state_dict_pre_hook(lambda _opt: self.restore())
            opt.register_load_state_dict_pre_hook(lambda _opt, _sd: self._before_load())
            opt.register_load_state_dict_post_hook(own_loaded_state)

    # -- the allocator: the only thing the disk subclass overrides --------------------------------------------
    def _allocate_chunk(self, index: int, nbytes: int, pin: bool) -> HostChunk:
        return HostChunk(torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin))

    # -- public API -----------------------------------------------------------------------------------------
    def offload(self) -> int:
        """Copy the state (and master weights) into host chunks and free their device storages; returns bytes."""
        if self.is_offloaded:
            return 0
        storages = unique_storages(_state_tensors(self.optimizer) + self.master_params)
        if not storages:
            return 0
        fixed = [s for s in storages if not s.resizable()]
        if fixed:
            raise RuntimeError(
                f"{len(fixed)} optimizer-state storages cannot be resized (e.g. loaded from a file mapping); "
                "clone the state tensors, or load them with optimizer.load_state_dict (which does)"
            )
        t0 = time.perf_counter()
        self._ensure_chunks(storages)
        self._copy_out()
        for s in storages:
            s.resize_(0)
        if storages[0].device.type == "cpu":
            trim_heap()  # freed CPU storages otherwise stay in the process RSS (glibc keeps heap pages)
        self.offloaded_bytes = sum(n for _, n in self._layout)
        self.is_offloaded = True
        self._record("device", self.offloaded_bytes, "out", "optimizer_offload")
        self.last_offload_seconds = time.perf_counter() - t0
        return self.offloaded_bytes

    def restore(self) -> int:
        """Bring the state back chunk by chunk, prefetching the next chunk meanwhile; a no-op when resident."""
        if not self.is_offloaded:
            return 0
        t0 = time.perf_counter()
        for s, n in self._layout:
            s.resize_(n)
        self._copy_in()
        self.is_offloaded = False
        self._record("device", self.offloaded_bytes, "in", "optimizer_restore")
        self.assert_master_weights_resident()
        self.last_restore_seconds = time.perf_counter() - t0
        return self.offloaded_bytes

    def flush(self) -> None:
        """Make every chunk durable (msync for disk chunks); call before writing a checkpoint."""
        for chunk in self.chunks:
            chunk.flush()

    def assert_master_weights_resident(self) -> None:
        """Raise MasterWeightsNotResidentError if any parameter the step writes has no device bytes."""
        params = {id(p): p for p in _optimizer_params(self.optimizer) + self.master_params}.values()
        missing = [p for p in params if _local(p).untyped_storage().nbytes() < _needed_bytes(_local(p))]
        if missing:
            p = missing[0]
            raise MasterWeightsNotResidentError(
                f"optimizer.step() would run with {len(missing)} of {len(params)} master weights not resident "
                f"(first: shape {tuple(p.shape)} {p.dtype}, storage holds {_local(p).untyped_storage().nbytes()} "
                f"of {_needed_bytes(_local(p))} bytes); call offloader.restore() and resume the trainer's 'params' "
                "tag before optimizer.step()"
            )

    def close(self) -> None:
        """Release every chunk (the state must be resident: restore() first)."""
        if self.is_offloaded:
            raise RuntimeError("close() while the optimizer state is offloaded would lose it; call restore() first")
        self._release_chunks()
        self._release_staging()
        self._worker.shutdown(wait=True)

    # -- internals ------------------------------------------------------------------------------------------
    def _before_step(self, _opt, _args, _kwargs) -> None:
        self.assert_master_weights_resident()
        if self.is_offloaded:
            raise RuntimeError(
                "optimizer.step() while the optimizer state is offloaded; call offloader.restore() first"
            )

    def _before_load(self) -> None:
        self.restore()  # resident first, so a failed load leaves the old state intact
        self._record("device", sum(n for _, n in self._layout), "out", "optimizer_load")  # replaced by the load
        self._release_chunks()  # the loaded tensors replace these storages; the next offload re-plans

    def _record(self, pool: str, nbytes: int, direction: str, phase: str) -> None:
        if self.ledger is not None:
            self.ledger.record(self.owner, "optimizer", pool, nbytes, direction, phase)

    def _ensure_chunks(self, storages: list[torch.UntypedStorage]) -> None:
        """(Re)plan and allocate chunks when the set of storages changed; all or nothing, nothing copied yet."""
        layout = tuple((s, s.nbytes()) for s in storages)
        if [(s._cdata, n) for s, n in layout] == [(s._cdata, n) for s, n in self._layout]:
            return
        self._release_chunks()
        plan = _plan_chunks(storages, self.chunk_bytes)
        pin = any(s.device.type == "cuda" for s in storages)
        chunks: list[HostChunk] = []
        try:
            for i, pieces in enumerate(plan):
                chunks.append(self._allocate_chunk(i, sum(p.nbytes for p in pieces), pin))
        except BaseException:
            for c in chunks:
                c.close()
            raise
        self.chunks, self._plan, self._layout = chunks, plan, layout
        self._record(self.pool, sum(c.nbytes for c in chunks), "in", "optimizer_allocate")
        # the state appeared on the device in a step (or a load) the ledger did not see; the offload moves it out
        self._record("device", sum(n for _, n in layout), "in", "optimizer_allocate")

    def _release_chunks(self) -> None:
        if self.chunks:
            self._record(self.pool, sum(c.nbytes for c in self.chunks), "out", "optimizer_release")
        for c in self.chunks:
            c.close()
        self.chunks, self._plan, self._layout = [], [], ()

    def _needs_staging(self) -> bool:
        """Device storages on CUDA with pageable (e.g. file-backed) chunks go through two pinned buffers."""
        on_cuda = any(s.device.type == "cuda" for s, _ in self._layout)
        return on_cuda and not self.chunks[0].tensor.is_pinned()

    def _staging_buffers(self) -> list[torch.Tensor]:
        if not self._staging:
            n = max(c.nbytes for c in self.chunks)
            self._staging = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self._record("host", 2 * n, "in", "optimizer_staging")
        return self._staging

    def _release_staging(self) -> None:
        if self._staging:
            self._record("host", sum(t.numel() for t in self._staging), "out", "optimizer_staging")
        self._staging = []

    def _copy_out(self) -> None:
        if self._needs_staging():
            return self._copy_out_staged()
        for chunk, pieces in zip(self.chunks, self._plan):
            chunk.store([p.view() for p in pieces])
            _synchronize(pieces)
            chunk.written()

    def _copy_in(self) -> None:
        """Chunks in pairs: the worker restores chunk i+1 while this thread restores chunk i (on a CPU device the
        first touch of re-allocated state pages costs as much as the read, so two threads overlap both)."""
        if self._needs_staging():
            return self._copy_in_staged()
        self.chunks[0].prefetch()
        for i in range(0, len(self.chunks), 2):
            for chunk in self.chunks[i + 1 : i + 3]:
                chunk.prefetch()  # asynchronous readahead hints
            pending = self._worker.submit(self._restore_chunk, i + 1) if i + 1 < len(self.chunks) else None
            self._restore_chunk(i)
            if pending is not None:
                pending.result()

    def _restore_chunk(self, index: int) -> None:
        chunk, pieces = self.chunks[index], self._plan[index]
        chunk.load([p.view() for p in pieces])
        _synchronize(pieces)
        chunk.consumed()

    def _copy_out_staged(self) -> None:
        """Device -> pinned staging (async, copy engine) while the worker copies the previous chunk to its pages."""
        staging = self._staging_buffers()
        events = [torch.cuda.Event(), torch.cuda.Event()]
        pending: list[Future | None] = [None, None]
        for i, (chunk, pieces) in enumerate(zip(self.chunks, self._plan)):
            slot = i % 2
            if pending[slot] is not None:
                pending[slot].result()
            for p in pieces:
                staging[slot][p.chunk_offset : p.chunk_offset + p.nbytes].copy_(
                    _bytes(p.storage)[p.storage_offset : p.storage_offset + p.nbytes], non_blocking=True
                )
            events[slot].record()
            pending[slot] = self._worker.submit(_drain_staging, events[slot], staging[slot], chunk)
        for f in pending:
            if f is not None:
                f.result()

    def _copy_in_staged(self) -> None:
        """The worker fills one pinned buffer from chunk i+1's pages while the copy engine uploads chunk i."""
        staging = self._staging_buffers()
        events = [torch.cuda.Event(), torch.cuda.Event()]
        for chunk in self.chunks[:2]:
            chunk.prefetch()
        pending = self._worker.submit(_fill_staging, events[0], staging[0], self.chunks[0])
        for i, pieces in enumerate(self._plan):
            slot = i % 2
            pending.result()
            if i + 1 < len(self.chunks):
                pending = self._worker.submit(_fill_staging, events[1 - slot], staging[1 - slot], self.chunks[i + 1])
            if i + 2 < len(self.chunks):
                self.chunks[i + 2].prefetch()  # an asynchronous readahead hint for the one after
            for p in pieces:
                _bytes(p.storage)[p.storage_offset : p.storage_offset + p.nbytes].copy_(
                    staging[slot][p.chunk_offset : p.chunk_offset + p.nbytes], non_blocking=True
                )
            events[slot].record()
        torch.cuda.current_stream().synchronize()


def own_loaded_state(optimizer: torch.optim.Optimizer) -> None:
    """load_state_dict may keep the caller's tensors (torch.load storages cannot be resized): copy those."""
    for st in optimizer.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and not _local(v).untyped_storage().resizable():
                st[k] = v.clone()


def _drain_staging(event: torch.cuda.Event, staging: torch.Tensor, chunk: HostChunk) -> None:
    event.synchronize()
    chunk.store([(0, staging[: chunk.nbytes])])
    chunk.written()


def _fill_staging(event: torch.cuda.Event, staging: torch.Tensor, chunk: HostChunk) -> None:
    event.synchronize()  # the upload that last read this buffer has finished
    chunk.load([(0, staging[: chunk.nbytes])])
    chunk.consumed()


def _synchronize(pieces: list[_Piece]) -> None:
    """Wait for this thread's copies (the worker thread's current device may differ from the storages')."""
    for device in {p.storage.device for p in pieces if p.storage.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # DTensor (FSDP2) shard


def _needed_bytes(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return (t.storage_offset() + extent) * t.element_size()
