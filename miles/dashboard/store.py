"""The run directory: the one format the driver writes during a run and the dashboard reads, live.

```
RUN_DIR/
  config.json                 the resolved RunConfig
  metrics.jsonl               one object per RL step (step, reward, loss, time/*, mem/*, ...; keys vary)
  ledger.jsonl                one object per memory event (LedgerEvent fields, plus step)
  rollouts/step_000012/       one directory per RL step, published atomically (never half a step)
    summary.json              step, num_samples, num_tokens, mean_reward, max_tokens (what the step list shows)
    index.json                the same, plus per-sample metadata and the column layout
    tokens.int32              flat per-token columns over all samples of the step, in sample order;
    loss_mask.uint8           sample i owns tokens [token_start, token_start + num_tokens)
    rollout_log_probs.float32   NaN where unknown (prompt tokens, a missing stat)
    train_log_probs.float32
    advantages.float32
    entropy.float32
    token_text_len.uint32     display length of each token's text in UTF-16 code units (what JS slices by)
    token_text.utf8           every token's display text, concatenated (sample i: token_text_bytes at token_text_start)
    text.utf8                 prompt_text and response_text of every sample (byte ranges in index.json)
```

JSONL files are appended one complete line per ``write``; a reader keeps only lines that end in a newline,
so a line being written is never parsed. A sample's whole token range travels in ONE response
(:meth:`RunDirReader.sample_chunks`): the token strip and the per-token chart share it, and the server
streams it from the column files in bounded chunks without loading the step.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from miles.atomic import atomic_directory, atomic_write_text

ROLLOUTS = "rollouts"
STEP_DIR = re.compile(r"^step_(\d{6,})$")
FLOAT_COLUMNS = ("rollout_log_probs", "train_log_probs", "advantages", "entropy")
# name -> numpy dtype, in the order they are sent to the browser (every column is 8-byte aligned there)
COLUMNS = {
    "tokens": "int32",
    **dict.fromkeys(FLOAT_COLUMNS, "float32"),
    "token_text_len": "uint32",
    "loss_mask": "uint8",
}
SAMPLE_MAGIC = b"MLSD"  # sample payload: magic, u32 header length, header JSON, padded columns
CHUNK_BYTES = 1 << 20
META_KEYS = ("index", "group", "reward", "weight_version", "finish_reason")
PER_SAMPLE_KEYS = {
    "tokens",
    "token_text",
    "loss_mask",
    "prompt_len",
    "prompt_text",
    "response_text",
    *FLOAT_COLUMNS,
    "row",
    "num_tokens",
    "response_len",
    "token_start",
    "token_text_start",
    "token_text_bytes",
    "text",
    "preview",
}


def _is_scalar(value) -> bool:
    return isinstance(value, bool | int | float | np.generic) or (isinstance(value, str) and len(value) <= 1000)


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _full_length(name: str, values, num_tokens: int, prompt_len: int, fill: float) -> np.ndarray:
    """Per-token values given over the whole sequence or over the response only, as a full-length array."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.shape == (num_tokens,):
        return arr
    if arr.shape == (num_tokens - prompt_len,):
        return np.concatenate([np.full(prompt_len, fill), arr])
    raise ValueError(
        f"sample field {name!r} has {arr.shape} values but the sample has {num_tokens} tokens with prompt_len "
        f"{prompt_len}; give one value per token ({num_tokens}) or per response token ({num_tokens - prompt_len})"
    )


