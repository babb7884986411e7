"""Host arenas with an exact footprint: what the OS holds is the bytes asked for, rounded up to one page.

torch's caching pinned-host allocator (``torch.empty(n, pin_memory=True)``) rounds every block up to a power of
two and keeps freed blocks cached, so a 2.1 GB backup can hold 4 GB of pinned RAM. On a host whose RAM is
smaller than the HBM it mirrors (a GB300 tray), that rounding alone runs a job out of memory. An arena here is
one anonymous mmap per backup (TaggedMemory allocates one per tag): its pages go back to the OS when the last
tensor viewing it dies (munmap, no allocator cache), and when a CUDA device is the source the mapping is
page-locked in place with ``cudaHostRegister`` (pinned: full-speed DMA, never the pageable path) and
unregistered just before it is unmapped.

    buf = host_arena(nbytes, pin=True)          # uint8 tensor of exactly nbytes, page-locked
    buf.copy_(device_bytes, non_blocking=True)  # async D2H at link speed
    del buf                                     # unregistered, unmapped: RSS drops by arena_footprint(nbytes)

Page-locking a fresh mapping costs time (the driver faults in and pins every page), paid at every offload. Where
host RAM is plentiful (an H200 node), ``keep_pinned(True)`` keeps released arenas mapped and registered and
hands them to the next request of the same size (each tag asks for the same size every step): the copy then
runs at link speed, and the host holds every tag's backup for the whole run (the planner's ``arena_kept``).
"""

from __future__ import annotations

import ctypes
import mmap
import time

import torch

PAGE = mmap.PAGESIZE
# Time spent creating arenas (mmap + page-locking), so a benchmark can split a handoff into allocation and copy.
STATS = {"arenas": 0, "bytes": 0, "seconds": 0.0}
_KEEP = {"on": False}
_KEPT: dict[tuple[int, bool], list[tuple[mmap.mmap, int]]] = {}  # (nbytes, pinned) -> released (mapping, pinned ptr)


def keep_pinned(on: bool) -> None:
    """Keep released arenas mapped (and page-locked) for reuse by the next request of the same size; off frees them."""
    _KEEP["on"] = on
    if not on:
        release_kept()


def release_kept() -> int:
    """Unregister and unmap every kept arena; returns the bytes given back."""
    freed = 0
    for (nbytes, _), entries in list(_KEPT.items()):
        for mm, ptr in entries:
            if ptr:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            mm.close()
            freed += arena_footprint(nbytes)
    _KEPT.clear()
    return freed


def kept_bytes() -> int:
    return sum(arena_footprint(n) * len(v) for (n, _), v in _KEPT.items())


def arena_footprint(nbytes: int) -> int:
    """Resident bytes of one arena of ``nbytes`` once written: whole pages."""
    return -(-nbytes // PAGE) * PAGE


def caching_allocator_footprint(nbytes: int) -> int:
    """Bytes torch's caching pinned-host allocator reserves for one ``nbytes`` block (the next power of two)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def _check(err, what: str, nbytes: int) -> None:
    code = getattr(err, "value", err)
    if code:
        raise RuntimeError(
            f"{what}({nbytes} bytes) failed with cudaError {code}; the host may be out of lockable "
            f"memory (ulimit -l) or its cgroup budget; offload fewer bytes or raise the limit"
        )


def _release(arena) -> None:
    if _KEEP["on"]:  # the mapping outlives this array: the kept entry holds it
        _KEPT.setdefault((len(arena), bool(arena.pinned_ptr)), []).append((arena.mm, arena.pinned_ptr))
        return
    if arena.pinned_ptr:
        torch.cuda.cudart().cudaHostUnregister(arena.pinned_ptr)
        arena.pinned_ptr = 0


def host_arena(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 tensor of exactly ``nbytes`` in its own anonymous mapping (page-locked when ``pin``)."""
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    arena_type = type("HostArena", (ctypes.c_uint8 * nbytes,), {"__del__": _release})
    kept = _KEPT.get((nbytes, pin))
    if kept:
        mm, ptr = kept.pop()
        arena = arena_type.from_buffer(mm)
        arena.mm, arena.pinned_ptr = mm, ptr
        return torch.frombuffer(arena, dtype=torch.uint8)
    t0 = time.perf_counter()
    mm = mmap.mmap(-1, arena_footprint(nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # A ctypes array over the mapping, of a subclass whose __del__ unregisters: torch.frombuffer keeps a reference
    # to it, so it dies with the last storage; the array holds the mmap, which is unmapped right after.
    arena = arena_type.from_buffer(mm)
    arena.mm, arena.pinned_ptr = mm, 0
    if pin:
        ptr = ctypes.addressof(arena)
        _check(torch.cuda.cudart().cudaHostRegister(ptr, arena_footprint(nbytes), 0), "cudaHostRegister", nbytes)
        arena.pinned_ptr = ptr
    STATS["arenas"] += 1
    STATS["bytes"] += nbytes
    STATS["seconds"] += time.perf_counter() - t0
    return torch.frombuffer(arena, dtype=torch.uint8)


def is_pinned(t: torch.Tensor) -> bool:
    """Whether CUDA sees ``t``'s memory as page-locked (False without CUDA)."""
    return torch.cuda.is_available() and t.is_pinned()


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``). torch's CPU allocator uses malloc, and
    once a process has freed a few large blocks glibc serves multi-MiB requests from its heap, where ``free``
    keeps the pages: without this, a CPU tensor freed by an offload stays in the process RSS. Returns whether the
    C library could do it (False off glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    libc.malloc_trim(0)
    return True
