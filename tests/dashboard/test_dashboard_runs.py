"""A folder of runs (`miles dashboard runs/`): which directories are runs, ?run=NAME on every endpoint, the newest run
first, a directory that is neither a run nor a folder of runs refused with the reason, and the checkpoints listing the
Memory tab matches against the ledger."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from miles.checkpoints import DATA_FILES, Checkpoints
from miles.dashboard.runs import NotARunDir, RunCatalog
from miles.dashboard.server import create_app, main
from miles.dashboard.store import NotInRunDir, RunDirWriter


def write_run(path, reward: float, mtime: float | None = None):
    run = RunDirWriter(run_dir=path)
    run.write_config({"run_dir": str(path)})
    run.append_metrics({"step": 0, "reward": reward})
    if mtime is not None:
        for name in ("config.json", "metrics.jsonl"):
            os.utime(path / name, (mtime, mtime))
    return path


@pytest.fixture
def runs(tmp_path):
    write_run(tmp_path / "older", 0.1, mtime=1_000_000)
    write_run(tmp_path / "newer", 0.9, mtime=2_000_000)
    (tmp_path / "notes").mkdir()  # not a run: no config, metrics, ledger or rollouts
    (tmp_path / "README.txt").write_text("runs of the week")
    return tmp_path


def client(path):
    return TestClient(create_app(path), base_url="http://127.0.0.1", raise_server_exceptions=False)


def test_a_folder_lists_its_runs_and_opens_the_newest(runs):
    catalog = RunCatalog(runs)
    assert not catalog.single and catalog.names() == ["newer", "older"] and catalog.default() == "newer"
    listing = client(runs).get("/api/runs").json()
    assert listing["folder"] is True and listing["default"] == "newer"
    assert [r["name"] for r in listing["runs"]] == ["newer", "older"]


def test_every_endpoint_reads_the_run_it_names(runs):
    c = client(runs)
    assert c.get("/api/metrics").json()["rows"][0]["reward"] == 0.9  # the newest by default
    assert c.get("/api/metrics?run=older").json()["rows"][0]["reward"] == 0.1
    assert c.get("/api/info?run=older").json()["name"] == "older"
    assert c.get("/api/config?run=older").json()["run_dir"].endswith("older")


@pytest.mark.parametrize("name", ["notes", "../older", "older/..", "nosuch", ".", "/etc"])
def test_a_name_that_is_not_one_of_the_runs_is_a_404_listing_the_runs(runs, name):
    r = client(runs).get("/api/metrics", params={"run": name})
    assert r.status_code == 404 and "newer, older" in r.json()["detail"]


def test_a_run_directory_is_served_as_the_one_run(runs):
    catalog = RunCatalog(runs / "older")
    assert catalog.single and catalog.names() == ["older"]
    assert client(runs / "older").get("/api/runs").json()["folder"] is False
    with pytest.raises(NotInRunDir):
        catalog.reader("newer")


def test_an_empty_directory_is_a_run_not_written_yet(tmp_path):
    assert RunCatalog(tmp_path).single  # `miles dashboard --follow` started before `miles train`


def test_a_directory_that_holds_no_run_is_refused_with_what_it_holds(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "README.txt").write_text("x")
    with pytest.raises(NotARunDir, match=r"not a run directory .*\(it has README.txt, notes\)"):
        RunCatalog(tmp_path)


def test_the_cli_refuses_a_directory_that_holds_no_run_in_one_line(tmp_path, capsys):
    (tmp_path / "data.csv").write_text("a,b\n")
    assert main([str(tmp_path), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "not a run directory" in err and "miles train" in err


def test_checkpoints_are_listed_with_the_time_their_manifest_was_written(tmp_path):
    write_run(tmp_path, 0.5)

    def trainer_files(directory):
        for name in DATA_FILES:
            (Path(directory) / name).write_bytes(b"x")

    path = Checkpoints(tmp_path / "checkpoints").save(25, trainer_files)  # as the driver publishes one
    (tmp_path / "checkpoints" / "step_000007.broken-20261204T000000Z").mkdir()  # moved aside: not listed
    listed = client(tmp_path).get("/api/checkpoints").json()["checkpoints"]
    assert listed == [{"step": 25, "name": "step_000025", "saved_at": (path / "state.json").stat().st_mtime}]
    assert json.loads((path / "state.json").read_text())["next_step"] == 25
