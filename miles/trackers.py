"""Experiment trackers: every metrics row the run writes to metrics.jsonl (always on) also goes, under the same
metric names, to TensorBoard event files (the `tensorboard` package) and to Weights & Biases in offline mode.

    with Trackers.open(cfg.log, run_dir, config=cfg.to_dict()):   # a miles.run_dir.RunDir
        run_dir.append_metrics({"step": 3, "reward": 0.5, "eval/all/mean@4": 0.2})   # -> every tracker


Rows are keyed by their "step" (RL step); warm-up rows ("phase": "sft", keyed by "sft_step") are logged as
"sft/<name>" on an axis of their own: in TensorBoard a run of their own (run_dir/tensorboard/sft, x = sft_step),
in wandb the step metric sft_step, so neither axis goes back (the warm-up's steps 0-24 and then RL step 0 in one
event file read as out of order). One miles run is one wandb run: its id is kept in
``run_dir/wandb_run_id`` and a resumed run logs into it again (RunDir drops the id with the logs on a fresh start).
"""

from __future__ import annotations

import importlib.util
import logging
import numbers
import re
from dataclasses import dataclass
from pathlib import Path

from miles.atomic import atomic_write_text

log = logging.getLogger("miles")

TRACKERS = ("jsonl", "tensorboard", "wandb")
WANDB_RUN_ID = "wandb_run_id"  # in the run directory: the wandb run this miles run logs into, across resumes
INSTALL = {
    "tensorboard": "pip install tensorboard (or 'miles[trackers]')",
    "wandb": "pip install wandb (it runs offline here: no account or network needed)",
}


@dataclass(kw_only=True, slots=True)
class LogConfig:
    trackers: tuple[str, ...] = ("jsonl",)  # any of jsonl (always on), tensorboard, wandb
    project: str = "miles"  # the wandb project name (offline runs land in run_dir/wandb)

    def __post_init__(self):
        unknown = [t for t in self.trackers if t not in TRACKERS]
        if unknown:
            raise ValueError(f"log.trackers = {list(self.trackers)} has unknown {unknown}; choose from {TRACKERS}")
        for name in ("tensorboard", "wandb"):
            if name in self.trackers and importlib.util.find_spec(name) is None:
                raise ValueError(f"log.trackers has {name!r} but the {name} package is not installed: {INSTALL[name]}")


def scalars(row: dict) -> tuple[int, dict[str, float]]:
    """(step, {name: value}) for a metrics row: its numbers only, warm-up rows under 'sft/'."""
    sft = row.get("phase") == "sft"
    step = int(row.get("sft_step" if sft else "step", 0))
    out = {}
    for k, v in row.items():
        if k in ("step", "sft_step", "phase") or isinstance(v, bool) or not isinstance(v, numbers.Real):
            continue
        out[f"sft/{k}" if sft else k] = float(v)
    return step, out


class TensorBoardTracker:
    """RL and eval rows in run_dir/tensorboard (x: the RL step); warm-up rows in run_dir/tensorboard/sft, which
    TensorBoard shows as the run "sft" (x: the warm-up step), opened at the first warm-up row."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.root = run_dir / "tensorboard"
        self.writers = {"rl": SummaryWriter(log_dir=str(self.root))}

    def log(self, row: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        axis = "sft" if row.get("phase") == "sft" else "rl"
        if axis not in self.writers:
            self.writers[axis] = SummaryWriter(log_dir=str(self.root / axis))
        step, values = scalars(row)
        for k, v in values.items():
            self.writers[axis].add_scalar(k, v, global_step=step)
        self.writers[axis].flush()

    def close(self) -> None:
        for w in self.writers.values():
            w.close()


class WandbTracker:
    """An offline wandb run, started at the first row: by then the run directory has chosen between a resume (the
    id in ``wandb_run_id`` is kept, and wandb resumes that run: each start writes an ``offline-run-*-<id>``
    directory, and ``wandb sync`` merges them into one run) and a fresh start (the id was dropped with the logs)."""

    def __init__(self, run_dir: Path, project: str, config: dict):
        self.dir, self.project, self.config = run_dir, project, config
        self.run = None

    def _start(self) -> None:
        import wandb

        path = self.dir / WANDB_RUN_ID
        run_id = _stored_id(path)  # None: a new run, whose id wandb picks
        resume = {"id": run_id, "resume": "allow"} if run_id else {}
        self.run = wandb.init(
            project=self.project, dir=str(self.dir), mode="offline", config=self.config, reinit=True, **resume
        )
        if run_id is None:
            atomic_write_text(path, self.run.id + "\n")
        # two step axes: wandb's own step only moves forward, so warm-up rows (sft_step 0, 1, ...) logged at a
        # step would merge into one and RL rows after them would be dropped; each row names its axis instead
        self.run.define_metric("rl_step")
        self.run.define_metric("sft_step")
        self.run.define_metric("*", step_metric="rl_step")
        self.run.define_metric("sft/*", step_metric="sft_step")

    def log(self, row: dict) -> None:
        if self.run is None:
            self._start()
        step, values = scalars(row)
        self.run.log({**values, "sft_step" if row.get("phase") == "sft" else "rl_step": step})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


def _stored_id(path: Path) -> str | None:
    """The wandb run id kept in ``path``, or None (absent, or not an id wandb writes: then a new run is started)."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", text):
        return text
    log.warning("%s holds %r, not a wandb run id; this run starts a new wandb run", path, text[:80])
    return None


class Trackers:
    """The trackers of a run, fed by the RunDir's metrics rows while open (a context manager)."""

    def __init__(self, trackers: list, run_dir=None):
        self.trackers, self.run_dir = trackers, run_dir

    @classmethod
    def open(cls, cfg: LogConfig, run_dir, *, config: dict | None = None) -> "Trackers":
        path, out = Path(run_dir.path), []
        if "tensorboard" in cfg.trackers:
            out.append(TensorBoardTracker(path))
        if "wandb" in cfg.trackers:
            out.append(WandbTracker(path, cfg.project, config or {}))
        self = cls(out, run_dir)
        run_dir.sinks.append(self.log)
        return self

    def __enter__(self) -> "Trackers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def log(self, row: dict) -> None:
        for t in self.trackers:
            t.log(row)

    def close(self) -> None:
        if self.run_dir is not None and self.log in self.run_dir.sinks:
            self.run_dir.sinks.remove(self.log)
        for t in self.trackers:
            t.close()
