"""The RL loop end to end on real Ray actors (tiny model, a few seconds per step)."""

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from miles.driver import train
from miles.rollout.tasks import RewardError
from miles.run_dir import RunDir, RunDirError
from tests.conftest import tiny_run_cfg

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)


def _metrics(cfg):
    return [json.loads(l) for l in open(f"{cfg.run_dir}/metrics.jsonl")]


def test_a_short_run_writes_one_metrics_row_per_rl_step_and_a_final_checkpoint(tmp_path, ray_session):
    cfg = tiny_run_cfg(tmp_path, "sync.check_weights=true", "num_steps=3")
    rows = train(cfg, progress=False)
    rl = [r for r in _metrics(cfg) if "step" in r]
    assert [r["step"] for r in rl] == [0, 1, 2] == [r["step"] for r in rows]
    assert all(0.0 <= r["reward"] <= 1.0 and r["weight_version"] == r["step"] for r in rl)
    assert {"loss", "time/generate", "tokens_per_s", "mem/device_peak", "mem/host_peak", "sync/bytes"} <= set(rl[0])
    assert (tmp_path / "run" / "checkpoints" / "step_000003" / "model.safetensors").exists()
    ledger = [json.loads(l) for l in open(tmp_path / "run" / "ledger.jsonl")]
    assert {e["tag"] for e in ledger} >= {"params", "optimizer", "weights", "kv_cache"}


def test_resume_continues_from_the_last_complete_checkpoint_and_skips_a_half_written_one(tmp_path, ray_session, caplog):
    cfg = tiny_run_cfg(tmp_path, "num_steps=2", "checkpoint_every=1")
    train(cfg, progress=False)
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "step_000005").mkdir()  # a checkpoint directory without its files, e.g. a copy that died halfway
    (ckpts / "step_000005" / "model.safetensors").write_bytes(b"\0" * 3)
    (ckpts / ".step_000004.abc.tmp").mkdir()  # left by a crash while writing
    more = tiny_run_cfg(tmp_path, "num_steps=4", "checkpoint_every=1")
    with caplog.at_level("WARNING"):
        rows = train(more, progress=False)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # steps 0-1 kept from the first run, 2-3 new
    assert any(
        re.search(r"checkpoint .*step_000005 is broken \(missing .*moved it to step_000005.broken-", m)
        for m in caplog.messages
    )
    assert not (ckpts / ".step_000004.abc.tmp").exists() and not (ckpts / "step_000005").exists()
    assert [r["step"] for r in _metrics(more) if "step" in r] == [0, 1, 2, 3]


BROKEN = Path(tempfile.gettempdir()) / f"miles-broken-reward-{hashlib.sha1(__file__.encode()).hexdigest()[:12]}"


def flaky_reward(prompt, response, target):
    """Breaks once the flag file exists (rewards run in worker processes: the flag is what they share)."""
    if BROKEN.exists():
        raise KeyError("broken reward")
    return 0.5


def test_a_reward_function_that_raises_stops_with_a_clear_error_and_keeps_completed_steps(tmp_path, ray_session):
    cfg = tiny_run_cfg(
        tmp_path,
        "num_steps=3",
        "checkpoint_every=0",
        f"task.reward={__name__}:flaky_reward",
        "data.reward_on_error=raise",
    )
    BROKEN.unlink(missing_ok=True)
    try:
        with pytest.raises(
            RewardError, match=r"RL step 1: reward function .*flaky_reward raised KeyError: 'broken reward'"
        ):
            train(cfg, progress=False, on_step=lambda row: BROKEN.touch())  # step 0 scores, step 1 breaks
    finally:
        BROKEN.unlink(missing_ok=True)
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / "model.safetensors").exists()
    assert [r["step"] for r in _metrics(cfg) if "step" in r] == [0]
    failure = json.loads((tmp_path / "run" / "reward_errors" / "step_000001.json").read_text())
    assert failure["kind"] == "error" and failure["error"] == "KeyError: 'broken reward'"


EXTRA = {
    "disk-delta": ["handoff.engine_host_mirror=true"],  # deltas need the base weights
    "tensor": ["sync.source=in_place", "handoff.offload_train=none"],
}  # the trainer's weights stay put


