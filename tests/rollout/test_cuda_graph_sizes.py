"""The ``cuda_graph`` tag's sizes, checkable without a GPU: the reserved pool is made of segments the caching
allocator creates exactly as asked, and the engine, the planner and the reservation read one list of sizes."""

from dataclasses import replace

import pytest

from miles.rollout.cuda_graphs import (
    LARGE_MIN,
    SMALL_SEGMENT,
    allocator_segment,
    graph_tag_storages,
    logits_bytes,
    pool_segments,
    reservation_requests,
)

MiB = 1 << 20


def _pack(requests: list[int]) -> list[int]:
    """The segments an empty pool ends with after ``requests`` (each held): small requests share 2 MiB segments."""
    segments, small_free = [], 0
    for n in requests:
        seg = allocator_segment(n)
        if seg == SMALL_SEGMENT and small_free >= n:
            small_free -= n
            continue
        segments.append(seg)
        small_free = seg - n if seg == SMALL_SEGMENT else small_free
    return segments


def test_the_allocator_rule_gives_small_mid_and_large_requests_their_segments():
    assert [allocator_segment(n) for n in (1, MiB, MiB + 1, 10 * MiB - 1)] == [2 * MiB, 2 * MiB, 20 * MiB, 20 * MiB]
    assert [allocator_segment(n) for n in (10 * MiB, 10 * MiB + 1, 33 * MiB)] == [10 * MiB, 12 * MiB, 34 * MiB]


@pytest.mark.parametrize("rows", [1, 8, 64, 512])
def test_the_reservation_makes_exactly_the_planned_segments(tiny_model_cfg, rows):
    for cfg in (tiny_model_cfg, replace(tiny_model_cfg, hidden_size=896, intermediate_size=4864, dtype="bfloat16")):
        planned = pool_segments(cfg, rows)
        assert planned[0] >= LARGE_MIN and allocator_segment(planned[0]) == planned[0]
        assert set(planned[1:]) == {SMALL_SEGMENT}
        assert sorted(_pack(reservation_requests(planned))) == sorted(planned)


def test_the_engines_logits_buffer_is_the_first_planned_storage(tiny_model_cfg):
    from miles.rollout.engine import EmbeddedEngine

    engine = EmbeddedEngine(tiny_model_cfg, max_batch_size=6, max_seq_len=32, seed=0)
    assert engine.logits.nbytes == logits_bytes(tiny_model_cfg, 6) == graph_tag_storages(tiny_model_cfg, 6)[0]
    assert engine.graphs is None and engine.memory.resident_bytes("cuda_graph") == 0  # no graphs on the CPU
