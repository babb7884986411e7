"""File-backed optimizer state: no files left behind, stale files purged, ENOSPC at allocation without damage,
a warning on tmpfs, checkpoint + resume equal to an uninterrupted run, RSS bounded by chunks."""

import os
import subprocess
import warnings

import pytest
import torch
from test_optim_offload import loss_at, params_of, train  # tests/optim is on sys.path (rootdir-relative import mode)

from miles.optim import DiskOptimizerStateOffloader, OptimizerOffloadSpaceError, TmpfsOffloadWarning
from miles.optim.disk_offload import filesystem_type, prepare_offload_directory

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (needs root); skipped where mounting is not permitted."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_chunks_leave_no_files_behind(tmp_path):
    _, _, offloader = train("adamw", "disk", 2, tmp_path, chunk_bytes=512)
    assert len(offloader.chunks) > 3
    assert os.listdir(tmp_path / "rank0") == []  # unlinked right after mapping


def test_stale_chunk_files_of_dead_processes_are_purged(tmp_path):
    rank_dir = tmp_path / "rank0"
    rank_dir.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is now free
    (rank_dir / f"optstate.pid{dead.pid}.0.chunk0.bin").write_bytes(b"x" * 10)
    (rank_dir / f"optstate.pid{os.getpid()}.99.chunk0.bin").write_bytes(b"x")  # a live process's: kept
    (rank_dir / "notes.txt").write_text("not ours")
    prepare_offload_directory(str(rank_dir))
    assert sorted(os.listdir(rank_dir)) == ["notes.txt", f"optstate.pid{os.getpid()}.99.chunk0.bin"]


def test_full_filesystem_fails_at_allocation_and_corrupts_nothing(small_tmpfs, tmp_path):
    torch.manual_seed(0)
    layer = torch.nn.Linear(512, 512)  # 1 MiB of weights -> 2 MiB of AdamW state on a 1 MiB filesystem
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    with pytest.warns(TmpfsOffloadWarning):
        offloader = DiskOptimizerStateOffloader(opt, directory=str(small_tmpfs), chunk_bytes=256 << 10)
    layer(torch.ones(2, 512)).sum().backward()
    opt.step()
    before = {k: v.clone() for st in opt.state.values() for k, v in st.items()}
    with pytest.raises(
        OptimizerOffloadSpaceError, match=r"no space for optimizer-state chunk \d+ .*free.*The state stays resident"
    ):
        offloader.offload()
    assert not offloader.is_offloaded and offloader.chunks == []
    assert os.listdir(small_tmpfs / "rank0") == []
    assert os.statvfs(small_tmpfs).f_bfree == os.statvfs(small_tmpfs).f_blocks  # partial chunks freed
    after = {k: v for st in opt.state.values() for k, v in st.items()}
    assert all(torch.equal(before[k], after[k]) for k in before)
    opt.step()  # training goes on with the resident state


def test_tmpfs_directory_warns_and_a_disk_directory_does_not(small_tmpfs, tmp_path):
    assert filesystem_type(str(small_tmpfs)) == "tmpfs"
    with pytest.warns(TmpfsOffloadWarning, match="on tmpfs.*optimizer_offload_dir"):
        prepare_offload_directory(str(small_tmpfs / "rank0"))
    if filesystem_type(str(tmp_path)) not in ("tmpfs", "ramfs"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", TmpfsOffloadWarning)
            prepare_offload_directory(str(tmp_path / "rank0"))


@pytest.mark.parametrize("optimizer_name", ["adamw", "muon"])
def test_checkpoint_after_flush_and_resume_matches_uninterrupted_run(optimizer_name, tmp_path):
    reference, _, _ = train(optimizer_name, "none", 6, tmp_path)
    model, opt, offloader = train(optimizer_name, "disk", 3, tmp_path / "a", chunk_bytes=700)
    offloader.flush()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt.pt")
    offloader.offload()  # the run goes on offloaded; the checkpoint file holds its own bytes

    ckpt = torch.load(tmp_path / "ckpt.pt")
    resumed, resumed_opt, resumed_off = train(optimizer_name, "disk", 0, tmp_path / "b", chunk_bytes=700)
    resumed.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["optimizer"])
    for step in range(3, 6):
        loss_at(resumed, step).backward()
        resumed_off.restore()
        resumed_opt.step()
        resumed_opt.zero_grad()
        resumed_off.offload()
    assert all(torch.equal(a, b) for a, b in zip(params_of(reference), params_of(resumed)))


def rss_parts() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon", "RssFile", "RssShmem")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) << 10
    return out


def test_disk_backed_state_leaves_process_rss(tmp_path):
    if filesystem_type(str(tmp_path)) in ("tmpfs", "ramfs"):
        pytest.skip("tmp_path is in RAM")
    torch.ones(64 << 20, dtype=torch.uint8).sum()  # a freed large block: glibc now serves 4 MiB from its heap
    params = [torch.nn.Parameter(torch.randn(1024, 1024)) for _ in range(8)]  # 32 MiB -> 64 MiB AdamW state
    opt = torch.optim.AdamW(params)
    chunk = 4 << 20
    offloader = DiskOptimizerStateOffloader(opt, directory=str(tmp_path), chunk_bytes=chunk)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    with_state = rss_parts()
    offloader.offload()
    offloaded = rss_parts()
    assert with_state["RssAnon"] - offloaded["RssAnon"] > 60 << 20  # the anonymous state is gone
    assert offloaded["RssFile"] - with_state["RssFile"] <= 2 * chunk  # and file pages did not replace it
    offloader.restore()
    assert rss_parts()["RssFile"] - with_state["RssFile"] <= 2 * chunk
