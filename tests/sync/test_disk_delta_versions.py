"""Published versions in one process: atomic directories, engine-side rejection of corrupt or incomplete
versions (the engine keeps its weights), chains of versions, and the end-to-end sync into real engines."""

from __future__ import annotations

import json
import os

import pytest
import torch

from miles.sync.disk_delta.transport import Baseline, DiskDeltaConfig, DiskDeltaSync, MissingTensorError, save_baseline
from miles.sync.disk_delta.version import VersionError, load_version, published_versions, read_index, version_dir


def _weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = {"embed.weight": torch.randn(16, 8, generator=g), "norm.weight": torch.ones(8), "step": torch.tensor(0)}
    w = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in w.items()}
    for s in range(1, step + 1):
        gs = torch.Generator().manual_seed(s)
        w["embed.weight"] = (w["embed.weight"].float() * (1 + 1e-2 * torch.randn(16, 8, generator=gs))).bfloat16()
        w["step"] = torch.tensor(s)
    return w


class Receiver:
    def __init__(self, weights):
        self.weights, self.weight_version = {k: v.clone() for k, v in weights.items()}, 0

    def update_weights_from_disk(self, path, version):
        self.weights = load_version(path, version, self.weights, local_version=self.weight_version)
        self.weight_version = version

    def named_weights(self):
        return self.weights


@pytest.fixture
def published(tmp_path):
    """A sync root with versions 1..3 published (default encoding) and the baseline the engines start from."""
    base = save_baseline(_weights(0), tmp_path / "base.safetensors")
    sync = DiskDeltaSync(DiskDeltaConfig(root=str(tmp_path / "w"), baseline=str(base)))
    for v in (1, 2, 3):
        sync.update(_weights(v).items(), version=v)
    return tmp_path / "w"


def test_versions_are_published_whole_with_no_temporary_leftovers(published):
    assert published_versions(published) == [1, 2, 3]
    assert sorted(os.listdir(published)) == ["LATEST", "v00000001", "v00000002", "v00000003"]
    index = read_index(published, 2)
    assert (index["version"], index["base_version"], index["encoding"], index["compression"], index["checksum"]) == (
        2,
        1,
        "sparse_xor",
        "zstd",
        "xxh3_128",
    )
    assert "norm.weight" not in index["tensors"], "unchanged tensors are skipped"


def test_engine_walks_a_chain_of_versions_and_matches_the_trainer(published):
    got = load_version(published, 3, _weights(0), local_version=0)
    assert all(torch.equal(got[k], v) for k, v in _weights(3).items())
    one_step = load_version(published, 3, _weights(2))  # without local_version: must be at the base version
    assert all(torch.equal(one_step[k], v) for k, v in _weights(3).items())
    changed = load_version(published, 3, _weights(0), local_version=0, changed_only=True)
    assert sorted(changed) == ["embed.weight", "step"]


def _assert_rejected(published, match, exc=VersionError):
    local = _weights(2)
    before = {k: v.clone() for k, v in local.items()}
    with pytest.raises(exc, match=match):
        load_version(published, 3, local, local_version=2)
    assert all(torch.equal(before[k], local[k]) for k in before), "the engine's copy must be untouched"


def test_flipped_payload_byte_is_rejected_by_checksum_or_decompression(published):
    shard = version_dir(published, 3) / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    _assert_rejected(published, "checksum mismatch|does not decompress|corrupt")


def test_truncated_shard_is_rejected_as_incomplete(published):
    shard = version_dir(published, 3) / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    _assert_rejected(published, "incomplete")


def test_corrupt_index_and_absent_versions_are_rejected(published):
    (version_dir(published, 3) / "index.json").write_text("{broken")
    _assert_rejected(published, "is corrupt")
    with pytest.raises(VersionError, match=r"not published .* published versions: \[1, 2, 3\]"):
        load_version(published, 9, _weights(2))


def test_engine_with_a_different_layout_or_missing_tensor_is_rejected(published):
    local = _weights(2)
    local["embed.weight"] = local["embed.weight"].half()
    with pytest.raises(ValueError, match=r"'embed.weight': the engine has F16\[16, 8\].*BF16\[16, 8\]"):
        load_version(published, 3, local)
    local = _weights(2)
    del local["step"]
    with pytest.raises(MissingTensorError, match="'step'"):
        load_version(published, 3, local)


