"""What a weight update carries and how it is cut: the manifest (every tensor's name, dtype, shape, group), the
pieces a tensor is cut into, their byte layout inside a bucket (``ALIGN``-aligned), the fused groups an engine
loads as one parameter (q/k/v, gate/up, experts), and the planner that packs pieces into buckets."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger(__name__)

ALIGN = 256  # byte alignment of every piece inside a bucket (a multiple of every element size)


# ---- manifest and pieces ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WeightSpec:
    name: str
    dtype: str  # torch dtype name without the prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    group: str  # tensors of one group are applied together (the shards of a fused parameter)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True, slots=True)
class WeightManifest:
    """Everything an engine needs to validate a whole update before the first byte arrives."""

    specs: tuple[WeightSpec, ...]
    staging: str = "shadow"  # "shadow": land in a copy, swap in at commit | "direct": write into the weights

    @staticmethod
    def of(named: list[tuple[str, torch.Tensor]], group_of: Callable[[str], str], staging: str) -> "WeightManifest":
        return WeightManifest(
            tuple(WeightSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), group_of(n)) for n, t in named),
            staging,
        )


@dataclass(frozen=True, slots=True)
class PieceMeta:
    """Bytes [start, start + nbytes) of tensor ``name``, found at ``offset`` in a flat bucket."""

    name: str
    offset: int
    nbytes: int
    start: int = 0


@dataclass(frozen=True, slots=True)
class Piece:
    name: str
    tensor: torch.Tensor
    start: int
    nbytes: int

    def source_bytes(self) -> torch.Tensor:
        return byte_view(self.tensor)[self.start : self.start + self.nbytes]


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's bytes (a copy only if it is not contiguous)."""
    if t.dtype == torch.uint8 and t.dim() == 1 and not t.requires_grad and t.is_contiguous():
        return t  # already one (the in-place receive path passes thousands per second)
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def host_bytes(t: torch.Tensor):
    """A numpy uint8 array over a contiguous CPU tensor's bytes, without ``Tensor.numpy()``: exporting a storage to
    numpy marks it non-resizable for good, and live parameters must stay resizable (TaggedMemory frees them at
    every offload). The array does not keep ``t`` alive: hold ``t`` while the array is in use."""
    import ctypes

    import numpy as np

    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"host_bytes needs a contiguous CPU tensor, got {t.device} contiguous={t.is_contiguous()}")
    n = t.numel() * t.element_size()
    if n == 0:
        return np.empty(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(t.data_ptr()))


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout(pieces: list[Piece]) -> tuple[list[PieceMeta], int]:
    """Offsets of pieces packed into one bucket (each aligned to ALIGN bytes) and the bucket's size."""
    metas, off = [], 0
    for p in pieces:
        metas.append(PieceMeta(p.name, off, p.nbytes, p.start))
        off += aligned(p.nbytes)
    return metas, off


# ---- fused groups ----------------------------------------------------------------------------------------
_QKV = re.compile(r"^(.*\.self_attn\.)(q|k|v)_proj\.(weight|bias)$")
_GATE_UP = re.compile(r"^(.*\.mlp\.)(gate|up)_proj\.weight$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)\d+\.(gate|up|down)_proj\.weight$")


def fused_group(name: str) -> str:
    """The engine-side parameter a trainer tensor is a shard of (SGLang-style stacking).

    q/k/v projections of a layer form ``qkv_proj``, gate/up form ``gate_up_proj``, the experts of a layer form
    ``w13`` (gate and up) and ``w2`` (down). Shards of one group are always applied together.
    """
    if m := _QKV.match(name):
        return f"{m[1]}qkv_proj.{m[3]}"
    if m := _EXPERT.match(name):
        return f"{m[1]}{'w2' if m[2] == 'down' else 'w13'}"
    if m := _GATE_UP.match(name):
        return f"{m[1]}gate_up_proj.weight"
    return name


# ---- bucket planning -------------------------------------------------------------------------------------
def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    group_of: Callable[[str], str] = fused_group,
    *,
    split: bool = False,
) -> Iterator[list[Piece]]:
    """Yield buckets (lists of pieces) whose aligned bytes fit in ``bucket_bytes``.

    Tensors with the same ``group_of(name)`` always travel together, in the order their group first appears.
    A group larger than the bucket: with ``split=False`` it gets a bucket of its own, larger than the limit,
    with a warning (the sender grows its buffer); with ``split=True`` (fixed, registered buckets) it starts a
    fresh bucket and its bytes are cut into pieces across as many buckets as it needs — the engine applies the
    group only once every piece has arrived.
    """
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named_tensors:
        groups.setdefault(group_of(name), []).append((name, t))
    bucket, used = [], 0
    for key, members in groups.items():
        size = sum(aligned(_nbytes(t)) for _, t in members)
        if used + size > bucket_bytes and bucket:
            yield bucket
            bucket, used = [], 0
        if size <= bucket_bytes:
            bucket += [Piece(n, t, 0, _nbytes(t)) for n, t in members]
            used += size
            continue
        if not split:
            if key not in _WARNED:
                _WARNED.add(key)
                log.warning(
                    "weight group %s (%d bytes) exceeds update_weight_buffer_size %d; sending it in a bucket of its "
                    "own (the staging buffer grows to hold it)",
                    key,
                    size,
                    bucket_bytes,
                )
            yield [Piece(n, t, 0, _nbytes(t)) for n, t in members]
            continue
        for piece in _cut(members, bucket_bytes):
            if used + aligned(piece.nbytes) > bucket_bytes:
                yield bucket
                bucket, used = [], 0
            bucket.append(piece)
            used += aligned(piece.nbytes)
    if bucket:
        yield bucket


_WARNED: set[str] = set()  # groups already warned about (once per process, not once per sync)


def _cut(members: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Piece]:
    chunk = bucket_bytes // ALIGN * ALIGN
    for name, t in members:
        n = _nbytes(t)
        for start in range(0, max(n, 1), chunk):
            yield Piece(name, t, start, min(chunk, n - start))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
