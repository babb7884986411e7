"""``miles bench tools-seeds``: does the quickstart tool run (recipe ``quickstart_tools``) learn whatever the seed?

Runs the recipe through ``driver.train`` in a fresh child process per seed (one after the other, so the runs never
share the cores) and records per seed the train episodes' return, pass rate and tool calls per episode over the
first and last 5 RL steps, the held-out figures before RL and after the last step (greedy pass@1, pass@2 and
mean@2 of the episodes' return, tool calls per episode; a return of 1 is a right answer), the whole run's wall and CPU seconds and the load average before and after (the machine may be shared). ``--no-tools`` adds
the same runs with ``env.args`` ``tools: false`` (the same budget and seeds, the tool taken away).

    miles bench tools-seeds --json                          # seeds 0,1,2
    miles bench tools-seeds --seeds 0 --no-tools --set num_steps=20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.quickstart_seeds import wait_child

K = 5  # RL steps averaged at each end


def run_seed(seed: int, overrides: list[str], timeout: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"miles-tools-seed{seed}-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "benchmarks.tools_seeds", "--one", str(run_dir), f"seed={seed}", *overrides]
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        with open(Path(tmp) / "stderr", "w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
            status, usage = wait_child(proc, timeout, "a quickstart_tools run")
        wall = time.perf_counter() - t0
        if status:
            raise RuntimeError(f"seed {seed}: `{' '.join(cmd)}` failed:\n{(Path(tmp) / 'stderr').read_text()[-3000:]}")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {
        "seed": seed,
        **figures(rows),
        "wall_s": round(wall, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }


def figures(rows: list[dict]) -> dict:
    """First/last-K means of the train episodes and the first/last held-out evaluation of one run's metrics."""
    rl = [r for r in rows if "phase" not in r]
    evals = [r for r in rows if r.get("phase") == "eval"]
    sft = [r["sft_loss"] for r in rows if r.get("phase") == "sft"]
    out = {"rl_steps": len(rl), "sft_steps": len(sft), "sft_loss_last": round(sft[-1], 4) if sft else None}
    for name, key in (("return", "reward"), ("pass_rate", "env/pass_rate"), ("tool_calls", "env/tool_calls")):
        first = statistics.fmean(r[key] for r in rl[:K])
        last = statistics.fmean(r[key] for r in rl[-K:])
        out |= {f"{name}_first{K}": round(first, 4), f"{name}_last{K}": round(last, 4)}
    out["gain"] = round(out[f"return_last{K}"] - out[f"return_first{K}"], 4)
    for when, e in (("before", evals[:1]), ("after", evals[-1:] if len(evals) > 1 else [])):
        for key in ("greedy_pass@1", "mean@2", "pass@2", "tool_calls"):
            if e and f"eval/all/{key}" in e[0]:
                out[f"heldout_{key}_{when}"] = round(e[0][f"eval/all/{key}"], 4)
    out["returns"] = [round(r["reward"], 4) for r in rl]
    out["tool_calls"] = [round(r["env/tool_calls"], 3) for r in rl]
    return out


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="miles bench tools-seeds")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--set", nargs="*", default=[], help="extra overrides for every run (section.field=value)")
    ap.add_argument("--no-tools", action="store_true", help="also run each seed with the tool taken away")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds allowed per run")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    variants = {"tools": []}
    if args.no_tools:
        variants["no_tools"] = ['env.args={"describe": false, "partial_credit": true, "tools": false}']
    out: dict = {"recipe": "quickstart_tools", "overrides": args.set, "num_threads": 1}
    for name, extra in variants.items():
        runs = [run_seed(s, ["num_threads=1", *args.set, *extra], args.timeout) for s in seeds]
        out[name] = {"runs": runs, "min_gain": min(r["gain"] for r in runs)}
    return out


if __name__ == "__main__":  # one run: python -m benchmarks.tools_seeds --one RUN_DIR [overrides]
    _, flag, run_dir, *overrides = sys.argv
    assert flag == "--one"
    from miles.config import apply_overrides
    from miles.driver import train_in_process
    from miles.recipes import quickstart_tools

    train_in_process(apply_overrides(quickstart_tools(), [f"run_dir={run_dir}", *overrides]))
