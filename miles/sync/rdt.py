"""The ``rdt`` transport: Ray Direct Transport moves each round of weights from the trainer actor to the engine actors.

Use it for disaggregated engines in the same Ray cluster when NIXL is installed (zero-copy GPU->GPU reads over
NVLink / RDMA, no collective group to set up), or colocated on one GPU through ``cuda_ipc``; ``nccl`` needs a
collective group and ``gloo`` (CPU) exists for testing the path anywhere.

How it works: the trainer owns one fixed staging bucket of ``update_weight_buffer_size`` bytes, allocated once
outside expandable segments (VMM memory cannot be exported by CUDA IPC or registered with NIXL, which then
falls back to a slow bounce path) and registered / exported once at its full size, so a broken
GPU-direct path shows at connect instead of hiding behind a small-buffer fast path. The embedded engines hold
unsharded weights, so one bucket serves every engine (a tensor-parallel engine would get one per rank).
Each round, views of the weights are copied into the bucket; the trainer calls *itself* through Ray with
``tensor_transport=...`` to publish the bucket as an RDT object and passes that ObjectRef to every engine,
whose ``update_weights_from_rdt`` receives the tensors pulled by Ray. A set larger than the bucket goes in
sequential rounds; a group larger than the bucket is cut into pieces the engine assembles before applying
(a fused parameter waits for all its shards); the version is set after the last pull.

``sync.source=in_place`` (cuda_ipc, gloo): no bucket; the round is the trainer's weight tensors themselves, all
in one round, so the engines copy each byte once (over cuda_ipc they map the trainer's memory; the same
conditions as the tensor transport's in-place mode apply: weights resident at fixed addresses).

Actor requirements (see ``actor_options``): the trainer ``max_concurrency >= 1 + gpus_per_engine``: its
``update_weights`` call holds one slot while the publishing self-calls need others; ``enable_tensor_transport=True``
on both sides gives transfers their own ``_ray_system`` concurrency group (without it they queue in the default
group, which works when that has a free slot: measured with the driver's max_concurrency=2 TrainActor).
With ``max_concurrency=1`` the self-call waits behind ``update_weights`` forever; ``connect`` probes this and
raises instead of hanging (with Ray 2.60 a busy max_concurrency=1 actor runs neither the self-call nor its
``_ray_system`` transfers: a sync then waits for Ray's 60 s RDT fetch timeout, which is how a first try timed
out). A handle from ``get_runtime_context().current_actor`` lacks the tensor-transport flag of the actor, so
the sync sets it on its own handle after the probe.

Two-sided transports (gloo, nccl) also need a Ray collective group, which must be created in the process that
owns the ObjectRefs (the trainer: Ray keeps the group registry per process) and which initialises
torch.distributed's *default* group in each member: a trainer that already has one (FSDP world > 1) cannot
join, so use nixl / cuda_ipc or the ``broadcast`` transport there.
"""

from __future__ import annotations

import logging
import time
import uuid

import torch

from miles.config import SyncConfig
from miles.sync.bucket_sync import BucketSync, SyncTimer
from miles.sync.buckets import Piece, PieceMeta, fused_group, layout
from miles.sync.calls import is_actor, submit, wait
from miles.sync.flat_bucket import alloc_exportable

log = logging.getLogger(__name__)

TWO_SIDED = ("gloo", "nccl")
_SOURCES: dict[str, "RDTSync"] = {}  # sync id -> the sync living in this (trainer) process


def resolve_transport(name: str, device) -> str:
    """``auto``: nixl where it is installed (GPU), else cuda_ipc on GPU, gloo on CPU."""
    if name != "auto":
        return name
    if torch.device(device).type != "cuda":
        return "gloo"
    try:
        import nixl  # noqa: F401

        return "nixl"
    except ImportError:
        return "cuda_ipc"


def actor_options(gpus_per_engine: int = 1) -> dict:
    """Ray actor options the trainer actor needs for the rdt transport. The engine actor needs
    ``enable_tensor_transport=True`` and a second slot too: its receive call waits inside the actor while the
    transfer completes (measured: with ``max_concurrency=1`` on the engine the transfer times out after 60 s)."""
    return {"enable_tensor_transport": True, "max_concurrency": 1 + gpus_per_engine}


