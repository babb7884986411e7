"""``miles bench optim-offload``: process RSS, disk bytes, step time and bandwidth of resident / host / disk
optimizer state (AdamW and Muon), against this machine's sequential file bandwidth measured in the same run.

Each (optimizer, mode) runs in a fresh Python process so its RSS starts clean. RSS is read from
/proc/self/status: RssAnon (heap, pinned buffers), RssFile (mapped file pages: the disk chunks while they are
mapped), RssShmem (tmpfs / shared memory). The chunk allocator's pages are unmapped with MADV_DONTNEED after
each chunk, so they stay in the page cache (counted by the kernel, reclaimable) but not in the process's RSS.

The disk figures: ``write`` = offload + flush (msync) of the whole state, ``read`` = restore after every chunk
was written back and evicted from the page cache (so the bytes really come from the disk), each compared with
plain sequential ``write``+fsync and ``read`` of a file of the same size in the same directory.

    miles bench optim-offload --json
    miles bench optim-offload --json --param-mib 4096 --chunk-mib 256 --dir /local_nvme/miles   # on a GPU node
"""

from __future__ import annotations

import argparse
import os
import shutil

from miles.optim.offload_measure import pinned_bandwidth, run_child


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
