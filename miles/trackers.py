"""Experiment trackers: every metrics row the run writes to metrics.jsonl (always on) also goes, under the same
metric names, to TensorBoard event files (the `tensorboard` package) and to Weights & Biases in offline mode.

    with Trackers.open(cfg.log, run_dir, config=cfg.to_dict()):   # a miles.run_dir.RunDir
        run_dir.append_metrics({"step": 3, "reward": 0.5, "eval/all/mean@4": 0.2})   # -> every tracker


Rows are keyed by their "step" (RL step); warm-up rows ("phase": "sft", keyed by "sft_step") are logged as
"sft/<name>" so that their steps do not collide with the RL steps.
"""

from __future__ import annotations

import importlib.util
import numbers
from dataclasses import dataclass
from pathlib import Path

TRACKERS = ("jsonl", "tensorboard", "wandb")
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
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, row: dict) -> None:
        step, values = scalars(row)
        for k, v in values.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, project: str, config: dict):
        import wandb

        self.run = wandb.init(project=project, dir=str(run_dir), mode="offline", config=config, reinit=True)
        # two step axes: wandb's own step only moves forward, so warm-up rows (sft_step 0, 1, ...) logged at a
        # step would merge into one and RL rows after them would be dropped; each row names its axis instead
        self.run.define_metric("rl_step")
        self.run.define_metric("sft_step")
        self.run.define_metric("*", step_metric="rl_step")
        self.run.define_metric("sft/*", step_metric="sft_step")

    def log(self, row: dict) -> None:
        step, values = scalars(row)
        self.run.log({**values, "sft_step" if row.get("phase") == "sft" else "rl_step": step})

    def close(self) -> None:
        self.run.finish()


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
