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
    assert set(acc.Tags()["scalars"]) == {"eval/all/mean@4", "eval/all/num_problems", "reward", "time/step"}
    assert [(e.step, e.value) for e in acc.Scalars("reward")] == [(0, 0.5), (1, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/all/mean@4")] == [(0, 0.25)]
    sft = EventAccumulator(str(tmp_path / "tensorboard" / "sft")).Reload()  # the warm-up: a run of its own
    assert [(e.step, e.value) for e in sft.Scalars("sft/loss")] == [(0, 2.0)]


def test_tensorboard_keeps_the_warmup_on_its_own_axis_so_no_step_goes_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import event_file_inspector as inspector

    run = RunDir(tmp_path)
    with Trackers.open(LogConfig(trackers=("jsonl", "tensorboard")), run):
        for i in range(25):  # the quickstart's 25 warm-up steps, then RL steps from 0
            run.append_metrics({"phase": "sft", "sft_step": i, "loss": 2.0 - i / 25})
        for i in range(5):
            run.append_metrics({"step": i, "reward": i / 5})
    for d in (tmp_path / "tensorboard", tmp_path / "tensorboard" / "sft"):
        for f in d.glob("events.out.tfevents.*"):
            inspection = inspector.get_inspection_units(logdir=str(d), event_file=str(f))
            assert all(not u.field_to_obs["scalars"] or _monotone(u) for u in inspection), f


def _monotone(unit) -> bool:
    steps = [o["step"] for o in unit.field_to_obs["scalars"]]
    return all(a <= b for a, b in zip(steps, steps[1:]))


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


def _offline_ids(run_dir) -> list[str]:
    """The run id of each offline run directory, from its ``run-<id>.wandb`` file."""
    return sorted(f.stem.removeprefix("run-") for f in (run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_a_resumed_run_logs_into_the_same_wandb_run_and_a_fresh_start_into_a_new_one(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LogConfig(trackers=("jsonl", "wandb"))

    def start(next_step: int, resumed: bool, steps) -> None:
        with RunDir(tmp_path) as run, Trackers.open(cfg, run):
            run.begin(next_step, "{}", resumed=resumed)  # what the driver does once it knows (RunDir.begin)
            for i in steps:
                run.append_metrics({"step": i, "reward": 0.5})

    start(0, False, [0, 1])
    start(2, True, [2, 3])  # resumed from a checkpoint at step 2 (the review's K8: a second wandb run)
    ids = _offline_ids(tmp_path)
    assert len(ids) == 2 and ids[0] == ids[1], ids
    assert (tmp_path / "wandb_run_id").read_text().strip() == ids[0]
    start(0, False, [0])  # no checkpoint: a fresh start clears the logs, and the tracker run with them
    new = set(_offline_ids(tmp_path)) - {ids[0]}
    assert len(new) == 1 and (tmp_path / "wandb_run_id").read_text().strip() == new.pop()


def test_a_wandb_run_id_file_that_holds_no_id_starts_a_new_run_with_a_warning(tmp_path, monkeypatch, caplog):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb_run_id").write_text("../../etc\n")
    with (
        RunDir(tmp_path) as run,
        Trackers.open(LogConfig(trackers=("jsonl", "wandb")), run),
        caplog.at_level("WARNING"),
    ):
        run.append_metrics({"step": 0, "reward": 0.5})
    assert any("not a wandb run id" in m for m in caplog.messages)
    assert len(_offline_ids(tmp_path)) == 1 and "etc" not in _offline_ids(tmp_path)[0]
