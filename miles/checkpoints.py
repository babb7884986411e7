"""A run's ``checkpoints/`` folder: each checkpoint is published atomically with a manifest (size and xxh3 of every
file), verified before it is loaded, and moved aside (never loaded, never silently rewritten) when it is broken.

checkpoints/step_000010/
  model.safetensors    the trainer's weights (safetensors); with LoRA instead the adapter in PEFT's format:
                       adapter_model.safetensors + adapter_config.json (miles.model.peft_format)
  optimizer.pt         the optimizer's state dict (torch.save; loaded with weights_only=True)
  state.json           {"next_step": 10, "files": {"model.safetensors": {"bytes": ..., "xxh3_64": "..."}, ...}}
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from pathlib import Path

import xxhash

from miles.atomic import atomic_directory, atomic_write_text

log = logging.getLogger("miles")
DATA_FILES = ("model.safetensors", "optimizer.pt")
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json", "optimizer.pt")  # a LoRA run's (PEFT format)
CHECKPOINT_FILES = (*DATA_FILES, "state.json")
BASE_DIR = "base"  # in a LoRA checkpoint: the base its warm-up trained (model.lora.warmup = "base"), a HF checkpoint
BASE_FILES = (f"{BASE_DIR}/model.safetensors", f"{BASE_DIR}/config.json")
STEP_DIR = re.compile(r"step_(\d+)")
HASH_CHUNK = 8 << 20


def step_dir_name(next_step: int) -> str:
    return f"step_{next_step:06d}"


def file_digest(path: Path) -> dict:
    """``{"bytes": n, "xxh3_64": hex}`` of one file, read in 8 MiB chunks (xxh3 runs at memory speed)."""
    h, n = xxhash.xxh3_64(), 0
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return {"bytes": n, "xxh3_64": h.hexdigest()}


class Checkpoints:
    """The checkpoints of one run directory (the caller holds the run directory's lock).

    ckpts = Checkpoints(run_dir / "checkpoints")
    found = ckpts.latest()                 # (next_step, path) of the newest verified one; broken ones moved aside
    ckpts.save(12, lambda tmp: trainer_writes_files_into(tmp))   # published as step_000012 with its manifest
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def steps(self) -> list[tuple[int, Path]]:
        """Published checkpoint directories (verified or not), newest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), d) for d in self.root.iterdir() if (m := STEP_DIR.fullmatch(d.name))]
        return sorted(found, reverse=True)

    def save(self, next_step: int, write_files) -> Path:
        """``write_files(tmp_dir)`` writes model.safetensors (or a LoRA adapter's files) and optimizer.pt; published
        only when complete."""
        final = self.root / step_dir_name(next_step)
        if final.exists():
            problem = checkpoint_problem(final)
            if not problem:
                return final  # the same step saved before (nothing has trained since)
            self.move_aside(final, problem)
        with atomic_directory(final) as tmp:
            write_files(str(tmp))
            files = data_files(tmp)
            missing = [f for f in files if not (tmp / f).is_file()]
            if missing:
                raise RuntimeError(f"checkpoint step {next_step} is missing {missing}; not publishing it")
            manifest = {"next_step": next_step, "files": {f: file_digest(tmp / f) for f in files}}
            atomic_write_text(tmp / "state.json", json.dumps(manifest, indent=1))
        return final

    def latest(self) -> tuple[int, Path] | None:
        """The newest checkpoint that verifies. Broken ones are moved aside with a warning, older ones tried next;
        unpublished ``.step_*.tmp`` leftovers of a stopped run are removed."""
        if not self.root.is_dir():
            return None
        for leftover in self.root.glob(".step_*.tmp"):
            log.warning(
                "removing %s: a checkpoint that was being written when a run stopped (never published)", leftover
            )
            shutil.rmtree(leftover, ignore_errors=True)
        for step, d in self.steps():
            problem = checkpoint_problem(d)
            if not problem:
                return step, d
            self.move_aside(d, problem)
        return None

    def move_aside(self, d: Path, problem: str) -> Path:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = d.with_name(f"{d.name}.broken-{stamp}")
        n = 1
        while aside.exists():
            n += 1
            aside = d.with_name(f"{d.name}.broken-{stamp}-{n}")
        d.rename(aside)
        log.warning("checkpoint %s is broken (%s); moved it to %s and using an earlier one", d, problem, aside.name)
        return aside


def checkpoint_problem(d: Path) -> str:
    """Why ``d`` must not be loaded ("" when it verifies): a missing file, or a size or checksum that differs from
    its manifest. Checkpoints written before manifests existed get a structural check of each file."""
    missing = [f for f in (*data_files(d), "state.json") if not (d / f).is_file()]
    if missing:
        return f"missing {missing} (half-written or copied by hand)"
    try:
        state = json.loads((d / "state.json").read_text())
        int(state["next_step"])
    except (ValueError, KeyError, TypeError) as e:
        return f"state.json is unreadable ({type(e).__name__}: {e})"
    files = state.get("files")
    if not isinstance(files, dict):
        return _legacy_problem(d)
    for name in data_files(d):
        want = files.get(name)
        if not isinstance(want, dict):
            return f"state.json lists no size and checksum for {name}"
        size = (d / name).stat().st_size
        if size != want.get("bytes"):
            return f"{name} has {size} bytes; its manifest says {want.get('bytes')}"
        if file_digest(d / name)["xxh3_64"] != want.get("xxh3_64"):
            return f"{name} does not match its xxh3_64 checksum {want.get('xxh3_64')}"
    return ""


def data_files(d: Path) -> tuple[str, ...]:
    """The files a checkpoint holds besides state.json: a LoRA adapter's when its weights file is there, and the
    base a warm-up trained when base/ is there."""
    files = ADAPTER_FILES if (d / ADAPTER_FILES[0]).is_file() else DATA_FILES
    return files + BASE_FILES if (d / BASE_DIR).is_dir() else files


def _legacy_problem(d: Path) -> str:
    import zipfile

    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError) as e:
        return f"model.safetensors is unreadable ({e})"
    if not zipfile.is_zipfile(d / "optimizer.pt"):
        return "optimizer.pt is not a complete torch.save archive"
    return ""
