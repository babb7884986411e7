"""The receiving side of a flat bucket checks the handle whole before it opens anything, and opens only a miles
staging buffer, read-only (miles.sync.flat_bucket.check_handle / open_shm_readonly)."""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest
import torch

from miles.sync.flat_bucket import BucketRefused, OpenedBuffers, StagingBuffers, TensorMeta, check_handle


@pytest.fixture
def staged():
    staging = StagingBuffers("cpu")
    named = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.tensor([7, 8], dtype=torch.int64))]
    yield staging.pack(0, named), named
    staging.close()


def test_an_opened_staging_bucket_holds_exactly_the_packed_tensors_and_sees_the_next_pack(staged):
    h, named = staged
    st = os.stat(h.path)
    opened = OpenedBuffers()
    got = opened.tensors(h)
    assert [n for n, _ in got] == [n for n, _ in named]
    assert all(torch.equal(g, t) for (_, g), (_, t) in zip(got, named))
    assert (os.stat(h.path).st_size, os.stat(h.path).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    with open(h.path, "r+b") as f:  # the sender rewrites the same buffer for the next sync: the mapping is shared
        f.write(torch.full((6,), 5.0).numpy().tobytes())
    assert torch.equal(opened.tensors(h)[0][1], torch.full((2, 3), 5.0))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"key": "k-read"}, "not a miles staging buffer"),
        ({"slot": "attacker/1"}, "not a miles staging buffer"),
        ({"kind": "file"}, "kind"),
        ({"nbytes": 0}, "positive integer"),
        ({"metas": ()}, "non-empty tuple"),
        ({"metas": (TensorMeta("a", "load", (2,), 0, 8),)}, "torch dtype name"),
        ({"metas": (TensorMeta("a", "float32", (2, -1), 0, 8),)}, "non-negative ints"),
        ({"metas": (TensorMeta("a", "float32", (1 << 40,), 0, 4 << 40),)}, "does not fit"),
        ({"metas": (TensorMeta("a", "float32", (2,), -8, 8),)}, "does not fit"),
        ({"metas": (TensorMeta("a", "float32", (2,), 0, 4),)}, "does not fit"),
        ({"ipc": (1, 2)}, "no IPC handle"),
        ({"kind": "cuda_ipc", "path": "", "ipc": (torch.Tensor,) * 15}, "CUDA IPC handle"),
    ],
)
def test_a_malformed_handle_is_refused_before_any_file_is_opened(staged, change, message):
    h, _ = staged
    path = os.path.join(tempfile.gettempdir(), "miles-1-0-0123abcd")  # named like a bucket, does not exist
    bad = dataclasses.replace(h, **{"path": path, "key": os.path.basename(path), "slot": "1/0", **change})
    with pytest.raises(BucketRefused, match=message):
        OpenedBuffers().buffer(bad)
    assert not os.path.exists(path)


def test_a_handle_reusing_a_cached_key_cannot_declare_more_bytes_than_were_opened(staged):
    h, _ = staged
    opened = OpenedBuffers()
    opened.buffer(h)
    bigger = dataclasses.replace(
        h, nbytes=h.nbytes * 4, metas=(TensorMeta("a", "uint8", (h.nbytes * 4,), 0, h.nbytes * 4),)
    )
    check_handle(bigger)  # well-formed on its own
    with pytest.raises(BucketRefused, match="the opened buffer holds"):
        opened.tensors(bigger)


def test_a_bucket_handle_is_refused_when_it_is_not_one():
    with pytest.raises(BucketRefused, match="expected a BucketHandle"):
        check_handle({"path": "/etc/passwd"})
    assert isinstance(BucketRefused("x"), ValueError)  # a 400 in miles serve, like every other bad input
