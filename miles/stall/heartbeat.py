"""The process side of the stall watchdog (miles.stall.watchdog): every miles process started under a run registers in
the run's watch directory, says when it makes progress, and dumps its Python stacks when the driver asks.

A process registers when ``import miles`` finds ``MILES_WATCH_DIR`` in its environment: the run's Ray actors get
it from the driver, and everything they start inherits it (``miles serve`` engines, agent servers, reward
workers); a forked child registers itself again. Registering leaves two files, ``<role>-<pid>.beat`` (its mtime is
the process's last sign of progress, its JSON names the process and its phase) and ``<role>-<pid>.stacks``, where
faulthandler writes every thread's stack on SIGUSR1. faulthandler writes from inside the signal handler, in C,
without taking the GIL, so a process whose main thread is stuck in C code holding the GIL (a catastrophic regex,
a huge integer power) still dumps.

    heartbeat.name("train-0")      # an actor names itself; other processes are named after `-m module` / --owner
    heartbeat.phase("reward")      # a sub-phase the driver cannot see (the rollout actor: generate, then reward)
    heartbeat.beat()               # progress inside a long phase (decode steps, finished requests): ~100 ns
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import time
from pathlib import Path

ENV = "MILES_WATCH_DIR"
DUMP_SIGNAL = signal.SIGUSR1
BEAT_EVERY_S = 0.5  # a beat touches its file at most this often; the watchdog's limits are seconds to minutes


class _Registration:
    def __init__(self, directory: Path, role: str):
        self.directory, self.role, self.pid = directory, role, os.getpid()
        self.phase, self.since, self.last = "", time.time(), 0.0
        self.created = _created(self.pid)
        self.stacks = open(self.path(".stacks"), "a")  # noqa: SIM115 - lives as long as the process
        faulthandler.register(DUMP_SIGNAL, file=self.stacks, all_threads=True, chain=False)
        self.write()

    def path(self, suffix: str) -> Path:
        return self.directory / f"{self.role}-{self.pid}{suffix}"

    def write(self) -> None:
        info = {"role": self.role, "pid": self.pid, "created": self.created, "phase": self.phase, "since": self.since}
        tmp = self.path(".beat.tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, self.path(".beat"))
        self.last = time.monotonic()


_me: _Registration | None = None


def register(directory: str | os.PathLike, role: str = "") -> None:
    """Register this process in ``directory`` as ``role`` (a name made from its command line when empty)."""
    global _me
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _me = _Registration(d, _clean(role or _role_from_cmdline()))


def register_from_env() -> None:
    """Register if this process runs under a watchdog (``MILES_WATCH_DIR``) and has not yet; else nothing."""
    directory = os.environ.get(ENV)
    if directory and (_me is None or _me.pid != os.getpid()):
        try:
            register(directory)
        except OSError:  # the directory is on another node or gone: this process is simply not watched
            pass


def name(role: str) -> None:
    """Rename this process's registration (``rollout-0``, ``train-1``); nothing when not registered."""
    me = _me
    if me is None or me.pid != os.getpid():
        return
    old = {s: me.path(s) for s in (".beat", ".stacks")}
    me.role = _clean(role)
    for suffix, path in old.items():
        os.replace(path, me.path(suffix))  # the open stacks file follows its inode
    me.write()


def phase(name: str) -> None:
    """Record that this process entered ``name`` (progress, too)."""
    me = _me
    if me is not None and me.pid == os.getpid():
        me.phase, me.since = name, time.time()
        me.write()


def beat() -> None:
    """Progress: touch the beat file (at most every BEAT_EVERY_S; nothing when not registered)."""
    me = _me
    if me is None:
        return
    now = time.monotonic()
    if now - me.last < BEAT_EVERY_S or me.pid != os.getpid():
        return
    me.last = now
    try:
        os.utime(me.path(".beat"))
    except OSError:
        pass


def _after_fork() -> None:
    """A forked child registers as ``<parent role>-fork`` with files of its own (the parent's stay the parent's)."""
    global _me
    parent, _me = _me, None
    if parent is not None:
        try:
            register(parent.directory, f"{parent.role}-fork")
        except OSError:
            faulthandler.unregister(DUMP_SIGNAL)


os.register_at_fork(after_in_child=_after_fork)


def _created(pid: int) -> float:
    """The process's start time (psutil): a pid that the kernel reused for another process has another one."""
    import psutil

    return psutil.Process(pid).create_time()


def _role_from_cmdline() -> str:
    """``engine-0`` for a process started with ``--owner engine/0``, ``worker`` for ``python -m miles.reward.worker``,
    the script's name otherwise."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        import sys

        argv = list(sys.argv)
    for flag, pick in (("--owner", lambda v: v), ("-m", lambda v: v.rsplit(".", 1)[-1])):
        if flag in argv[:-1]:
            return pick(argv[argv.index(flag) + 1])
    script = argv[1] if len(argv) > 1 and re.fullmatch(r"python[\d.]*", Path(argv[0]).name) else argv[0]
    return Path(script).stem if argv and not script.startswith("-") else "python"


def _clean(role: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", role).strip("-")[:60] or "python"
