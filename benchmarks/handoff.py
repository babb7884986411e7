"""``miles bench handoff``: a real colocated run in one process (no Ray), both peak devices, against the planner.

For each mode: init + N RL steps of the RL loop in this process (miles.driver.train on a Colocated: RolloutManager
+ TorchBackend + TaggedMemory), recording per plan step the bytes moved, the copy time, the device bytes held
(allocator) and the process RSS; then the planner's prediction for the same config. Reported: predicted vs measured device peak (allocator, CUDA), held
bytes per step (exact), host footprint as RSS around the trainer's offload vs the predicted arena footprint, and
the handoff throughput of the pinned host copies against a raw copy ceiling measured in the same run (arena,
torch's caching pinned allocator and pageable memory, 1 GiB each way). Each mode runs with exact arenas (page-locked
at every pause, freed at resume) and with kept arenas (page-locked once, reused; the host keeps every backup).

    miles bench handoff --json                          # CPU: the quickstart-sized model
    miles bench handoff --size 1b --steps 2 --json      # one GPU: a ~1B-parameter bf16 Llama-style decoder
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time

import torch

from miles.colocated import Colocated
from miles.config import RunConfig, apply_overrides
from miles.driver import train
from miles.handoff.plan import HandoffPlan
from miles.handoff.planner import plan as predict
from miles.memory.host_arena import STATS as ARENA_STATS
from miles.memory.host_arena import host_arena, keep_pinned
from miles.memory.ledger import process_rss_bytes
from miles.recipes import MODEL_SIZES as SIZES
from miles.recipes import quickstart


def bench_config(size: str, mode: str, level: str, mirror: bool) -> RunConfig:
    over = SIZES[size] + [
        "rollout.num_prompts_per_step=4",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=16",
        "rollout.max_seq_len=64",
        "trainer.warmup_sft_steps=0",
        "trainer.num_minibatches=1",
        "device=" + _device(),
        f"handoff.colocate_memory_peak_device={mode}",
        f"handoff.offload_rollout_level={level}",
        f"handoff.engine_host_mirror={str(mirror).lower()}",
        "handoff.hardware=" + ("cpu" if _device() == "cpu" else "auto"),
        "run_dir=/tmp/miles-bench-handoff",
    ]
    return apply_overrides(quickstart(), over)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def measure(cfg: RunConfig, steps: int, arenas: str = "exact") -> dict:
    """One colocated run; ``arenas='kept'`` keeps released pinned arenas mapped for reuse (host_arena.keep_pinned)."""
    device = _device()
    keep_pinned(arenas == "kept")
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    plan = HandoffPlan.from_config(cfg.handoff)
    rss: list[tuple[str, int, int]] = []  # (step, rss before, rss after)
    alloc: dict[int, float] = {}  # record index -> seconds spent creating (page-locking) host arenas in that step
    made: list[Colocated] = []

    def colocated(c: RunConfig) -> Colocated:  # the driver's cluster, each plan step timed and its RSS read
        co = Colocated(c, device=device)
        plain = co.run_step

        def timed_step(s, version, **hooks):
            before, a0 = process_rss_bytes(), ARENA_STATS["seconds"]
            out = plain(s, version, **hooks)
            alloc[len(co.records)] = ARENA_STATS["seconds"] - a0
            rss.append((str(s), before, process_rss_bytes()))
            return out

        co.run_step = timed_step
        made.append(co)
        return co

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="miles-bench-handoff-") as run_dir:  # the loop writes a run directory
        train(apply_overrides(cfg, [f"num_steps={steps}", f"run_dir={run_dir}"]), progress=False, cluster=colocated)
    wall = time.perf_counter() - t0
    co = made.pop()
    rep = predict(cfg, None, num_steps=steps, host_allocator="arena_kept" if arenas == "kept" else "arena")
    # Colocated.train resets the peak counter per train step and keeps that step's peak on its record
    measured_peak = (
        max([r.device_allocated for r in co.records] + [torch.cuda.max_memory_allocated()]) - base
        if device == "cuda"
        else None
    )
    rows = [r for r in co.records if r.phase != "train"]
    pred_rows = [s for s in rep.steps if s.phase not in ("construct", "train")]
    held_equal = all(r.held_device == p.device for r, p in zip(rows, pred_rows))
    copies = []  # host-backed moves: bytes through the link and their time
    for i, r in enumerate(co.records):
        host_bytes = sum(e.bytes for e in r.events if e.pool == "host")
        if host_bytes and r.phase != "train":
            a = alloc.get(i, 0.0)
            copies.append(
                {
                    "step": f"{r.phase}: {r.step}",
                    "bytes": host_bytes,
                    "seconds": r.seconds,
                    "arena_seconds": a,
                    "GBps": host_bytes / r.seconds / 1e9,
                    "copy_GBps": host_bytes / max(r.seconds - a, 1e-9) / 1e9,
                }
            )
    offload = [(b, a) for name, b, a in rss if name.startswith("trainer.offload")]
    footprint_pred = [
        p.host_node - prev.host_node
        for prev, p in zip(rep.steps, rep.steps[1:])
        if p.step.startswith("trainer.offload")
    ]
    out = {
        "arenas": arenas,
        "mode": plan.mode,
        "level": list(cfg.handoff.offload_rollout_level),
        "mirror": cfg.handoff.engine_host_mirror,
        "parameters": cfg.model.num_parameters,
        "wall_s": wall,
        "predicted_device_peak": rep.device_peak,
        "measured_device_peak": measured_peak,
        "device_peak_ratio": measured_peak / rep.device_peak if measured_peak else None,
        "held_bytes_equal_prediction_every_step": held_equal,
        "predicted_host_peak": rep.host_peak,
        "host_copies": copies,
        "handoff_GBps_median": statistics.median(c["GBps"] for c in copies) if copies else None,
        "handoff_GBps_bytes_weighted": (
            sum(c["bytes"] for c in copies) / sum(c["seconds"] for c in copies) / 1e9 if copies else None
        ),
        # the same moves without the time spent mapping and page-locking fresh arenas (cudaHostRegister)
        "copy_GBps_bytes_weighted": (
            sum(c["bytes"] for c in copies) / sum(c["seconds"] - c["arena_seconds"] for c in copies) / 1e9
            if copies
            else None
        ),
        # on CUDA the offloaded bytes leave the GPU, so RSS grows by the backup's footprint alone (on CPU the
        # freed "device" tensors are RAM too, and the difference says nothing)
        "trainer_offload_rss_growth": [a - b for b, a in offload] if device == "cuda" else None,
        "trainer_offload_predicted_footprint_growth": footprint_pred[: len(offload)],
        "rss_over_predicted_footprint": (
            [(a - b) / f for (b, a), f in zip(offload, footprint_pred) if f] if device == "cuda" else None
        ),
    }
    del co.run_step  # break the co -> timed_step -> co cycle so the run's memory is freed now
    co = None  # noqa: F841 (drop the reference so the run's memory is freed now)
    gc.collect()
    keep_pinned(False)  # unmaps every kept arena before the next run
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def copy_ceiling(nbytes: int = 1 << 30, repeats: int = 5) -> dict:
    """D2H/H2D GB/s of one buffer: exact-footprint pinned arena, torch's caching pinned allocator, pageable."""
    if not torch.cuda.is_available():
        return {}
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, make in (
        ("arena_pinned", lambda: host_arena(nbytes, pin=True)),
        ("torch_pinned", lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)),
        ("pageable", lambda: torch.empty(nbytes, dtype=torch.uint8)),
    ):
        host = make()
        host.fill_(1)
        for direction, (dst, src) in (("d2h", (host, dev)), ("h2d", (dev, host))):
            times = []
            for _ in range(repeats):
                torch.cuda.synchronize()
                t = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            out[f"{name}_{direction}_GBps"] = nbytes / statistics.median(times) / 1e9
        del host
    return out


