"""Experiment trackers: every metrics row the run writes to metrics.jsonl (always on) also goes, under the same
metric names, to TensorBoard event files (the `tensorboard` package) and to Weights & Biases in offline mode.

    trackers = Trackers.open(cfg.log, run_dir="runs/x", config=cfg.to_dict())
    trackers.log({"step": 3, "reward": 0.5, "eval/all/mean@4": 0.2})   # RunDir.append_metrics calls this
    trackers.close()

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

    def log(self, row: dict) -> None:
        step, values = scalars(row)
        self.run.log(values, step=0 if row.get("phase") == "sft" else step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    def __init__(self, trackers: list):
        self.trackers = trackers

    @classmethod
    def open(cls, cfg: LogConfig, *, run_dir: str | Path, config: dict | None = None) -> "Trackers":
        run_dir, out = Path(run_dir), []
        if "tensorboard" in cfg.trackers:
            out.append(TensorBoardTracker(run_dir))
        if "wandb" in cfg.trackers:
            out.append(WandbTracker(run_dir, cfg.project, config or {}))
        return cls(out)

    def log(self, row: dict) -> None:
        for t in self.trackers:
            t.log(row)

    def close(self) -> None:
        for t in self.trackers:
            t.close()