class RDTSync(BucketSync):
    """sync = RDTSync(cfg.sync, "cuda")          # inside the trainer actor (a Ray actor, see actor_options)
    sync.connect([engine_actor, ...])            # bucket allocated + registered; collective group if two-sided
    sync.update(backend.named_weights(), version=1)
    sync.metrics()                               # bytes, rounds, seconds per phase
    """

    name = "rdt"
    split = True

    def __init__(
        self, cfg: SyncConfig, device, *, is_source: bool = True, group_of=fused_group, timeout_s: float = 120.0
    ):
        super().__init__(cfg, device, is_source=is_source, group_of=group_of)
        self.transport = resolve_transport(cfg.rdt_transport, self.device)
        self.timeout_s = timeout_s
        self.sync_id = uuid.uuid4().hex
        self.bucket: torch.Tensor | None = None
        self.me = None
        self.comm, self._owns_comm = None, False
        self.in_place = getattr(cfg, "source", "bucket") == "in_place"
        if self.in_place:
            if self.transport not in ("cuda_ipc", "gloo"):
                raise ValueError(
                    f"rdt with sync.source=in_place publishes the trainer's own tensors; over "
                    f"{self.transport!r} use sync.source=bucket (registered buckets), or rdt_transport=cuda_ipc"
                )
            self.split = False  # whole tensors, one round: nothing is staged, so no bucket bounds it
        self._round: list[torch.Tensor] = []

    def connect(self, engines: list) -> None:
        super().connect(engines)
        if not self.is_source or not self.engines:
            return

        self.me = _current_actor()
        local = [e for e in self.engines if not is_actor(e)]
        if local:
            raise ValueError(f"the rdt transport sends to engines that are Ray actors; {local[0]!r} is not one")
        _check_actor(self.me, min(self.timeout_s, 30.0))
        if self.transport in TWO_SIDED:
            self.comm, self._owns_comm = _collective_group([self.me] + self.engines, self.transport)
        if not self.in_place:
            self.bucket = alloc_exportable(self.cfg.update_weight_buffer_size, self.device)
            _probe_registration(self.bucket, self.transport)
        _SOURCES[self.sync_id] = self

    def _bucket_bytes(self) -> int:
        return 1 << 62 if self.in_place else self.cfg.update_weight_buffer_size

    def _send(self, index: int, pieces: list[Piece], timer: SyncTimer) -> None:
        if self.in_place:
            return self._send_in_place(pieces, timer)
        t = time.perf_counter()
        metas, total = layout(pieces)
        for p, m in zip(pieces, metas):
            self.bucket[m.offset : m.offset + m.nbytes].copy_(p.source_bytes(), non_blocking=True)
        if self.bucket.is_cuda:
            torch.cuda.current_stream().synchronize()
        t = timer.add("stage", t)
        ref = self.me.__ray_call__.options(tensor_transport=self.transport).remote(_publish, self.sync_id, total)
        recvs = [submit(e.update_weights_from_rdt, ref, metas) for e in self.engines]
        wait(recvs, timeout=self.timeout_s)  # the bucket is reused next round: every engine must have pulled
        timer.add("pull", t)

    def _send_in_place(self, pieces: list[Piece], timer: SyncTimer) -> None:
        """The round is the trainer's tensors themselves: over cuda_ipc the engines map them (torch keeps the
        mapping of a storage opened before, see receive_rdt) and copy once; over gloo they are sent as they are."""
        t = time.perf_counter()
        bad = [
            f"{p.name} ({p.tensor.device}, contiguous={p.tensor.is_contiguous()})"
            for p in pieces
            if not p.tensor.is_contiguous() or p.tensor.device.type != self.device.type
        ]
        if bad:
            raise ValueError(
                f"rdt in place sends the trainer's tensors as they are: contiguous, on {self.device.type}; "
                f"got {bad[:3]}: use sync.source=bucket"
            )
        self._round = [p.tensor.detach() for p in pieces]
        metas = [PieceMeta(p.name, 0, p.nbytes) for p in pieces]
        if any(x.is_cuda for x in self._round):
            torch.cuda.current_stream().synchronize()
        ref = self.me.__ray_call__.options(tensor_transport=self.transport).remote(_publish_round, self.sync_id)
        wait([submit(e.update_weights_from_rdt, ref, metas) for e in self.engines], timeout=self.timeout_s)
        self._round = []
        timer.add("pull", t)

    def close(self) -> None:
        _SOURCES.pop(self.sync_id, None)
        if self.comm is not None and self._owns_comm:
            from ray.experimental.collective import destroy_collective_group

            try:
                destroy_collective_group(self.comm)
            except Exception:
                log.exception("destroying the rdt collective group failed")
            self.comm = None


