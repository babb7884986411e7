"""host_bytes: the bytes of a live tensor for numpy code, without pinning its storage's size."""

import numpy as np
import pytest
import torch

from miles.sync.base import host_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_host_bytes_equal_the_numpy_export_and_leave_the_storage_resizable(dtype):
    t = (torch.randn(7, 5) * 100).to(dtype)
    view = host_bytes(t)
    reference = t.clone().view(torch.uint8).reshape(-1).numpy()  # the export marks only the clone's storage
    assert view.dtype == np.uint8 and np.array_equal(view, reference)
    t.untyped_storage().resize_(0)  # what TaggedMemory does at an offload; after .numpy() this raises
    assert t.untyped_storage().nbytes() == 0


def test_host_bytes_rejects_what_it_cannot_view():
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        host_bytes(torch.randn(4, 4).t())
    assert host_bytes(torch.empty(0)).size == 0
