"""The run directory: resolved config, per-step logs (JSONL), rollout dumps and checkpoints, opened under a lock.

A run directory is either new (absent or empty), or a miles run (its ``config.json`` written by ``miles train``)
that is resumed. Anything else is refused unless ``overwrite=true`` (``miles train --force``) says so, and even
then nothing that is not a miles run is deleted. ``resume=false`` over a run with history is refused unless
``overwrite=true`` (which deletes that run), so two runs never mix in one directory.

run_dir/
  config.json            the resolved RunConfig (written at a fresh start, or after a compatible resume loaded)
  metrics.jsonl          one row per RL step (and warm-up rows with "phase": "sft")
  ledger.jsonl           memory moves (LedgerEvent fields + step)
  processes.jsonl        RSS / allocator samples per actor, with the Ray node (node_id, node_ip) it ran on
  placement.jsonl        where each actor ran, one row per actor at each (re)start: its pin, node, pid, rendezvous
  agent_episodes.jsonl   per-episode rows of agentic rollouts
  rollouts/step_000012/  one directory of per-token columns per RL step (miles.rollout_dump)
  checkpoints/step_000010/{model.safetensors, optimizer.pt, state.json}   (miles.checkpoints)
  wandb_run_id           the wandb run that log.trackers=wandb logs into (kept on a resume; miles.trackers)
  run.lock               flock'ed by the run that has the directory open; holds its pid
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path

from miles.atomic import atomic_write_text
from miles.checkpoints import Checkpoints
from miles.trackers import WANDB_RUN_ID

log = logging.getLogger("miles")
LOCK = "run.lock"
JSONL = ("metrics.jsonl", "ledger.jsonl", "processes.jsonl", "placement.jsonl", "agent_episodes.jsonl")
OUTPUTS = ("config.json", *JSONL, WANDB_RUN_ID, "rollouts", "checkpoints", "weights", "offload")  # what a run writes
CONFIG_KEYS = {"recipe", "run_dir", "model", "trainer", "rollout"}  # a config.json that miles train wrote


class RunDirError(ValueError):
    """The run directory cannot be used as asked (bad input: the message says what to change)."""


class RunDirBusy(RuntimeError):
    """Another process holds the run directory's lock."""


