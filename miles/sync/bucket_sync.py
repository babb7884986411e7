"""The update sequence every bucketed transport (tensor, broadcast, rdt) shares, and its per-phase timer.

A transport is connected once to the engines, then ``update(named_tensors, version)`` is called after every
training step on every trainer rank (named_weights is collective under FSDP2; only the source rank sends).
The engine side sees: pause generation -> flush cache -> begin (manifest) -> buckets -> set version (commit)
-> continue. A failure anywhere between begin and commit aborts the update on every engine, which keeps
serving the version it had (see miles.sync.receiver).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from miles.protocols.engine import Transactional, TwoCallUpdate, supports
from miles.sync import SyncError
from miles.sync.buckets import Piece, WeightManifest, fused_group, plan_buckets
from miles.sync.calls import submit, wait

log = logging.getLogger(__name__)


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
    ``commit_weight_update`` (miles.protocols.engine.UpdateCalls) gets the steps around the buckets in two calls.

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
        self._two_calls = [supports(e, TwoCallUpdate) for e in self.engines]  # miles.protocols.engine.UpdateCalls
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
            self._each(lambda e: e.continue_generation, quiet=True)
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
        self._each(lambda e: e.abort_weight_update, only_transactional=True, quiet=True)

    def _open(self, manifest: WeightManifest) -> None:
        """pause -> flush -> begin on every engine: one call where the engine takes them together."""
        self._each(lambda e: e.pause_generation, "in_place", one_by_one=True)
        self._each(lambda e: e.flush_cache, one_by_one=True)
        self._each(lambda e: e.begin_weight_update, manifest, only_transactional=True, one_by_one=True)
        wait([submit(e.open_weight_update, manifest) for e, two in zip(self.engines, self._two_calls) if two])

    def _commit(self, version: int) -> None:
        """set version (commit) -> continue on every engine: one call where the engine takes them together."""
        self._each(lambda e: e.set_weight_version, version, one_by_one=True)
        self._each(lambda e: e.continue_generation, one_by_one=True)
        wait([submit(e.commit_weight_update, version) for e, two in zip(self.engines, self._two_calls) if two])

    def _each(
        self, method: Callable, *args, only_transactional: bool = False, quiet: bool = False, one_by_one: bool = False
    ) -> list:
        """``method(engine)`` (the engine's method: ``lambda e: e.flush_cache``) called on every engine (only those
        that take a whole sync's steps one by one, if asked)."""
        engines = [
            e
            for e, ok, two in zip(self.engines, self._transactional, self._two_calls)
            if (ok or not only_transactional) and not (one_by_one and two)
        ]
        try:
            return wait([submit(method(e), *args) for e in engines])
        except Exception:
            if not quiet:
                raise
            log.exception("a call on the engines failed while cleaning up a weight update")
            return []
