"""The decode step's CUDA graphs: one per bucketed row count, captured once, in one memory pool owned by the
``cuda_graph`` tag.

A decode step is a few hundred small kernels; replaying it as one graph removes the launch cost that bounds
a small model's step. Each bucket is captured the first time a step runs at that row count, after one eager
step at that size on the capture stream (which compiles the Triton kernels and makes cuBLAS's per-stream
workspace there, in the ordinary pool: made during a capture it would land in the graphs' pool and outlive
it). All graphs share one private pool, reserved first as the segments ``pool_segments(...)`` lists: each
of a size the caching allocator makes exactly as asked, so the pool's bytes are known before launch. The
planner predicts the tag from the same list (``graph_tag_storages``); the ledger records the pool's segments
as the allocator reports them, so a capture that outgrows the reservation shows there (and is logged).
Weight updates copy into the same storages, so graphs survive them. Releasing the tag drops the graphs and
hands their pool back; so does releasing ``weights`` or ``kv_cache`` (their storages come back at new
addresses, which the graphs would still point to). The next step at a bucket captures it again.

    graphs = DecodeGraphs("engine/0", ledger, reserve=pool_segments(model_cfg, max_rows))
    graphs.run(("decode", R), step_fn)   # eager + capture on first use, replay afterwards
    graphs.release(phase)                # -> bytes handed back (also recorded in the ledger)
"""

from __future__ import annotations

import gc
import logging

import torch

from miles.memory import MemoryLedger

log = logging.getLogger(__name__)
MiB = 1 << 20
# PyTorch's caching allocator: a request of at most 1 MiB comes from a 2 MiB segment (two such blocks to one);
# one of 10 MiB or more gets a segment of its size rounded up to 2 MiB; one in between gets a 20 MiB segment
SMALL_REQUEST, SMALL_SEGMENT, LARGE_MIN, LARGE_ROUND, MID_SEGMENT = MiB, 2 * MiB, 10 * MiB, 2 * MiB, 20 * MiB
SMALL_SEGMENTS = 16  # the step's small tensors (<= 1 MiB each) at once, with room for fragmentation


def allocator_segment(request: int) -> int:
    """The segment the caching allocator creates for one request that finds no free block (default settings)."""
    if request <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if request < LARGE_MIN:
        return MID_SEGMENT
    return -(-request // LARGE_ROUND) * LARGE_ROUND


def pool_segments(model_cfg, max_rows: int, num_splits: int = 16) -> list[int]:
    """The graphs' pool at ``max_rows``, segment by segment: one large segment for the intermediates of one
    decode step alive at once at its widest point (the MLP, three [rows, intermediate] tensors, the FP32
    RMSNorm temporaries, the decode attention's per-split partials), at least 10 MiB and a multiple of 2 MiB,
    then ``SMALL_SEGMENTS`` small ones. Each size is one the allocator creates exactly (``allocator_segment``)."""
    from miles.model.size import DTYPE_BYTES

    dt = DTYPE_BYTES[model_cfg.dtype]
    R, H, I = max_rows, model_cfg.hidden_size, model_cfg.intermediate_size
    heads, D = model_cfg.num_attention_heads, model_cfg.head_dim
    need = 4 * R * I * dt + 8 * R * H * 4 + R * heads * num_splits * (D + 2) * 4 + 4 * R * heads * D * dt
    return [allocator_segment(max(need, LARGE_MIN))] + [SMALL_SEGMENT] * SMALL_SEGMENTS


def reservation_requests(segments: list[int]) -> list[int]:
    """The allocations that make ``segments`` in an empty pool: a large segment is one request of its size, a
    small one two requests of 1 MiB (the second fills the first's segment)."""
    return [n for s in segments for n in ([SMALL_REQUEST] * 2 if s == SMALL_SEGMENT else [s])]


def logits_bytes(model_cfg, max_rows: int) -> int:
    from miles.model.size import DTYPE_BYTES

    return max_rows * model_cfg.vocab_size * DTYPE_BYTES[model_cfg.dtype]


def graph_tag_storages(model_cfg, max_rows: int) -> list[int]:
    """What the ``cuda_graph`` tag holds once graphs are captured: the logits buffer and the pool's segments."""
    return [logits_bytes(model_cfg, max_rows), *pool_segments(model_cfg, max_rows)]


def pool_segment_bytes(pool) -> int:
    """Bytes of the segments the caching allocator holds for ``pool`` (a graph pool handle), on any device."""
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == tuple(pool))


class DecodeGraphs:
    def __init__(self, owner: str, ledger: MemoryLedger, *, reserve: list[int] = ()):
        self.owner, self.ledger, self.reserve = owner, ledger, list(reserve)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.bytes = 0  # device bytes the pool's segments hold (what the ledger was told)
        self._anchor: torch.cuda.CUDAGraph | None = None  # the graph that made the reservation keeps the pool
        self.stream: torch.cuda.Stream | None = None  # warm-ups and captures run here; replays on the caller's

    def run(self, key: tuple, fn) -> None:
        g = self.graphs.get(key)
        if g is not None:
            g.replay()
            return
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            fn()  # the first step at this size runs eagerly (Triton compiles, cuBLAS picks kernels, makes workspaces)
        torch.cuda.current_stream().wait_stream(self.stream)
        self.graphs[key] = self._capture(fn)  # capturing records the kernels; it runs nothing

    def _capture(self, fn) -> torch.cuda.CUDAGraph:
        torch.cuda.synchronize()
        gc.collect()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
            self._reserve()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool, stream=self.stream):
            fn()
        torch.cuda.synchronize()
        self._record(pool_segment_bytes(self.pool))
        return g

    def _record(self, held: int) -> None:
        grown = held - self.bytes
        if grown > 0:
            if self.bytes:
                log.warning("decode graph capture outgrew its reserved pool by %d bytes (recorded)", grown)
            self.bytes = held
            self.ledger.record(self.owner, "cuda_graph", "device", grown, "in", "capture_cuda_graph")

    def _reserve(self) -> None:
        """Make the pool's segments now, by allocating and freeing ``reservation_requests`` inside a graph
        capture (allocations there come from the graph's pool). One small kernel keeps the graph non-empty."""
        if not self.reserve:
            return
        self._anchor = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._anchor, pool=self.pool, stream=self.stream):
            held = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in reservation_requests(self.reserve)]
            held[0][:1].zero_()
            del held
        torch.cuda.synchronize()
        self._record(pool_segment_bytes(self.pool))

    def release(self, phase: str | None = None) -> int:
        freed = self.bytes
        self.graphs.clear()
        self._anchor, self.pool = None, None
        if freed:
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            self.ledger.record(self.owner, "cuda_graph", "device", freed, "out", phase)
        self.bytes = 0
        return freed
