"""``miles bench optim-offload``: process RSS, disk bytes, step time and bandwidth of resident / host / disk
optimizer state (AdamW and Muon), against this machine's sequential file bandwidth measured in the same run.

Each (optimizer, mode) runs in a fresh Python process so its RSS starts clean. RSS is read from
/proc/self/status: RssAnon (heap, pinned buffers), RssFile (mapped file pages: the disk chunks while they are
mapped), RssShmem (tmpfs / shared memory). The chunk allocator's pages are unmapped with MADV_DONTNEED after
each chunk, so they stay in the page cache (counted by the kernel, reclaimable) but not in the process's RSS.

The disk figures: ``write`` = offload + flush (msync) of the whole state, ``read`` = restore after every chunk
was written back and evicted from the page cache (so the bytes really come from the disk), each compared with
plain sequential ``write``+fsync and ``read`` of a file of the same size in the same directory.

The measurement itself (``measure``, one configuration in a fresh process; ``child``, what that process runs) is
here too: notebook 06 runs it, with the checkout on sys.path (``miles.cli.bench.benchmarks()``).

    miles bench optim-offload --json
    miles bench optim-offload --json --param-mib 4096 --chunk-mib 256 --dir /local_nvme/miles   # on a GPU node
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) << 10
    return out


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:  # not permitted here: VmHWM then stays the process-lifetime peak
        pass


def sequential_file_bandwidth(directory: str, nbytes: int, block: int = 16 << 20) -> dict:
    """This machine's bandwidth for one file: write ``nbytes`` from memory into a preallocated file (+fsync), then,
    evicted from the page cache, read it back in ``block``-sized requests into the same (already touched) buffer
    and into freshly allocated memory (what a CPU restore does: its first touch of each page costs a fault)."""
    import torch

    from miles.optim.disk_offload import _transfer

    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    path = os.path.join(directory, f"seqbw.{os.getpid()}.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)

    def transfer(op, dst) -> float:
        t0 = time.perf_counter()
        for off in range(0, nbytes, block):
            _transfer(op, fd, [(off, dst[off : off + block])])
        if op is os.pwritev:
            os.fsync(fd)
        os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
        return nbytes / (time.perf_counter() - t0) / 1e9

    try:
        os.posix_fallocate(fd, 0, nbytes)
        write = transfer(os.pwritev, buf)
        read_touched = transfer(os.preadv, buf)
        del buf
        read_fresh = transfer(os.preadv, torch.empty(nbytes, dtype=torch.uint8))
    finally:
        os.close(fd)
        os.unlink(path)
    return {"bytes": nbytes, "write_GBps": write, "read_GBps": read_touched, "read_fresh_GBps": read_fresh}


def pinned_bandwidth(nbytes: int) -> dict:
    import torch

    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[f"{name}_GBps"] = nbytes / (time.perf_counter() - t0) / 1e9
    return out


def child(spec: dict) -> dict:
    """One (optimizer, mode) measured in this (fresh) process."""
    ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD fixed: freed large blocks go back to the OS
    import torch

    from miles.config import TrainerConfig
    from miles.optim import build_optimizer, make_offloader
    from miles.optim.disk_offload import DiskOptimizerStateOffloader

    device = torch.device(spec["device"])
    shape = tuple(int(x) for x in spec["matrix"].split("x"))
    num = max(1, (spec["param_mib"] << 20) // (shape[0] * shape[1] * 4))
    _warm_up(spec["optimizer"], shape, device)  # lazy imports and library scratch buffers are not the state
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen, device=device)) for _ in range(num)]
    for p in params:
        p.grad = torch.randn(shape, generator=gen, device=device)
    mode = spec["mode"]
    cfg = TrainerConfig(
        optimizer=spec["optimizer"],
        optimizer_offload={"resident": "none", "disk-mmap": "disk"}.get(mode, mode),
        optimizer_offload_dir=spec["dir"],
        optimizer_offload_chunk_bytes=spec["chunk_mib"] << 20,
    )
    opt = build_optimizer(params, cfg)
    if mode == "disk-mmap":
        offloader = DiskOptimizerStateOffloader(
            opt, directory=spec["dir"], chunk_bytes=spec["chunk_mib"] << 20, io="mmap"
        )
    else:
        offloader = make_offloader(cfg, opt, None, rank=0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    rss_model = status()
    times = {"restore": [], "step": [], "offload": []}
    peaks = {"restore": 0, "offload": 0}
    rss_with_state = None
    for _ in range(spec["steps"]):
        for phase, fn in (
            ("restore", offloader and offloader.restore),
            ("step", opt.step),
            ("offload", offloader and offloader.offload),
        ):
            reset_peak_rss()
            t0 = time.perf_counter()
            if fn:
                fn()
            sync()
            times[phase].append(time.perf_counter() - t0)
            if phase in peaks:
                peaks[phase] = max(peaks[phase], status()["VmHWM"])
            if phase == "step" and rss_with_state is None:
                rss_with_state = status()["VmRSS"]
    rss_after = status()
    state_bytes = sum(
        v.numel() * v.element_size()
        for o in getattr(opt, "optimizers", [opt])
        for st in o.state.values()
        for v in st.values()
        if torch.is_tensor(v)
    )
    out = {
        "optimizer": spec["optimizer"],
        "mode": spec["mode"],
        "state_bytes": state_bytes,
        "param_bytes": num * shape[0] * shape[1] * 4,
        "num_matrices": num,
        "step_s": statistics.median(times["step"]),
        "restore_s": statistics.median(times["restore"]),
        "offload_s": statistics.median(times["offload"]),
        "rss_model": rss_model["VmRSS"],
        "rss_with_state": rss_with_state,
        "rss_after_step_cycle": rss_after["VmRSS"],
        "rss_growth_over_model": rss_after["VmRSS"] - rss_model["VmRSS"],
        "rss_file_growth": rss_after["RssFile"] - rss_model["RssFile"],
        "peak_rss_offload": peaks["offload"],
        "peak_rss_restore": peaks["restore"],
        "disk_bytes": sum(c.nbytes for c in offloader.chunks) if mode.startswith("disk") else 0,
    }
    if device.type == "cuda":
        out["device_allocated_after_offload"] = torch.cuda.memory_allocated()
    if mode.startswith("disk") and spec.get("throughput", True):
        out["disk"] = _disk_throughput(offloader, state_bytes, sync, spec["dir"])
    if mode == "host" and device.type == "cuda":
        out["host"] = _timed_cycle(offloader, state_bytes, sync)
    return out


def _warm_up(optimizer: str, shape: tuple[int, int], device) -> None:
    import torch

    from miles.config import TrainerConfig
    from miles.optim import build_optimizer

    p = torch.nn.Parameter(torch.zeros(shape, device=device))
    p.grad = torch.ones_like(p)
    build_optimizer([p], TrainerConfig(optimizer=optimizer)).step()


def _timed_cycle(offloader, state_bytes: int, sync) -> dict:
    offloader.restore()
    sync()
    t0 = time.perf_counter()
    offloader.offload()
    sync()
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    offloader.restore()
    sync()
    read_s = time.perf_counter() - t0
    offloader.offload()
    return {"offload_GBps": state_bytes / write_s / 1e9, "restore_GBps": state_bytes / read_s / 1e9}


def _disk_throughput(offloader, state_bytes: int, sync, directory: str, repeats: int = 2) -> dict:
    """offload + msync with the chunks evicted beforehand, then restore with them evicted again, so both go to
    the disk; interleaved with plain sequential file I/O of the same size (medians of ``repeats``)."""
    rows, seq = [], []
    for _ in range(repeats):
        seq.append(sequential_file_bandwidth(directory, state_bytes))
        offloader.restore()
        for c in offloader.chunks:
            c.drop_page_cache()
        sync()
        t0 = time.perf_counter()
        offloader.offload()
        offloader.flush()
        write_s = time.perf_counter() - t0
        for c in offloader.chunks:
            c.drop_page_cache()
        cached = statistics.mean(c.resident_fraction() for c in offloader.chunks)
        t0 = time.perf_counter()
        offloader.restore()
        sync()
        read_s = time.perf_counter() - t0
        offloader.offload()
        rows.append(
            {
                "write_GBps": state_bytes / write_s / 1e9,
                "read_GBps": state_bytes / read_s / 1e9,
                "page_cache_fraction_before_read": cached,
            }
        )
    med = lambda xs, k: statistics.median(x[k] for x in xs)
    return {
        "write_GBps": med(rows, "write_GBps"),
        "read_GBps": med(rows, "read_GBps"),
        "seq_write_GBps": med(seq, "write_GBps"),
        "seq_read_GBps": med(seq, "read_GBps"),
        "seq_read_fresh_GBps": med(seq, "read_fresh_GBps"),
        "page_cache_fraction_before_read": max(r["page_cache_fraction_before_read"] for r in rows),
        "repeats": rows,
        "sequential": seq,
    }


def measure(
    optimizer: str,
    mode: str,
    *,
    directory: str,
    device: str = "cpu",
    param_mib: int = 64,
    chunk_mib: int = 4,
    steps: int = 2,
    matrix: str = "32768x32",
    throughput: bool = False,
) -> dict:
    """One (optimizer, mode) in a fresh process: RSS, step-phase times, disk bytes (and bandwidth if asked)."""
    return run_child(
        {
            "optimizer": optimizer,
            "mode": mode,
            "device": device,
            "param_mib": param_mib,
            "chunk_mib": chunk_mib,
            "steps": steps,
            "dir": directory,
            "matrix": matrix,
            "throughput": throughput,
        }
    )


def run_child(spec: dict) -> dict:
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = f"import json, benchmarks.optim_offload as m; print(json.dumps(m.child({spec!r})))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root)
    if r.returncode:
        raise RuntimeError(f"optim-offload child {spec} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _parse(argv: list[str]) -> argparse.Namespace:
    import torch

    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="miles bench optim-offload")
    p.add_argument("--json", action="store_true", help="print JSON (the default output anyway)")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--param-mib", type=int, default=2048 if cuda else 256, help="fp32 master weights")
    p.add_argument("--chunk-mib", type=int, default=128 if cuda else 16)
    p.add_argument(
        "--matrix",
        default="4096x4096" if cuda else "131072x8",
        help="shape of each fp32 matrix (thin on CPU: Muon's Newton-Schulz cost grows with the short side)",
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dir", default=_default_dir(), help="a scratch directory on the local disk (not tmpfs)")
    p.add_argument("--optimizers", default="adamw,muon")
    p.add_argument("--modes", default="resident,host,disk,disk-mmap", help="disk-mmap: copies through the mapping")
    return p.parse_args(argv)


def _default_dir() -> str:
    import tempfile

    from miles.optim.disk_offload import RAM_FILESYSTEMS, filesystem_type

    base = tempfile.gettempdir()
    if filesystem_type(base) in RAM_FILESYSTEMS:
        base = os.getcwd()
    return os.path.join(base, f"miles-bench-optim-offload.{os.getpid()}")


def run(argv: list[str]) -> dict:
    from miles.optim.disk_offload import filesystem_type

    args = _parse(argv)
    os.makedirs(args.dir, exist_ok=True)
    fstype = filesystem_type(args.dir)
    chunk = args.chunk_mib << 20
    runs = []
    for optimizer in args.optimizers.split(","):
        for mode in args.modes.split(","):
            spec = {
                "optimizer": optimizer,
                "mode": mode,
                "device": args.device,
                "param_mib": args.param_mib,
                "chunk_mib": args.chunk_mib,
                "steps": args.steps,
                "dir": args.dir,
                "matrix": args.matrix,
            }
            runs.append(run_child(spec))
    shutil.rmtree(args.dir, ignore_errors=True)
    summary = []
    for r in runs:
        row = {
            "optimizer": r["optimizer"],
            "mode": r["mode"],
            "state_MiB": r["state_bytes"] / 2**20,
            "step_s": r["step_s"],
            "restore_s": r["restore_s"],
            "offload_s": r["offload_s"],
            "rss_growth_over_model_MiB": r["rss_growth_over_model"] / 2**20,
            "rss_growth_chunks": r["rss_growth_over_model"] / chunk,
            "offload_peak_over_state_chunks": (r["peak_rss_offload"] - r["rss_with_state"]) / chunk,
        }
        if "disk" in r:
            d = r["disk"]
            row.update(
                disk_write_GBps=d["write_GBps"],
                disk_read_GBps=d["read_GBps"],
                seq_write_GBps=d["seq_write_GBps"],
                seq_read_GBps=d["seq_read_GBps"],
                write_vs_sequential=d["write_GBps"] / d["seq_write_GBps"],
                read_vs_sequential=d["read_GBps"] / d["seq_read_GBps"],
                read_vs_sequential_fresh=d["read_GBps"] / d["seq_read_fresh_GBps"],
            )
        summary.append(row)
    disk_rows = [s for s in summary if s["mode"] == "disk"]
    out = {
        "device": args.device,
        "dir": args.dir,
        "filesystem": fstype,
        "matrix": args.matrix,
        "param_MiB": args.param_mib,
        "chunk_MiB": args.chunk_mib,
        "steps": args.steps,
        "summary": summary,
        "runs": runs,
        "checks": {
            "disk_rss_growth_within_2_chunks": all(s["rss_growth_chunks"] <= 2.25 for s in disk_rows),
            # a CPU restore reads into fresh memory (the state is re-allocated); on CUDA into a reused pinned buffer
            "disk_read_at_least_70pct_of_sequential_same_destination": all(
                s["read_vs_sequential_fresh" if args.device == "cpu" else "read_vs_sequential"] >= 0.7
                for s in disk_rows
            ),
            "disk_read_at_least_70pct_of_sequential_touched_buffer": all(
                s["read_vs_sequential"] >= 0.7 for s in disk_rows
            ),
            "disk_write_at_least_70pct_of_sequential": all(s["write_vs_sequential"] >= 0.7 for s in disk_rows),
        },
    }
    if args.device == "cuda":
        out["pinned"] = pinned_bandwidth(min(max(r["state_bytes"] for r in runs), 4 << 30))
    return out
