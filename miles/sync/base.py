"""The WeightSync interface shared by every transport, and the bucket planner.

A transport is connected once to the engines, then ``update(named_tensors, version)`` is called after every
training step on every trainer rank (named_weights is collective under FSDP2; only the source rank sends).
The engine side sees: pause generation -> flush cache -> buckets -> set version -> continue.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)


class WeightSync(Protocol):
    def connect(self, engines: list[Any]) -> None: ...

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def metrics(self) -> dict[str, float]: ...


def call(engine: Any, method: str, *args, **kwargs):
    """Call ``method`` on an in-process engine or a Ray actor handle alike (blocking)."""
    fn = getattr(engine, method)
    if hasattr(fn, "remote"):
        import ray

        return ray.get(fn.remote(*args, **kwargs))
    return fn(*args, **kwargs)


def plan_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 group_of=lambda name: name) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of (name, tensor) whose bytes fit in ``bucket_bytes``.

    Tensors with the same ``group_of(name)`` (e.g. the shards of a fused parameter) always share a bucket.
    A group larger than the bucket is yielded alone, with a warning: the bucket must grow to hold it.
    """
    bucket, size, group, gsize = [], 0, [], 0
    current = object()
    for name, t in list(named_tensors) + [(None, None)]:
        key = group_of(name) if name is not None else object()
        if key != current and group:
            if size + gsize > bucket_bytes and bucket:
                yield bucket
                bucket, size = [], 0
            if gsize > bucket_bytes:
                log.warning("weight group %s (%d bytes) exceeds update_weight_buffer_size %d; sending it in a bucket of its own",
                            group[0][0], gsize, bucket_bytes)
            bucket, size = bucket + group, size + gsize
            group, gsize = [], 0
        if name is None:
            break
        current = key
        group.append((name, t))
        gsize += t.numel() * t.element_size()
    if bucket:
        yield bucket
