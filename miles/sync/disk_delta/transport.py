"""Disk-delta weight sync: each trainer source rank writes the byte delta of its weights against the last
published version (the canonical baseline at first) as a zstd-compressed safetensors shard; rank 0 publishes
the version atomically and tells the engines to pull it with ``update_weights_from_disk(root, version)``.

Engines on other hosts only need the shared directory. With bf16 weights and RL learning rates most bytes do
not change between steps, so a version is a small fraction of a checkpoint. Every error on any rank (a layout
that differs from the baseline, a corrupt baseline file, two ranks disagreeing on a replicated tensor, a failed
write) is held until the next gather and raised on every rank naming the first failing rank, so no rank is
left waiting in a collective and no version is published.

The other modules of this package are listed in its ``__init__``.
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import safetensors.numpy
import torch
import torch.distributed as dist
import zstandard

from miles.atomic import atomic_write_text, fsync_dir
from miles.protocols.engine import Pausable, supports
from miles.sync.buckets import host_bytes
from miles.sync.calls import call
from miles.sync.disk_delta.baseline import Baseline, MissingTensorError, save_baseline, trainer_layout
from miles.sync.disk_delta.codec import CHECKSUMS, ENCODINGS, TensorEncoder, checksum
from miles.sync.disk_delta.collective_errors import (
    CollectiveError,
    HeldError,
    RankError,
    gather_or_raise,
    raise_together,
)
from miles.sync.disk_delta.safetensors_dtypes import Layout, check_layout
from miles.sync.disk_delta.staging_pool import StagingPool, byte_view
from miles.sync.disk_delta.version import (
    FORMAT,
    LATEST,
    VersionError,
    fsync_file,
    load_version,
    published_versions,
    version_dir,
    write_index,
)

__all__ = [
    "Baseline",
    "DiskDeltaConfig",
    "DiskDeltaSync",
    "MissingTensorError",
    "VersionError",
    "load_version",
    "save_baseline",
]


@dataclass(kw_only=True, slots=True)
class DiskDeltaConfig:
    root: str  # directory shared by trainer and engines; versions appear as <root>/v00000001/
    baseline: str  # safetensors checkpoint (file or directory) the engines loaded: the first delta's base
    baseline_version: int = 0  # the engines' weight_version while they hold the baseline
    # no checkpoint to start from (random init): the first update writes the baseline from its tensors, the
    # engines load it whole, and that version is the baseline version; older versions under root are removed
    write_baseline: bool = False
    encoding: Literal["xor", "sparse_xor", "overwrite"] = "sparse_xor"  # see miles.sync.disk_delta.codec
    zstd_level: int = 1  # higher levels barely shrink XOR deltas; -1..-7 trade ratio for speed (see the bench)
    zstd_threads: int = 0  # zstd worker threads per rank (0: compress in the calling thread, -1: one per core)
    checksum: str = "xxh3_128"
    staging_buffers: int = 2  # host staging buffers per rank (pinned with CUDA); bound = buffers x bytes
    staging_buffer_bytes: int = 64 << 20
    keep_versions: int = 4  # published versions kept on disk (rank 0 deletes older ones); 0 keeps all
    check_weights: bool = False  # after each sync, compare every engine tensor with the trainer's (by checksum)
    # "emitted": each rank encodes what it emits (pipeline / expert shards; a name emitted twice is kept once).
    # "round_robin": every rank emits every tensor (FSDP full tensors) and rank r encodes tensors r, r + world, ...
    partition: Literal["emitted", "round_robin"] = "emitted"

    def __post_init__(self):
        if self.encoding not in ENCODINGS:
            raise ValueError(f"disk_delta.encoding = {self.encoding!r} must be one of {ENCODINGS}")
        if self.partition not in ("emitted", "round_robin"):
            raise ValueError(f"disk_delta.partition = {self.partition!r} must be 'emitted' or 'round_robin'")
        if self.checksum not in CHECKSUMS:
            raise ValueError(f"disk_delta.checksum = {self.checksum!r} must be one of {sorted(CHECKSUMS)}")
        if not -7 <= self.zstd_level <= 22 or self.zstd_level == 0 or self.keep_versions < 0:
            raise ValueError(
                f"disk_delta.zstd_level = {self.zstd_level} must be in [-7, -1] (fast) or [1, 22], and "
                f"keep_versions = {self.keep_versions} >= 0"
            )


@dataclass(slots=True)
class _Canonical:
    """This rank's copy of a tensor's bytes at the last published version."""

    layout: Layout
    data: np.ndarray
    digest: str


@dataclass(slots=True)
class _Encoded:
    layout: Layout
    payload: bytes
    digest: str
    new_bytes: np.ndarray | None  # becomes the canonical copy once the version is published
    encoder: TensorEncoder | None = None  # sparse_xor: patches the canonical copy in place instead


@dataclass(slots=True)
class _Step:
    """What one rank produced for one update: every emitted tensor's (layout, digest), the changed ones encoded."""

    emitted: dict[str, tuple[tuple, str]] = field(default_factory=dict)
    encoded: dict[str, _Encoded] = field(default_factory=dict)
    raw_bytes: int = 0


