"""Optimizer state on local NVMe: the chunked offloader with a file-backed allocator and nothing else changed.

Each chunk is a file: ``posix_fallocate`` reserves its blocks (a full disk fails now with ENOSPC, not later with
SIGBUS at the first page touch), ``torch.UntypedStorage.from_file(path, shared=True, nbytes)`` maps it, and the
file is unlinked at once (the mapping keeps the inode; nothing is left behind, even after a crash past this
point). Pages of a shared file mapping are page cache, not anonymous memory: once written back the kernel can
drop them, so a host with less RAM than the optimizer state can still hold it.

What RSS counts: ``VmRSS = RssAnon + RssFile + RssShmem``. A page of a shared file mapping counts in RssFile
while it is mapped in this process's page table, dirty or clean. ``madvise(MADV_DONTNEED)`` on a shared mapping
only removes the page-table entries (the data stays in the page cache and reaches the disk by writeback), so each
chunk is unmapped that way as soon as it has been written or read, and RSS grows by at most about two chunks
(the two being copied), not by the state size. On tmpfs the pages are shmem: they can only go to
swap, which defeats the point, hence the warning.

Bytes move through the chunk's fd (preadv/pwritev) by default, not through page faults on the mapping: on the
machines measured, fault-driven copies reached well under half of plain read() bandwidth (``miles bench
optim-offload`` prints both). Both paths see the same page cache, so the mapping, msync and eviction stay valid.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import resource
import shutil
import warnings
from itertools import count

import torch

from miles.optim.offload import ChunkedOptimizerStateOffloader, HostChunk

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = _libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MS_SYNC = 4
MADV_DONTNEED = 4
PAGE = os.sysconf("SC_PAGE_SIZE")
RAM_FILESYSTEMS = ("tmpfs", "ramfs")
IOV_MAX = os.sysconf("SC_IOV_MAX")
_CHUNK_NAME = re.compile(r"^optstate\.pid(\d+)\.\d+\.chunk\d+\.bin$")
_serial = count()


class OptimizerOffloadSpaceError(OSError):
    """posix_fallocate could not reserve a chunk: the offload directory's filesystem is full."""


class TmpfsOffloadWarning(UserWarning):
    """The offload directory is in RAM (tmpfs/ramfs): file-backed state would not leave memory."""


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding ``path`` (longest matching mount point in /proc/self/mounts)."""
    path = os.path.realpath(path)
    best, fstype = "", "unknown"
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            mount = fields[1].replace("\\040", " ")
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                best, fstype = mount, fields[2]
    return fstype


def prepare_offload_directory(directory: str) -> None:
    """Create the per-rank directory, delete chunk files left by dead processes, warn when it is in RAM."""
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):
        m = _CHUNK_NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            os.unlink(os.path.join(directory, name))
    fstype = filesystem_type(directory)
    if fstype in RAM_FILESYSTEMS:
        warnings.warn(
            f"optimizer offload directory {directory} is on {fstype}: its pages stay in RAM (shmem), so disk "
            "offload saves no memory; set trainer.optimizer_offload_dir to a directory on local NVMe "
            "(check with `df DIR`), or use trainer.optimizer_offload='host'",
            TmpfsOffloadWarning,
            stacklevel=3,
        )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _reserve(fd: int, nbytes: int, path: str, index: int) -> None:
    """posix_fallocate, so a full disk fails here; ftruncate (sparse, may SIGBUS later) where unsupported."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            usage = shutil.disk_usage(os.path.dirname(path))
            raise OptimizerOffloadSpaceError(
                errno.ENOSPC,
                f"no space for optimizer-state chunk {index} ({nbytes} bytes) in {os.path.dirname(path)}: "
                f"{usage.free} of {usage.total} bytes free; free space there, point trainer.optimizer_offload_dir "
                "at a larger local NVMe volume, or use trainer.optimizer_offload='host'. The state stays resident.",
            ) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        warnings.warn(
            f"posix_fallocate is not supported on {os.path.dirname(path)} ({e.strerror}); using a sparse file: a "
            "full disk will then show up as SIGBUS when a page is first written",
            RuntimeWarning,
            stacklevel=4,
        )
        os.ftruncate(fd, nbytes)


