"""The decode step's CUDA graphs: one per bucketed row count, captured once, in one memory pool owned by the
``cuda_graph`` tag.

A decode step is a few hundred small kernels; replaying it as one graph removes the launch cost that bounds
a small model's step. Each bucket is captured the first time a step runs at that row count (after one eager
step at that size, which also compiles the Triton kernels) and replayed after that. All graphs share one
private pool, first reserved at ``pool_bytes(...)`` so that its size is known before launch (the planner
predicts it; a capture that outgrows it is recorded in the ledger for what it really took). Weight updates
copy into the same storages, so graphs survive them. Releasing the tag drops the graphs and hands their pool
back; so does releasing ``weights`` or ``kv_cache`` (their storages come back at new addresses, which the
graphs would still point to). The next step at a bucket captures it again.

    graphs = DecodeGraphs("engine/0", ledger, reserve=pool_bytes(model_cfg, max_rows))
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
SMALL_SEGMENT = 2 * MiB  # the caching allocator serves requests of at most 1 MiB from 2 MiB segments


def pool_bytes(model_cfg, max_rows: int, num_splits: int = 16) -> tuple[int, int]:
    """(large, small) bytes reserved for the graphs' private pool at ``max_rows``: the intermediates of one
    decode step live at once at its widest point (the MLP, three [rows, intermediate] tensors, and the
    FP32 RMSNorm temporaries), plus the decode attention's per-split partials. Rounded to 2 MiB segments."""
    from miles.model.size import DTYPE_BYTES

    dt = DTYPE_BYTES[model_cfg.dtype]
    R, H, I = max_rows, model_cfg.hidden_size, model_cfg.intermediate_size
    heads, D = model_cfg.num_attention_heads, model_cfg.head_dim
    large = 4 * R * I * dt + 8 * R * H * 4 + R * heads * num_splits * (D + 2) * 4 + 4 * R * heads * D * dt
    large = -(-large // SMALL_SEGMENT) * SMALL_SEGMENT
    return large, 16 * SMALL_SEGMENT


def graph_tag_storages(model_cfg, max_rows: int) -> list[int]:
    """What the ``cuda_graph`` tag holds once graphs are captured: the logits buffer and the reserved pool."""
    from miles.model.size import DTYPE_BYTES

    return [max_rows * model_cfg.vocab_size * DTYPE_BYTES[model_cfg.dtype], *pool_bytes(model_cfg, max_rows)]


class DecodeGraphs:
    def __init__(self, owner: str, ledger: MemoryLedger, *, reserve: tuple[int, int] = (0, 0)):
        self.owner, self.ledger, self.reserve = owner, ledger, reserve
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.bytes = 0  # device bytes the pool holds (what the ledger was told)
        self._anchor: torch.cuda.CUDAGraph | None = None  # the graph that made the reservation keeps the pool

    def run(self, key: tuple, fn) -> None:
        g = self.graphs.get(key)
        if g is not None:
            g.replay()
            return
        fn()  # the first step at this size runs eagerly (Triton compiles, cuBLAS picks its kernels)
        self.graphs[key] = self._capture(fn)  # capturing records the kernels; it runs nothing

    def _capture(self, fn) -> torch.cuda.CUDAGraph:
        # torch.cuda.graph() empties the allocator's cache before capturing: empty it first, so that the growth
        # measured across the capture is the pool's own segments and not offset by freed cached blocks
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
            self._reserve()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            fn()
        torch.cuda.synchronize()
        grown = torch.cuda.memory_reserved() - before
        if grown > 0:
            if self.bytes and self.reserve != (0, 0):
                log.warning("decode graph capture outgrew its reserved pool by %d bytes (recorded)", grown)
            self.bytes += grown
            self.ledger.record(self.owner, "cuda_graph", "device", grown, "in", "capture_cuda_graph")
        return g

    def _reserve(self) -> None:
        """Make the pool's segments now: one large block, and small blocks two to a 2 MiB segment."""
        large, small = self.reserve
        if not (large or small):
            return
        self._anchor = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._anchor, pool=self.pool):
            held = [torch.empty(large, dtype=torch.uint8, device="cuda")] if large else []
            held += [torch.empty(MiB, dtype=torch.uint8, device="cuda") for _ in range(2 * small // SMALL_SEGMENT)]
            del held

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