class DiskDeltaSync:
    """Weight-sync transport through delta files. Every source rank of ``group`` builds one and calls ``update``
    with its tensors for every version, in the same order; rank 0 holds the engine handles.

        sync = DiskDeltaSync(DiskDeltaConfig(root="runs/x/weights", baseline="ckpt/"), group=None)
        sync.connect(engines if rank == 0 else [])   # objects or Ray actor handles
        for step in range(1, n + 1):
            train_step()
            sync.update(trainer.named_weights().items(), version=step)
        sync.metrics()                              # wire bytes, timings of the last update
    """

    def __init__(self, config: DiskDeltaConfig, group=None):
        self.config, self.group = config, group
        self.rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
        self.root = Path(config.root)
        self.pool = StagingPool(num_buffers=config.staging_buffers, buffer_bytes=config.staging_buffer_bytes)
        self.published_version = config.baseline_version
        self.engines: list = []
        self._baseline: Baseline | None = None
        self._baseline_written = False
        self._canonical: dict[str, _Canonical] = {}
        self._metrics: dict = {}
        self._compressor = zstandard.ZstdCompressor(level=config.zstd_level, threads=config.zstd_threads)

    @classmethod
    def from_run_config(cls, cfg, *, group=None) -> "DiskDeltaSync":
        """The transport for a RunConfig. Root: ``sync.disk_delta_dir`` or ``<run_dir>/weights``. Baseline: the
        checkpoint the engines loaded (``model.checkpoint``); for a random-initialised model none exists, nor for
        LoRA adapters (the checkpoint holds the base only), so the first update writes
        ``<root>/baseline.safetensors`` from the weights it is given and the engines load it whole
        (``write_baseline``); later versions are deltas against it."""
        root = cfg.sync.disk_delta_dir or str(Path(cfg.run_dir) / "weights")
        own = cfg.model.checkpoint and not cfg.model.lora.enabled
        baseline = cfg.model.checkpoint if own else str(Path(root) / "baseline.safetensors")
        return cls(
            DiskDeltaConfig(
                root=root,
                baseline=baseline,
                write_baseline=not own,
                check_weights=cfg.sync.check_weights,
                partition="round_robin" if cfg.trainer.world_size > 1 else "emitted",
            ),
            group=group,
        )

    def connect(self, engines) -> None:
        self.engines = list(engines)

    def metrics(self) -> dict:
        return dict(self._metrics)

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Publish ``version`` and load it into the engines. Four gathers, each reached by every rank with its
        held error: encode -> (dedupe) -> write shards -> rank 0 publishes -> rank 0 updates the engines. Any
        error raises ``CollectiveError`` on every rank; before the publish step nothing is published."""
        if self.config.write_baseline and not self._baseline_written:
            return self._publish_baseline(named_tensors, version)
        t0, cpu0, held = time.perf_counter(), time.thread_time(), HeldError()
        step = self._encode_all(named_tensors, version, held)
        t_encode, encode_cpu_s = time.perf_counter(), time.thread_time() - cpu0
        summary = {"token": uuid.uuid4().hex, "emitted": step.emitted, "raw_bytes": step.raw_bytes}
        gathered = gather_or_raise(summary, held.error, self.group)
        owners = _owners([g["emitted"] for g in gathered])
        tmp = self.root / f".v{version:08d}.{gathered[0]['token']}.tmp"
        with held:
            shard = self._write_shard(tmp, step, owners)
        try:
            shards = gather_or_raise(shard, held.error, self.group)
        except CollectiveError:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        with held:
            if self.rank == 0:
                self._publish(tmp, version, [s for s in shards if s is not None])
        raise_together(held.error, self.group)
        self._commit(step, version)
        t_publish = time.perf_counter()
        with held:
            if self.rank == 0:
                self._update_engines(version, gathered)
        raise_together(held.error, self.group)
        t_end = time.perf_counter()
        self._record(version, step, gathered, shards, t0, t_encode, t_publish, t_end)
        self._metrics["disk_delta/encode_cpu_s"] = encode_cpu_s  # this thread's CPU time: fair on a shared host

    # -- source side ------------------------------------------------------------------------------------------

    def _encode_all(self, named_tensors, version: int, held: HeldError) -> _Step:
        """Encode every tensor; after a first error keep draining the iterator (it may run collectives, e.g.
        FSDP all-gathers, that the other ranks are waiting in) without encoding."""
        step = _Step()
        with held:
            if version <= self.published_version:
                raise ValueError(
                    f"weight version {version} must be greater than the last published "
                    f"{self.published_version}; versions only move forward"
                )
            if self._baseline is None:
                self._baseline = Baseline.from_checkpoint(self.config.baseline)
        world = dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1
        stride = world if self.config.partition == "round_robin" else 1
        with held:
            for i, (name, tensor) in enumerate(named_tensors):
                if held.error is None and i % stride == self.rank % stride:
                    with held:
                        self._encode_one(name, tensor, step)
        return step

    def _encode_one(self, name: str, tensor: torch.Tensor, step: _Step) -> None:
        if name in step.emitted:
            raise ValueError(f"tensor {name!r} is emitted twice by this rank in one update")
        layout = trainer_layout(name, tensor)
        base = self._base(name, layout)
        step.raw_bytes += layout.nbytes
        if layout.nbytes == 0:
            step.emitted[name] = (_key(layout), base.digest)
            return
        cfg = self.config
        encoder = TensorEncoder(
            cfg.encoding,
            nbytes=layout.nbytes,
            itemsize=tensor.element_size(),
            checksum_format=cfg.checksum,
            compressor=self._compressor,
        )
        sparse = cfg.encoding == "sparse_xor"  # keeps only changed words: no full-size copy of the new bytes
        new_bytes = None if sparse else np.empty(layout.nbytes, np.uint8)
        for offset, chunk, scratch in self.pool.stage(tensor):
            if new_bytes is not None:
                new_bytes[offset : offset + chunk.size] = chunk
            encoder.feed(offset, chunk, base.data[offset : offset + chunk.size], out=scratch)
        payload, digest = encoder.finish()
        step.emitted[name] = (_key(layout), digest)
        if digest != base.digest:
            step.encoded[name] = _Encoded(layout, payload, digest, new_bytes, encoder if sparse else None)

    def _base(self, name: str, layout: Layout) -> _Canonical:
        """The tensor's bytes at the last published version; the first time, read and validated from the baseline."""
        if name in self._canonical:
            base = self._canonical[name]
            check_layout(name, base.layout, layout, got_from=f"version {self.published_version} (synced before)")
            return base
        data = self._baseline.read_bytes(name, layout)
        base = _Canonical(layout, data, checksum(data, self.config.checksum))
        self._canonical[name] = base
        return base

    def _write_shard(self, tmp: Path, step: _Step, owners: dict[str, int]) -> dict | None:
        mine = {n: e for n, e in step.encoded.items() if owners[n] == self.rank}
        if not mine:
            return None
        tmp.mkdir(parents=True, exist_ok=True)
        file = f"shard-{self.rank:05d}.safetensors"
        safetensors.numpy.save_file({n: np.frombuffer(e.payload, np.uint8) for n, e in mine.items()}, str(tmp / file))
        fsync_file(tmp / file)
        tensors = {
            n: {
                "dtype": e.layout.dtype,
                "shape": list(e.layout.shape),
                "nbytes": e.layout.nbytes,
                "encoding": self.config.encoding,
                "checksum": e.digest,
                "payload_nbytes": len(e.payload),
                "shard": file,
            }
            for n, e in mine.items()
        }
        return {"file": file, "nbytes": (tmp / file).stat().st_size, "tensors": tensors}

    def _publish(self, tmp: Path, version: int, shards: list[dict]) -> None:
        final = version_dir(self.root, version)
        if final.exists():
            raise FileExistsError(
                f"weight version {version} is already published at {final}; versions are "
                f"immutable, use a new version number (or a fresh sync root)"
            )
        tmp.mkdir(parents=True, exist_ok=True)
        cfg = self.config
        index = {
            "format": FORMAT,
            "version": version,
            "base_version": self.published_version,
            "encoding": cfg.encoding,
            "compression": "zstd",
            "checksum": cfg.checksum,
            "shards": {s["file"]: s["nbytes"] for s in shards},
            "tensors": {n: info for s in shards for n, info in s["tensors"].items()},
        }
        write_index(tmp, index)
        fsync_dir(tmp)
        tmp.rename(final)
        fsync_dir(self.root)
        atomic_write_text(self.root / LATEST, f"{version}\n")
        self._prune(version)

    def _prune(self, version: int) -> None:
        """Delete versions older than ``keep_versions`` and temporary directories left by a crashed run."""
        for stale in self.root.glob(".v*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        keep = self.config.keep_versions
        if keep:
            for old in published_versions(self.root):
                if old <= version - keep:
                    shutil.rmtree(version_dir(self.root, old), ignore_errors=True)

    def _commit(self, step: _Step, version: int) -> None:
        for name, e in step.encoded.items():
            if e.encoder is not None:
                e.encoder.apply_in_place(self._canonical[name].data)
                self._canonical[name].digest = e.digest
            else:
                self._canonical[name] = _Canonical(e.layout, e.new_bytes, e.digest)
        self.published_version = version

    def _publish_baseline(self, named_tensors, version: int) -> None:
        """write_baseline: rank 0 writes the canonical baseline (atomically) and the engines load it whole."""
        t0, held = time.perf_counter(), HeldError()
        tensors = dict(named_tensors)  # every rank iterates: reading sharded weights may be collective
        with held:
            if self.rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                for old in published_versions(self.root):  # deltas against an earlier baseline
                    shutil.rmtree(version_dir(self.root, old), ignore_errors=True)
                save_baseline(tensors, self.config.baseline)
        gather_or_raise(None, held.error, self.group)
        self.published_version, self._baseline, self._canonical = version, None, {}
        self._baseline_written = True
        if self.rank == 0:
            for engine in self.engines:
                _load(engine, str(self.config.baseline), version)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self._metrics = {"bytes": nbytes, "disk_delta/baseline_bytes": nbytes, "seconds": time.perf_counter() - t0}

    # -- engine side (rank 0) -----------------------------------------------------------------------------------

    def _update_engines(self, version: int, gathered: list[dict]) -> None:
        for engine in self.engines:
            _load(engine, str(self.root), version)
        if self.config.check_weights:
            expected = {n: d for g in gathered for n, (_, d) in g["emitted"].items()}
            for i, engine in enumerate(self.engines):
                check_engine_weights(engine, expected, version, self.config.checksum, label=f"engine {i}")

    def _record(self, version, step, gathered, shards, t0, t_encode, t_publish, t_end) -> None:
        wire = sum(s["nbytes"] for s in shards if s is not None)
        self._metrics = {
            "disk_delta/version": version,
            "disk_delta/wire_bytes": wire,
            "disk_delta/raw_bytes": sum(g["raw_bytes"] for g in gathered),
            "disk_delta/num_tensors": len({n for g in gathered for n in g["emitted"]}),
            "disk_delta/num_changed": sum(len(s["tensors"]) for s in shards if s is not None),
            "disk_delta/rank_raw_bytes": step.raw_bytes,
            "disk_delta/encode_s": t_encode - t0,
            "disk_delta/publish_s": t_publish - t_encode,
            "disk_delta/engines_s": t_end - t_publish,
            "disk_delta/total_s": t_end - t0,
        }


def _key(layout: Layout) -> tuple:
    return (layout.dtype, layout.shape, layout.nbytes)


def _owners(emitted_by_rank: list[dict[str, tuple[tuple, str]]]) -> dict[str, int]:
    """The lowest rank emitting each name writes it; every rank computes the same answer from the same gather,
    so a disagreement raises the same CollectiveError on every rank without another collective."""
    first: dict[str, tuple[int, tuple, str]] = {}
    for rank, emitted in enumerate(emitted_by_rank):
        for name, (key, digest) in emitted.items():
            if name not in first:
                first[name] = (rank, key, digest)
                continue
            r0, key0, digest0 = first[name]
            if (key0, digest0) != (key, digest):
                message = (
                    f"tensor {name!r} is emitted by rank {r0} as {Layout(*key0)} (checksum {digest0}) and by "
                    f"rank {rank} as {Layout(*key)} (checksum {digest}); a name emitted by several ranks must "
                    f"carry identical bytes: check that replicated parameters are synchronised"
                )
                raise CollectiveError([RankError(rank=rank, type="ValueError", message=message)], len(emitted_by_rank))
    return {name: rank for name, (rank, _, _) in first.items()}


def _load(engine, path: str, version: int) -> None:
    """pause -> flush -> load (the version with it) -> continue, like every transport; an engine that cannot pause
    (no Pausable methods) only loads."""
    pauses = supports(engine, Pausable)
    if pauses:
        call(engine.pause_generation, "in_place")
        call(engine.flush_cache)
    try:
        call(engine.update_weights_from_disk, path, version)
    finally:
        if pauses:
            call(engine.continue_generation)


def engine_weight_version(engine) -> int:
    value = engine.weight_version
    if hasattr(value, "remote"):
        import ray

        return ray.get(value.remote())
    return value() if callable(value) else value


def check_engine_weights(
    engine, expected: dict[str, str], version: int, checksum_format: str = "xxh3_128", *, label: str = "engine"
) -> None:
    """Raise unless the engine reports ``version`` and every tensor in ``expected`` (name -> checksum of the
    trainer's bytes) is bit-equal on the engine."""
    got_version = engine_weight_version(engine)
    if got_version != version:
        raise RuntimeError(f"{label} reports weight_version {got_version} after syncing version {version}")
    weights = call(engine.named_weights)
    for name, digest in expected.items():
        if name not in weights:
            raise MissingTensorError(f"check_weights: {label} has no tensor {name!r} after version {version}")
        engine_bytes = byte_view(weights[name]).cpu()  # held while host_bytes views it (in-process: a live param)
        got = checksum(host_bytes(engine_bytes), checksum_format)
        if got != digest:
            raise RuntimeError(
                f"check_weights: {label} tensor {name!r} differs from the trainer's after version "
                f"{version} (checksum {got} vs {digest})"
            )
