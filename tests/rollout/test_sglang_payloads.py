"""miles' reading of SGLang's MultiprocessingSerializer payloads: a restricted unpickler that builds tensors from
same-host handles and nothing else (miles.rollout.sglang_payloads), and a writer of the same format."""

from __future__ import annotations

import base64
import io
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from miles.rollout.sglang_api import WireError
from miles.rollout.sglang_payloads import deserialize, named_tensors, serialize


class RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /tmp/miles-payload-pwned",))


class Evals:
    def __reduce__(self):
        return (eval, ("1 + 1",))


@pytest.mark.parametrize("obj, name", [(RunsCode(), "posix.system"), (Evals(), "builtins.eval")])
def test_a_payload_naming_code_is_refused_naming_it_and_nothing_runs(obj, name):
    raw = pickle.dumps([("w", obj)])
    with pytest.raises(WireError, match=f"{name} is not admitted"):
        deserialize(raw)
    assert not os.path.exists("/tmp/miles-payload-pwned")


def test_a_shared_memory_handle_that_is_not_torchs_is_refused():
    from torch.multiprocessing.reductions import rebuild_storage_filename

    class Forged:
        def __reduce__(self):
            return (rebuild_storage_filename, (torch.UntypedStorage, b"/tmp/sock", b"/../../etc/passwd", 8))

    with pytest.raises(WireError, match="is not torch's"):
        deserialize(pickle.dumps(Forged()))


def test_a_file_descriptor_handle_is_refused_with_the_fix():
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump([("w", torch.ones(3))])
    finally:
        torch.multiprocessing.set_sharing_strategy("file_descriptor")
    with pytest.raises(WireError, match=r"set_sharing_strategy\('file_system'\)"):
        deserialize(buf.getvalue())


def test_serialize_matches_the_reference_forking_pickler_under_the_file_system_strategy():
    """Our writer against torch's own (what SGLang's MultiprocessingSerializer runs with that strategy): both read
    back, through the restricted reader, to the same tensors; the caller's tensor is not moved into shared memory."""
    named = [("a", torch.randn(3, 4)), ("b", torch.arange(6, dtype=torch.bfloat16)[1:]), ("e", torch.empty(0))]
    ours = named_tensors(deserialize(base64.b64decode(serialize([(n, t.clone()) for n, t in named]))), None)
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump([(n, t.clone()) for n, t in named])
    finally:
        torch.multiprocessing.set_sharing_strategy("file_descriptor")
    ref = named_tensors(deserialize(buf.getvalue()), None)
    for (n, t), (n1, a), (n2, b) in zip(named, ours, ref, strict=True):
        assert n == n1 == n2 and torch.equal(a, t) and torch.equal(b, t) and a.dtype == b.dtype == t.dtype


def test_a_flattened_bucket_whose_metadata_overruns_the_buffer_is_refused():
    from miles.rollout.sglang_payloads import FlattenedMeta

    m = FlattenedMeta()
    m.__setstate__({"name": "w", "shape": torch.Size([4]), "dtype": torch.float32, "start_idx": 8, "end_idx": 24,
                    "numel": 16})  # fmt: skip
    with pytest.raises(WireError, match=r"bytes \[8, 24\) do not hold"):
        named_tensors({"flattened_tensor": torch.zeros(16, dtype=torch.uint8), "metadata": [m]}, "flattened_bucket")
