"""The ``broadcast`` transport: a torch.distributed group of the trainer's source rank and the engine processes.

Use it when the engines run in other processes or on other hosts and no shared memory or RDT path exists
between them: NCCL on GPU (over NVLink / InfiniBand, the usual disaggregated path of SGLang-based systems),
gloo on CPU. The group forms with SGLang's rendezvous (miles.sync.weight_group), so its members may be SGLang
servers as well as miles ones; what a bucket travels as is agreed at connect from what every endpoint takes
(``broadcast_formats()``): miles' aligned flat bucket in one collective where all take it, else SGLang's
flattened bucket, else one broadcast per tensor (SGLang's default). The engines land it in their open update.
The group is private (its own TCPStore rendezvous), so it coexists with the trainer's FSDP world and needs no
default process group in the engine processes.
"""

from __future__ import annotations

import logging
import time
import uuid

import torch

from miles.config import SyncConfig
from miles.ports import free_port
from miles.sync.bucket_sync import BucketSync, SyncTimer
from miles.sync.buckets import Piece, WeightSpec, fused_group
from miles.sync.calls import is_actor, submit, wait
from miles.sync.weight_group import FORMATS, broadcast, layout, make_group

log = logging.getLogger(__name__)


class BroadcastSync(BucketSync):
    """sync = BroadcastSync(cfg.sync, "cpu")      # inside the trainer's source rank
    sync.connect([engine_actor, ...])            # engines join a group: rank 0 = trainer, 1.. = engines
    sync.update(backend.named_weights(), version=1)
    sync.close()                                 # engines leave the group

    Engines (Ray actors) expose ``init_weights_update_group``, ``update_weights_from_distributed``,
    ``destroy_weights_update_group`` besides the common update methods.
    """

    name = "broadcast"

    def __init__(
        self, cfg: SyncConfig, device, *, is_source: bool = True, group_of=fused_group, timeout_s: float = 120.0
    ):
        super().__init__(cfg, device, is_source=is_source, group_of=group_of)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.group_name = f"miles-weights-{uuid.uuid4().hex[:8]}"
        self.timeout_s = timeout_s
        self.group = None
        self.format = FORMATS[0]  # agreed at connect with every endpoint
        self._buf: torch.Tensor | None = None

    def connect(self, engines: list) -> None:
        super().connect(engines)
        if not self.is_source or not self.engines:
            return
        local = [e for e in self.engines if not is_actor(e)]
        if local:
            raise ValueError(
                f"the broadcast transport sends to engines in other processes (Ray actors); {local[0]!r} "
                "lives in this process: use sync.transport='tensor' for it"
            )
        self._form_group()

    def _form_group(self) -> None:
        """Rank 0 here; each endpoint from the next free rank, as many ranks as it takes (an engine process one,
        a real SGLang server one per tensor-parallel worker, a router the sum over its live servers)."""
        asks = [submit(e.broadcast_formats) if hasattr(e, "broadcast_formats") else None for e in self.engines]
        self.format = _agree([FORMATS if a is None else wait([a])[0] for a in asks])
        ranks = wait([submit(e.group_ranks) for e in self.engines])
        addr, port, world = _address(), free_port(""), 1 + sum(ranks)
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        joins = [
            submit(e.init_weights_update_group, addr, port, off, world, self.group_name, self.backend)
            for e, off in zip(self.engines, offsets)
        ]
        self.group = make_group(addr, port, 0, world, self.group_name, self.backend, self.timeout_s)
        wait(joins)
        log.info(
            "broadcast group %s: %s at %s:%d, %d ranks, %s",
            self.group_name,
            self.backend,
            addr,
            port,
            world,
            self.format,
        )

    def _start(self, timer: SyncTimer) -> None:
        """A group that lost a member (a server restarted by the router) is formed again over who is live now."""
        super()._start(timer)
        if not all(wait([submit(e.in_weights_group, self.group_name) for e in self.engines])):
            log.warning("broadcast group %s lost a member: forming a new group", self.group_name)
            self.close()
            self.group_name = f"miles-weights-{uuid.uuid4().hex[:8]}"
            self._form_group()

    def _send(self, index: int, pieces: list[Piece], timer: SyncTimer) -> None:
        t = time.perf_counter()
        names = [p.name for p in pieces]
        dtypes = [str(p.tensor.dtype).removeprefix("torch.") for p in pieces]
        shapes = [tuple(p.tensor.shape) for p in pieces]
        if self.format == "per_tensor":  # whole tensors (broadcast buckets never split a tensor), one collective each
            payload = [p.tensor.detach().contiguous() for p in pieces]
        else:
            metas, total = layout(
                [WeightSpec(p.name, d, s, p.name) for p, d, s in zip(pieces, dtypes, shapes)], self.format
            )
            buf = self._buffer(max(total, 1))
            for p, m in zip(pieces, metas):
                buf[m.offset : m.offset + m.nbytes].copy_(p.source_bytes(), non_blocking=True)
            payload = buf[: max(total, 1)]
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        t = timer.add("pack", t)
        recvs = [
            submit(e.update_weights_from_distributed, names, dtypes, shapes, self.group_name, None, self.format)
            for e in self.engines
        ]
        broadcast(self.group, payload)
        t = timer.add("broadcast", t)
        wait(recvs)
        timer.add("engine_wait", t)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buf

    def close(self) -> None:
        if self.group is not None:
            try:
                wait([submit(e.destroy_weights_update_group, self.group_name) for e in self.engines])
            except Exception:
                log.exception("engines failed to leave weight update group %s", self.group_name)
            self.group = None


def _agree(each: list) -> str:
    """The first format (in the first endpoint's order of preference) that every endpoint takes."""
    common = [f for f in each[0] if all(f in e for e in each[1:])] if each else list(FORMATS)
    if not common:
        raise ValueError(f"the engines take no broadcast format in common: {each}")
    return common[0]


def _address() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"
