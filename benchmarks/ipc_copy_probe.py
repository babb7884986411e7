"""How fast can a process copy another process's GPU tensors, opened through CUDA IPC, into its own?

Run on a GPU machine: ``python benchmarks/ipc_copy_probe.py [GiB]``. The parent holds ~GiB of bf16 tensors shaped
like a decoder's weights and shares them (torch's reduce_tensor); a child process opens them once and times,
median of 9 after a warm-up:
  flat_local     one flat device copy of the same bytes, both sides the child's own memory (the ceiling)
  local_tensors  one copy_ per tensor, local -> local
  ipc_memcpy     one copy_ per tensor, IPC-opened -> local (cudaMemcpyAsync, what miles' in-place sync does)
  ipc_kernel     the same bytes through an elementwise kernel (int64 views, torch.add(src, 0, out=dst))
  ipc_flat       one copy_ of one flat IPC-opened buffer of the same size (is the mapping slow, or the many copies?)
  ipc_flat_kernel  the same flat buffer through the int64 kernel
Prints one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp


def _shapes(gib: float) -> list[tuple[int, ...]]:
    h, inter, v = 4096, 11008, 32768
    layer = [(h * 3 // 2, h), (h, h), (2 * inter, h), (h, inter), (h,), (h,)]
    per = sum(torch.Size(s).numel() for s in layer) * 2
    n = max(1, round((gib * 2**30 - 2 * v * h * 2) / per))
    return [(v, h)] + layer * n + [(v, h)]


def _timed(fn, reps: int = 9) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _child(handles, flat_handle, q) -> None:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    torch.cuda.set_device(0)
    remote = [rebuild_cuda_tensor(*h) for h in handles]
    local = [torch.empty_like(t) for t in remote]
    other = [torch.empty_like(t) for t in remote]
    nbytes = sum(t.numel() * t.element_size() for t in remote)
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    flat = rebuild_cuda_tensor(*flat_handle)

    def per_tensor(src, dst):
        for s, d in zip(src, dst):
            d.copy_(s, non_blocking=True)

    def kernel(src, dst):
        for s, d in zip(src, dst):
            s8, d8 = s.reshape(-1).view(torch.uint8), d.reshape(-1).view(torch.uint8)
            if s8.numel() % 8 == 0:
                torch.add(s8.view(torch.int64), 0, out=d8.view(torch.int64))
            else:
                d8.copy_(s8)

    res = {
        "bytes": nbytes,
        "tensors": len(remote),
        "flat_local_s": _timed(lambda: b.copy_(a)),
        "local_tensors_s": _timed(lambda: per_tensor(other, local)),
        "ipc_memcpy_s": _timed(lambda: per_tensor(remote, local)),
        "ipc_kernel_s": _timed(lambda: kernel(remote, local)),
        "ipc_flat_s": _timed(lambda: b.copy_(flat)),
        "ipc_flat_kernel_s": _timed(lambda: kernel([flat], [b])),
    }
    res["ipc_equal"] = all(torch.equal(x, y) for x, y in zip(remote, local))
    q.put(res)


def main() -> None:
    from torch.multiprocessing.reductions import reduce_tensor

    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
    tensors = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in _shapes(gib)]
    flat = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(
        target=_child, args=([tuple(reduce_tensor(t)[1]) for t in tensors], tuple(reduce_tensor(flat)[1]), q)
    )
    p.start()
    res = q.get(timeout=600)
    p.join()
    res["device"] = torch.cuda.get_device_name()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
