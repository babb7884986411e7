"""The stall watchdog on real Ray runs (tiny model): a stall forced in each phase (generate, reward, train, sync,
eval) stops the run with one line naming the phase and the stall directory, which holds a stack file for every
miles process with the stuck frame in it; a stall on the rollout side saves the steps before it.

Stalls are forced through hooks a user has anyway where there is one: a ``module:function`` reward that holds the
GIL in a catastrophic regex (reward) or sleeps (eval). Generate, train and sync run only miles code, so there a test
fixture replaces one method inside the actor between two steps (``__ray_call__``). A flag file starts the stall
after RL step 0, so every run has one healthy step first."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tempfile
import time
from pathlib import Path

import psutil
import pytest

import miles.driver
from miles.cli import explain
from miles.data.config import DataConfig
from miles.driver import train
from miles.stall.watchdog import StallError
from tests.conftest import tiny_run_cfg

pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]  # procs: it starts processes or servers

WATCHDOG_S = 12  # long enough that no healthy phase of a tiny run on a loaded 2-core machine comes near it
REWARD_WATCHDOG_S = 30  # the first reward phase may start reward worker processes (torch imports) under load
FLAG = Path(tempfile.gettempdir()) / f"miles-stall-{hashlib.sha1(__file__.encode()).hexdigest()[:12]}"


def _stalled() -> bool:
    return FLAG.exists()


def regex_reward(prompt, response, target):
    """After the flag: a catastrophic regex, stuck in C with the GIL held (the 2026-12-04 verifier hang)."""
    if _stalled():
        re.match(r"(a+)+$", "a" * 64 + "!")
    return 0.5


def sleepy_verifier(prompt, response, target):
    """After the flag: never returns."""
    while _stalled():
        time.sleep(0.5)
    return float(response.strip() == target)


def stuck_in_generate(step):
    while True:
        time.sleep(0.5)


def stuck_in_train(batch, step=None):
    while True:
        time.sleep(0.5)


def stuck_in_sync(named, version):
    while True:
        time.sleep(0.5)


def _replace_samples(manager):
    manager.source.samples = stuck_in_generate


def _replace_train_step(actor):
    actor.backend.train_step = stuck_in_train


def _replace_sync_update(actor):
    actor.sync.update = stuck_in_sync


@pytest.fixture
def flag():
    FLAG.unlink(missing_ok=True)
    yield FLAG
    FLAG.unlink(missing_ok=True)


@pytest.fixture
def clusters(monkeypatch):
    """The Cluster of each run the test starts (the driver builds it inside ``train``)."""
    made = []

    class Recorded(miles.driver.Cluster):
        def __init__(self, cfg):
            super().__init__(cfg)
            made.append(self)

    monkeypatch.setattr(miles.driver, "Cluster", Recorded)
    return made


def _cfg(tmp_path, *overrides, watchdog_s=WATCHDOG_S):
    patient_rewards = (
        ["data.reward_timeout_s=600"] if "reward_timeout_s" in {f.name for f in dataclasses.fields(DataConfig)} else []
    )  # a reward time limit (where there is one) would end the reward stall first; here the watchdog must
    return tiny_run_cfg(
        tmp_path,
        "trainer.warmup_sft_steps=0",
        "num_steps=3",
        f"watchdog_s={watchdog_s}",
        *patient_rewards,
        *overrides,
    )


def _stall(cfg, on_step) -> tuple[str, Path, float]:
    t0 = time.monotonic()
    with pytest.raises(StallError) as e:
        train(cfg, progress=False, on_step=on_step)
    seconds = time.monotonic() - t0
    code, line = explain(e.value)
    assert code == 1 and "\n" not in line and line.startswith("failed: StallError: no progress for"), line
    (directory,) = Path(cfg.run_dir).glob("stall-*")
    assert str(directory) in line
    print(f"\n{line}\n{sorted(p.name for p in directory.iterdir())} in {seconds:.0f} s")
    return line, directory, seconds


def _stacks(directory: Path) -> dict[str, str]:
    """role -> the text of its stack file; every process listed got one, and each holds a traceback."""
    listed = (directory / "processes.txt").read_text().splitlines()
    assert not [row for row in listed if "no stack" in row], listed
    files = {re.sub(r"-\d+\.txt$", "", p.name): p.read_text() for p in directory.glob("*-*.txt")}
    assert {"driver", "rollout", "train-0"} <= set(files), sorted(files)
    assert all("most recent call first" in text for text in files.values()), files
    return files


def _stopped(directory: Path, roles: tuple[str, ...]) -> None:
    """The processes of the stuck side, and what they started, are gone."""
    pids = [int(p.stem.rsplit("-", 1)[1]) for p in directory.glob("*.txt") if p.name.startswith(roles)]
    assert pids and not [pid for pid in pids if psutil.pid_exists(pid)], pids


def test_a_reward_holding_the_gil_in_a_regex_stalls_in_reward_and_the_steps_before_it_are_saved(
    tmp_path, ray_session, flag
):
    cfg = _cfg(tmp_path, "checkpoint_every=0", f"task.reward={__name__}:regex_reward", watchdog_s=REWARD_WATCHDOG_S)
    line, directory, _ = _stall(cfg, lambda row: flag.touch())
    assert re.search(r"in phase reward \(RL step 1; the limit is 30 s", line), line
    assert "RL steps before 1 are saved in" in line and (Path(cfg.run_dir) / "checkpoints/step_000001").is_dir()
    files = _stacks(directory)
    stuck = [role for role, text in files.items() if "in regex_reward" in text]
    assert stuck and set(stuck) <= {"rollout", "worker"}, stuck  # in the rollout actor or a reward worker
    _stopped(directory, ("rollout", "worker"))


def test_a_stuck_generate_is_a_stall_in_generate_named_with_the_stuck_frame(tmp_path, ray_session, clusters):
    cfg = _cfg(tmp_path, "checkpoint_every=0")
    patch = lambda row: ray_session.get(clusters[0].rollout.__ray_call__.remote(_replace_samples))  # noqa: E731
    line, directory, _ = _stall(cfg, patch)
    assert "in phase generate (RL step 1;" in line and "RL steps before 1 are saved" in line, line
    assert "in stuck_in_generate" in _stacks(directory)["rollout"]
    _stopped(directory, ("rollout",))


def test_a_stuck_train_step_is_a_stall_in_train_and_stops_both_sides(tmp_path, ray_session, clusters):
    cfg = _cfg(tmp_path, "checkpoint_every=1")
    patch = lambda row: ray_session.get(clusters[0].trainer.actors[0].__ray_call__.remote(_replace_train_step))  # noqa: E731
    line, directory, _ = _stall(cfg, patch)
    assert "in phase train (RL step 1;" in line and "RL steps before 1 are saved" in line, line
    assert "in stuck_in_train" in _stacks(directory)["train-0"]
    _stopped(directory, ("rollout", "train"))


def test_a_stuck_weight_sync_is_a_stall_in_sync(tmp_path, ray_session, clusters):
    cfg = _cfg(tmp_path, "checkpoint_every=0")
    patch = lambda row: ray_session.get(clusters[0].trainer.actors[0].__ray_call__.remote(_replace_sync_update))  # noqa: E731
    line, directory, _ = _stall(cfg, patch)
    assert "in phase sync (RL step 1;" in line and "no checkpoint is saved" in line, line
    assert "in stuck_in_sync" in _stacks(directory)["train-0"]
    _stopped(directory, ("rollout", "train"))


def test_a_verifier_that_never_returns_in_eval_is_a_stall_in_eval_and_the_rerun_resumes(tmp_path, ray_session, flag):
    from miles.data.generate import generated_train, split_path

    cfg = _cfg(
        tmp_path,
        "checkpoint_every=0",
        "model.max_position_embeddings=160",
        "rollout.max_seq_len=160",
        "rollout.max_new_tokens=4",
        f"data.train={generated_train('mixed', 200, out_dir=tmp_path)}",
        f"data.eval={split_path('mixed')}",
        f"data.reward={__name__}:sleepy_verifier",
        "eval.every=1",
        "eval.at_start=false",
        "eval.k=1",
        "eval.max_problems=2",
        watchdog_s=REWARD_WATCHDOG_S,
    )
    line, directory, _ = _stall(cfg, lambda row: flag.touch())
    assert "in phase eval (RL step 1;" in line and "RL steps before 1 are saved" in line, line
    stuck = [role for role, text in _stacks(directory).items() if "in sleepy_verifier" in text]
    assert stuck and set(stuck) <= {"rollout", "worker"}, stuck
    saved = Path(cfg.run_dir) / "checkpoints/step_000001"
    assert json.loads((saved / "data_state.json").read_text())["next_step"] == 1  # written without the rollout
    flag.unlink()
    rows = train(cfg, progress=False)  # the same command, the verifier fixed: it resumes at step 1
    assert [r["step"] for r in rows] == [0, 1, 2]


def test_the_stacks_of_a_process_stuck_in_c_holding_the_gil_are_dumped(tmp_path):
    """No Ray: a child that registers as every miles process does (MILES_WATCH_DIR at ``import miles``) and then
    spins in a catastrophic regex on its main thread; a second thread sleeps. faulthandler answers the signal."""
    import subprocess
    import sys

    from miles.stall.stacks import dump_stacks, registered

    code = (
        "import re, threading, time, miles\n"
        "def idle():\n    time.sleep(600)\n"
        "def spin():\n    re.match(r'(a+)+$', 'a' * 64 + '!')\n"
        "threading.Thread(target=idle, daemon=True).start()\nprint('ready', flush=True)\nspin()\n"
    )
    env = {**os.environ, "MILES_WATCH_DIR": str(tmp_path / "watch"), "PYTHONPATH": str(Path(__file__).parents[1])}
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # inside the regex
        procs = registered(tmp_path / "watch")
        assert [p.pid for p in procs] == [child.pid]
        files = dump_stacks(procs, tmp_path / "stall", wait_s=10)
        text = (tmp_path / "stall" / f"{procs[0].role}-{child.pid}.txt").read_text()
        assert re.search(r"line 5 in spin", text) and "in idle" in text, text
        assert len(files) == 2 and files[0].name == f"driver-{os.getpid()}.txt"
    finally:
        child.kill()
        child.wait()
    assert registered(tmp_path / "watch") == [] and not list((tmp_path / "watch").iterdir())  # exited: dropped


def test_a_registration_whose_pid_now_names_another_process_is_never_signalled(tmp_path):
    """A pid reused by the kernel: same pid, another start time. SIGUSR1 would kill that process."""
    watch = tmp_path / "watch"
    watch.mkdir()
    me = psutil.Process()
    info = {"role": "engine-0", "pid": me.pid, "created": me.create_time() - 100, "phase": "", "since": 0}
    (watch / f"engine-0-{me.pid}.beat").write_text(json.dumps(info))
    from miles.stall.stacks import registered

    assert registered(watch) == [] and not (watch / f"engine-0-{me.pid}.beat").exists()


def test_heartbeats_are_progress_and_a_stall_is_named_after_the_sub_phase_a_process_entered(tmp_path):
    """No Ray: a registered child beats for 5 s (more than the 2 s limit) in its sub-phase 'reward', then hangs."""
    import subprocess
    import sys

    from miles.stall.watchdog import Watchdog

    stops = []
    wd = Watchdog(2, tmp_path / "run", stop=stops.append)
    code = (
        "import time, miles\nfrom miles.stall import heartbeat\nheartbeat.name('rollout')\nheartbeat.phase('reward')\n"
        "t = time.time()\nwhile time.time() - t < 5:\n    heartbeat.beat()\n    time.sleep(0.1)\n"
        "print('hung', flush=True)\ntime.sleep(600)\n"
    )
    env = {**os.environ, **wd.env(), "PYTHONPATH": str(Path(__file__).parents[1])}
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        wd.phase("generate", step=4)
        wd.start()
        assert child.stdout.readline().strip() == "hung"
        assert wd.stall is None and stops == []  # 5 s of beats: progress all along
        deadline = time.monotonic() + 30
        while wd.stall is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert wd.stall is not None and stops == ["reward"], stops
        assert re.match(r"no progress for [23] s in phase reward \(RL step 4; the limit is 2 s", wd.stall.line)
        assert "in <module>" in (wd.stall.directory / f"rollout-{child.pid}.txt").read_text()
    finally:
        child.kill()
        child.wait()
        wd.close()
    assert not wd.directory.exists()


def test_a_stall_whose_stacks_cannot_be_written_still_stops_the_run_and_says_so(tmp_path):
    from miles.stall.watchdog import Watchdog

    (tmp_path / "run").write_text("a file where the run directory should be")
    stops = []
    wd = Watchdog(0.5, tmp_path / "run", stop=stops.append)
    wd.start()
    deadline = time.monotonic() + 20
    while not stops and time.monotonic() < deadline:
        time.sleep(0.05)
    wd.close()
    assert stops == ["init"] and "its stacks could not be written to" in wd.stall.line, wd.stall
