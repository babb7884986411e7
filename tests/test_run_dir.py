"""The run directory without Ray: what may be opened, the lock, consistent truncation on resume."""

import json
import os

import pytest

from miles.config import apply_overrides
from miles.recipes import quickstart
from miles.run_dir import RunDir, RunDirBusy, RunDirError


def _config(**model) -> dict:
    cfg = quickstart().to_dict()
    cfg["model"].update(model)
    return cfg


def _write_files(tmp: str) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.arange(4.0)}, os.path.join(tmp, "model.safetensors"))
    torch.save({"state": {}, "param_groups": []}, os.path.join(tmp, "optimizer.pt"))


def _a_run(path, steps=(2, 4), rows=5) -> RunDir:
    """A finished run in ``path``: config.json, metrics/ledger/processes rows for steps 0..rows-1, rollouts, checkpoints."""
    with RunDir.open(str(path), resume=True, config=_config()) as run:
        run.begin(0, json.dumps(_config()), resumed=False)
        for s in range(rows):
            run.append_metrics({"step": s, "reward": s / 10})
            run._append("ledger.jsonl", [{"step": s, "bytes": 1}, {"step": s, "bytes": 2}])
            run._append("processes.jsonl", [{"step": s, "rss_bytes": 3}])
            (run.path / "rollouts" / f"step_{s:06d}").mkdir(parents=True)
        for s in steps:
            run.checkpoints.save(s, _write_files)
    return run


def test_resume_false_over_a_run_with_checkpoints_is_refused_and_deletes_nothing(tmp_path):
    _a_run(tmp_path / "run")
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    with pytest.raises(RunDirError, match=r"holds an earlier run \(2 checkpoints, the newest step_000004, 5 metrics"):
        RunDir.open(str(tmp_path / "run"), resume=False, config=_config())
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before


def test_resume_false_with_overwrite_deletes_the_old_run_whole_so_the_new_checkpoints_are_written(tmp_path):
    _a_run(tmp_path / "run")
    (tmp_path / "run" / "notes.txt").write_text("mine")
    with RunDir.open(str(tmp_path / "run"), resume=False, overwrite=True, config=_config()) as run:
        assert run.checkpoints.latest() is None and not run.metrics()
        run.begin(0, json.dumps(_config()), resumed=False)
        written = run.checkpoints.save(2, _write_files)
    assert json.loads((written / "state.json").read_text())["files"]["model.safetensors"]["bytes"] > 0
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"  # not a run's file: kept


@pytest.mark.parametrize("path", ["", "  "])
def test_an_empty_run_dir_is_refused_before_anything_is_written(tmp_path, path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "precious.txt").write_text("data")
    with pytest.raises(RunDirError, match="run_dir is empty; give the run a directory"):
        RunDir.open(path, resume=True, config=_config())
    assert (tmp_path / "rollouts" / "precious.txt").read_text() == "data"
    assert sorted(os.listdir(tmp_path)) == ["rollouts"]


def test_a_directory_that_is_not_a_run_is_refused_and_its_files_stay(tmp_path):
    proj = tmp_path / "proj"
    (proj / "rollouts").mkdir(parents=True)
    (proj / "rollouts" / "precious.txt").write_text("data")
    (proj / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RunDirError, match=r"holds no miles run .*metrics.jsonl, rollouts.*overwrite=true"):
        RunDir.open(str(proj), resume=True, config=_config())
    with pytest.raises(RunDirError, match=r"has \['metrics.jsonl', 'rollouts'\], which a run would write over"):
        RunDir.open(str(proj), resume=False, overwrite=True, config=_config())
    assert (proj / "rollouts" / "precious.txt").read_text() == "data" and (proj / "metrics.jsonl").read_text() == "{}\n"
    assert sorted(os.listdir(proj)) == ["metrics.jsonl", "rollouts"]  # no lock file, no config.json left behind


