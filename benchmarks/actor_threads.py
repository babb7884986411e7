"""``miles bench actor-threads``: seconds per ``RolloutManager.generate`` in a Ray actor, by where its torch work runs.

Variants of the same actor, one at a time (the others killed), alternating over ``--rounds``, in one run. Between
timed calls each actor answers ``named_weights`` (a torch copy on Ray's task thread, as a weight sync does in the
RL loop), so a variant whose hot work runs on another thread has two OpenMP teams, as it would in the loop:

    threaded        max_concurrency=4, no compute thread: each call on whichever pool thread is free
    hot-only        max_concurrency=4, generate on a dedicated thread, the model built on another
    built-and-run   max_concurrency=4, built and run on one dedicated thread (miles' threaded actors, rdt)
    compute-1       max_concurrency=1, built and run on a dedicated thread, Ray's thread doing the rest
    single          max_concurrency=1, everything on Ray's one thread (miles' actors: miles/threads.py)

plus the same ``generate`` in this process (no actor) for reference. Median and fastest call per variant. First,
the mechanism on its own: a 32x256 @ 256x768 matmul in a single-threaded actor on Ray's thread, then on a second
thread of the same actor, then on Ray's thread again (``openmp_teams_matmul``, microseconds).

    miles bench actor-threads --json                       # the trl_parity rollout (32 x 32 tokens)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from miles.config import apply_overrides
from miles.recipes import get_recipe
from miles.rollout.manager import RolloutManager
from miles.sources import make_sources
from miles.threads import COMPUTE_THREAD_ENV, ComputeThread


class _Threaded(RolloutManager):
    def __init__(self, *args, **kwargs):
        RolloutManager.__init__.__wrapped__(self, *args, **kwargs)  # built on the thread Ray constructs the actor on
        self.compute = None  # calls run on Ray's task threads


class _HotOnly(_Threaded):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.compute = ComputeThread("hot-only")  # generate hops to this one


# name -> (class, max_concurrency, compute thread flag in the actor's environment)
VARIANTS = {
    "threaded": (_Threaded, 4, False),
    "hot-only": (_HotOnly, 4, False),
    "built-and-run": (RolloutManager, 4, True),
    "compute-1": (RolloutManager, 1, True),
    "single": (RolloutManager, 1, False),
}


def _matmul_us(n: int = 2000) -> float:
    """A decode-step-sized matmul (32x256 @ 256x768), microseconds, on the calling thread."""
    a, w = torch.randn(32, 256), torch.randn(256, 768)
    for _ in range(10):
        a @ w
    t0 = time.perf_counter()
    for _ in range(n):
        a @ w
    return (time.perf_counter() - t0) / n * 1e6


class _Teams:
    """One actor: a matmul on Ray's thread, then on a second thread, then on Ray's thread again."""

    def on_ray_thread(self) -> float:
        return _matmul_us()

    def on_second_thread(self) -> float:
        from concurrent.futures import ThreadPoolExecutor

        self.pool = getattr(self, "pool", None) or ThreadPoolExecutor(1)
        return self.pool.submit(_matmul_us).result()


def openmp_teams(ray) -> dict:
    """Matmul microseconds in a single-threaded actor before and after a second thread of it has used torch."""
    a = ray.remote(_Teams).options(num_cpus=0, max_concurrency=1).remote()
    out = {
        "ray_thread_alone_us": statistics.median(ray.get(a.on_ray_thread.remote()) for _ in range(3)),
        "second_thread_us": statistics.median(ray.get(a.on_second_thread.remote()) for _ in range(3)),
        "ray_thread_after_us": statistics.median(ray.get(a.on_ray_thread.remote()) for _ in range(3)),
    }
    ray.kill(a)
    return out


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="miles bench actor-threads")
    ap.add_argument("--json", action="store_true", help="accepted for the CLI; the result is always JSON")
    ap.add_argument("--recipe", default="trl_parity")
    ap.add_argument("--calls", type=int, default=6, help="measured calls per variant per round")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    import os

    import ray

    from miles.cluster import start_ray

    cfg = apply_overrides(get_recipe(args.recipe), ["run_dir=/tmp/miles-bench-actor-threads"])
    threads = cfg.num_threads or os.cpu_count() or 1
    owns = not ray.is_initialized()
    if owns:
        start_ray(num_cpus=max(2, os.cpu_count() or 1), threads=threads)
    times: dict[str, list[float]] = {k: [] for k in [*VARIANTS, "in-process"]}
    try:
        teams = openmp_teams(ray)
        for _ in range(args.rounds):
            for name, (cls, concurrency, flag) in VARIANTS.items():
                env = {"runtime_env": {"env_vars": {COMPUTE_THREAD_ENV: "1"}}} if flag else {}
                actor = (
                    ray.remote(cls)
                    .options(num_cpus=0, max_concurrency=concurrency, **env)
                    .remote(cfg, "cpu", sources=make_sources)
                )
                for step in range(2):  # warm-up
                    ray.get(actor.generate.remote(step))
                    ray.get(actor.named_weights.remote())
                for step in range(2, 2 + args.calls):
                    t0 = time.perf_counter()
                    ray.get(actor.generate.remote(step))
                    times[name].append(time.perf_counter() - t0)
                    ray.get(actor.named_weights.remote())  # Ray's task thread touches torch, as a sync does
                ray.kill(actor)
                time.sleep(1.0)  # let the killed process go before the next variant starts
            local = RolloutManager(cfg, "cpu", sources=make_sources)
            for step in range(2 + args.calls):
                t0 = time.perf_counter()
                local.generate(step)
                local.named_weights()
                if step >= 2:
                    times["in-process"].append(time.perf_counter() - t0)
            del local
    finally:
        if owns:
            ray.shutdown()
    out = {
        "recipe": args.recipe,
        "completions_per_call": cfg.rollout.num_prompts_per_step * cfg.rollout.n_samples_per_prompt,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "torch_threads": threads,
        "openmp_teams_matmul": teams,
        "variants": {k: {"median_s": statistics.median(v), "min_s": min(v), "calls": len(v)} for k, v in times.items()},
    }
    base = out["variants"]["single"]["median_s"]
    out["over_single"] = {k: v["median_s"] / base for k, v in out["variants"].items()}
    return out
