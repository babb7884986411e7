"""A reward worker process: ``python -m miles.reward.worker FD PARENT_PID MEMORY_BYTES [SPEC ...]``, started and
killed by miles.reward.pool.RewardPool, never by hand.

It talks over the socket ``FD`` (multiprocessing Connection frames): it says ``("hello", pid)`` once the SPECs are
loaded, then for each chunk of calls it receives runs them in order and answers one message per call:
``("done", value, seconds)`` or ``("fail", error, seconds, traceback)``. Before the first call of a function it has
not loaded it says ``("load", spec)`` and, once loaded, ``("go",)``: loading (imports, and the function's optional
``warm_up()``) is outside the per-call time limit, which the pool counts from the last message.

It dies with its parent (PR_SET_PDEATHSIG on Linux, and a thread that watches the parent pid), ignores Ctrl-C
(the run stops it), and caps its data segment at MEMORY_BYTES so that a number the size of ``10^{10^{10}}`` fails
with MemoryError instead of taking the machine's memory.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection


def load(spec: str):
    """The function named by 'module:function' (a worker imports what the parent checked already)."""
    module, _, name = spec.partition(":")
    fn = getattr(importlib.import_module(module), name)
    warm_up = getattr(fn, "warm_up", None)
    if callable(warm_up):
        warm_up()
    return fn


def serve(conn: Connection, preload: list[str]) -> None:
    fns, broken = {}, {}

    def ensure(spec: str, announce: bool) -> None:
        if spec in fns or spec in broken:
            return
        if announce:
            conn.send(("load", spec))
        try:
            fns[spec] = load(spec)
        except Exception as e:
            broken[spec] = f"cannot load {spec}: {type(e).__name__}: {e}"
        if announce:
            conn.send(("go",))

    for spec in preload:
        ensure(spec, announce=False)
    conn.send(("hello", os.getpid()))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        for spec, args in chunk:
            ensure(spec, announce=True)
            if spec in broken:
                conn.send(("fail", broken[spec], 0.0, ""))
                continue
            t0 = time.perf_counter()
            try:
                out = fns[spec](*args)
            except Exception as e:
                tb = "".join(traceback.format_exception(e)[-6:])
                conn.send(("fail", f"{type(e).__name__}: {e}"[:2000], time.perf_counter() - t0, tb[-8000:]))
                continue
            seconds = time.perf_counter() - t0
            try:
                value = float(out)
            except (TypeError, ValueError, OverflowError):
                conn.send(("fail", f"returned {out!r:.200}, not a number", seconds, ""))
                continue
            conn.send(("done", value, seconds))


def die_with_parent(parent_pid: int) -> None:
    """Exit when the process that started this one is gone, even while a call runs (a hung call holds the GIL
    only until the kernel's signal: PR_SET_PDEATHSIG; the thread covers the other platforms)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(0)

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def main(argv: list[str]) -> None:
    fd, parent_pid, memory_bytes, preload = int(argv[0]), int(argv[1]), int(argv[2]), argv[3:]
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory_bytes > 0:
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (memory_bytes, memory_bytes))
    try:
        serve(Connection(fd), preload)
    except OSError:  # the pool closed its end (close, or it was replaced) while this one spoke: nothing to say
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
