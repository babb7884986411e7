"""An HTTP client cannot make `miles serve` read, create or change a file by naming it in a flat-bucket handle
(review 2026-12-03, defect 1): only a checked shared-memory bucket of a miles sender is opened, read-only."""

from __future__ import annotations

import os
import tempfile
import uuid

import httpx
import pytest
import torch

from miles.rollout.sglang_api import FLATTENED_BUCKET, encode_payload
from miles.sync.flat_bucket import BucketHandle, StagingBuffers, TensorMeta

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]  # procs: it starts processes or servers

NORM = TensorMeta("model.norm.weight", "float32", (32,), 0, 128)  # the tiny model's final norm: float32[32]


def _key() -> str:
    return f"miles-{os.getpid()}-0-{uuid.uuid4().hex[:8]}"


def _post_bucket(url: str, h: BucketHandle) -> httpx.Response:
    body = {"serialized_named_tensors": [encode_payload(h)], "load_format": FLATTENED_BUCKET}
    return httpx.post(url + "/update_weights_from_tensor", json=body, timeout=30)


def _state(path: str):
    if not os.path.lexists(path):
        return None
    st = os.lstat(path)
    with open(path, "rb") as f:
        return st.st_size, st.st_mtime_ns, f.read()


def _weights(url: str) -> bytes:
    return httpx.get(url + "/miles/weights", timeout=30).content


def test_a_bucket_naming_any_file_is_refused_and_the_file_is_neither_read_created_nor_changed(serve, tmp_path):
    s = serve()
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"root:$6$SECRETHASH$" * 40)
    os.chmod(secret, 0o600)
    short = tmp_path / "victim_short.txt"
    short.write_bytes(b"important-config\n")
    missing = tmp_path / "created_by_http.bin"
    shm = tempfile.gettempdir()
    key_link, key_hard, key_out = _key(), _key(), _key()
    (tmp_path / key_out).write_bytes(secret.read_bytes())  # named like a bucket, reached by ".." out of the shm dir
    os.symlink(secret, os.path.join(shm, key_link))  # named like a bucket, but a symlink out of the shm dir
    os.link(secret, os.path.join(shm, key_hard))  # named like a bucket, but a second name of the secret
    weights = _weights(s.url)
    outside = os.path.join(shm, "..", str(tmp_path).lstrip("/"), key_out)
    files = [str(secret), str(short), str(missing), outside, os.path.join(shm, key_link), os.path.join(shm, key_hard)]
    before = {p: _state(p) for p in files}
    key = _key()
    attacks = [
        BucketHandle("shm", key, f"{os.getpid()}/0", 128, (NORM,), str(secret)),  # read a file into a weight
        BucketHandle("shm", "k-read", "attacker/1", 128, (NORM,), str(secret)),  # the review's exact handle
        BucketHandle("shm", key, f"{os.getpid()}/0", 1 << 30, (NORM,), str(missing)),  # create 1 GiB
        BucketHandle("shm", key, f"{os.getpid()}/0", 4096, (NORM,), str(short)),  # extend a short file
        BucketHandle("shm", key_link, f"{os.getpid()}/0", 128, (NORM,), os.path.join(shm, key_link)),
        BucketHandle("shm", key_hard, f"{os.getpid()}/0", 128, (NORM,), os.path.join(shm, key_hard)),
        BucketHandle("shm", key_out, f"{os.getpid()}/0", 128, (NORM,), outside),
        BucketHandle("shm", key, f"{os.getpid()}/0", 4, (NORM,), os.path.join(shm, key)),  # metas beyond nbytes
    ]
    try:
        for h in attacks:
            r = _post_bucket(s.url, h)
            assert r.status_code == 400, (h.path, r.status_code, r.text)
            assert "bucket" in r.json()["message"], r.text
        after = {p: _state(p) for p in files}
    finally:
        for k in (key_link, key_hard):
            os.unlink(os.path.join(shm, k))
    assert after == before  # size, mtime and bytes; the missing file still missing
    assert not os.path.exists(os.path.join(shm, key))
    assert _weights(s.url) == weights
    assert httpx.get(s.url + "/get_weight_version").json()["weight_version"] == "default"


def test_a_bucket_smaller_than_declared_is_refused_before_it_is_mapped(serve):
    s = serve()
    key = _key()
    path = os.path.join(tempfile.gettempdir(), key)
    with open(path, "wb") as f:
        f.write(b"\x01" * 64)
    try:
        r = _post_bucket(s.url, BucketHandle("shm", key, f"{os.getpid()}/0", 128, (NORM,), path))
        assert r.status_code == 400 and "fewer than the declared 128" in r.json()["message"], r.text
        assert _state(path)[0] == 64
    finally:
        os.unlink(path)


def test_a_staging_bucket_of_a_miles_sender_still_lands_over_http(serve):
    s = serve()
    staging = StagingBuffers("cpu")
    want = torch.linspace(-1, 1, 32)
    try:
        r = _post_bucket(s.url, staging.pack(0, [("model.norm.weight", want)]))
        assert r.status_code == 200, r.text
        path = staging.slots[0][2]
        assert os.path.dirname(os.path.realpath(path)) in {os.path.realpath(d) for d in ("/dev/shm", "/tmp")}
    finally:
        staging.close()
    got = httpx.post(s.url + "/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 32}).json()
    assert torch.equal(torch.tensor(got), want)
