"""A private torch.distributed group between a trainer's source rank (rank 0) and engine processes, formed with
SGLang's rendezvous so that either side may be SGLang, slime or miles, and the receive side of its broadcasts.

The rendezvous is sglang 0.5.10.post1's ``srt/utils/common.py init_custom_process_group`` (slime's
``slime/utils/distributed_utils.init_process_group`` is the same), key for key: a TCPStore at
``master_address:master_port`` (rank 0 hosts it), wrapped in ``PrefixStore(group_name)``, then torch's
``_new_process_group_helper`` adds ``PrefixStore(f"{group_name}/")`` and the backend's ``PrefixStore("cpu/")``
(gloo) or ``("cuda/")`` (NCCL). ``make_group`` builds the same stores but creates the backend itself, so gloo
binds an explicit address of this host (not the hostname's) and the whole join is bounded by
``connect_timeout_s`` (the store, and gloo's connect, which otherwise waits out the collective timeout).

What a broadcast carries (``load_format`` of /update_weights_from_distributed; both ends agree on it beforehand,
``FORMATS`` in preference order, a server lists what it takes in /server_info):

- ``per_tensor`` (SGLang's default, ``None`` on the wire): one broadcast per tensor, in order;
- ``flattened_bucket``: SGLang's FlattenedTensorBucket, the tensors' bytes back to back in one uint8 broadcast;
- ``miles_flat``: miles' bucket, every tensor's bytes at an ``ALIGN``-aligned offset, one broadcast.

Received tensors land in an open update (miles' transactions) when there is one; otherwise (an SGLang-protocol
trainer) every name, dtype and shape is checked against the engine first and the call is applied whole. A call
that fails the check still receives its broadcasts (into scratch) before it is refused, so the sender never hangs.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from miles.sync.buckets import ALIGN, PieceMeta, WeightSpec, aligned, byte_view
from miles.sync.receiver import ReceiveError, WeightReceiver

FORMATS = ("miles_flat", "flattened_bucket", "per_tensor")  # what a miles receiver takes, fastest first


@dataclass(frozen=True, slots=True)
class WeightGroup:
    pg: object
    store: object  # the master's TCPStore must live as long as the group


def make_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = 300.0,
    connect_timeout_s: float | None = None,
) -> WeightGroup:
    """Join (rank > 0) or host (rank 0) group ``group_name``; ``connect_timeout_s`` bounds the whole join,
    ``timeout_s`` each collective afterwards."""
    import torch.distributed as dist

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"broadcast backend {backend!r} is not supported; use 'gloo' (CPU) or 'nccl' (CUDA)")
    connect = connect_timeout_s or timeout_s
    deadline = time.monotonic() + connect
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=_td(connect))
    group_store = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    left = _td(max(1.0, deadline - time.monotonic()))
    store.set_timeout(left)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = left  # gloo's full-mesh connect waits this long at most
        opts._devices = [
            dist.ProcessGroupGloo.create_device(
                hostname=master_address if rank == 0 else _local_address(master_address)
            )
        ]
        pg = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", group_store), rank, world_size, opts)
        pg._set_default_timeout(_td(timeout_s))
    else:  # NCCL connects lazily, at the first collective (bounded by its own timeout)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _td(timeout_s)
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", group_store), rank, world_size, opts)
    store.set_timeout(_td(timeout_s))
    return WeightGroup(pg, store)


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _local_address(master_address: str) -> str:
    if master_address in ("127.0.0.1", "localhost", "::1"):
        return master_address
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # the interface that routes to the master
        s.connect((master_address, 9))
        return s.getsockname()[0]


def broadcast(group: WeightGroup, tensors: torch.Tensor | list[torch.Tensor], root: int = 0) -> None:
    """Broadcast each tensor from ``root`` in order (one collective each, all in flight at once, as SGLang's
    receive posts them), then wait for all."""
    import torch.distributed as dist

    works = []
    for t in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        works.append(group.pg.broadcast([t], opts))
    for w in works:
        w.wait()
    if any(t.is_cuda for t in ([tensors] if isinstance(tensors, torch.Tensor) else tensors)):
        torch.cuda.current_stream().synchronize()


# ---- the groups this process is a member of ---------------------------------------------------------------------
_GROUPS: dict[str, WeightGroup] = {}
_RECV_BUFFERS: dict[str, torch.Tensor] = {}


def join_group(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    connect_timeout_s: float | None = None,
) -> None:
    """Engine-process side of ``init_weights_update_group`` (this process is rank ``rank_offset``)."""
    if group_name in _GROUPS:
        return
    _GROUPS[group_name] = make_group(
        master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s, connect_timeout_s
    )


def in_group(group_name: str) -> bool:
    """Whether this process is a member of weight update group ``group_name``."""
    return group_name in _GROUPS


def leave_group(group_name: str) -> None:
    _GROUPS.pop(group_name, None)
    _RECV_BUFFERS.pop(group_name, None)


def layout(specs: list[WeightSpec], load_format: str) -> tuple[list[PieceMeta], int]:
    """Where each tensor's bytes sit in one flat bucket of ``load_format`` (aligned for miles_flat, back to back
    for flattened_bucket), and the bucket's size."""
    metas, off = [], 0
    for s in specs:
        metas.append(PieceMeta(s.name, off, s.nbytes))
        off += aligned(s.nbytes) if load_format == "miles_flat" else s.nbytes
    return metas, off