class FileChunk(HostChunk):
    """A chunk whose bytes are a shared mapping of an unlinked, fully reserved file (the fd stays open).

    ``io="fd"`` (default) moves the bytes with preadv/pwritev on the file: the same page cache as the mapping,
    but in large requests with kernel readahead, no page fault per 4 KiB page and no read-before-write of an
    evicted page. ``io="mmap"`` copies through the mapping with torch (the reference path; slower, see the bench).
    """

    def __init__(self, storage: torch.UntypedStorage, fd: int, nbytes: int, *, evict: bool = False, io: str = "fd"):
        if io not in ("fd", "mmap"):
            raise ValueError(f"io = {io!r} must be 'fd' or 'mmap'")
        super().__init__(torch.empty(0, dtype=torch.uint8).set_(storage)[:nbytes])
        self._storage, self._fd, self._evict, self._io = storage, fd, evict, io
        self._mapped = -(-storage.nbytes() // PAGE) * PAGE

    @classmethod
    def allocate(cls, path: str, nbytes: int, index: int, **kwargs) -> FileChunk:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _reserve(fd, max(nbytes, 1), path, index)
            storage = torch.UntypedStorage.from_file(path, True, max(nbytes, 1))
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(path)
        return cls(storage, fd, nbytes, **kwargs)

    def store(self, pieces: list[tuple[int, torch.Tensor]]) -> None:
        if self._io == "mmap" or any(t.device.type != "cpu" for _, t in pieces):
            return super().store(pieces)
        _transfer(os.pwritev, self._fd, pieces)

    def load(self, pieces: list[tuple[int, torch.Tensor]]) -> None:
        if self._io == "mmap" or any(t.device.type != "cpu" for _, t in pieces):
            return super().load(pieces)
        _transfer(os.preadv, self._fd, pieces)

    def _advise(self, advice: int) -> int:
        return _libc.madvise(self.tensor.data_ptr(), self._mapped, advice)

    def written(self) -> None:
        if self._evict:
            self.drop_page_cache()
        self._advise(MADV_DONTNEED)  # out of RSS; the dirty pages stay in the page cache until written back

    def prefetch(self) -> None:
        os.posix_fadvise(self._fd, 0, self.nbytes, os.POSIX_FADV_WILLNEED)  # asynchronous readahead

    def consumed(self) -> None:
        self._advise(MADV_DONTNEED)

    def flush(self) -> None:
        if _libc.msync(self.tensor.data_ptr(), self._mapped, MS_SYNC) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"msync of an optimizer-state chunk failed: {os.strerror(err)}")

    def drop_page_cache(self) -> None:
        """Write the chunk back and evict it from the page cache (the next read comes from the disk)."""
        self.flush()
        self._advise(MADV_DONTNEED)
        os.posix_fadvise(self._fd, 0, self.nbytes, os.POSIX_FADV_DONTNEED)

    def resident_fraction(self) -> float:
        """Fraction of this chunk's pages in the page cache (mincore)."""
        num_pages = self._mapped // PAGE
        vec = (ctypes.c_ubyte * num_pages)()
        if _libc.mincore(ctypes.c_void_p(self.tensor.data_ptr()), ctypes.c_size_t(self._mapped), vec) != 0:
            return float("nan")
        return sum(v & 1 for v in vec) / max(num_pages, 1)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        super().close()
        self._storage = None  # the last reference unmaps the file and frees its blocks


def _transfer(op, fd: int, pieces: list[tuple[int, torch.Tensor]]) -> None:
    """preadv/pwritev of contiguous pieces, at most IOV_MAX buffers a call, resuming after short transfers."""
    offset = pieces[0][0]
    # ctypes views, not Tensor.numpy(): exporting to numpy marks a storage non-resizable for good
    buffers = [
        memoryview((ctypes.c_ubyte * t.numel()).from_address(t.data_ptr())).cast("B") for _, t in pieces if t.numel()
    ]
    while buffers:
        done = op(fd, buffers[:IOV_MAX], offset)
        if done == 0:
            raise OSError(errno.EIO, f"{op.__name__} of an optimizer-state chunk moved 0 bytes at offset {offset}")
        offset += done
        while buffers and done >= len(buffers[0]):
            done -= len(buffers[0])
            buffers.pop(0)
        if done:
            buffers[0] = buffers[0][done:]


class DiskOptimizerStateOffloader(ChunkedOptimizerStateOffloader):
    """ChunkedOptimizerStateOffloader whose chunks are file-backed pages in ``directory/rank<rank>``.

    offloader = DiskOptimizerStateOffloader(optimizer, directory="/nvme/miles", rank=0, chunk_bytes=64 << 20)
    offloader.restore(); optimizer.step(); offloader.offload()   # same call order as the base class
    offloader.flush()                                           # msync every chunk before a checkpoint

    ``evict_page_cache=True`` writes each chunk back and evicts it right after the offload, so the state really
    leaves RAM instead of waiting for the kernel's writeback and reclaim (offload then runs at disk speed).
    ``io`` picks how bytes move in and out of the chunks (see FileChunk). Each chunk holds one open fd; the soft
    RLIMIT_NOFILE is raised to the hard limit when the chunks would need more than half of it.
    """

    pool = "disk"

    def __init__(
        self, optimizer, *, directory: str, rank: int = 0, evict_page_cache: bool = False, io: str = "fd", **kwargs
    ):
        super().__init__(optimizer, **kwargs)
        self.directory = os.path.join(directory, f"rank{rank}")
        self.evict_page_cache, self.io = evict_page_cache, io
        self._serial = next(_serial)
        prepare_offload_directory(self.directory)

    def _allocate_chunk(self, index: int, nbytes: int, pin: bool) -> HostChunk:
        _raise_fd_limit(index + 1)
        path = os.path.join(self.directory, f"optstate.pid{os.getpid()}.{self._serial}.chunk{index}.bin")
        return FileChunk.allocate(path, nbytes, index, evict=self.evict_page_cache, io=self.io)


def _raise_fd_limit(num_chunks: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and num_chunks > soft // 2 and (hard == resource.RLIM_INFINITY or hard > soft):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
