"""Flat buckets: many tensors packed into one byte buffer that another process opens by handle.

On CPU the buffer is a file in /dev/shm (shared memory); on CUDA it is a device buffer shared through a
CUDA IPC handle. Buffers are allocated once per bucket slot and reused across syncs, so the receiving side
opens each handle once (opening a 4 GiB IPC handle costs about as much as copying the bytes).

CUDA buffers are allocated with expandable segments off: memory from expandable (VMM) segments cannot be
exported through ``cudaIpcGetMemHandle`` (nor registered with NIXL), so a staging buffer taken from such a
segment would fail to open on the other side, or make NIXL fall back to a slow bounce path.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from dataclasses import dataclass

import torch

ALIGN = 256


@dataclass(frozen=True, slots=True)
class TensorMeta:
    name: str
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class BucketHandle:
    kind: str  # "shm" | "cuda_ipc"
    key: str  # id of the staging buffer; changes only when the sender reallocates it
    slot: str  # "<sender pid>/<slot>": the receiver keeps one opened buffer per slot
    nbytes: int
    metas: tuple[TensorMeta, ...]
    path: str = ""  # shm
    ipc: tuple = ()  # cuda_ipc: torch.multiprocessing.reductions.reduce_tensor(...) output


def layout(named: list[tuple[str, torch.Tensor]]) -> tuple[list[TensorMeta], int]:
    metas, off = [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        metas.append(TensorMeta(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), off, n))
        off += -(-n // ALIGN) * ALIGN
    return metas, off


class StagingBuffers:
    """Sender side: one reusable buffer per bucket slot, grown when a bucket needs more."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.slots: dict[int, tuple[str, torch.Tensor, str, tuple]] = {}

    def get(self, slot: int, nbytes: int) -> tuple[str, torch.Tensor, str, tuple]:
        cur = self.slots.get(slot)
        if cur is None or cur[1].numel() < nbytes:
            self._release(slot)
            key = f"miles-{os.getpid()}-{slot}-{uuid.uuid4().hex[:8]}"
            if self.device.type == "cuda":
                from torch.multiprocessing.reductions import reduce_tensor

                buf = alloc_exportable(max(nbytes, 1), self.device)
                cur = (key, buf, "", reduce_tensor(buf)[1])
            else:
                path = os.path.join(_shm_dir(max(nbytes, 1)), key)
                buf = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
                cur = (key, buf, path, ())
            self.slots[slot] = cur
        return cur

    def pack(self, slot: int, named: list[tuple[str, torch.Tensor]]) -> BucketHandle:
        metas, total = layout(named)
        key, buf, path, ipc = self.get(slot, total)
        for (_, t), m in zip(named, metas):
            src = t.detach().contiguous().reshape(-1).view(torch.uint8)
            buf[m.offset : m.offset + m.nbytes].copy_(src, non_blocking=True)
        if self.device.type == "cuda" or any(t.is_cuda for _, t in named):
            torch.cuda.synchronize()  # the receiver reads the bytes as soon as it gets the handle
        return BucketHandle(
            "cuda_ipc" if ipc else "shm", key, f"{os.getpid()}/{slot}", buf.numel(), tuple(metas), path, ipc
        )

    def _release(self, slot: int) -> None:
        cur = self.slots.pop(slot, None)
        if cur and cur[2]:
            try:
                os.unlink(cur[2])
            except FileNotFoundError:
                pass

    def close(self) -> None:
        for slot in list(self.slots):
            self._release(slot)

    def __del__(self):
        self.close()


class OpenedBuffers:
    """Receiver side: opens handles once and keeps them (keyed by the sender's buffer key)."""

    def __init__(self):
        self.cache: dict[str, tuple[str, torch.Tensor]] = {}  # slot -> (key, opened buffer)

    def tensors(self, h: BucketHandle) -> list[tuple[str, torch.Tensor]]:
        buf = self.buffer(h)
        return [
            (m.name, buf[m.offset : m.offset + m.nbytes].view(getattr(torch, m.dtype)).view(m.shape)) for m in h.metas
        ]

    def buffer(self, h: BucketHandle) -> torch.Tensor:
        """The sender's whole bucket as a flat uint8 tensor (opened once per sender buffer)."""
        key, buf = self.cache.get(h.slot, ("", None))
        if key != h.key:
            if h.kind == "shm":
                buf = torch.from_file(h.path, shared=True, size=h.nbytes, dtype=torch.uint8)
            else:
                from torch.multiprocessing.reductions import rebuild_cuda_tensor

                buf = rebuild_cuda_tensor(*h.ipc)
            self.cache[h.slot] = (h.key, buf)
        return buf


def alloc_exportable(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer another process can open (CUDA IPC) or NIXL can register: outside expandable segments."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    with expandable_segments_off():
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


@contextlib.contextmanager
def expandable_segments_off():
    """Allocate from ordinary cudaMalloc segments inside the block, whatever PYTORCH_CUDA_ALLOC_CONF says."""
    conf = (os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")).replace(
        " ", ""
    )
    if "expandable_segments:True" not in conf:
        yield
        return
    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def _shm_dir(nbytes: int = 0) -> str:
    """/dev/shm when it can hold ``nbytes`` more (a container's default 64 MiB cannot: writing past it is a
    SIGBUS, not an error), else the temporary directory (file-backed, served from the page cache)."""
    import shutil

    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= 2 * nbytes:
        return shm
    return tempfile.gettempdir()