@pytest.mark.parametrize(
    "transport",
    ["broadcast", "rdt", "disk-delta", "tensor"],
    ids=["broadcast", "rdt", "disk-delta", "tensor-in-place"],
)
def test_every_transport_carries_the_loop_and_the_engine_matches_the_trainer_after_each_sync(
    tmp_path, ray_session, transport
):
    cfg = tiny_run_cfg(
        tmp_path,
        f"sync.transport={transport}",
        "sync.check_weights=true",
        "num_steps=2",
        "checkpoint_every=0",
        *EXTRA.get(transport, []),
    )
    rows = train(cfg, progress=False)  # check_weights raises WeightMismatch after a sync that lost a byte
    assert [r["step"] for r in rows] == [0, 1] and all(r["weight_version"] == r["step"] for r in rows)


def test_ctrl_c_in_the_loop_saves_the_completed_steps_says_where_and_the_rerun_resumes(tmp_path, ray_session):
    cfg = tiny_run_cfg(tmp_path, "num_steps=3", "checkpoint_every=0", "trainer.warmup_sft_steps=0")

    def ctrl_c_after_step_0(row):
        if row["step"] == 0:
            os.kill(os.getpid(), signal.SIGINT)  # what a terminal's Ctrl-C sends (Ray's processes block SIGINT)

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt, match=r"RL steps before 1 are saved in .*step_000001: rerun the same"):
        train(cfg, progress=False, on_step=ctrl_c_after_step_0)
    assert signal.getsignal(signal.SIGINT) is before  # the handler is the loop's only
    rows = train(cfg, progress=False)
    assert [r["step"] for r in rows] == [0, 1, 2] == [r["step"] for r in _metrics(cfg) if "step" in r]


def test_a_rollout_dump_that_cannot_be_written_warns_and_training_goes_on(tmp_path, ray_session, caplog):
    cfg = tiny_run_cfg(tmp_path, "num_steps=2", "checkpoint_every=0", "trainer.warmup_sft_steps=0")
    rollouts = tmp_path / "run" / "rollouts"

    def break_the_dump_dir(row):
        if row["step"] == 0:
            shutil.rmtree(rollouts)
            rollouts.write_text("not a directory")  # every later dump fails with an OSError, as on a full disk

    with caplog.at_level("WARNING"):
        rows = train(cfg, progress=False, on_step=break_the_dump_dir)
    assert [r["step"] for r in rows] == [0, 1]
    assert any("RL step 1: rollout dump not written" in m and "1 dumps missing" in m for m in caplog.messages)
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "model.safetensors").exists()


def test_resume_false_over_a_run_with_checkpoints_is_refused_before_ray_starts_and_keeps_every_file(tmp_path):
    from tests.test_run_dir import _a_run

    _a_run(tmp_path / "run")
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file() and p.name != "run.lock"}
    cfg = tiny_run_cfg(tmp_path, "resume=false")
    with pytest.raises(RunDirError, match="resume=false would mix a new run into it"):
        train(cfg, progress=False)
    after = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file() and p.name != "run.lock"}
    assert after == before


class _FullDisk:
    """Stands in for the Ray cluster only: its trainer 'writes' a file and then meets a full disk."""

    def save_checkpoint(self, run_dir, next_step):
        def write(tmp):
            open(os.path.join(tmp, "model.safetensors"), "wb").close()
            raise OSError(errno.ENOSPC, "No space left on device")

        return run_dir.save_checkpoint(next_step, write)


def test_a_full_disk_at_a_checkpoint_stops_with_one_line_naming_the_checkpoint_and_what_is_kept(tmp_path):
    from miles.cli import explain
    from miles.driver import Bookkeeper, CheckpointError
    from tests.test_run_dir import _a_run

    run = _a_run(tmp_path / "run", steps=(2,))
    cfg = tiny_run_cfg(tmp_path)
    with RunDir.open(str(run.path), resume=True, config=None) as run:
        book = Bookkeeper(cfg, run, _FullDisk())
        with pytest.raises(CheckpointError) as e:
            book.checkpoint(4, reason="periodic")
    code, line = explain(e.value)
    assert code == 1 and "\n" not in line
    assert re.search(r"step_000004 could not be written \(OSError: \[Errno 28\] No space left on device\)", line)
    assert "RL steps before 2 are saved in" in line and sorted(os.listdir(run.ckpt_root)) == ["step_000002"]