def _publish(actor, sync_id: str, nbytes: int) -> list[torch.Tensor]:
    """Runs on the trainer actor (through ``__ray_call__``): the staged round, as an RDT object's tensors."""
    return [_SOURCES[sync_id].bucket[: max(nbytes, 1)]]


def _publish_round(actor, sync_id: str) -> list[torch.Tensor]:
    """Runs on the trainer actor: an in-place round, the trainer's tensors as an RDT object."""
    return list(_SOURCES[sync_id]._round)


def _ping(actor) -> bool:
    return True


def _current_actor():
    import ray

    try:
        me = ray.get_runtime_context().current_actor
    except RuntimeError:
        me = None
    if me is None:
        raise RuntimeError(
            "the rdt transport runs inside a Ray actor (the trainer's TrainActor): RDT objects are "
            "created by an actor task; use 'tensor' or 'broadcast' from a plain process"
        )
    return me


def _check_actor(me, timeout_s: float) -> None:
    """Fail fast where Ray would starve the transfer: RDT sends run on the trainer actor in Ray's ``_ray_system``
    concurrency group (created by enable_tensor_transport=True; without it they queue in the default group) and
    the publishing self-call needs a free default slot while ``update_weights`` runs. Measured with Ray 2.60: on
    a max_concurrency=1 actor neither runs while the actor is busy, so a sync would wait for Ray's 60 s RDT
    timeout and kill the actors."""
    import ray

    for opts in ({"concurrency_group": "_ray_system"}, {}):
        try:
            ray.get(me.__ray_call__.options(**opts).remote(_ping), timeout=timeout_s)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError, ValueError) as e:
            raise RuntimeError(
                f"the rdt transport needs the trainer actor created with max_concurrency >= 1 + "
                f"gpus_per_engine and enable_tensor_transport=True: a call {opts or 'in the default group'} "
                f"did not run while the actor was busy (Ray {ray.__version__}: {type(e).__name__}); see "
                "miles.sync.rdt.actor_options()"
            ) from None
    # A handle from get_runtime_context().current_actor does not carry the actor's enable_tensor_transport flag
    # (Ray 2.60 rebuilds it from the core worker without it), so .options(tensor_transport=...) on it would be
    # refused even on an actor created with the flag; the probe above showed transfers can run, so set it here.
    me._ray_enable_tensor_transport = True


def _collective_group(actors: list, transport: str):
    """A Ray collective group of these actors: an existing one of this process (a second sync to the same
    engines reuses it: an actor joins one group per backend), else a new one. Returns (group, created)."""
    import torch.distributed as dist
    from ray.experimental.collective import create_collective_group, get_collective_groups

    backend = "torch_gloo" if transport == "gloo" else "nccl"
    existing = [g for g in get_collective_groups(actors, backend=backend) if len(g.actors) == len(actors)]
    if existing:
        return existing[0], False
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            f"rdt over {transport} needs a Ray collective group, which initialises torch.distributed's "
            "default group in every member; this trainer process already has one (world size "
            f"{dist.get_world_size()}). Use sync.rdt_transport=nixl / cuda_ipc, or sync.transport=broadcast"
        )
    return create_collective_group(actors, backend=backend, name=f"miles-rdt-{uuid.uuid4().hex[:8]}"), True


def _probe_registration(bucket: torch.Tensor, transport: str) -> None:
    """Register / export the bucket at its real size now, so a broken path fails here, loudly."""
    if transport == "nixl":
        try:
            from ray.experimental.rdt import register_nixl_memory
        except ImportError as e:
            raise ImportError("sync.rdt_transport=nixl needs NIXL: pip install 'miles[nixl]'") from e
        register_nixl_memory(bucket)
    elif transport == "cuda_ipc":
        from torch.multiprocessing.reductions import reduce_tensor

        try:
            reduce_tensor(bucket)
        except RuntimeError as e:
            raise RuntimeError(
                f"the {bucket.numel()}-byte rdt bucket cannot be exported through CUDA IPC ({e}); it must "
                "come from ordinary cudaMalloc memory (expandable_segments off)"
            ) from e
