"""One thread for an actor's torch work: one OpenMP team per process.

torch's CPU kernels use OpenMP, and OpenMP keeps a team of worker threads per calling thread. While a process
has one team, its idle workers spin and the next kernel starts at once; once a second thread has run a parallel
kernel, libgomp sees more workers than cores and puts idle workers to sleep, so every kernel pays a wake-up,
on either thread, for the life of the process (``miles bench actor-threads`` measures it: ``openmp_teams_matmul``;
figures in BENCHMARKS.md).

So an actor's torch work stays on one thread:

- ``max_concurrency=1`` (the default for miles' actors): Ray runs the constructor and every call on the
  worker's main thread, which is the one thread; nothing hops. ``actor_options(1)``.
- ``max_concurrency > 1`` (the rdt transport needs a second slot on both sides: transfers and self-calls run
  while a hot call waits): calls arrive on Ray's pool threads, so the constructor and the hot methods run on a
  ComputeThread instead. ``actor_options(n)`` marks the actor for that through its environment.

The contract: a single-threaded actor's torch work runs as fast as the same work in-process, and a compute
thread costs less than hopping between Ray's pool threads. ``miles bench actor-threads`` compares the variants
side by side (the trl_parity rollout's ``generate``; BENCHMARKS.md, benchmarks/results/actor-threads.cpu.json).

    class RolloutManager:
        @init_on_compute_thread("rollout-compute")
        def __init__(self, ...): ...

        @on_compute_thread
        def generate(self, step): ...

    ray.remote(RolloutManager).options(**actor_options(max_concurrency=2), ...)

In-process (a notebook's Colocated, a test) both decorators run the method inline.

Only methods that never wait for another call of the same actor may be marked: a marked method that blocks until
a second marked call runs would wait forever (the second call queues behind it). A marked method called from the
compute thread itself (one marked method calling another) runs inline.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import torch


class ComputeThread:
    """A single worker thread; it adopts the creating thread's CUDA device (the current device is per thread)."""

    def __init__(self, name: str = "compute"):
        device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name, initializer=self._enter, initargs=(device,))

    def _enter(self, device) -> None:
        self._local.inside = True
        if device is not None:
            torch.cuda.set_device(device)

    def run(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the compute thread; its exception is raised here."""
        if getattr(self._local, "inside", False):
            return fn(*args, **kwargs)
        return self._pool.submit(fn, *args, **kwargs).result()


COMPUTE_THREAD_ENV = "MILES_COMPUTE_THREAD"  # "1" in the environment of an actor created with max_concurrency > 1


def actor_options(max_concurrency: int = 1, env_vars: dict | None = None) -> dict:
    """Ray actor options for a class with marked methods: ``max_concurrency`` and, above 1, the environment flag
    that gives it a ComputeThread (merged into ``env_vars``, which are the actor's own, e.g. LOCAL_RANK)."""
    env = dict(env_vars or {})
    if max_concurrency > 1:
        env[COMPUTE_THREAD_ENV] = "1"
    return {"max_concurrency": max_concurrency, **({"runtime_env": {"env_vars": env}} if env else {})}


def actor_compute_thread(name: str = "compute") -> ComputeThread | None:
    """A ComputeThread inside a Ray actor created with ``actor_options(n > 1)``, else None (marked methods run
    inline: in a single-threaded actor that is Ray's one thread)."""
    import os
    import sys

    ray = sys.modules.get("ray")
    if os.environ.get(COMPUTE_THREAD_ENV) != "1" or ray is None or not ray.is_initialized():
        return None
    try:
        return ComputeThread(name) if ray.get_runtime_context().get_actor_id() else None
    except Exception:  # not a worker context
        return None


def init_on_compute_thread(name: str):
    """Decorate ``__init__``: inside a threaded actor, create ``self.compute`` and run the constructor on it."""

    def wrap(init):
        @functools.wraps(init)
        def run(self, *args, **kwargs):
            self.compute = actor_compute_thread(name)
            if self.compute is None:
                return init(self, *args, **kwargs)
            return self.compute.run(init, self, *args, **kwargs)

        return run

    return wrap


def on_compute_thread(method):
    """Run ``method`` on ``self.compute`` (a ComputeThread); inline where the object has none."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        compute = getattr(self, "compute", None)
        if compute is None:
            return method(self, *args, **kwargs)
        return compute.run(method, self, *args, **kwargs)

    return run
