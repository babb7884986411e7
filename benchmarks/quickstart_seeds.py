"""``miles bench quickstart-seeds``: does the README's main job learn with margin whatever the seed?

Runs ``miles train --recipe quickstart --set seed=S`` as a user would (a fresh subprocess, a fresh run directory,
Ray started and stopped), one seed after the other so the runs never share the cores, and records per seed the
mean reward of the first 3 and last 3 RL steps, the gain, the whole command's wall time, the load average before
and after (the machine may be shared: wall time counts only with the load next to it), the CPU seconds of the
command and the processes it waited for (Ray's actors included), and the median
train/inference mismatch. The bar (issue 22): gain >= 0.3 for every seed, median gain >= 0.4, under 2 minutes.

    miles bench quickstart-seeds --json                       # seeds 0-4
    miles bench quickstart-seeds --seeds 0,1 --set trainer.lr=2e-3
    miles bench quickstart-seeds --recipe quickstart_lora --seeds 0,1,2 --in-process   # LoRA rank 4
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def run_seed(
    seed: int,
    overrides: list[str],
    timeout: int,
    in_process: bool = False,
    attempts: int = 3,
    recipe: str = "quickstart",
) -> dict:
    for attempt in range(attempts):
        try:
            return _run_seed(seed, overrides, timeout, in_process, recipe)
        except RayStartTimeout:  # Ray's fixed 30 s node-registration wait, on a loaded machine; the run is not at fault
            if attempt == attempts - 1:
                raise


class RayStartTimeout(RuntimeError):
    pass


def _run_seed(seed: int, overrides: list[str], timeout: int, in_process: bool, recipe: str) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"miles-qs-seed{seed}-") as tmp:
        run_dir = Path(tmp) / "run"
        if in_process:
            run_dir.mkdir()
            cmd = [sys.executable, "-m", "benchmarks.quickstart_seeds", "--in-process-seed", str(seed), str(run_dir)]
            cmd += ["--recipe", recipe, *overrides]
        else:
            cmd = [sys.executable, "-m", "miles.cli", "train", "--recipe", recipe, "--no-progress", "--set"]
            cmd += [f"seed={seed}", f"run_dir={run_dir}", "resume=false", *overrides]
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        err = Path(tmp) / "stderr"
        with open(err, "w") as f:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f)
            status, usage = wait_child(proc, timeout)
        wall = time.perf_counter() - t0
        if status:
            text = err.read_text()
            if "timed out during startup" in text:
                raise RayStartTimeout(text[-500:])
            raise RuntimeError(f"seed {seed}: `{' '.join(cmd)}` failed:\n{text[-3000:]}")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rl = [r for r in rows if r.get("phase") != "sft"]
    first = statistics.fmean(r["reward"] for r in rl[:3])
    last = statistics.fmean(r["reward"] for r in rl[-3:])
    return {
        "seed": seed,
        "reward_first3": round(first, 4),
        "reward_last3": round(last, 4),
        "gain": round(last - first, 4),
        "wall_s": round(wall, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),  # the command and every process it waited for
        "median_rl_step_s": round(statistics.median(r["time/step"] for r in rl), 3),
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "mismatch_abs_diff_median": statistics.median(r["train_rollout_logprob_abs_diff"] for r in rl),
        "mismatch_kl_median": statistics.median(r["train_rollout_kl"] for r in rl),
        "rewards": [round(r["reward"], 4) for r in rl],
    }


def in_process_rewards(seed: int, overrides: list[str], recipe: str = "quickstart") -> list[dict]:
    """The quickstart's RL loop without Ray (``--in-process``, for a machine where Ray cannot start in its fixed
    30 s): the same RolloutManager and TorchBackend calls as the driver (warm-up, sync, generate, train_step with
    the step, sync), one torch thread, no handoff (it moves memory, not numbers)."""
    import torch

    from miles.config import apply_overrides
    from miles.policy.objective import resolved_trainer
    from miles.recipes import get_recipe
    from miles.rollout.manager import RolloutManager
    from miles.sources import make_sources
    from miles.train.torch_backend import TorchBackend

    torch.set_num_threads(1)
    cfg = apply_overrides(get_recipe(recipe), [f"seed={seed}", *overrides])
    manager = RolloutManager(cfg, sources=make_sources)
    trainer = TorchBackend(
        cfg.model, resolved_trainer(cfg), seed=seed, temperature=cfg.rollout.temperature, offload_policy="none"
    )

    def sync(version: int) -> None:
        weights = list(trainer.weights_to_sync())  # with model.lora.warmup = base: the warmed-up base once
        for engine in manager.engines:
            engine.update_weights_from_tensor(weights, version)
        trainer.weights_synced()

    trainer.set_lr(cfg.trainer.warmup_sft_lr)
    for i in range(cfg.trainer.warmup_sft_steps):
        trainer.sft_step(manager.sft_batches(i)[0])
    trainer.end_warmup()  # with model.lora.warmup = base: the base it trained is frozen (else nothing)
    trainer.set_lr(cfg.trainer.lr)
    sync(0)
    rows = []
    for step in range(cfg.num_steps):
        t0 = time.perf_counter()
        batches, metrics = manager.generate(step)
        metrics |= trainer.train_step(batches[0], step=step)
        sync(step + 1)
        rows.append(metrics | {"time/step": time.perf_counter() - t0})
    return rows


def wait_child(proc: subprocess.Popen, timeout: int, what: str = "`miles train`"):
    """(exit status, rusage) of ``proc`` once it ends (its own CPU seconds, not this process's), or kill it and raise
    a TimeoutError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            return status, usage
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{what} ran past {timeout} s (--timeout)")


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="miles bench quickstart-seeds")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds")
    ap.add_argument("--set", nargs="*", default=[], help="extra overrides for every run (section.field=value)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds allowed per run")
    ap.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="runs at a time (default 1: one after the other, so wall times are comparable; more shares the cores)",
    )
    ap.add_argument("--in-process", action="store_true", help="the loop without Ray (see in_process_rewards)")
    ap.add_argument("--recipe", default="quickstart", help="the recipe every run starts from (e.g. quickstart_lora)")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    with ThreadPoolExecutor(args.parallel) as pool:
        runs = list(pool.map(lambda s: run_seed(s, args.set, args.timeout, args.in_process, recipe=args.recipe), seeds))
    gains = [r["gain"] for r in runs]
    return {
        "recipe": args.recipe,
        "overrides": args.set,
        "parallel": args.parallel,
        "mode": "in-process (no Ray, 1 torch thread)" if args.in_process else "miles train (Ray)",
        "runs": runs,
        "summary": {
            "min_gain": min(gains),
            "median_gain": statistics.median(gains),
            "max_wall_s": max(r["wall_s"] for r in runs),
            "passes_bar": min(gains) >= 0.3 and statistics.median(gains) >= 0.4,
        },
    }


if (
    __name__ == "__main__"
):  # one in-process seed: python -m benchmarks.quickstart_seeds --in-process-seed S DIR [--recipe R] [overrides]
    _, flag, seed_arg, out_dir, *extra = sys.argv
    assert flag == "--in-process-seed"
    name = "quickstart"
    if extra[:1] == ["--recipe"]:
        name, extra = extra[1], extra[2:]
    with open(Path(out_dir) / "metrics.jsonl", "w") as out:
        for row in in_process_rewards(int(seed_arg), extra, name):
            out.write(json.dumps(row) + "\n")
