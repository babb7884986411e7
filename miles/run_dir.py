"""The run directory: resolved config, per-step metrics and memory ledger (JSONL), rollout dumps, and
checkpoints published atomically so that a resumed run starts from the last complete one.

run_dir/
  config.json            the resolved RunConfig
  metrics.jsonl          one row per RL step (and warm-up rows with "phase": "sft")
  ledger.jsonl           memory moves (LedgerEvent fields + step)
  processes.jsonl        RSS / allocator samples per actor
  rollouts/              per-step sample dumps (miles.dashboard.store)
  checkpoints/step_000010/{model.safetensors, optimizer.pt, state.json}
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path

from miles.atomic import atomic_directory, atomic_write_text

log = logging.getLogger("miles")
CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "state.json")


class RunDir:
    """run = RunDir(path, cfg_json); run.append_metrics(row); run.save_checkpoint(step, writer); run.latest_checkpoint()"""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.ckpt_root = self.path / "checkpoints"

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

    def append_ledger(self, step: int, events, samples) -> None:
        self._append("ledger.jsonl", [{**asdict(e), "step": step} for e in events])
        self._append("processes.jsonl", [{**asdict(s), "step": step} for s in samples])

    def metrics(self) -> list[dict]:
        p = self.path / "metrics.jsonl"
        if not p.exists():
            return []
        rows = []
        for line in p.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("skipping a torn line at the end of %s", p)
        return rows

    def reset(self) -> None:
        """A fresh start: forget the logs of an earlier run that left no checkpoint (config.json is kept)."""
        for name in ("metrics.jsonl", "ledger.jsonl", "processes.jsonl"):
            if (self.path / name).exists():
                log.warning("starting fresh in %s: no complete checkpoint, so its old %s is cleared", self.path, name)
                (self.path / name).unlink()
        shutil.rmtree(self.path / "rollouts", ignore_errors=True)

    def truncate_metrics(self, next_step: int) -> None:
        """Keep the rows of steps before ``next_step`` (those after the checkpoint will be run again)."""
        rows = [r for r in self.metrics() if r.get("phase") == "sft" or r.get("step", -1) < next_step]
        atomic_write_text(self.path / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))

    # ---- checkpoints --------------------------------------------------------------------------------------
    def save_checkpoint(self, next_step: int, write_files) -> Path:
        """``write_files(tmp_dir)`` writes the trainer files; published as step_<next_step> only if complete."""
        final = self.ckpt_root / f"step_{next_step:06d}"
        if final.exists():
            return final
        with atomic_directory(final) as tmp:
            write_files(str(tmp))
            atomic_write_text(tmp / "state.json", json.dumps({"next_step": next_step}))
            missing = [f for f in CHECKPOINT_FILES if not (tmp / f).exists()]
            if missing:
                raise RuntimeError(f"checkpoint step {next_step} is missing {missing}; not publishing it")
        return final

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        """The newest complete checkpoint; incomplete ones are reported and skipped, never loaded."""
        if not self.ckpt_root.exists():
            return None
        for leftover in self.ckpt_root.glob(".step_*.tmp"):
            log.warning(
                "removing %s: a checkpoint that was being written when a run stopped (it was never published)", leftover
            )
            shutil.rmtree(leftover, ignore_errors=True)
        found = []
        for d in self.ckpt_root.iterdir():
            m = re.fullmatch(r"step_(\d+)", d.name)
            if not m:
                continue
            problem = _checkpoint_problem(d)
            if problem:
                log.warning("ignoring checkpoint %s: %s", d, problem)
                continue
            found.append((int(m.group(1)), d))
        return max(found) if found else None


def _checkpoint_problem(d: Path) -> str:
    missing = [f for f in CHECKPOINT_FILES if not (d / f).is_file()]
    if missing:
        return f"missing {missing} (half-written or copied by hand)"
    try:
        json.loads((d / "state.json").read_text())["next_step"]
    except (ValueError, KeyError) as e:
        return f"state.json is unreadable ({e})"
    if (d / "model.safetensors").stat().st_size < 8:
        return "model.safetensors is truncated"
    return ""
