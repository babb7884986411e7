"""The engine surface, declared once, below both the engines (miles.rollout) and the weight syncs (miles.sync): the
request and output types every engine speaks (``GenerateRequest`` with its ``SamplingParams``, ``GenerateOutput``,
``EngineError``), what every rollout engine has (``Engine``), the optional capabilities a weight sync looks for
(``Transactional``, ``TwoCallUpdate``, ``ReceivesBroadcast``, ``ReceivesRDT``, ``ReceivesInPlace``,
``ReceivesInProcess``) and ``UpdateCalls``, the two-call form of ``TwoCallUpdate`` an engine class inherits.

Engines: ``EmbeddedEngine`` (in-process), ``SGLangClient`` (one HTTP server), ``Router`` (several), and the
``RolloutManager``, which applies each weight and memory call to every engine it drives. A transport checks a
capability once, when it connects, with ``supports``, which treats an in-process engine and a Ray actor handle
alike:

    if supports(engine, Transactional): ...   # begin/abort around the buckets, else a warning at connect
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy (log-probs then reported at temperature 1)
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    stop_token_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0  # stop tokens cannot be sampled before this many tokens (SGLang's min_new_tokens)


class RowWatch(Protocol):
    """Something that follows one request's tokens as they are generated (stop strings, streaming)."""

    interval: int  # look at the row at least every this many tokens

    def seen(self, ids: list[int], log_probs: list[float]) -> int | None:
        """The row's tokens so far; a returned count ends the row keeping that many tokens (finish reason 'stop')."""
        ...


@dataclass(kw_only=True, slots=True)
class GenerateRequest:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    watch: RowWatch | None = None


@dataclass(kw_only=True, slots=True)
class GenerateOutput:
    rid: str
    output_ids: list[int]
    output_log_probs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int  # the engine's version when the request finished
    retractions: int = 0  # times pause_generation("retract") sent it back to the queue
    # the weight version each output token was sampled under (a weight update between decode steps changes it for
    # the rows in flight); empty from an engine that does not report it: see token_versions
    output_versions: list[int] = field(default_factory=list)


def token_versions(out: GenerateOutput) -> list[int]:
    """The weight version of each output token: the engine's per-token versions, or, from an engine that reports
    only one version per request (SGLang), that version for every token."""
    if out.output_versions:
        return list(out.output_versions)
    return [out.weight_version] * len(out.output_ids)


class EngineError(ValueError):
    """Bad input to the engine (the engine itself keeps serving)."""


class WeightsNotSynced(EngineError):
    """Generation asked of an engine whose weights were discarded and not yet written again (HTTP 409)."""