def test_engine_behind_a_pruned_version_gets_a_clear_error(tmp_path):
    base = save_baseline(_weights(0), tmp_path / "base.safetensors")
    sync = DiskDeltaSync(DiskDeltaConfig(root=str(tmp_path / "w"), baseline=str(base), keep_versions=2))
    for v in (1, 2, 3):
        sync.update(_weights(v).items(), version=v)
    assert published_versions(tmp_path / "w") == [2, 3]
    with pytest.raises(VersionError, match="needs version 1"):
        load_version(tmp_path / "w", 3, _weights(0), local_version=0)


@pytest.mark.parametrize("encoding", ["xor", "sparse_xor", "overwrite"])
def test_sync_into_two_receivers_keeps_them_bit_equal_with_check_weights(tmp_path, encoding):
    base = save_baseline(_weights(0), tmp_path / "base.safetensors")
    engines = [Receiver(_weights(0)), Receiver(_weights(0))]
    sync = DiskDeltaSync(
        DiskDeltaConfig(root=str(tmp_path / "w"), baseline=str(base), encoding=encoding, check_weights=True)
    )
    sync.connect(engines)
    for v in (1, 2):
        sync.update(_weights(v).items(), version=v)
    m = sync.metrics()
    assert m["disk_delta/version"] == 2 and m["disk_delta/num_changed"] == 2 and m["disk_delta/num_tensors"] == 3
    assert 0 < m["disk_delta/wire_bytes"] < 2 * m["disk_delta/raw_bytes"]
    for e in engines:
        assert e.weight_version == 2 and all(torch.equal(e.weights[k], v) for k, v in _weights(2).items())


def test_a_failed_update_publishes_nothing_and_a_retry_succeeds(tmp_path):
    base = save_baseline(_weights(0), tmp_path / "base.safetensors")
    sync = DiskDeltaSync(DiskDeltaConfig(root=str(tmp_path / "w"), baseline=str(base)))
    (tmp_path / "w" / ".v00000001.crashed-run.tmp").mkdir(parents=True)  # left by a killed trainer
    bad = _weights(1)
    bad["norm.weight"] = bad["norm.weight"].float()
    with pytest.raises(ValueError, match=r"'norm.weight'.*BF16\[8\].*F32\[8\]"):
        sync.update(bad.items(), version=1)
    assert published_versions(tmp_path / "w") == []
    sync.update(_weights(1).items(), version=1)
    assert load_version(tmp_path / "w", 1, _weights(0))["step"].item() == 1
    assert sorted(os.listdir(tmp_path / "w")) == ["LATEST", "v00000001"]
    with pytest.raises(ValueError, match="must be greater than the last published 1"):
        sync.update(_weights(2).items(), version=1)


def test_baseline_read_validates_dtype_and_shape(tmp_path):
    base = Baseline.from_checkpoint(save_baseline(_weights(0), tmp_path / "base.safetensors"))
    w = base.read("embed.weight", expected_dtype=torch.bfloat16, expected_shape=(16, 8))
    assert torch.equal(w, _weights(0)["embed.weight"])
    assert base.read("step", expected_dtype=torch.int64, expected_shape=()).shape == ()
    with pytest.raises(ValueError, match=r"BF16\[16, 8\] \(256 bytes\).*F16\[16, 8\] \(256 bytes\)"):
        base.read("embed.weight", expected_dtype=torch.float16, expected_shape=(16, 8))
    with pytest.raises(KeyError, match="close names: \\['embed.weight'"):
        base.read("embed.weights", expected_dtype=torch.bfloat16, expected_shape=(16, 8))
    with pytest.raises(ValueError, match="complex128 has no safetensors dtype"):
        base.read("step", expected_dtype=torch.complex128, expected_shape=())


def test_index_lists_every_shard_with_its_size(published):
    index = json.loads((version_dir(published, 1) / "index.json").read_text())
    for shard, nbytes in index["shards"].items():
        assert (version_dir(published, 1) / shard).stat().st_size == nbytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_trainer_tensors_sync_into_a_cuda_receiver_bit_exactly(tmp_path):
    base = save_baseline(_weights(0), tmp_path / "base.safetensors")
    engine = Receiver({k: v.cuda() for k, v in _weights(0).items()})
    sync = DiskDeltaSync(
        DiskDeltaConfig(root=str(tmp_path / "w"), baseline=str(base), check_weights=True, staging_buffer_bytes=64)
    )  # many chunks per tensor
    sync.connect([engine])
    for v in (1, 2):
        sync.update({k: t.cuda() for k, t in _weights(v).items()}.items(), version=v)
    assert all(engine.weights[k].is_cuda and torch.equal(engine.weights[k].cpu(), t) for k, t in _weights(2).items())