@dataclass(slots=True)
class RolloutDumpWriter:
    """Writes one directory of columns per RL step under ``RUN_DIR/rollouts``; the dashboard reads it live.

    writer = RolloutDumpWriter(run_dir)       # or RolloutDumpWriter(run_dir=run_dir)
    writer.write_step(3, [{"index": 0, "group": 0, "reward": 1.0, "tokens": [...], "token_text": [...],
                           "prompt_len": 5, "prompt_text": "...", "response_text": "...",
                           "loss_mask": [...], "rollout_log_probs": [...], "advantages": [...]}, ...])

    Per-token fields (loss_mask, rollout_log_probs, train_log_probs, advantages, entropy) may cover the whole
    sequence (len(tokens)) or only the response (len(tokens) - prompt_len); prompt positions are then stored
    as NaN (stats) or 0 (loss_mask). A missing loss_mask means every response token is trained on; a missing
    stat is NaN. Other scalar fields (str, int, float, bool; e.g. "target") are kept as sample metadata.
    Writing a step that already exists replaces it (a resumed run redoing a step).
    """

    run_dir: str | os.PathLike

    def write_step(self, step: int, samples: list[dict]) -> Path:
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step = {step!r} must be a non-negative int")
        final = Path(self.run_dir) / ROLLOUTS / step_dir_name(step)
        staging = final.with_name(f".{final.name}.new")
        shutil.rmtree(staging, ignore_errors=True)
        with atomic_directory(staging) as tmp:
            self._write_columns(Path(tmp), step, samples)
        if final.exists():  # replace: the gap between the two renames only hides the step for an instant
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(staging, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, final)
        return final

    def _write_columns(self, out: Path, step: int, samples: list[dict]) -> None:
        files = {name: open(out / f"{name}.{dtype}", "wb") for name, dtype in COLUMNS.items()}
        files["token_text"] = open(out / "token_text.utf8", "wb")
        files["text"] = open(out / "text.utf8", "wb")
        metas, pos = [], {"token": 0, "token_text": 0, "text": 0}
        try:
            for row, sample in enumerate(samples):
                metas.append(self._write_sample(files, pos, row, sample))
        finally:
            for f in files.values():
                f.close()
        rewards = [m["reward"] for m in metas if isinstance(m.get("reward"), (int, float))]
        summary = {
            "format": 1,
            "step": step,
            "num_samples": len(metas),
            "num_tokens": pos["token"],
            "mean_reward": (sum(rewards) / len(rewards)) if rewards else None,
            "max_tokens": max((m["num_tokens"] for m in metas), default=0),
        }
        index = {**summary, "columns": dict(COLUMNS), "samples": metas}
        atomic_write_text(out / "summary.json", json.dumps(_clean(summary), allow_nan=False))
        atomic_write_text(out / "index.json", json.dumps(_clean(index), allow_nan=False, default=str))

    def _write_sample(self, files: dict, pos: dict, row: int, sample: dict) -> dict:
        tokens = np.asarray(sample["tokens"], dtype=np.int64)
        n, prompt_len = len(tokens), int(sample.get("prompt_len", 0))
        if not 0 <= prompt_len <= n:
            raise ValueError(f"sample {row}: prompt_len = {prompt_len} must be within [0, {n}] (len(tokens))")
        # round-trip through UTF-8 so stored bytes and UTF-16 lengths agree even for lone surrogates
        texts = [
            str(t).encode(errors="replace").decode() for t in sample.get("token_text") or map(str, tokens.tolist())
        ]
        if len(texts) != n:
            raise ValueError(f"sample {row}: {len(texts)} token_text strings for {n} tokens; give one per token")
        columns = {"tokens": tokens}
        for name in FLOAT_COLUMNS:
            values = sample.get(name)
            columns[name] = np.full(n, np.nan) if values is None else _full_length(name, values, n, prompt_len, np.nan)
        mask = sample.get("loss_mask")
        columns["loss_mask"] = (
            (np.arange(n) >= prompt_len) if mask is None else _full_length("loss_mask", mask, n, prompt_len, 0)
        )
        columns["token_text_len"] = np.fromiter((len(t.encode("utf-16-le")) // 2 for t in texts), np.int64, n)
        for name, dtype in COLUMNS.items():
            files[name].write(np.ascontiguousarray(columns[name], dtype=dtype).tobytes())
        token_text = "".join(texts).encode()
        files["token_text"].write(token_text)
        text_ranges = {}
        for key in ("prompt_text", "response_text"):
            data = str(sample.get(key, "")).encode(errors="replace")
            files["text"].write(data)
            text_ranges[key] = [pos["text"], len(data)]
            pos["text"] += len(data)
        meta = {
            k: _clean(v) for k, v in sample.items() if k in META_KEYS or (k not in PER_SAMPLE_KEYS and _is_scalar(v))
        }
        meta.update(
            row=row,
            num_tokens=n,
            prompt_len=prompt_len,
            response_len=n - prompt_len,
            token_start=pos["token"],
            token_text_start=pos["token_text"],
            token_text_bytes=len(token_text),
            text=text_ranges,
            preview=str(sample.get("response_text", ""))[:120],
        )
        pos["token"] += n
        pos["token_text"] += len(token_text)
        return meta


def _clean(value):
    """JSON has no NaN/inf: they become null (a browser's JSON.parse rejects the bare words)."""
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value.item() if isinstance(value, np.generic) else value


def _json_line(row: dict) -> str:
    return json.dumps(_clean(row), default=str) + "\n"


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