def test_overwrite_lets_a_run_write_into_a_directory_of_other_files_and_keeps_them(tmp_path):
    (tmp_path / "paper.tex").write_text("x")
    with RunDir.open(str(tmp_path), resume=True, overwrite=True, config=_config()) as run:
        run.begin(0, json.dumps(_config()), resumed=False)
    assert (tmp_path / "paper.tex").read_text() == "x" and (tmp_path / "config.json").exists()


def test_a_run_dir_that_is_a_file_is_refused_with_a_one_line_message(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunDirError, match=r"run_dir = '.*f' is a file, not a directory"):
        RunDir.open(str(tmp_path / "f"), resume=True, config=_config())


def test_a_second_run_on_a_locked_run_dir_is_refused_naming_the_holders_pid(tmp_path):
    with RunDir.open(str(tmp_path / "run"), resume=True, config=_config()):
        with pytest.raises(RunDirBusy, match=rf"in use by another run \(pid {os.getpid()}\)"):
            RunDir.open(str(tmp_path / "run"), resume=True, config=_config())
    RunDir.open(str(tmp_path / "run"), resume=True, config=_config()).close()  # released when the first closes


def test_a_resume_with_a_different_model_is_refused_before_config_json_changes(tmp_path):
    _a_run(tmp_path / "run")
    saved = (tmp_path / "run" / "config.json").read_text()
    with pytest.raises(RunDirError, match=r"different model: model.hidden_size = 64 \(the run has 128\)"):
        RunDir.open(str(tmp_path / "run"), resume=True, config=_config(hidden_size=64))
    assert (tmp_path / "run" / "config.json").read_text() == saved


def test_a_resume_truncates_every_jsonl_and_the_rollout_dumps_to_the_resumed_step(tmp_path):
    _a_run(tmp_path / "run", rows=6)
    with RunDir.open(str(tmp_path / "run"), resume=True, config=_config()) as run:
        run._append("metrics.jsonl", [{"phase": "sft", "sft_step": 0}])
        run._append("ledger.jsonl", [{"step": -1, "bytes": 9}])
        next_step, _ = run.checkpoints.latest()
        run.begin(next_step, json.dumps(_config()), resumed=True)
        steps = {name: [r.get("step") for r in run.rows(name)] for name in ("metrics.jsonl", "processes.jsonl")}
        ledger = [r["step"] for r in run.rows("ledger.jsonl")]
    assert next_step == 4
    assert steps == {"metrics.jsonl": [0, 1, 2, 3, None], "processes.jsonl": [0, 1, 2, 3]}
    assert ledger == [0, 0, 1, 1, 2, 2, 3, 3, -1]
    assert sorted(os.listdir(tmp_path / "run" / "rollouts")) == [f"step_{s:06d}" for s in range(4)]


def test_a_fresh_start_in_a_run_without_checkpoints_clears_its_logs_only(tmp_path):
    _a_run(tmp_path / "run", steps=())
    (tmp_path / "run" / "notes.txt").write_text("mine")
    with RunDir.open(str(tmp_path / "run"), resume=True, config=_config()) as run:
        assert run.checkpoints.latest() is None
        run.begin(0, json.dumps(_config()), resumed=False)
        assert run.metrics() == [] and not (run.path / "rollouts").exists()
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"


def test_overwrite_is_a_config_field_that_defaults_to_false():
    assert quickstart().overwrite is False and apply_overrides(quickstart(), ["overwrite=true"]).overwrite is True


@pytest.mark.parametrize("text", ["garbage{", "[1, 2]", '{"recipe": "x"}'], ids=["not-json", "a-list", "not-a-run"])
def test_a_config_json_that_miles_did_not_write_is_no_run_so_it_is_refused_and_kept(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(RunDirError, match=r"holds no miles run .*it has config.json"):
        RunDir.open(str(tmp_path), resume=True, config=_config())
    with pytest.raises(RunDirError, match=r"has \['config.json'\], which a run would write over"):
        RunDir.open(str(tmp_path), resume=True, overwrite=True, config=_config())
    assert (tmp_path / "config.json").read_text() == text and os.listdir(tmp_path) == ["config.json"]
