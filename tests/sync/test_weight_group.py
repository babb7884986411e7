"""The weight group's join is bounded as a whole by its connect timeout: the store, and gloo's full-mesh connect,
which waited out the 300 s collective timeout when rank 0 reached the store but never formed its group
(2026-12-04 conformance review: a 40 s pending join under --group-connect-timeout-s 8)."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch

from miles.ports import free_port
from miles.sync.buckets import WeightSpec
from miles.sync.weight_group import FORMATS, layout, make_group

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]  # procs: it starts processes or servers


def test_a_join_whose_rank_0_never_forms_its_group_fails_within_the_connect_timeout():
    import torch.distributed as dist

    port = free_port()
    master = {}

    def host_store_only():  # rank 0 reaches the rendezvous but never creates its process group
        master["store"] = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=datetime.timedelta(seconds=60))

    t = threading.Thread(target=host_store_only, daemon=True)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        make_group("127.0.0.1", port, 1, 2, "never-formed", "gloo", timeout_s=300.0, connect_timeout_s=3.0)
    took = time.monotonic() - t0
    assert took < 30, f"the join took {took:.0f} s for a 3 s bound (300 s is the collective timeout)"


def test_two_ranks_form_a_group_and_a_broadcast_arrives_in_every_format():
    from miles.sync.weight_group import broadcast

    port, groups = free_port(), {}
    joiner = threading.Thread(
        target=lambda: groups.setdefault(1, make_group("127.0.0.1", port, 1, 2, "g", "gloo", 60, 30)), daemon=True
    )
    joiner.start()
    groups[0] = make_group("127.0.0.1", port, 0, 2, "g", "gloo", 60, 30)
    joiner.join(30)
    sent, got = torch.arange(10, dtype=torch.float32), torch.zeros(10)
    t = threading.Thread(target=lambda: broadcast(groups[1], got), daemon=True)
    t.start()
    broadcast(groups[0], sent)
    t.join(30)
    assert torch.equal(sent, got)


def test_flat_layouts_are_aligned_for_miles_and_back_to_back_for_sglang():
    specs = [WeightSpec("a", "bfloat16", (3,), "a"), WeightSpec("b", "float32", (2,), "b")]
    miles, total = layout(specs, "miles_flat")
    assert [m.offset for m in miles] == [0, 256] and total == 512
    sglang, total = layout(specs, "flattened_bucket")
    assert [m.offset for m in sglang] == [0, 6] and total == 14
    assert FORMATS[0] == "miles_flat" and "per_tensor" in FORMATS