@runtime_checkable
class Engine(Protocol):
    def generate(self, requests: list[Any], *, seed: int | None = None) -> list[Any]:
        """One GenerateOutput per GenerateRequest, in order, sampled per its SamplingParams."""
        ...

    def abort(self, rids: Iterable[str] | str = "all") -> None:
        """End the named requests (or all) now; each returns what it has with finish_reason 'abort'."""
        ...

    def pause_generation(self, mode: str = "in_place") -> None:
        """Hold generation between forward steps (requests keep their state) until continue_generation."""
        ...

    def continue_generation(self) -> None:
        """Resume what pause_generation held."""
        ...

    def flush_cache(self) -> None:
        """Drop cached prefixes (their keys and values belong to the weights about to be replaced)."""
        ...

    def offload(self, tags: Iterable[str]) -> int:
        """Free the tagged memory ('weights', 'kv_cache', 'cuda_graph'); returns the bytes freed."""
        ...

    def onload(self, tags: Iterable[str]) -> int:
        """Allocate (and for weights, restore) the tagged memory again; returns the bytes allocated."""
        ...

    def update_weights_from_tensor(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        """Copy the named tensors into the weights (all validated before any is written)."""
        ...

    def update_weights_from_bucket(self, handle, version: int | None = None) -> None:
        """Apply a flat bucket sent by handle (shared memory or CUDA IPC, miles.sync.flat_bucket)."""
        ...

    def update_weights_from_disk(self, path: str, version: int | None = None) -> None:
        """Load a safetensors file or a disk-delta version (miles.sync.disk_delta.transport)."""
        ...

    def set_weight_version(self, version: int) -> None:
        """Set the weight version (commits an update opened by begin_weight_update)."""
        ...

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The engine's weights by Hugging Face name (for bit-equality checks)."""
        ...


@runtime_checkable
class EngineMemory(Protocol):
    """The engine memory a handoff plan moves by tag: every Engine has it, and the RolloutManager applies it to each
    engine it drives (miles.handoff.executor calls nothing else on the rollout side)."""

    def offload(self, tags: Iterable[str]) -> int: ...

    def onload(self, tags: Iterable[str]) -> int: ...


@runtime_checkable
class Pausable(Protocol):
    """Generation held around a weight load (every Engine has it; a bare weight receiver may not)."""

    def pause_generation(self, mode: str = "in_place") -> None: ...

    def flush_cache(self) -> None: ...

    def continue_generation(self) -> None: ...


@runtime_checkable
class Transactional(Protocol):
    """Weight updates as transactions: a failure between begin and commit keeps the previous version."""

    def begin_weight_update(self, manifest) -> None:
        """Open an update for the manifest's tensors (miles.sync.buckets.WeightManifest), validated whole first."""
        ...

    def abort_weight_update(self) -> None:
        """Drop the open update; the weights stay as they were."""
        ...


@runtime_checkable
class TwoCallUpdate(Protocol):
    """The steps around a bucketed update's buckets in two calls instead of five (UpdateCalls below)."""

    def open_weight_update(self, manifest) -> None:
        """pause_generation, flush_cache, begin_weight_update."""
        ...

    def commit_weight_update(self, version: int) -> None:
        """set_weight_version, then continue_generation."""
        ...


@runtime_checkable
class ReceivesBroadcast(Protocol):
    """A member of a private torch.distributed group that receives buckets by broadcast (miles.sync.broadcast)."""

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        """Join the group as rank ``rank_offset`` (blocks until every rank has joined)."""
        ...

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str, version: int | None = None):
        """Receive one flat bucket broadcast by rank 0 of the group."""
        ...

    def destroy_weights_update_group(self, group_name: str) -> None:
        """Leave the group."""
        ...

    def group_ranks(self) -> int:
        """How many ranks of a group this endpoint takes when it joins (a server's tensor-parallel workers)."""
        ...

    def in_weights_group(self, group_name: str) -> bool:
        """Whether every rank this endpoint took in ``group_name`` is still there (False once a server behind it
        was restarted: the group must be formed again before the next broadcast)."""
        ...


@runtime_checkable
class ReceivesRDT(Protocol):
    def update_weights_from_rdt(self, tensors, pieces, version: int | None = None) -> None:
        """One Ray Direct Transport round: a flat uint8 bucket Ray moved device to device (miles.sync.rdt)."""
        ...


@runtime_checkable
class ReceivesInPlace(Protocol):
    def update_weights_in_place(self, shared, version: int) -> dict[str, float]:
        """One whole update read from the trainer's own tensors through opened handles (miles.sync.in_place)."""
        ...


@runtime_checkable
class ReceivesInProcess(Protocol):
    def weight_receiver(self):
        """The engine's WeightReceiver (miles.sync.receiver): a transfer made once in this process lands there."""
        ...


class UpdateCalls:
    """For an engine class with pause_generation / flush_cache / begin_weight_update / set_weight_version /
    continue_generation: the steps around a bucketed sync's buckets in two calls instead of five
    (miles.sync.bucket_sync.BucketSync uses them where an engine has them). Every call to an engine actor is a Ray
    round trip (``ray_call_s`` in ``miles bench weight-sync``)."""

    def open_weight_update(self, manifest) -> None:
        self.pause_generation("in_place")
        self.flush_cache()
        self.begin_weight_update(manifest)

    def commit_weight_update(self, version: int) -> None:
        try:
            self.set_weight_version(version)
        finally:
            self.continue_generation()


def supports(engine: Any, capability: type) -> bool:
    """Whether ``engine`` (an in-process object or a Ray actor handle) has every method of ``capability``.

    A Ray actor handle exposes its class's methods as attributes, so the same attribute check serves both;
    ``isinstance`` with a runtime-checkable Protocol is this check for in-process objects."""
    return all(hasattr(engine, name) for name in _members(capability))


def _members(capability: type) -> list[str]:
    return [n for n in vars(capability) if not n.startswith("_") and callable(vars(capability)[n])]
