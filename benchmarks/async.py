"""``miles bench async``: the synchronous loop and the async one (``async.max_staleness``) side by side, same recipe
and seeds, and whether ``max_staleness = 0`` is the synchronous loop bit for bit.

Per seed it runs the recipe twice in fresh run directories, ``async.max_staleness=0`` and ``=K`` (``--staleness``),
one after the other (``--parallel`` shares the cores), and records per arm: the mean reward of the first 3 and last 3
RL steps, the gain, the median RL step time, the measured staleness and version span per step (async/*), the load
average before and after (the machine may be shared), and the planner's prediction (miles.async_plan) from the
sync arm's measured generate and train times.

``--reference TREE``: another checkout (the synchronous loop before miles.rollout_window, e.g. ``git archive`` of
the commit before it) runs the same seeds; every step's samples (the rollout dump's columns), rewards and losses
(metrics.jsonl, timings aside) and weights (each step's checkpoint, ``checkpoint_every=1``) are compared byte for
byte with this checkout's ``max_staleness=0`` arm.

    miles bench async --seeds 0,1,2 --staleness 2 --steps 100 --set trainer.rollout_correction=decoupled
    miles bench async --seeds 0,1,2 --steps 10 --arms 0 --reference /tmp/main_tree --set checkpoint_every=1
    miles bench async --ray ...        # through `miles train` (Ray actors: generation overlaps training)

In-process (the default) the rollout of a step ahead runs before the train step rather than beside it
(miles.colocated): the same versions and numbers as on Ray, no overlap, so step times compare only with ``--ray``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from miles.async_plan import predict

# both arms and the reference run this (it uses only what the synchronous loop's checkout has as well)
IN_PROCESS = """
import sys, torch
from miles import recipes
from miles.config import apply_overrides
from miles.driver import train_in_process
torch.set_num_threads(1)
train_in_process(apply_overrides(getattr(recipes, sys.argv[1])(), sys.argv[2:]))
"""

ASYNC_FREE = ("handoff.offload_train=none", "handoff.offload_rollout=false")  # both sides resident (async needs it)
TIMING = ("time/", "async/", "sync/", "mem/", "moved/", "tokens_per_s", "samples_per_s", "train_time", "engines/")


def run_arm(recipe: str, seed: int, overrides: list[str], root: Path | None, ray: bool, timeout: int) -> dict:
    """One run in a fresh run directory (kept under a temporary folder until the caller compares it)."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"miles-async-s{seed}-"))
    sets = [f"seed={seed}", f"run_dir={run_dir}", "overwrite=true", *overrides]
    if ray:
        cmd = [sys.executable, "-m", "miles.cli", "train", "--recipe", recipe, "--no-progress", "--set", *sets]
    else:
        cmd = [sys.executable, "-c", IN_PROCESS, recipe, *sets]
    env = os.environ | ({"PYTHONPATH": str(root)} if root else {})
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=root or None, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"seed {seed}: `{' '.join(cmd[:3])} ... {' '.join(sets)}` failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rl = [r for r in rows if "phase" not in r]
    return {
        "run_dir": str(run_dir),
        "wall_s": round(time.perf_counter() - t0, 1),
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "rows": rl,
    }