def receive_broadcast(
    group_name: str,
    names: list[str],
    dtypes: list[str],
    shapes: list,
    receivers: list[WeightReceiver],
    device,
    load_format: str | None = None,
    *,
    check: Callable[[str, torch.dtype, tuple], None] | None = None,
    apply: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None,
) -> None:
    """Receive one call's broadcasts from rank 0 and land them: in every receiver's open update, else (no update
    open) through ``check`` (each name, dtype, shape, before any byte is taken in) and ``apply`` (the whole call)."""
    group = _GROUPS.get(group_name)
    if group is None:
        raise ReceiveError(
            f"no weight update group {group_name!r} in this process; call init_weights_update_group first"
        )
    fmt = load_format or "per_tensor"
    if fmt not in FORMATS:
        raise ReceiveError(f"load_format {load_format!r} is not one of {list(FORMATS)} (null = per tensor)")
    specs = [
        WeightSpec(n, _dtype_name(d), tuple(int(x) for x in s), n)
        for n, d, s in zip(names, dtypes, shapes, strict=True)
    ]
    transaction = all(r.is_open for r in receivers)
    refused = None
    if not transaction:
        try:
            for s in specs:
                check(s.name, getattr(torch, s.dtype), s.shape)
        except (ValueError, KeyError) as e:
            refused = e  # still take the broadcasts in: the sender is already sending them
    tensors = _receive(group, group_name, specs, device, fmt)
    if refused is not None:
        raise ReceiveError(f"update refused after its broadcasts were drained: {refused}")
    if transaction:
        items = [(PieceMeta(s.name, 0, s.nbytes), byte_view(t)) for s, t in zip(specs, tensors)]
        for r in receivers:
            r.receive(items)
    else:
        apply([(s.name, t) for s, t in zip(specs, tensors)])


def _dtype_name(d) -> str:
    name = str(d).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ReceiveError(f"dtype {d!r} is not a torch dtype name (e.g. 'bfloat16')")
    return name


def _receive(group: WeightGroup, group_name: str, specs: list[WeightSpec], device, fmt: str) -> list[torch.Tensor]:
    """The call's tensors, each shaped and typed as its spec says."""
    if fmt == "per_tensor":
        tensors = [torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=device) for s in specs]
        broadcast(group, tensors)
        return tensors
    metas, total = layout(specs, fmt)
    buf = _RECV_BUFFERS.get(group_name)
    if buf is None or buf.numel() < total or buf.device != torch.device(device):
        buf = _RECV_BUFFERS[group_name] = torch.empty(max(total, ALIGN), dtype=torch.uint8, device=device)
    broadcast(group, buf[: max(total, 1)])
    return [
        buf[m.offset : m.offset + m.nbytes].view(getattr(torch, s.dtype)).reshape(s.shape)
        if s.nbytes % getattr(torch, s.dtype).itemsize == 0 and m.offset % getattr(torch, s.dtype).itemsize == 0
        else buf[m.offset : m.offset + m.nbytes].clone().view(getattr(torch, s.dtype)).reshape(s.shape)
        for s, m in zip(specs, metas)
    ]
