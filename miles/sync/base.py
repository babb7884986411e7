"""The WeightSync interface shared by every transport, the bucket planner, and the update sequence they share.

A transport is connected once to the engines, then ``update(named_tensors, version)`` is called after every
training step on every trainer rank (named_weights is collective under FSDP2; only the source rank sends).
The engine side sees: pause generation -> flush cache -> begin (manifest) -> buckets -> set version (commit)
-> continue. A failure anywhere between begin and commit aborts the update on every engine, which keeps
serving the version it had (see miles.sync.receiver).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from miles.rollout.api import Transactional, TwoCallUpdate, supports

log = logging.getLogger(__name__)

ALIGN = 256  # byte alignment of every piece inside a bucket (a multiple of every element size)


class WeightSync(Protocol):
    def connect(self, engines: list[Any]) -> None: ...

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def metrics(self) -> dict[str, float]: ...


class SyncError(RuntimeError):
    """A weight update failed; the engines were told to abort it and keep their previous version."""


# ---- calling engines: in-process objects and Ray actor handles alike ---------------------------------------
def call(engine: Any, method: str, *args, **kwargs):
    """Call ``method`` on an in-process engine or a Ray actor handle alike (blocking)."""
    return wait([submit(engine, method, *args, **kwargs)])[0]


def submit(engine: Any, method: str, *args, **kwargs):
    """Start ``method``: a Ray ObjectRef for an actor handle, the result itself for an in-process engine."""
    fn = getattr(engine, method)
    if hasattr(fn, "remote"):
        return fn.remote(*args, **kwargs)
    return _Done(fn(*args, **kwargs))


def wait(pending: list, timeout: float | None = None) -> list:
    """Results of ``submit`` calls, in order (raises the first remote error)."""
    refs = [p for p in pending if not isinstance(p, _Done)]
    got = iter(_ray_get(refs, timeout) if refs else [])
    return [p.value if isinstance(p, _Done) else next(got) for p in pending]


def is_actor(engine: Any) -> bool:
    """True for a Ray actor handle (its methods have ``.remote``)."""
    return hasattr(getattr(engine, "set_weight_version", None), "remote")


@dataclass(frozen=True, slots=True)
class _Done:
    value: Any


def _ray_get(refs, timeout):
    import ray

    return ray.get(refs, timeout=timeout)


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


# ---- the update sequence every bucketed transport shares --------------------------------------------------
@dataclass(kw_only=True, slots=True)
class SyncTimer:
    """Seconds per phase of one update, plus bytes and buckets."""

    phases: dict[str, float] = field(default_factory=dict)
    nbytes: int = 0
    buckets: int = 0

    def add(self, phase: str, t0: float) -> float:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - t0
        return now

    def metrics(self, prefix: str, total_s: float) -> dict[str, float]:
        out = {
            f"{prefix}/bytes": self.nbytes,
            f"{prefix}/buckets": self.buckets,
            f"{prefix}/seconds": total_s,
            f"{prefix}/gbps": self.nbytes / total_s / 1e9 if total_s else 0.0,
        }
        out.update({f"{prefix}/{k}_s": v for k, v in self.phases.items()})
        return out


class BucketSync:
    """Template for transports that move buckets: subclasses implement ``_send(index, pieces)`` (and may
    override ``_start``/``_finish``); this class runs pause -> flush -> begin -> buckets -> commit -> continue
    and aborts the update on every engine when anything fails in between. An engine with ``open_weight_update`` /
    ``commit_weight_update`` (miles.sync.receiver.UpdateCalls) gets the steps around the buckets in two calls.

        sync = TensorSync(cfg, "cpu"); sync.connect([engine])
        sync.update(backend.named_weights(), version=1)      # every trainer rank calls it
        sync.metrics()                                      # {"sync/bytes": ..., "sync/seconds": ...}
    """

    name = "sync"
    split = False  # fixed buckets (rdt) cut large groups into pieces; growing buckets never do

    def __init__(self, cfg, device, *, is_source: bool = True, group_of: Callable[[str], str] = fused_group):
        self.cfg, self.device, self.is_source, self.group_of = cfg, torch.device(device), is_source, group_of
        self.engines: list[Any] = []
        self._metrics: dict[str, float] = {}
        self._transactional: list[bool] = []
        self._two_calls: list[bool] = []

    def connect(self, engines: list[Any]) -> None:
        self.engines = list(engines)
        self._transactional = [supports(e, Transactional) for e in self.engines]
        self._two_calls = [supports(e, TwoCallUpdate) for e in self.engines]  # miles.sync.receiver.UpdateCalls
        for e, ok in zip(self.engines, self._transactional):
            if not ok:
                log.warning(
                    "engine %r has no begin_weight_update: a failure mid-sync can leave it with a mix of versions", e
                )

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        t0 = time.perf_counter()
        named = list(named_tensors) if self.is_source else named_tensors
        if not self.is_source:
            for _ in named:  # the iteration itself may be collective (FSDP2 full tensors)
                pass
            return
        timer = SyncTimer()
        try:
            self._open(WeightManifest.of(named, self.group_of, self.cfg.engine_staging))
            t = timer.add("begin", t0)
            self._start(timer)
            for i, pieces in enumerate(plan_buckets(named, self._bucket_bytes(), self.group_of, split=self.split)):
                self._send(i, pieces, timer)
                timer.nbytes += sum(p.nbytes for p in pieces)
                timer.buckets += 1
            self._finish(timer)
            t = time.perf_counter()
            self._commit(version)
            timer.add("commit", t)
        except Exception as e:
            self._abort()
            self._each("continue_generation", quiet=True)
            raise SyncError(
                f"{self.name} weight update to version {version} failed ({type(e).__name__}: {e}); "
                "the engines aborted it and keep serving their previous version"
            ) from e
        self._metrics = timer.metrics("sync", time.perf_counter() - t0)

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def close(self) -> None:
        pass

    # ---- for subclasses ------------------------------------------------------------------------------------
    def _bucket_bytes(self) -> int:
        return self.cfg.update_weight_buffer_size

    def _start(self, timer: SyncTimer) -> None:
        pass

    def _send(self, index: int, pieces: list[Piece], timer: SyncTimer) -> None:
        raise NotImplementedError

    def _finish(self, timer: SyncTimer) -> None:
        pass

    def _abort(self) -> None:
        self._each("abort_weight_update", only_transactional=True, quiet=True)

    def _open(self, manifest: WeightManifest) -> None:
        """pause -> flush -> begin on every engine: one call where the engine takes them together."""
        self._each("pause_generation", "in_place", one_by_one=True)
        self._each("flush_cache", one_by_one=True)
        self._each("begin_weight_update", manifest, only_transactional=True, one_by_one=True)
        wait([submit(e, "open_weight_update", manifest) for e, two in zip(self.engines, self._two_calls) if two])

    def _commit(self, version: int) -> None:
        """set version (commit) -> continue on every engine: one call where the engine takes them together."""
        self._each("set_weight_version", version, one_by_one=True)
        self._each("continue_generation", one_by_one=True)
        wait([submit(e, "commit_weight_update", version) for e, two in zip(self.engines, self._two_calls) if two])

    def _each(
        self, method: str, *args, only_transactional: bool = False, quiet: bool = False, one_by_one: bool = False
    ) -> list:
        """``method`` on every engine (only those that take a whole sync's steps one by one, if asked)."""
        engines = [
            e
            for e, ok, two in zip(self.engines, self._transactional, self._two_calls)
            if (ok or not only_transactional) and not (one_by_one and two)
        ]
        try:
            return wait([submit(e, method, *args) for e in engines])
        except Exception:
            if not quiet:
                raise
            log.exception("%s on the engines failed while cleaning up a weight update", method)
            return []
