"""The dashboard's side of the run directory (its format: miles.run_dir), safe to read while the driver writes it.

JSONL files are appended one complete line per ``write``; a reader keeps only lines that end in a newline,
so a line being written is never parsed. A sample's whole token range travels in ONE response
(:meth:`RunDirReader.sample_chunks`): the token strip and the per-token chart share it, and the server
streams it from the column files in bounded chunks without loading the step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from miles.atomic import atomic_write_text
from miles.rollout_dump import COLUMNS, ROLLOUTS, STEP_DIR, json_safe, step_dir_name

SAMPLE_MAGIC = b"MLSD"  # sample payload: magic, u32 header length, header JSON, padded columns
CHUNK_BYTES = 1 << 20


def _json_line(row: dict) -> str:
    return json.dumps(json_safe(row), default=str) + "\n"


@dataclass(slots=True)
class RunDirWriter:
    """The driver's side of the run directory, apart from rollouts (see RolloutDumpWriter).

    run = RunDirWriter(run_dir)
    run.write_config(cfg.to_dict())
    run.append_metrics({"step": 1, "reward": 0.4, "time/train": 1.2})
    run.append_ledger([{**asdict(event), "step": 1} for event in events])
    """

    run_dir: str | os.PathLike

    def write_config(self, config: dict) -> None:
        atomic_write_text(Path(self.run_dir) / "config.json", json.dumps(config, indent=1, default=str))

    def append_metrics(self, row: dict) -> None:
        self._append("metrics.jsonl", [row])

    def append_ledger(self, rows: list[dict]) -> None:
        self._append("ledger.jsonl", rows)

    def _append(self, name: str, rows: list[dict]) -> None:
        if not rows:
            return
        path = Path(self.run_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        data = "".join(_json_line(r) for r in rows).encode()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:  # one write of whole lines: a reader never sees a torn line it would keep
            os.write(fd, data)
        finally:
            os.close(fd)


class NotInRunDir(LookupError):
    """A name that does not resolve to a file of this run directory (absent, or pointing outside it)."""


class RunDirReader:
    """The dashboard's read side of a run directory: safe to use while the driver is writing it.

    reader = RunDirReader(run_dir)
    rows, next_offset = reader.read_jsonl("metrics.jsonl", offset=0)   # poll again from next_offset
    reader.steps()                          # [{"step": 1, "num_samples": 32, ...}, ...]
    reader.step_index(1)["samples"][0]      # metadata of one sample
    size, chunks = reader.sample_chunks(1, 0)   # one sample's whole token range, streamed
    """

    JSONL = ("metrics.jsonl", "ledger.jsonl")

    def __init__(self, run_dir: str | os.PathLike):
        self.root = Path(run_dir).resolve()
        if not self.root.is_dir():
            raise FileNotFoundError(f"run directory {run_dir} does not exist; pass the run_dir a driver wrote")
        self._cache: dict[tuple[int, str], tuple[tuple[int, int], dict]] = {}

    def path(self, *parts: str) -> Path:
        """A path inside the run directory; anything resolving outside it (.., symlinks) is refused."""
        path = self.root.joinpath(*parts).resolve()
        if not path.is_relative_to(self.root) or not path.exists():
            raise NotInRunDir("/".join(parts))
        return path

    def config(self) -> dict:
        try:
            return json.loads(self.path("config.json").read_text())
        except NotInRunDir:
            return {}

    def read_jsonl(self, name: str, offset: int = 0, max_bytes: int = 4 << 20) -> tuple[list[dict], int]:
        """Complete lines from byte ``offset`` (at most ~max_bytes of them) and the offset to poll from next."""
        if name not in self.JSONL:
            raise NotInRunDir(name)
        try:
            path = self.path(name)
        except NotInRunDir:
            return [], 0
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(max_bytes)
            if len(data) == max_bytes:  # finish the line that crosses the boundary
                data += f.readline()
        end = data.rfind(b"\n") + 1
        # NaN / Infinity (json.dumps writes them by default) become null: browsers cannot parse them
        rows = [json.loads(line, parse_constant=lambda _: None) for line in data[:end].splitlines() if line.strip()]
        return rows, offset + end

    def steps(self) -> list[dict]:
        """One small summary per published step (never the per-sample index: a long run has many steps)."""
        out = []
        for step in self._step_numbers():
            for name in ("summary.json", "index.json"):  # dumps written before summary.json existed
                try:
                    out.append(
                        {k: v for k, v in self._cached_json(step, name).items() if k not in ("samples", "columns")}
                    )
                    break
                except NotInRunDir:
                    continue
        return out

    def checkpoints(self) -> list[dict]:
        """The run's published checkpoints (``checkpoints/step_N``, N = the next RL step) and when each was written:
        the mtime of its manifest, state.json, written last. The Memory tab matches these times against the ledger
        to name a checkpoint save as the cause of a peak (saving onloads the trainer's state)."""
        out = []
        base = self.root / "checkpoints"
        for d in sorted(base.iterdir()) if base.is_dir() else ():
            m = STEP_DIR.match(d.name)
            manifest = d / "state.json"
            if m and manifest.is_file() and manifest.resolve().is_relative_to(self.root):
                out.append({"step": int(m.group(1)), "name": d.name, "saved_at": manifest.stat().st_mtime})
        return out

    def _step_numbers(self) -> list[int]:
        base = self.root / ROLLOUTS
        if not base.is_dir():
            return []
        return sorted(int(m.group(1)) for p in base.iterdir() if (m := STEP_DIR.match(p.name)))

    def step_index(self, step: int) -> dict:
        return self._cached_json(step, "index.json")

    def _cached_json(self, step: int, name: str) -> dict:
        path = self.path(ROLLOUTS, step_dir_name(step), name)
        stat = path.stat()
        key, stamp = (step, name), (stat.st_ino, stat.st_mtime_ns)  # a replaced step has a new inode
        cached = self._cache.get(key)
        if cached is None or cached[0] != stamp:
            if len(self._cache) > 256:
                self._cache.clear()
            cached = (stamp, json.loads(path.read_text()))
            self._cache[key] = cached
        return cached[1]

    def sample_meta(self, step: int, row: int) -> dict:
        samples = self.step_index(step)["samples"]
        if not 0 <= row < len(samples):
            raise NotInRunDir(f"step {step} has {len(samples)} samples; row {row} does not exist")
        return samples[row]

    def sample_chunks(self, step: int, row: int) -> tuple[int, Iterator[bytes]]:
        """One sample as a binary payload (total size, chunks): every per-token column plus its metadata.

        Layout (little-endian): b"MLSD", u32 header length H, H bytes of header JSON (padded so columns
        start 8-byte aligned), then each column of ``header["columns"]`` at its ``offset`` from the end of
        the header. The header holds the sample's metadata with prompt_text and response_text.
        """
        meta = self.sample_meta(step, row)
        num_samples = len(self.step_index(step)["samples"])
        step_dir = self.path(ROLLOUTS, step_dir_name(step))
        n, start = meta["num_tokens"], meta["token_start"]
        ranges, layout, offset = [], [], 0  # (file, byte start, byte count) per column
        for name, dtype in COLUMNS.items():
            size = np.dtype(dtype).itemsize
            ranges.append((step_dir / f"{name}.{dtype}", start * size, n * size))
            layout.append({"name": name, "dtype": dtype, "offset": offset, "length": n})
            offset += _pad8(n * size)
        text_bytes = meta["token_text_bytes"]
        ranges.append((step_dir / "token_text.utf8", meta["token_text_start"], text_bytes))
        layout.append({"name": "token_text", "dtype": "utf8", "offset": offset, "length": text_bytes})
        header = {
            "step": step,
            "step_num_samples": num_samples,
            "sample": {**meta, **self._texts(step_dir, meta)},
            "num_tokens": n,
            "columns": layout,
        }
        head = json.dumps(header, allow_nan=False).encode()
        head += b" " * (_pad8(8 + len(head)) - 8 - len(head))
        prefix = SAMPLE_MAGIC + len(head).to_bytes(4, "little") + head
        total = len(prefix) + offset + _pad8(text_bytes)
        return total, _stream(prefix, ranges)

    def _texts(self, step_dir: Path, meta: dict) -> dict:
        out = {}
        with open(step_dir / "text.utf8", "rb") as f:
            for key, (start, size) in meta["text"].items():
                f.seek(start)
                out[key] = f.read(size).decode(errors="replace")
        return out


def decode_sample(data: bytes) -> dict:
    """The payload of RunDirReader.sample_chunks (GET /api/steps/S/samples/R) as numpy columns + metadata."""
    if data[:4] != SAMPLE_MAGIC:
        raise ValueError(f"not a sample payload (starts with {data[:4]!r}, expected {SAMPLE_MAGIC!r})")
    head_len = int.from_bytes(data[4:8], "little")
    header = json.loads(data[8 : 8 + head_len])
    base = 8 + head_len
    out = {"step": header["step"], **header["sample"]}
    for c in header["columns"]:
        start = base + c["offset"]
        if c["dtype"] == "utf8":
            out[c["name"]] = data[start : start + c["length"]].decode()
        else:
            out[c["name"]] = np.frombuffer(data, c["dtype"], c["length"], start)
    ends = np.cumsum(out["token_text_len"])  # UTF-16 units; equal to characters outside the astral planes
    text16 = out["token_text"].encode("utf-16-le")
    out["token_strings"] = [text16[2 * a : 2 * b].decode("utf-16-le") for a, b in zip(np.r_[0, ends[:-1]], ends)]
    return out


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def _stream(prefix: bytes, ranges: list[tuple[Path, int, int]]) -> Iterator[bytes]:
    yield prefix
    for path, start, size in ranges:
        if path.name == "weight_versions.int32" and not path.exists():  # a dump from before per-token versions
            yield np.full(size // 4, -1, dtype=np.int32).tobytes() + b"\0" * (-size % 8)
            continue
        with open(path, "rb") as f:
            f.seek(start)
            left = size
            while left > 0:
                chunk = f.read(min(CHUNK_BYTES, left))
                if not chunk:
                    raise OSError(f"{path} ended {left} bytes early; the step directory is damaged")
                left -= len(chunk)
                yield chunk
        if size % 8:
            yield b"\0" * (8 - size % 8)
