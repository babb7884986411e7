"""Trackers: every metrics row the run directory writes also reaches TensorBoard and an offline wandb run under
the same names; wandb without its package is refused with the install hint; unknown trackers are refused."""

import importlib.util
import json
import time

import pytest

from miles.run_dir import RunDir
from miles.trackers import LogConfig, Trackers, scalars


def test_tensorboard_gets_every_metrics_row_under_the_jsonl_names(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = RunDir(tmp_path)
    rows = [
        {"phase": "sft", "sft_step": 0, "loss": 2.0},
        {"step": 0, "phase": "eval", "eval/all/mean@4": 0.25, "eval/all/num_problems": 128},
        {"step": 0, "reward": 0.5, "time/step": 1.5, "finish": "stop"},
        {"step": 1, "reward": 0.75, "time/step": 1.25},
    ]
    with Trackers.open(LogConfig(trackers=("jsonl", "tensorboard")), run):
        for r in rows:
            run.append_metrics(r)
    run.append_metrics({"step": 2, "reward": 1.0})  # closed: no longer forwarded
    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert jsonl[:4] == rows
    acc = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert set(acc.Tags()["scalars"]) == {"sft/loss", "eval/all/mean@4", "eval/all/num_problems", "reward", "time/step"}
    assert [(e.step, e.value) for e in acc.Scalars("reward")] == [(0, 0.5), (1, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/all/mean@4")] == [(0, 0.25)]


def test_scalars_keep_numbers_only_and_put_warmup_rows_under_sft():
    assert scalars({"step": 3, "reward": 1, "ok": True, "name": "x"}) == (3, {"reward": 1.0})
    assert scalars({"phase": "sft", "sft_step": 2, "loss": 0.5}) == (2, {"sft/loss": 0.5})


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_without_its_package_is_refused_with_the_install_hint():
    with pytest.raises(
        ValueError, match=r"log.trackers has 'wandb' but the wandb package is not installed: pip install wandb"
    ):
        LogConfig(trackers=("jsonl", "wandb"))


def test_an_unknown_tracker_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"has unknown \['mlflow'\]; choose from \('jsonl', 'tensorboard', 'wandb'\)"):
        LogConfig(trackers=("mlflow",))


def _wandb_history(run_file) -> list[dict]:
    """The history records of an offline wandb run file: a LevelDB-style log (32 KiB blocks, 7-byte record
    headers: crc, length, type full/first/middle/last) of protobuf Records after wandb's 7-byte file header."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunks, part = run_file.read_bytes(), 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # block trailer or padding
            pos += left
            continue
        body, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        part = body if kind in (1, 2) else part + body
        if kind in (1, 4):
            chunks.append(part)
    out = []
    for c in chunks:
        r = pb.Record()
        r.ParseFromString(c)
        if r.WhichOneof("record_type") == "history":
            out.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return out


def test_wandb_offline_gets_every_warmup_and_rl_row_on_its_own_axis(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = RunDir(tmp_path)
    rows = [{"phase": "sft", "sft_step": i, "loss": 2.0 - i} for i in range(3)]
    rows += [{"step": i, "reward": 0.25 * i, "loss": 1.0} for i in range(3)]
    with Trackers.open(LogConfig(trackers=("jsonl", "wandb")), run):
        for r in rows:
            run.append_metrics(r)
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 20  # wandb's own process writes the file; it may still be flushing
    while len(history := _wandb_history(run_file)) < len(rows) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [(h["sft_step"], h["sft/loss"]) for h in history if "sft/loss" in h] == [(0, 2.0), (1, 1.0), (2, 0.0)]
    assert [(h["rl_step"], h["reward"]) for h in history if "reward" in h] == [(0, 0.0), (1, 0.25), (2, 0.5)]
