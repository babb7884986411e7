"""Flat buckets: many tensors packed into one byte buffer that another process opens by handle.

On CPU the buffer is a file in /dev/shm (shared memory); on CUDA it is a device buffer shared through a
CUDA IPC handle. Buffers are allocated once per bucket slot and reused across syncs, so the receiving side
opens each handle once (opening a 4 GiB IPC handle costs about as much as copying the bytes).

A handle can arrive from the network (``miles serve``'s /update_weights_from_tensor), so the receiving side
trusts nothing in it: ``check_handle`` validates every field and tensor meta before anything is opened, and a
shared-memory bucket is opened only when it is a regular file of this user, named by its key, directly inside
the shared-memory directory (no symlink), at least as large as declared; it is mapped read-only and never
created or extended (``torch.from_file(shared=True)`` would do both).

CUDA buffers are allocated with expandable segments off: memory from expandable (VMM) segments cannot be
exported through ``cudaIpcGetMemHandle`` (nor registered with NIXL), so a staging buffer taken from such a
segment would fail to open on the other side, or make NIXL fall back to a slow bounce path.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import stat
import tempfile
import uuid
import warnings
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
    """Receiver side: opens handles once and keeps them (keyed by the sender's buffer key). Every handle is
    checked (``check_handle``) before its buffer is looked up or opened."""

    def __init__(self):
        self.cache: dict[str, tuple[str, torch.Tensor]] = {}  # slot -> (key, opened buffer)

    def tensors(self, h: BucketHandle) -> list[tuple[str, torch.Tensor]]:
        buf = self.buffer(h)
        return [
            (m.name, buf[m.offset : m.offset + m.nbytes].view(getattr(torch, m.dtype)).view(m.shape)) for m in h.metas
        ]

    def buffer(self, h: BucketHandle) -> torch.Tensor:
        """The sender's whole bucket as a flat uint8 tensor (opened once per sender buffer)."""
        check_handle(h)
        key, buf = self.cache.get(h.slot, ("", None))
        if key != h.key:
            if h.kind == "shm":
                buf = open_shm_readonly(h)
            else:
                from torch.multiprocessing.reductions import rebuild_cuda_tensor

                buf = rebuild_cuda_tensor(*h.ipc)
            if buf.dtype != torch.uint8 or buf.dim() != 1:
                raise BucketRefused(f"bucket {h.key}: the IPC handle is not a flat uint8 buffer")
            self.cache[h.slot] = (h.key, buf)
        if buf.numel() < h.nbytes:
            raise BucketRefused(f"bucket {h.key} declares {h.nbytes} bytes; the opened buffer holds {buf.numel()}")
        return buf


# ---- checks on a received handle ---------------------------------------------------------------------------
_KEY = re.compile(r"miles-(\d+)-\d+-[0-9a-f]{8}")  # StagingBuffers.get: miles-<pid>-<slot>-<8 hex>
_SLOT = re.compile(r"(\d+)/\d+")  # <pid>/<slot>
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_IPC_REF_COUNTER = re.compile(rb"/torch_\d+_\d+_\d+")  # at::NewProcessWideShmHandle


class BucketRefused(ValueError):
    """A bucket handle this process will not open: malformed, or naming memory it cannot vouch for."""


def check_handle(h: BucketHandle) -> None:
    """Validate everything ``h`` declares (types, key, slot, tensor metas inside ``nbytes``, the IPC tuple)
    before anything is opened; raises BucketRefused naming the field."""
    if not isinstance(h, BucketHandle):
        raise BucketRefused(f"expected a BucketHandle, got {type(h).__name__}")
    if h.kind not in ("shm", "cuda_ipc"):
        raise BucketRefused(f"bucket kind {h.kind!r} must be 'shm' or 'cuda_ipc'")
    key, slot = _KEY.fullmatch(str(h.key)), _SLOT.fullmatch(str(h.slot))
    if not (isinstance(h.key, str) and key and isinstance(h.slot, str) and slot and key[1] == slot[1]):
        raise BucketRefused(
            f"bucket key {str(h.key)[:80]!r} / slot {str(h.slot)[:40]!r} are not a miles staging buffer's "
            "(key miles-<pid>-<slot>-<8 hex>, slot <pid>/<slot>)"
        )
    if not _is_int(h.nbytes) or h.nbytes < 1:
        raise BucketRefused(f"bucket {h.key}: nbytes = {h.nbytes!r} must be a positive integer")
    if not isinstance(h.metas, tuple) or not h.metas:
        raise BucketRefused(f"bucket {h.key}: metas must be a non-empty tuple of TensorMeta")
    for m in h.metas:
        _check_meta(h, m)
    if h.kind == "shm" and not (isinstance(h.path, str) and h.path and h.ipc == ()):
        raise BucketRefused(f"bucket {h.key}: a shm bucket needs a path and no IPC handle")
    if h.kind == "cuda_ipc":
        _check_ipc(h)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_meta(h: BucketHandle, m) -> None:
    if not (isinstance(m, TensorMeta) and isinstance(m.name, str) and m.dtype in _DTYPES):
        raise BucketRefused(f"bucket {h.key}: {str(m)[:120]} is not a TensorMeta with a torch dtype name")
    if not (isinstance(m.shape, tuple) and all(_is_int(d) and d >= 0 for d in m.shape)):
        raise BucketRefused(f"bucket {h.key}: tensor {m.name!r} has shape {m.shape!r}; need non-negative ints")
    numel = 1
    for d in m.shape:
        numel *= d
    want = numel * _DTYPES[m.dtype].itemsize
    if not (_is_int(m.offset) and _is_int(m.nbytes) and m.nbytes == want and 0 <= m.offset <= h.nbytes - want):
        raise BucketRefused(
            f"bucket {h.key}: tensor {m.name!r} ({m.dtype} {m.shape}, {want} bytes) at offset {m.offset!r} with "
            f"nbytes {m.nbytes!r} does not fit in the bucket's {h.nbytes} bytes"
        )


def _check_ipc(h: BucketHandle) -> None:
    """The 15 arguments of torch's rebuild_cuda_tensor, as reduce_tensor builds them for a flat uint8 buffer."""
    ipc = h.ipc
    ok = (
        isinstance(ipc, tuple)
        and len(ipc) == 15
        and ipc[0] is torch.Tensor
        and all(isinstance(ipc[i], tuple) and all(_is_int(d) and d >= 0 for d in ipc[i]) for i in (1, 2))
        and ipc[4] in (torch.storage.TypedStorage, torch.UntypedStorage)
        and ipc[5] is torch.uint8
        and all(_is_int(ipc[i]) and ipc[i] >= 0 for i in (3, 6, 8, 9, 12))
        and isinstance(ipc[7], bytes)
        and isinstance(ipc[11], bytes)
        and _IPC_REF_COUNTER.fullmatch(ipc[11]) is not None
        and (ipc[13] is None or isinstance(ipc[13], bytes))
        and ipc[10] is False
    )
    if not ok:
        raise BucketRefused(f"bucket {h.key}: ipc is not a CUDA IPC handle of a flat uint8 buffer")


def shm_dirs() -> set[str]:
    """The directories a sender puts shared-memory buckets in (see _shm_dir), resolved."""
    return {os.path.realpath(d) for d in ("/dev/shm", tempfile.gettempdir())}


def open_shm_readonly(h: BucketHandle) -> torch.Tensor:
    """Map the checked shm bucket ``h`` read-only: the file must be ``<shm dir>/<key>``, a regular file owned by
    this user with one link, and hold at least ``h.nbytes`` bytes. Nothing is created, extended or written."""
    parent, name = os.path.split(h.path)
    real_parent = os.path.realpath(parent or ".")
    if name != h.key or real_parent not in shm_dirs():
        raise BucketRefused(
            f"bucket path {h.path[:200]!r} is not <shared-memory dir>/{h.key} with the dir in {sorted(shm_dirs())}"
        )
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(os.path.join(real_parent, name), flags)
    except OSError as e:
        raise BucketRefused(f"bucket {h.key} cannot be opened read-only ({e.strerror}); nothing was created") from None
    try:
        if problem := _file_problem(os.fstat(fd), h.nbytes):
            raise BucketRefused(f"bucket {h.path} {problem}; refused")
        mapped = mmap.mmap(fd, h.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # read-only on purpose: receivers only copy out of a bucket
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mapped, dtype=torch.uint8)


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


def _file_problem(st: os.stat_result, nbytes: int) -> str:
    """Why an opened bucket file cannot be a sender's staging buffer ("" when it can)."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not this process's {os.geteuid()}"
    if st.st_nlink != 1:  # a second name: a hard link to some other file
        return f"has {st.st_nlink} hard links"
    if st.st_size < nbytes:
        return f"holds {st.st_size} bytes, fewer than the declared {nbytes}"
    return ""
