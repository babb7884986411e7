"""CUDA: staging buckets stay exportable under expandable segments (the bench covers transports between GPU actors)."""

from __future__ import annotations

import pytest
import torch

from miles.sync.flat_bucket import alloc_exportable

pytestmark = pytest.mark.gpu


def test_a_staging_bucket_is_exportable_even_with_expandable_segments_on(monkeypatch):
    from torch.multiprocessing.reductions import reduce_tensor

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    try:
        bucket = alloc_exportable(64 << 20, torch.device("cuda"))
        reduce_tensor(bucket)  # cudaIpcGetMemHandle fails on memory from an expandable (VMM) segment
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
