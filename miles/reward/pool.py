"""RewardPool: worker processes that run reward calls under a wall-clock limit per call. A worker past the limit
is killed (SIGKILL: a regex or a big-integer power holds the GIL, nothing softer stops it) and replaced; a
worker that dies is replaced; the workers never outlive the pool (``close``, interpreter exit, garbage
collection, and the kernel when this process dies: miles.reward.worker).

    pool = RewardPool(num_workers=2, timeout_s=5.0)
    results = pool.run([Call("my_rewards:score", (prompt, response, target)), ...])   # one CallResult each, in order
    results[0]          # CallResult(value=1.0, seconds=0.002), or error=..., timed_out=True
    pool.close()

Calls travel in chunks (one message per chunk, one small answer per call), so the round trips cost microseconds
per call; the limit of a call counts from the worker's previous answer, and a worker's imports and a function's
``warm_up()`` are outside it. Workers start on the first ``run`` that needs them. Not thread-safe beyond a lock:
one ``run`` at a time.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait

from miles.protocols.reward import Call, CallResult
from miles.stall import heartbeat

MAX_FAILED_STARTS = 3


class RewardPoolError(RuntimeError):
    """The reward workers cannot start at all (not a reward's fault: the environment's)."""


class _Worker:
    """One worker process and what it was sent: ``todo`` holds the indices of the calls it has not answered, in
    order; ``since`` is when the current wait began (the start, a load, or the call at ``todo[0]``)."""

    def __init__(self, proc: subprocess.Popen, conn: Connection):
        self.proc, self.conn = proc, conn
        self.ready = False
        self.loading = ""
        self.todo: list[int] = []
        self.since = time.monotonic()


class RewardPool:
    def __init__(
        self,
        num_workers: int,
        timeout_s: float,
        *,
        memory_bytes: int = 0,
        startup_timeout_s: float = 120.0,
        load_timeout_s: float | None = None,
        max_chunk: int = 64,
    ):
        if num_workers < 1 or not timeout_s > 0:
            raise ValueError(f"RewardPool needs num_workers >= 1 and timeout_s > 0; got {num_workers}, {timeout_s}")
        self.num_workers, self.timeout_s, self.memory_bytes = num_workers, timeout_s, memory_bytes
        self.startup_timeout_s = startup_timeout_s
        self.load_timeout_s = load_timeout_s if load_timeout_s is not None else max(120.0, 10 * timeout_s)
        self.max_chunk = max_chunk
        self.workers: list[_Worker] = []
        self.loaded: list[str] = []  # functions called so far: a new worker loads them before it says hello
        self.broken: dict[str, str] = {}  # functions whose loading hung: their calls fail at once
        self.failed_starts = 0
        self.num_killed = 0  # workers killed for a timeout (a figure for tests and benchmarks)
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _kill_all, self._procs)

    # ---- the caller's side ----------------------------------------------------------------------------------
    def run(self, calls: list[Call]) -> list[CallResult]:
        """Each call's result, in the order of ``calls``; blocks until every one returned, failed or timed out."""
        results: list[CallResult | None] = [None] * len(calls)
        size = max(1, min(self.max_chunk, -(-len(calls) // (4 * self.num_workers))))
        queue = deque(list(range(i, min(i + size, len(calls)))) for i in range(0, len(calls), size))
        with self._lock:
            try:
                while queue or any(w.todo for w in self.workers):
                    self._fill()
                    for w in self.workers:
                        if w.ready and not w.todo and queue:
                            self._send(w, queue.popleft(), calls, results, queue)
                    self._step(calls, results, queue)
            except BaseException:  # Ctrl-C, or workers that cannot start: none keeps working on these calls
                for w in [w for w in self.workers if w.todo]:
                    w.todo = []
                    self._kill(w)
                raise
        return results

    def start(self, calls: list[str]) -> None:
        """Start the workers now, each loading ``calls`` ('module:function') before it is ready, instead of at the
        first ``run`` that needs them: a run starts its pool with the rollout, so the imports are no step's."""
        if not calls:
            return
        with self._lock:
            self.loaded += [c for c in calls if c not in self.loaded]
            self._fill()

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def close(self) -> None:
        """Stop every worker (end of input, then SIGKILL after a second) and reap it."""
        with self._lock:
            for w in self.workers:
                w.conn.close()
            end = time.monotonic() + 1.0
            for w in self.workers:
                try:
                    w.proc.wait(timeout=max(0.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    w.proc.kill()
                    w.proc.wait()
            self.workers.clear()
            self._procs.clear()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the loop -------------------------------------------------------------------------------------------
    def _step(self, calls, results, queue) -> None:
        """Wait for the next answer or the nearest deadline, handle what came, then what expired."""
        busy = [w for w in self.workers if not w.ready or w.todo]
        if not busy:
            return
        by_conn = {w.conn: w for w in busy}
        timeout = max(0.0, min(self._deadline(w) for w in busy) - time.monotonic())
        for conn in wait(list(by_conn), timeout=timeout):  # what already came first: a hello sent long ago counts
            self._read(by_conn[conn], calls, results, queue)
        now = time.monotonic()
        for w in busy:
            if w in self.workers and (w.todo or not w.ready) and self._deadline(w) <= now:
                self._expire(w, calls, results, queue, now)

    def _deadline(self, w: _Worker) -> float:
        if not w.ready:
            return w.since + self.startup_timeout_s
        return w.since + (self.load_timeout_s if w.loading else self.timeout_s)

    def _send(self, w: _Worker, chunk: list[int], calls, results, queue) -> None:
        for i in [i for i in chunk if calls[i].call in self.broken]:
            results[i] = CallResult(error=self.broken[calls[i].call])
        chunk = [i for i in chunk if calls[i].call not in self.broken]
        if not chunk:
            return
        for i in chunk:
            if calls[i].call not in self.loaded:
                self.loaded.append(calls[i].call)
        w.todo, w.since = chunk, time.monotonic()
        try:
            w.conn.send([(calls[i].call, calls[i].args) for i in chunk])
        except OSError:  # it died since its last answer: nothing of the chunk ran
            queue.appendleft(w.todo)
            w.todo = []
            self._remove(w)

    def _read(self, w: _Worker, calls, results, queue) -> None:
        while True:
            try:
                msg = w.conn.recv()
            except (EOFError, OSError):
                self._died(w, results, queue)
                return
            now = time.monotonic()
            kind = msg[0]
            if kind == "hello":
                w.ready, self.failed_starts = True, 0
            elif kind == "load":
                w.loading = msg[1]
            elif kind == "go":
                w.loading = ""
            elif kind == "done":
                results[w.todo.pop(0)] = CallResult(value=msg[1], seconds=msg[2])
            else:  # "fail"
                results[w.todo.pop(0)] = CallResult(error=msg[1], seconds=msg[2], traceback=msg[3])
            w.since = now
            heartbeat.beat()  # a reward call done, a worker ready: progress (miles.stall.watchdog)
            if not w.conn.poll():
                return

    def _expire(self, w: _Worker, calls, results, queue, now: float) -> None:
        if not w.ready:
            self._kill(w)
            self._start_failed(f"it did not start within {self.startup_timeout_s:g} s")
            return
        if w.loading:
            spec = w.loading
            self.broken[spec] = f"loading {spec} in a reward worker took more than {self.load_timeout_s:g} s"
            for i in [i for i in w.todo if calls[i].call == spec]:
                results[i] = CallResult(error=self.broken[spec])
            rest = [i for i in w.todo if calls[i].call != spec]
        else:
            i = w.todo[0]
            results[i] = CallResult(
                error=f"took more than {self.timeout_s:g} s (data.reward_timeout_s); its worker was killed",
                timed_out=True,
                seconds=now - w.since,
            )
            rest = w.todo[1:]
            self.num_killed += 1
        if rest:
            queue.appendleft(rest)
        w.todo = []
        self._kill(w)
        self._fill()  # the replacement starts (and loads) while the others work

    def _died(self, w: _Worker, results, queue) -> None:
        try:
            code = w.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # it closed its end but lingers
            w.proc.kill()
            code = w.proc.wait()
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        self._remove(w)
        if not w.ready:
            self._start_failed(f"it exited ({how}) before it started; its stderr is above")
            return
        if w.todo:
            results[w.todo[0]] = CallResult(error=f"the reward worker died ({how}) while running it")
            if w.todo[1:]:
                queue.appendleft(w.todo[1:])
        w.todo = []
        self._fill()

    def _start_failed(self, why: str) -> None:
        self.failed_starts += 1
        if self.failed_starts >= MAX_FAILED_STARTS:
            raise RewardPoolError(
                f"reward worker processes fail to start ({self.failed_starts} in a row; last: {why}); check that "
                f"'{sys.executable} -m miles.reward.worker' can import miles (PYTHONPATH) and the reward modules "
                f"{self.loaded}"
            )

    # ---- processes ------------------------------------------------------------------------------------------
    def _fill(self) -> None:
        while len(self.workers) < self.num_workers:
            ours, theirs = socket.socketpair()
            with theirs:
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "miles.reward.worker",
                        str(theirs.fileno()),
                        str(os.getpid()),
                        str(self.memory_bytes),
                        *self.loaded,
                    ],  # fmt: skip
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                    env=dict(os.environ, PYTHONPATH=import_path()),
                )
            self._procs.append(proc)
            self.workers.append(_Worker(proc, Connection(ours.detach())))

    def _kill(self, w: _Worker) -> None:
        try:
            w.proc.kill()
        except ProcessLookupError:
            pass
        w.proc.wait()
        self._remove(w)

    def _remove(self, w: _Worker) -> None:
        w.conn.close()
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()
        if w in self.workers:
            self.workers.remove(w)
        if w.proc in self._procs:
            self._procs.remove(w.proc)


def _kill_all(procs: list[subprocess.Popen]) -> None:
    """The finalizer: a pool dropped or left open at exit kills its workers."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def import_path() -> str:
    """This process's own import roots (the working directory, a test or user folder) ahead of PYTHONPATH, so that
    a worker imports 'module:function' and miles itself as this process does."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    roots = []
    for p in sys.path:
        p = os.path.realpath(p or os.getcwd())
        if os.path.isdir(p) and not any(p == x or p.startswith(x + os.sep) for x in prefixes) and p not in roots:
            roots.append(p)
    extra = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(roots + ([extra] if extra else []))