def run(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(prog="miles bench handoff")
    p.add_argument("--size", default="1b" if torch.cuda.is_available() else "cpu", choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--modes", default="cpu,gpu")
    p.add_argument(
        "--levels",
        default="kv_cache,weight",
        help="';'-separated offload_rollout_level sets, e.g. 'kv_cache;kv_cache,weight'",
    )
    p.add_argument("--mirror", default="true")
    p.add_argument("--arenas", default="exact,kept", help="exact: freed at resume; kept: stay pinned for reuse")
    a = p.parse_args(argv)
    runs = []
    for arenas in a.arenas.split(","):
        for level in a.levels.split(";"):
            for mode in a.modes.split(","):
                runs.append(measure(bench_config(a.size, mode, level, a.mirror == "true"), a.steps, arenas))
    ceiling = copy_ceiling()
    best = max((r["handoff_GBps_bytes_weighted"] or 0) for r in runs)
    copy = max((r["copy_GBps_bytes_weighted"] or 0) for r in runs)
    ceil = min(ceiling["arena_pinned_d2h_GBps"], ceiling["arena_pinned_h2d_GBps"]) if ceiling else None
    return {
        "size": a.size,
        "device": _device(),
        "runs": runs,
        "copy_ceiling": ceiling,
        "handoff_vs_55GBps": best / 55 if ceiling else None,
        "copy_vs_55GBps": copy / 55 if ceiling else None,
        "handoff_vs_measured_pinned_ceiling": best / ceil if ceiling else None,
        "copy_vs_measured_pinned_ceiling": copy / ceil if ceiling else None,
    }
