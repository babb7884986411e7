"""The delta codec, the dtype table and the staging pool, in one process: exact round trips for every dtype,
chunked encoding equal to whole-tensor encoding, and the naive reference for XOR and overwrite."""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.torch
import torch

from miles.sync.disk_delta.codec import TensorEncoder, apply_delta, checksum
from miles.sync.disk_delta.safetensors_dtypes import (
    SAFETENSORS_DTYPE,
    TORCH_DTYPE,
    Layout,
    read_header,
    safetensors_dtype,
    torch_dtype,
)
from miles.sync.disk_delta.staging_pool import StagingPool, byte_view


def _bytes(t: torch.Tensor) -> np.ndarray:
    return byte_view(t).numpy().copy()


def _encode(encoding: str, new: torch.Tensor, old: torch.Tensor, buffer_bytes: int = 1 << 20):
    pool = StagingPool(num_buffers=2, buffer_bytes=buffer_bytes)
    old_b = _bytes(old)
    enc = TensorEncoder(encoding, nbytes=old_b.size, itemsize=new.element_size())
    for offset, chunk, scratch in pool.stage(new):
        enc.feed(offset, chunk, old_b[offset : offset + chunk.size], out=scratch)
    return enc.finish(), old_b


def _sparse_bf16_update(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An AdamW-like step on bf16 weights: a small relative change that rounds away for most elements."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(n, generator=g).to(torch.bfloat16)
    new = (old.float() * (1 + 1e-3 * torch.randn(n, generator=g))).to(torch.bfloat16)
    return new, old


DTYPES = [d for d in SAFETENSORS_DTYPE]


@pytest.mark.parametrize("encoding", ["xor", "sparse_xor", "overwrite"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_apply_of_encode_is_bit_exact_for_every_dtype(encoding, dtype):
    g = torch.Generator().manual_seed(0)
    old_raw = torch.randint(0, 256, (37 * 8,), dtype=torch.uint8, generator=g)
    new_raw = old_raw.clone()
    new_raw[::5] = torch.randint(0, 256, new_raw[::5].shape, dtype=torch.uint8, generator=g)
    old, new = old_raw.view(dtype), new_raw.view(dtype)  # arbitrary bit patterns: NaNs included
    (payload, digest), old_b = _encode(encoding, new, old)
    out = apply_delta(encoding, payload, old_b, new.element_size())
    assert np.array_equal(out, _bytes(new)) and digest == checksum(_bytes(new))
    assert np.array_equal(old_b, _bytes(old)), "apply must not modify the old bytes"


@pytest.mark.parametrize("encoding", ["xor", "sparse_xor", "overwrite"])
@pytest.mark.parametrize("kind", ["random", "sparse"])
def test_chunked_encoding_matches_whole_tensor_reference(encoding, kind):
    if kind == "random":
        g = torch.Generator().manual_seed(1)
        old, new = torch.randn(10_000, generator=g).bfloat16(), torch.randn(10_000, generator=g).bfloat16()
    else:
        new, old = _sparse_bf16_update(10_000, seed=2)
    (payload, digest), old_b = _encode(encoding, new, old, buffer_bytes=1024)  # 20 chunks
    out = apply_delta(encoding, payload, old_b, 2)
    assert np.array_equal(out, _bytes(new)) and digest == checksum(_bytes(new))
    # the naive reference: XOR of whole arrays / positions where elements differ
    new_b = _bytes(new)
    if encoding in ("xor", "sparse_xor"):
        assert np.array_equal(np.bitwise_xor(new_b, old_b), np.bitwise_xor(out, old_b))
    else:
        changed = np.flatnonzero(new_b.view(np.uint16) != old_b.view(np.uint16))
        ref = old_b.copy()
        ref.view(np.uint16)[changed] = new_b.view(np.uint16)[changed]
        assert np.array_equal(ref, out)


@pytest.mark.parametrize("encoding", ["xor", "sparse_xor", "overwrite"])
def test_scalar_tensors_flatten_and_round_trip(encoding):
    old, new = torch.tensor(1.5), torch.tensor(2.5)
    assert byte_view(old).shape == (4,)
    (payload, _), old_b = _encode(encoding, new, old)
    out = torch.from_numpy(apply_delta(encoding, payload, old_b, 4)).view(torch.float32).reshape(())
    assert out.shape == () and out.item() == 2.5


@pytest.mark.parametrize("encoding", ["xor", "sparse_xor", "overwrite"])
@pytest.mark.parametrize("numel", [1, 7, 13, 29])
def test_byte_counts_that_are_not_a_multiple_of_8_round_trip_in_small_chunks(encoding, numel):
    g = torch.Generator().manual_seed(numel)
    old = torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=g)
    new = old.clone()
    new[-1] ^= 0x5A  # the change sits in the last, partial word
    (payload, digest), old_b = _encode(encoding, new, old, buffer_bytes=8)
    assert np.array_equal(apply_delta(encoding, payload, old_b, 1), _bytes(new)) and digest == checksum(_bytes(new))


@pytest.mark.parametrize("encoding", ["xor", "sparse_xor", "overwrite"])
def test_sparse_bf16_update_compresses_far_below_its_size(encoding):
    new, old = _sparse_bf16_update(1 << 16, seed=3)
    (payload, _), _ = _encode(encoding, new, old)
    assert len(payload) < new.numel() * 2 / 2.5


@pytest.mark.parametrize("encoding", ["xor", "sparse_xor", "overwrite"])
def test_truncated_payload_is_rejected(encoding):
    new, old = _sparse_bf16_update(1000, seed=4)
    (payload, _), old_b = _encode(encoding, new, old)
    with pytest.raises(ValueError, match="does not decompress|malformed"):
        apply_delta(encoding, payload[:-7], old_b, 2)


def test_dtype_table_round_trips_and_names_unsupported_dtypes():
    for name in [
        "F64",
        "F32",
        "F16",
        "BF16",
        "I64",
        "I32",
        "I16",
        "I8",
        "U8",
        "BOOL",
        "C64",
        "F8_E4M3",
        "F8_E5M2",
        "U16",
        "U32",
        "U64",
        "F8_E4M3FNUZ",
        "F8_E5M2FNUZ",
    ]:
        assert safetensors_dtype(torch_dtype(name)) == name
    with pytest.raises(ValueError, match="torch.complex128 has no safetensors dtype"):
        safetensors_dtype(torch.complex128)
    with pytest.raises(ValueError, match="'F4' is not supported"):
        torch_dtype("F4")


def test_dtype_table_agrees_with_safetensors_files(tmp_path):
    tensors = {f"t{i}": torch.zeros(2, 3, dtype=d) for i, d in enumerate(TORCH_DTYPE.values())}
    tensors["scalar"] = torch.tensor(7, dtype=torch.int64)
    safetensors.torch.save_file(tensors, str(tmp_path / "all.safetensors"))
    entries, _, _ = read_header(tmp_path / "all.safetensors")
    for name, t in tensors.items():
        assert entries[name].layout == Layout.of(t), name
    loaded = safetensors.torch.load_file(str(tmp_path / "all.safetensors"))
    for name, e in entries.items():  # the offsets we parse point at the bytes safetensors itself loads
        raw = np.fromfile(e.file, np.uint8, count=e.layout.nbytes, offset=e.offset)
        assert np.array_equal(raw, _bytes(loaded[name])), name


def test_staging_pool_is_bounded_and_reused():
    pool = StagingPool(num_buffers=2, buffer_bytes=64)
    t = torch.arange(1000, dtype=torch.float32)
    for _ in range(3):
        out = np.concatenate([c.copy() for _, c, _ in pool.stage(t)])
        assert np.array_equal(out, _bytes(t))
    assert pool.num_allocated == 2 and pool.capacity_bytes == 128
    stage = pool.stage(t)
    next(stage)
    stage.close()  # a consumer that stops early gives its buffers back
    assert len(pool._free) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_staging_pool_copies_cuda_tensors_through_pinned_buffers_like_a_host_copy():
    pool = StagingPool(num_buffers=2, buffer_bytes=4096)
    assert pool.pin
    t = torch.randn(10_000, device="cuda").bfloat16()
    chunks = [(off, new.copy(), new is scratch) for off, new, scratch in pool.stage(t)]
    assert all(same for _, _, same in chunks), "device chunks are staged into the scratch buffer itself"
    assert np.array_equal(np.concatenate([c for _, c, _ in chunks]), _bytes(t.cpu()))
    assert pool.num_allocated == 2


@pytest.mark.parametrize("numel", [4, 7, 4099])
def test_sparse_xor_in_place_patch_matches_apply_reference(numel):
    g = torch.Generator().manual_seed(numel)
    old = torch.randn(numel, generator=g).bfloat16()
    new = old.clone()
    new[::3] = torch.randn(new[::3].shape, generator=g).bfloat16()
    new[-1] = 7.0
    old_b = _bytes(old)
    enc = TensorEncoder("sparse_xor", nbytes=old_b.size, itemsize=2)
    for offset, chunk, scratch in StagingPool(num_buffers=2, buffer_bytes=64).stage(new):
        enc.feed(offset, chunk, old_b[offset : offset + chunk.size], out=scratch)
    payload, _ = enc.finish()
    reference = apply_delta("sparse_xor", payload, old_b, 2)
    enc.apply_in_place(old_b)
    assert np.array_equal(old_b, reference) and np.array_equal(old_b, _bytes(new))
