"""Stack dumps of a run's processes: what the stall watchdog (miles.stall.watchdog) writes into ``run_dir/stall-<UTC>/``.

Each process registered in the watch directory (miles.stall.heartbeat) gets SIGUSR1 and its faulthandler writes every
thread's stack into its ``.stacks`` file; the new part is copied to ``<role>-<pid>.txt`` under a header naming
the process, its phase and its last heartbeat. The driver dumps its own threads directly. ``processes.txt`` lists
every process with what came back, and the processes they started that are not miles processes (a real SGLang
server: no Python stack from here; ``py-spy dump --pid N`` gives one, and is run when it is installed).

    procs = registered(watch_dir)                      # alive and verified: a reused pid is never signalled
    files = dump_stacks(procs, out_dir, wait_s=5.0)    # one file per process, plus processes.txt
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from miles.stall.heartbeat import DUMP_SIGNAL

SETTLE_S = 0.3  # a stacks file that stopped growing this long is complete


@dataclass(slots=True)
class Registered:
    """One registered process, from its ``.beat`` file: ``beat`` is the file's mtime (its last heartbeat)."""

    role: str
    pid: int
    phase: str
    since: float  # when it entered ``phase`` (wall clock)
    beat: float
    stacks: Path


def registered(directory: Path) -> list[Registered]:
    """The live processes registered in ``directory``; files of exited processes are removed."""
    import psutil

    out = []
    for f in sorted(Path(directory).glob("*.beat")):
        try:
            info, beat = json.loads(f.read_text()), f.stat().st_mtime
        except (OSError, ValueError):
            continue  # being renamed or rewritten: seen on the next look
        try:
            proc = psutil.Process(info["pid"])
            alive = abs(proc.create_time() - info["created"]) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            alive = False
        except (KeyError, TypeError, psutil.Error):
            continue
        if not alive:  # exited, or its pid now belongs to another process: never signalled
            for stale in (f, f.with_suffix(".stacks")):
                stale.unlink(missing_ok=True)
            continue
        out.append(Registered(info["role"], info["pid"], info["phase"], info["since"], beat, f.with_suffix(".stacks")))
    return out


def dump_stacks(procs: list[Registered], out: Path, *, wait_s: float = 5.0, driver_note: str = "") -> list[Path]:
    """Every thread's stack of each of ``procs`` and of this process, one file each in ``out`` (created here)."""
    out.mkdir(parents=True)
    sizes = {}
    for p in procs:
        sizes[p.pid] = _size(p.stacks)
        try:
            os.kill(p.pid, DUMP_SIGNAL)
        except ProcessLookupError:
            pass
    own = out / f"driver-{os.getpid()}.txt"
    with open(own, "w") as f:
        f.write(f"# driver pid {os.getpid()}{driver_note}\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    answered = _wait_for_dumps(procs, sizes, wait_s)
    files, now = [own], time.time()
    rows = [f"driver  pid {os.getpid()}  {own.name}{driver_note}"]
    for p in procs:
        path = out / f"{p.role}-{p.pid}.txt"
        head = f"# {p.role} pid {p.pid}, phase {p.phase or '-'}, last heartbeat {now - p.beat:.1f} s ago\n"
        if p.pid in answered:
            with open(p.stacks, "rb") as src:
                src.seek(sizes[p.pid])
                path.write_bytes(head.encode() + src.read())
            files.append(path)
            rows.append(f"{p.role}  pid {p.pid}  {path.name}  (phase {p.phase or '-'}, beat {now - p.beat:.1f} s ago)")
        else:
            rows.append(
                f"{p.role}  pid {p.pid}  no stack within {wait_s:g} s (signals blocked, or the process is gone)"
            )
    rows += _others(procs, out, files)
    (out / "processes.txt").write_text("\n".join(rows) + "\n")
    return files


def _wait_for_dumps(procs: list[Registered], sizes: dict[int, int], wait_s: float) -> set[int]:
    """The pids whose stacks file grew and then stayed put for SETTLE_S (faulthandler has finished writing)."""
    deadline, last, done = time.monotonic() + wait_s, {}, set()
    while time.monotonic() < deadline and len(done) < len(procs):
        for p in procs:
            n = _size(p.stacks)
            if n > sizes[p.pid]:
                seen, at = last.get(p.pid, (-1, 0.0))
                if n != seen:
                    last[p.pid] = (n, time.monotonic())
                elif time.monotonic() - at >= SETTLE_S:
                    done.add(p.pid)
        time.sleep(0.05)
    return done | {pid for pid, (n, _) in last.items() if n > sizes[pid]}  # late but written


def _others(procs: list[Registered], out: Path, files: list[Path]) -> list[str]:
    """Processes that the registered ones started and that did not register (not miles code): listed, with a
    py-spy dump when py-spy is installed."""
    import psutil

    mine = {p.pid for p in procs}
    rows = []
    for p in procs:
        try:
            children = psutil.Process(p.pid).children(recursive=True)
        except psutil.Error:
            continue
        for c in children:
            if c.pid in mine:
                continue
            mine.add(c.pid)
            try:
                cmd = " ".join(c.cmdline())[:200]
            except psutil.Error:
                continue
            rows.append(f"(child of {p.role})  pid {c.pid}  {_py_spy(c.pid, out, files)}  {cmd}")
    return rows


def _py_spy(pid: int, out: Path, files: list[Path]) -> str:
    exe = shutil.which("py-spy")
    if exe is None:
        return "not a miles process: no stack (install py-spy for one)"
    try:
        r = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"py-spy failed ({type(e).__name__})"
    path = out / f"other-{pid}.txt"
    path.write_text(r.stdout + r.stderr)
    files.append(path)
    return path.name


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
