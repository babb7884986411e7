"""Checkpoints without Ray: manifests, verification, broken ones moved aside, safe loading of optimizer.pt."""

import errno
import json
import logging
import os

import pytest
import torch

from miles.checkpoints import Checkpoints, file_digest
from miles.train.backend import read_checkpoint_files, write_checkpoint_files


def _writer(value: float):
    def write(tmp: str) -> None:
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))])
        opt.zero_grad()
        opt.param_groups[0]["params"][0].grad = torch.ones(3)
        opt.step()
        write_checkpoint_files(tmp, {"model": {"w": torch.full((64,), value)}, "optimizer": opt.state_dict()})

    return write


def test_each_checkpoint_records_the_size_and_xxh3_of_its_files(tmp_path):
    d = Checkpoints(tmp_path).save(3, _writer(1.0))
    state = json.loads((d / "state.json").read_text())
    assert state["next_step"] == 3
    for name in ("model.safetensors", "optimizer.pt"):
        assert (
            state["files"][name] == file_digest(d / name) and state["files"][name]["bytes"] == (d / name).stat().st_size
        )


@pytest.mark.parametrize("damage", ["truncate model", "truncate optimizer", "flip a byte", "empty model"])
def test_a_broken_latest_checkpoint_is_moved_aside_with_a_warning_and_the_previous_one_used(tmp_path, caplog, damage):
    ckpts = Checkpoints(tmp_path)
    ckpts.save(2, _writer(2.0))
    bad = ckpts.save(4, _writer(4.0))
    name = "optimizer.pt" if "optimizer" in damage else "model.safetensors"
    data = (bad / name).read_bytes()
    if damage == "flip a byte":
        data = data[:-5] + bytes([data[-5] ^ 1]) + data[-4:]
    else:
        data = b"" if damage == "empty model" else data[:100]
    (bad / name).write_bytes(data)
    with caplog.at_level(logging.WARNING, "miles"):
        step, path = ckpts.latest()
    assert (step, path.name) == (2, "step_000002")
    aside = [p.name for p in tmp_path.iterdir() if p.name.startswith("step_000004.broken-")]
    assert len(aside) == 1 and not bad.exists()
    assert any(f"moved it to {aside[0]}" in m and name in m for m in caplog.messages)
    assert read_checkpoint_files(str(path))["model"]["w"][0] == 2.0


def test_saving_where_a_broken_checkpoint_sits_replaces_it_instead_of_keeping_the_broken_files(tmp_path):
    ckpts = Checkpoints(tmp_path)
    d = ckpts.save(4, _writer(4.0))
    (d / "model.safetensors").write_bytes(b"")  # e.g. a disk that filled while copying
    again = ckpts.save(4, _writer(5.0))
    assert again == d and read_checkpoint_files(str(d))["model"]["w"][0] == 5.0
    assert ckpts.latest() == (4, d)


def test_a_checkpoint_written_before_manifests_still_loads_and_a_truncated_one_is_refused(tmp_path):
    ckpts = Checkpoints(tmp_path)
    for step in (2, 4):
        d = tmp_path / f"step_{step:06d}"
        d.mkdir()
        _writer(float(step))(str(d))
        (d / "state.json").write_text(json.dumps({"next_step": step}))
    with open(tmp_path / "step_000004" / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert ckpts.latest() == (2, tmp_path / "step_000002")


def test_a_failed_write_such_as_a_full_disk_publishes_nothing_and_keeps_the_earlier_checkpoint(tmp_path):
    ckpts = Checkpoints(tmp_path)
    ckpts.save(2, _writer(2.0))

    def disk_full(tmp):
        (open(os.path.join(tmp, "model.safetensors"), "wb")).close()
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        ckpts.save(4, disk_full)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002"] and ckpts.latest()[0] == 2


class _CreatesAFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_a_crafted_optimizer_pickle_is_refused_on_resume_and_its_code_never_runs(tmp_path):
    d = Checkpoints(tmp_path / "ckpts").save(2, _writer(2.0))
    marker = tmp_path / "PWNED_BY_CHECKPOINT"
    torch.save({"state": {}, "param_groups": [], "x": _CreatesAFile(marker)}, d / "optimizer.pt")
    with pytest.raises(ValueError, match=r"optimizer.pt holds objects other than tensors .*posix.system"):
        read_checkpoint_files(str(d))
    assert not marker.exists()


@pytest.mark.parametrize("optimizer", ["AdamW", "Muon"])
def test_adamw_and_muon_state_dicts_round_trip_through_the_safe_loader(tmp_path, optimizer):
    param = torch.nn.Parameter(torch.ones(4, 4))
    opt = getattr(torch.optim, optimizer)([param])
    param.grad = torch.ones(4, 4)
    opt.step()
    d = Checkpoints(tmp_path).save(1, lambda t: write_checkpoint_files(t, {"model": {}, "optimizer": opt.state_dict()}))
    loaded = read_checkpoint_files(str(d))["optimizer"]
    fresh = getattr(torch.optim, optimizer)([torch.nn.Parameter(torch.ones(4, 4))])
    fresh.load_state_dict(loaded)
    want, got = opt.state_dict(), fresh.state_dict()
    assert want["param_groups"] == got["param_groups"]
    assert all(torch.equal(want["state"][0][k], got["state"][0][k]) for k in want["state"][0])
