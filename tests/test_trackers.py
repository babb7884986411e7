"""Trackers: every metrics row the run directory writes also reaches TensorBoard under the same names; wandb
without its package is refused with the install hint; unknown trackers are refused."""

import importlib.util
import json

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