def summary(arm: dict) -> dict:
    rl = arm["rows"]
    first, last = (statistics.fmean(r["reward"] for r in part) for part in (rl[:3], rl[-3:]))
    out = {
        "reward_first3": round(first, 4),
        "reward_last3": round(last, 4),
        "gain": round(last - first, 4),
        "median_step_s": round(statistics.median(r["time/step"] for r in rl), 3),
        "median_rollout_s": round(statistics.median(r["time/rollout"] for r in rl), 3),
        "median_train_s": round(statistics.median(r["train_time"] for r in rl), 3),
        "rewards": [round(r["reward"], 4) for r in rl],
    }
    for key in ("async/staleness_mean", "async/staleness_max", "async/version_span_max", "async/wait_s"):
        if key in rl[0]:
            out[key.split("/")[1] + "_per_step"] = [round(r[key], 4) for r in rl]
    if "async/staleness_mean" in rl[0]:  # measured: each step's mean, and the p95 over steps (miles.async_plan)
        per_step = sorted(r["async/staleness_mean"] for r in rl)
        out["staleness_mean"] = round(statistics.fmean(per_step), 4)
        out["staleness_p95"] = per_step[max(0, -(-95 * len(per_step) // 100) - 1)]
    return out | {k: arm[k] for k in ("wall_s", "load_before", "load_after")}


def predicted(sync_rows: list[dict], arms: list[int], ray: bool) -> dict:
    """miles.async_plan's prediction of each async arm from the sync arm's measured medians: in one process the
    rollout ahead runs before the train step (no overlap: one core's worth); on Ray beside it, on the machine's
    cores."""
    rates = {
        "rollout_s": statistics.median(r["time/rollout"] for r in sync_rows),
        "train_s": statistics.median(r["train_time"] for r in sync_rows),
        "sync_s": statistics.median(r.get("sync/seconds", 0.0) for r in sync_rows),
    }
    cores = (os.cpu_count() or 1) if ray else 1
    out = {"rates": {k: round(v, 4) for k, v in rates.items()}, "shared_cores": cores}
    for k in arms:
        if k:
            p = predict(**rates, max_staleness=k, num_steps=len(sync_rows), shared_cores=cores)
            out[f"staleness_{k}"] = {
                "staleness_mean": p.staleness_mean,
                "staleness_p95": p.staleness_p95,
                "step_s": round(p.step_s, 3),
                "speedup": round(p.speedup, 3),
            }
    return out


def identical(a: dict, b: dict) -> dict:
    """Compare two run directories step by step: metrics (timings aside), rollout dump columns, checkpoints."""
    da, db = Path(a["run_dir"]), Path(b["run_dir"])
    differs: list[str] = []
    for ra, rb in zip(a["rows"], b["rows"], strict=True):
        keys = {k for k in ra.keys() & rb.keys() if not k.startswith(TIMING)}
        differs += [f"step {ra['step']} {k}" for k in sorted(keys) if ra[k] != rb[k]]
    columns = 0
    for step in sorted(p.name for p in (db / "rollouts").iterdir() if p.is_dir()):
        for f in sorted((db / "rollouts" / step).iterdir()):
            if f.name.endswith(("float32", "int32", "uint8", "uint32", "utf8")):
                other = da / "rollouts" / step / f.name
                columns += 1
                if not other.exists() or other.read_bytes() != f.read_bytes():
                    differs.append(f"{step}/{f.name}")
    weights = 0
    for ck in sorted((db / "checkpoints").glob("step_*")):
        weights += 1
        if _sha(ck / "model.safetensors") != _sha(da / "checkpoints" / ck.name / "model.safetensors"):
            differs.append(f"{ck.name}/model.safetensors")
    return {
        "identical": not differs,
        "differs": differs[:20],
        "steps": len(a["rows"]),
        "columns": columns,
        "checkpoints": weights,
    }


def _sha(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="miles bench async")
    ap.add_argument("--recipe", default="quickstart")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--staleness", type=int, default=2, help="the async arm's async.max_staleness")
    ap.add_argument("--arms", default=None, help="comma-separated staleness values (default 0 and --staleness)")
    ap.add_argument("--steps", type=int, default=None, help="num_steps (default: the recipe's)")
    ap.add_argument("--set", nargs="*", default=[], help="overrides for every arm (section.field=value)")
    ap.add_argument("--reference", default=None, help="another checkout: its loop against this one's staleness 0")
    ap.add_argument("--ray", action="store_true", help="through `miles train` (Ray) instead of in this process")
    ap.add_argument("--timeout", type=int, default=3600)
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = [int(k) for k in args.arms.split(",")] if args.arms else [0, args.staleness]
    free = list(ASYNC_FREE) if any(arms) else []  # staleness 0 alone: the recipe's handoff as it is
    common = [*free, *args.set] + ([f"num_steps={args.steps}"] if args.steps else [])
    out: dict = {"recipe": args.recipe, "overrides": common, "mode": "ray" if args.ray else "in-process", "seeds": {}}
    for seed in seeds:
        per = {}
        for k in arms:
            per[k] = run_arm(args.recipe, seed, [*common, f"async.max_staleness={k}"], None, args.ray, args.timeout)
        entry = {f"staleness_{k}": summary(per[k]) for k in arms}
        if args.reference:
            ref = run_arm(args.recipe, seed, common, Path(args.reference), args.ray, args.timeout)
            entry["reference"] = summary(ref)
            entry["staleness_0_vs_reference"] = identical(per[0], ref)
        if 0 in per and len(arms) > 1:
            entry["predicted"] = predicted(per[0]["rows"], arms, args.ray)
        if 0 in per and len(arms) > 1 and "time/step" in per[0]["rows"][0]:
            entry["step_time_ratio"] = {
                f"staleness_{k}": round(
                    entry[f"staleness_{k}"]["median_step_s"] / entry["staleness_0"]["median_step_s"], 3
                )
                for k in arms
                if k
            }
        out["seeds"][seed] = entry
        for arm in [*per.values(), *([ref] if args.reference else [])]:
            shutil.rmtree(arm["run_dir"], ignore_errors=True)
    return out