class RunDir:
    """One run's directory, held under a lock from ``open`` to ``close``.

    run = RunDir.open("runs/x", resume=True, overwrite=False, config=cfg.to_dict())  # refuses what it must
    found = run.checkpoints.latest()          # (next_step, path) or None; the caller loads it
    run.begin(next_step, cfg.to_json())       # logs cut to steps < next_step, config.json written
    run.append_metrics(row); run.append_ledger(step, events, samples); run.checkpoints.save(step, write)
    run.close()                               # or use it as a context manager
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints = Checkpoints(self.path / "checkpoints")
        self.ckpt_root = self.checkpoints.root
        self._lock_fd: int | None = None
        self.sinks: list = []  # callables that also get every metrics row (miles.trackers)

    # ---- opening ------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str, *, resume: bool, overwrite: bool = False, config: dict | None = None) -> "RunDir":
        """Classify ``path`` (nothing is written when it is refused), take the lock, then clear what must go."""
        check_usable(path, resume=resume, overwrite=overwrite, config=config)
        run = cls(path)
        run.lock()
        try:  # again under the lock: another run may have written between the check and the lock
            kind = check_usable(path, resume=resume, overwrite=overwrite, config=config)
            if kind == "run" and not resume and overwrite:
                run.delete_outputs()
        except BaseException:
            run.close()
            raise
        return run

    def lock(self) -> None:
        fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirBusy(
                f"run_dir {self.path} is in use by another run (pid {holder}); wait for it to finish, stop it, "
                "or choose another run_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock; the file stays (its presence means nothing)
            self._lock_fd = None

    def __enter__(self) -> "RunDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def delete_outputs(self) -> None:
        """Delete what a miles run wrote here (only those names; other files stay). Called for overwrite=true."""
        log.warning("overwrite=true: deleting the earlier run in %s (its checkpoints, logs and rollouts)", self.path)
        for name in OUTPUTS:
            p = self.path / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()

    # ---- logs ---------------------------------------------------------------------------------------------
    def begin(self, next_step: int, cfg_json: str, resumed: bool) -> None:
        """Start logging at ``next_step``: a resumed run keeps the rows of steps before it (every JSONL and the
        rollout dumps alike, so no step is counted twice), a fresh start keeps none; then write config.json."""
        if resumed:
            self.truncate_logs(next_step)
        else:
            self.reset()
        self.write_config(cfg_json)

    def write_config(self, cfg_json: str) -> None:
        atomic_write_text(self.path / "config.json", cfg_json)

    def _append(self, name: str, rows: list[dict]) -> None:
        if not rows:
            return
        with open(self.path / name, "a") as f:
            for r in rows:
                f.write(json.dumps(r, default=float) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def append_metrics(self, row: dict) -> None:
        self._append("metrics.jsonl", [row])
        for sink in self.sinks:
            sink(row)

    def append_ledger(self, step: int, events, samples) -> None:
        self._append("ledger.jsonl", [{**asdict(e), "step": step} for e in events])
        self._append("processes.jsonl", [{**asdict(s), "step": step} for s in samples])

    def append_placement(self, step: int, rows: list[dict]) -> None:
        """Where the actors of a (re)start at RL step ``step`` run (miles.cluster_nodes.Placement.rows)."""
        self._append("placement.jsonl", [{**r, "step": step} for r in rows])

    def rows(self, name: str) -> list[dict]:
        p = self.path / name
        if not p.exists():
            return []
        rows = []
        for line in p.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("skipping a torn line in %s", p)
        return rows

    def metrics(self) -> list[dict]:
        return self.rows("metrics.jsonl")

    def reset(self) -> None:
        """A fresh start in a run that left no checkpoint to resume from: its old logs and dumps are cleared."""
        for name in JSONL:
            if (self.path / name).exists():
                log.warning(
                    "starting fresh in %s: no checkpoint to resume from, so its old %s is cleared", self.path, name
                )
                (self.path / name).unlink()
        (self.path / WANDB_RUN_ID).unlink(missing_ok=True)  # a fresh start is a new tracker run
        shutil.rmtree(self.path / "rollouts", ignore_errors=True)

    def truncate_logs(self, next_step: int) -> None:
        """Keep the rows of steps before ``next_step`` in every JSONL (rows without a step, such as warm-up rows,
        stay) and drop the rollout dumps from ``next_step`` on: those steps are run again."""
        for name in JSONL:
            if (self.path / name).exists():
                keep = [r for r in self.rows(name) if not isinstance(r.get("step"), int) or r["step"] < next_step]
                atomic_write_text(self.path / name, "".join(json.dumps(r) + "\n" for r in keep))
        rollouts = self.path / "rollouts"
        if rollouts.is_dir():
            for d in rollouts.iterdir():
                step = d.name.removeprefix("step_")
                if d.name.startswith("step_") and step.isdigit() and int(step) >= next_step:
                    shutil.rmtree(d, ignore_errors=True)

    def save_checkpoint(self, next_step: int, write_files) -> Path:
        return self.checkpoints.save(next_step, write_files)

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        return self.checkpoints.latest()


# ---- what a path holds ------------------------------------------------------------------------------------------
def check_usable(path: str, *, resume: bool, overwrite: bool, config: dict | None) -> str:
    """ "new", "run" or "foreign" (overwrite=true only) for ``path``; raises RunDirError where it must be refused."""
    if not str(path).strip():
        raise RunDirError("run_dir is empty; give the run a directory, e.g. run_dir=runs/my_run")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise RunDirError(f"run_dir = {path!r} is a file, not a directory; pass a new directory or a run's directory")
    entries = sorted(e.name for e in p.iterdir() if e.name != LOCK) if p.is_dir() else []
    if not entries:
        return "new"
    saved = _miles_config(p / "config.json")
    if saved is None:
        return _foreign(path, entries, overwrite)
    history = _history(p)
    if not resume and history and not overwrite:
        raise RunDirError(
            f"run_dir = {path!r} holds an earlier run ({history}); resume=false would mix a new run into it. "
            "Set resume=true to continue it, overwrite=true (miles train --force) to delete it and start over, "
            "or choose another run_dir"
        )
    if resume and config is not None and any(True for _ in Checkpoints(p / "checkpoints").steps()):
        _check_same_model(path, saved, config)
    return "run"


def _foreign(path: str, entries: list[str], overwrite: bool) -> str:
    shown = ", ".join(entries[:6]) + (", ..." if len(entries) > 6 else "")
    if not overwrite:
        raise RunDirError(
            f"run_dir = {path!r} is not empty and holds no miles run (no config.json written by miles train; it has "
            f"{shown}); choose a new or empty directory, or set overwrite=true (miles train --force) to write into it"
        )
    clash = [e for e in entries if e in OUTPUTS]
    if clash:
        raise RunDirError(
            f"run_dir = {path!r} holds no miles run but has {clash}, which a run would write over; move them away "
            "or choose another run_dir (overwrite=true never deletes files that a miles run did not write)"
        )
    return "foreign"


def _miles_config(p: Path) -> dict | None:
    try:
        saved = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) and CONFIG_KEYS <= saved.keys() else None


def _history(p: Path) -> str:
    """What an earlier run left that a new one would lose or mix with ("" when nothing)."""
    parts = []
    steps = Checkpoints(p / "checkpoints").steps()
    if steps:
        parts.append(f"{len(steps)} checkpoints, the newest {steps[0][1].name}")
    try:
        with open(p / "metrics.jsonl", "rb") as f:
            n = sum(1 for _ in f)
    except OSError:
        n = 0
    if n:
        parts.append(f"{n} metrics rows")
    return ", ".join(parts)


def _check_same_model(path: str, saved: dict, config: dict) -> None:
    config = json.loads(json.dumps(config, default=str))  # tuples as lists, as config.json holds them
    diff = [
        f"model.{k} = {config['model'].get(k)!r} (the run has {v!r})"
        for k, v in sorted(saved.get("model", {}).items())
        if config.get("model", {}).get(k) != v
    ]
    if diff:
        raise RunDirError(
            f"run_dir = {path!r} holds checkpoints of a different model: {'; '.join(diff)}. Resume with the same "
            "model settings, set resume=false overwrite=true to replace that run, or choose another run_dir"
        )
