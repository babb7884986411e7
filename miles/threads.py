"""One thread for an actor's torch work, the thread that built its model.

Where an actor's torch work runs changes its speed on a small CPU (``miles bench actor-threads``, 2-core VM,
``RolloutManager.generate`` of the trl_parity rollout, medians of 20 calls, variants alternating in one run):

    4 pool threads, each call on whichever is free                        0.343 s
    4 pool threads, generate on a dedicated thread, model built elsewhere 0.313 s
    4 pool threads, built and run on one dedicated thread                 0.246 s
    1 pool thread, built and run on a dedicated thread (miles)            0.203 s
    the same call in-process                                              0.200 s

torch's CPU kernels use OpenMP, which keeps a team of workers per calling thread, and glibc keeps a malloc arena
per thread; idle pool threads of a threaded Ray actor still cost. (``OMP_WAIT_POLICY=PASSIVE``, tried once by
hand, slowed every kernel instead.) So the actors run with ``max_concurrency=1`` where they can (the rdt transport needs
a second slot on both sides) and build themselves on a ComputeThread that also runs their hot methods: with a
second slot, the other thread stays free for the calls that must be answered while a hot call runs (transport
self-calls, a receive's transfer).

    class RolloutManager:
        @init_on_compute_thread("rollout-compute")
        def __init__(self, ...): ...

        @on_compute_thread
        def generate(self, step): ...

In-process (a notebook's Colocated, a test) there is no pool to hop between and a second thread would only add
a second OpenMP team next to the caller's: outside a Ray actor both decorators run the method inline.

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


def actor_compute_thread(name: str = "compute") -> ComputeThread | None:
    """A ComputeThread when called inside a Ray actor, else None (marked methods then run inline)."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        return ComputeThread(name) if ray.get_runtime_context().get_actor_id() else None
    except Exception:  # not a worker context
        return None


def init_on_compute_thread(name: str):
    """Decorate ``__init__``: inside a Ray actor, create ``self.compute`` and run the constructor on it."""

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
