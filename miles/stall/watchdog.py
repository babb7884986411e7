"""The stall watchdog: a run that makes no progress for its limit dumps the Python stacks of every miles process
into ``run_dir/stall-<UTC>/`` (miles.stall.stacks) and stops with one line naming the phase and that directory.

Progress is any of:
- a phase transition of the driver: init, warm-up (each supervised step), eval, generate, train, sync, record,
  checkpoint (``Watchdog.phase``; train covers the handoff into training, sync the handoff back and the sync);
- a sub-phase a process reports: the rollout actor's generate -> reward (miles.stall.heartbeat.phase), which also names
  the phase of a stall;
- a heartbeat from any registered process (miles.stall.heartbeat.beat) inside a phase that can legitimately be long: an
  embedded engine beats every decode-loop turn (at most 16 decode steps; in the rollout actor and in ``miles serve``
  engines), an SGLang client at every finished generate call. So a long generate or eval is progress while tokens
  come; a reward, a train step, a sync, a checkpoint write beat only at their start and end.

The limit is ``watchdog_s`` (RunConfig; default 900 s, 0 = off). After MEASURED_STEPS RL steps the phases inside a
step (generate, reward, train, sync) get min(watchdog_s, max(FLOOR_S, SLOWEST_STEPS x the slowest step so far)):
no silence inside a step can be longer than the step. Init, warm-up, eval, record and checkpoint keep watchdog_s.

On a stall the watchdog dumps the stacks, logs the line, and calls ``stop(phase)`` (miles.cluster.Cluster.abort:
it kills the stuck side's processes, so that the driver's wait ends); the driver then raises StallError with the
line and what is saved (miles.driver). It keeps watching: a second stall (the checkpoint after a rollout-side
stall) dumps again and stops everything.

    wd = Watchdog(watchdog_s=900, run_dir="runs/x", stop=cluster.abort)
    options = actor_options(1, wd.env())          # every actor gets the watch directory (and what it starts)
    wd.start()
    wd.phase("generate", step=3); ...; wd.step_done(seconds)
    wd.stall                                      # None, or the Stall once it fired
    wd.close()
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from miles.stall.heartbeat import ENV
from miles.stall.stacks import Registered, dump_stacks, registered

log = logging.getLogger("miles")

MEASURED_STEPS = 3  # RL steps before the limit of the phases inside a step follows the measured step times
SLOWEST_STEPS = 10  # ... as this many times the slowest step so far
FLOOR_S = 60.0  # ... and never below this (nor above watchdog_s)
STEP_PHASES = ("generate", "reward", "train", "sync")
ROLLOUT_PHASES = ("generate", "reward", "eval")  # a stall here leaves the trainer sound (it is idle meanwhile)
DUMP_WAIT_S = 5.0


class StallError(RuntimeError):
    """A run made no progress within its watchdog limit; the stacks of its processes are in the stall directory."""


@dataclass(slots=True)
class Stall:
    phase: str
    step: int | None
    seconds: float
    limit: float
    directory: Path
    num_processes: int
    dump_error: str = ""  # why the stacks could not be written (a full or read-only disk), if they were not

    @property
    def trainer_sound(self) -> bool:
        return self.phase in ROLLOUT_PHASES

    @property
    def line(self) -> str:
        where = f"RL step {self.step}" if self.step is not None else "before the first RL step"
        stacks = f"the Python stacks of its {self.num_processes} processes are in {self.directory}"
        if self.dump_error:
            stacks = f"its stacks could not be written to {self.directory} ({self.dump_error})"
        return (
            f"no progress for {self.seconds:.0f} s in phase {self.phase} ({where}; the limit is {self.limit:.0f} s, "
            f"watchdog_s): {stacks}"
        )


class StallLimits:
    """The limit of each phase: watchdog_s, then derived from the step times (the module docstring)."""

    def __init__(self, watchdog_s: float):
        self.watchdog_s = watchdog_s
        self.steps: list[float] = []

    def add_step(self, seconds: float) -> None:
        self.steps.append(seconds)

    def limit(self, phase: str) -> float:
        if len(self.steps) < MEASURED_STEPS or phase not in STEP_PHASES:
            return self.watchdog_s
        return min(self.watchdog_s, max(FLOOR_S, SLOWEST_STEPS * max(self.steps)))


class Watchdog:
    def __init__(self, watchdog_s: float, run_dir: str | Path, stop: Callable[[str], None]):
        self.limits = StallLimits(watchdog_s)
        self.run_dir, self.stop = Path(run_dir), stop
        self.directory = Path(tempfile.mkdtemp(prefix="miles-watch-")) if watchdog_s > 0 else None
        self.phase_name, self.step, self.since = "init", None, time.time()
        self.stall: Stall | None = None
        self.stopped = threading.Event()  # set once ``stop`` has returned after the first stall
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def env(self) -> dict[str, str]:
        """Environment for the run's actors: they and every process they start register (miles.stall.heartbeat)."""
        return {ENV: str(self.directory)} if self.directory else {}

    def start(self) -> None:
        if self.directory is not None and self._thread is None:
            self.since = time.time()
            self._thread = threading.Thread(target=self._watch, name="miles-watchdog", daemon=True)
            self._thread.start()

    def phase(self, name: str, step: int | None = None) -> None:
        """The driver entered phase ``name`` (of RL step ``step``, when given): progress."""
        self.phase_name, self.since = name, time.time()
        if step is not None:
            self.step = step

    def step_done(self, seconds: float) -> None:
        self.limits.add_step(seconds)

    def processes(self, role: str) -> list[Registered]:
        """The live registered processes named ``role``."""
        return [p for p in registered(self.directory) if p.role == role] if self.directory else []

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=DUMP_WAIT_S + 10)
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    # ---- the watching thread ----------------------------------------------------------------------------------
    def _watch(self) -> None:
        tick = min(1.0, max(0.05, self.limits.watchdog_s / 20))
        fired = 0
        while fired < 2 and not self._closed.wait(tick):
            procs = registered(self.directory)
            last = max([self.since] + [p.beat for p in procs])
            phase = self._current_phase(procs)
            limit, silent = self.limits.limit(phase), time.time() - last
            if silent > limit and not self._closed.is_set():
                self._fire(phase, silent, limit, procs, everything=fired > 0)
                fired += 1
                self.since = time.time()  # a second stall needs a full limit of its own

    def _current_phase(self, procs: list[Registered]) -> str:
        """The driver's phase, or a sub-phase that a process entered after it (the rollout actor's reward)."""
        later = [p for p in procs if p.phase and p.since > self.since]
        return max(later, key=lambda p: p.since).phase if later else self.phase_name

    def _fire(self, phase: str, silent: float, limit: float, procs: list[Registered], *, everything: bool) -> None:
        out = self.run_dir / f"stall-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"
        while out.exists():
            out = out.with_name(out.name + "-")
        stall = Stall(phase, self.step, silent, limit, out, len(procs) + 1)
        try:
            note = f", phase {self.phase_name}, {silent:.1f} s without progress"
            dump_stacks(procs, out, wait_s=DUMP_WAIT_S, driver_note=note)
        except Exception as e:  # the run must stop all the same
            stall.dump_error = f"{type(e).__name__}: {e}"
        log.error("stall: %s", stall.line)
        if self.stall is None:
            self.stall = stall
        try:
            self.stop("everything" if everything else phase)
        except Exception:
            log.exception("stall: stopping the stuck processes failed")
        finally:
            self.stopped.set()


class Unwatched:
    """The watchdog of a run in one process (miles.colocated.Colocated): no other process to watch or stop, so
    the driver's phase marks go nowhere and no stall fires."""

    stall = None

    def phase(self, name: str, step: int | None = None) -> None:
        pass

    def step_done(self, seconds: float) -> None:
        pass
