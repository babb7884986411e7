"""Pinned host arenas on a CUDA device: page-locked in place, exact footprint, bit-exact round trips."""

from __future__ import annotations

import pytest
import torch

from miles.memory import MemoryLedger, TaggedMemory
from miles.memory.host_arena import PAGE, arena_footprint, host_arena
from miles.memory.ledger import process_rss_bytes


def _load_the_cuda_kernels_the_test_uses():
    """Run each kernel of the test once on one page, before RSS is measured. The first launch of a CUDA kernel
    loads its module and the first reduction sets up torch's host-side state, and that RSS stays for the life of
    the process: on the H200 (2026-12-03, torch 2.11+cu130) the first torch.equal added 51.5 MB (38 MB anonymous,
    10 MB /dev/zero shared) and the first randint 8.2 MB, 61 MB that the old test counted as the arena's (20% of
    it). Warmed up here, RSS after ``del buf`` was back within 0.1 MB of ``before``."""
    x = torch.randint(0, 255, (PAGE,), dtype=torch.uint8, device="cuda")
    small = host_arena(PAGE, pin=True)
    small.copy_(x, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(small.cuda(), x)


@pytest.mark.gpu
def test_a_pinned_arena_is_page_locked_and_holds_exactly_its_pages():
    n = 300 * 2**20 + 5
    torch.zeros(1, device="cuda")  # create the CUDA context first: it alone adds ~110 MB of RSS
    _load_the_cuda_kernels_the_test_uses()
    before = process_rss_bytes()
    buf = host_arena(n, pin=True)
    assert buf.is_pinned() and buf.numel() == n
    grown = process_rss_bytes() - before
    assert 0.98 < grown / arena_footprint(n) < 1.02  # registering faults every page in: RSS = the pages, once
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    buf.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buf.cuda(), src)
    del buf
    assert process_rss_bytes() - before < 0.02 * n


@pytest.mark.gpu
def test_tagged_pause_and_resume_through_pinned_arenas_are_bit_exact():
    ts = [torch.randn(1000 + i, device="cuda", dtype=torch.bfloat16) for i in range(7)]
    ref = [t.clone() for t in ts]
    mem = TaggedMemory("trainer/0", MemoryLedger(), "cuda")
    mem.register("params", ts)
    assert mem.offload(["params"]) == sum(t.untyped_storage().nbytes() for t in ref)
    assert mem.tags["params"].backup.is_pinned()
    mem.onload(["params"])
    assert all(torch.equal(a, b) for a, b in zip(ts, ref))
