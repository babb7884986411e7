"""The rollout dump: one directory of per-token columns per RL step under ``RUN_DIR/rollouts``, published
atomically (never half a step). The driver writes it (RolloutDumpWriter); the dashboard reads it live
(miles.dashboard.store).

```
rollouts/step_000012/
  summary.json              step, num_samples, num_tokens, mean_reward, max_tokens (what the step list shows)
  index.json                the same, plus per-sample metadata and the column layout
  tokens.int32              flat per-token columns over all samples of the step, in sample order;
  loss_mask.uint8           sample i owns tokens [token_start, token_start + num_tokens)
  rollout_log_probs.float32   NaN where unknown (prompt tokens, a missing stat)
  train_log_probs.float32
  advantages.float32
  entropy.float32
  weight_versions.int32     the weight version each token was sampled under (-1: prompt tokens, or not known)
  token_text_len.uint32     display length of each token's text in UTF-16 code units (what JS slices by)
  token_text.utf8           every token's display text, concatenated (sample i: token_text_bytes at token_text_start)
  text.utf8                 prompt_text and response_text of every sample (byte ranges in index.json)
```
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
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
    "weight_versions": "int32",
    "token_text_len": "uint32",
    "loss_mask": "uint8",
}
META_KEYS = ("index", "group", "reward", "weight_version", "finish_reason")
PER_SAMPLE_KEYS = {
    "tokens",
    "token_text",
    "loss_mask",
    "prompt_len",
    "prompt_text",
    "response_text",
    *FLOAT_COLUMNS,
    "weight_versions",
    "row",
    "num_tokens",
    "response_len",
    "token_start",
    "token_text_start",
    "token_text_bytes",
    "text",
    "preview",
    "spans",
}
SPAN_KINDS = ("prompt", "model", "env", "tool_call", "tool_result")


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
        atomic_write_text(out / "summary.json", json.dumps(json_safe(summary), allow_nan=False))
        atomic_write_text(out / "index.json", json.dumps(json_safe(index), allow_nan=False, default=str))

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
        versions = sample.get("weight_versions")
        columns["weight_versions"] = (
            np.full(n, -1) if versions is None else _full_length("weight_versions", versions, n, prompt_len, -1)
        )
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
            k: json_safe(v) for k, v in sample.items() if k in META_KEYS or (k not in PER_SAMPLE_KEYS and _is_scalar(v))
        }
        if sample.get("spans"):
            meta["spans"] = _spans(sample["spans"], n, row)
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


def _spans(spans, n: int, row: int) -> list[dict]:
    """A multi-turn sample's turn and tool spans (miles.envs.trajectory.Span rows), checked against its length."""
    out = []
    for s in spans:
        start, end, kind = int(s["start"]), int(s["end"]), str(s["kind"])
        if not 0 <= start <= end <= n or kind not in SPAN_KINDS:
            raise ValueError(
                f"sample {row}: span {s} must have 0 <= start <= end <= {n} (its tokens) and a kind in {SPAN_KINDS}"
            )
        out.append(
            {
                "start": start,
                "end": end,
                "kind": kind,
                "turn": int(s.get("turn", -1)),
                "label": str(s.get("label", ""))[:80],
            }
        )
    return out


def json_safe(value):
    """JSON has no NaN/inf: they become null (a browser's JSON.parse rejects the bare words)."""
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value.item() if isinstance(value, np.generic) else value
