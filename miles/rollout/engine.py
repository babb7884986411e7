"""The embedded rollout engine: continuous batching on a slotted KV cache, with SGLang's control surface.

It is the CPU default and the engine a user runs on one GPU: the same methods are served over HTTP
(miles.rollout.server) and implemented against real SGLang (miles.rollout.sglang_client). Generation is
miles.rollout.decode_loop (the requests: queue, slots, prefix sharing, aborts, pause) over this engine (the device
batch, miles.rollout.rows, run through miles.rollout.forward); on CUDA the decode step runs as CUDA graphs
(miles.rollout.cuda_graphs). Memory tags follow SGLang's names:
``weights``, ``kv_cache``, ``cuda_graph`` (the graphs' static logits buffer and their private pool).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch

from miles.memory import MemoryLedger, TaggedMemory
from miles.model.config import ModelConfig
from miles.model.decoder import KVCache, build_decoder
from miles.model.kernels import kernels_for
from miles.model.lora import split_synced
from miles.protocols.engine import (
    EngineError,
    GenerateOutput,
    GenerateRequest,
    UpdateCalls,
    WeightsNotSynced,
)
from miles.rollout.decode_loop import DecodeLoop
from miles.rollout.forward import RopeTable, decode_step, decode_step_fused, fuse_projections
from miles.rollout.forward import prefill as forward_prefill
from miles.rollout.rows import STOP_SLOTS, PrefillBatch, RowState, StepBatch, advance, suppress_stops
from miles.rollout.sampling import sample, use_triton

ENGINE_TAGS = ("weights", "kv_cache", "cuda_graph")


class EmbeddedEngine(UpdateCalls):
    """Generates with the current weights; weights and KV cache can be released and resumed between steps.

    engine = EmbeddedEngine(model_cfg, max_batch_size=64, max_seq_len=128)
    outs = engine.generate([GenerateRequest(rid="0", input_ids=[1, 2, 3])])
    engine.offload(["kv_cache", "weights"])      # while the trainer runs
    engine.onload(["weights"]); engine.update_weights_from_tensor(named, version=1)
    engine.onload(["kv_cache"])
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        *,
        max_batch_size: int = 64,
        max_seq_len: int = 0,
        device="cpu",
        seed: int = 0,
        ledger: MemoryLedger | None = None,
        owner: str = "engine/0",
        weights_policy: str = "discard",
        true_on_policy: bool = False,
        share_prefix: bool | None = None,
    ):
        """``true_on_policy``: the invariant kernels (miles.model.kernels), so that each sampled token's reported
        log-prob equals the trainer's bit for bit; on CUDA they replace the fused decode path, graphs kept.
        ``share_prefix``: a group's prompt KV held once (None: on the CUDA engine)."""
        self.cfg, self.device = model_cfg, torch.device(device)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len or model_cfg.max_position_embeddings
        kernels = kernels_for(true_on_policy)
        self.model = build_decoder(model_cfg, seed=seed, device=self.device, kernels=kernels)
        self.model.eval().requires_grad_(False)
        # CUDA with Triton: graphs, and with the standard kernels the fused decode path (q|k|v and gate|up fused
        # before the weights register)
        self.fast = self.device.type == "cuda" and use_triton(torch.empty(0, device=self.device))
        self.fused = fuse_projections(self.model) if self.fast and not kernels.invariant else None
        self.cache = KVCache.allocate(
            model_cfg, max_batch_size, self.max_seq_len, self.device, next(self.model.parameters()).dtype
        )
        self.ledger = ledger or MemoryLedger()
        self.memory = TaggedMemory(owner, self.ledger, self.device)
        synced, base = split_synced(self.model)  # with LoRA: the adapters, and the base they sit on
        self.memory.register("weights", synced, policy=weights_policy)
        if base:  # written by no sync and released by no plan step: it stays resident for the run
            self.memory.register("base", base, policy="host")
        self.memory.register("kv_cache", self.cache.tensors(), policy="discard")
        dtype = next(self.model.parameters()).dtype
        self.rope = RopeTable(model_cfg, self.max_seq_len, self.device, dtype, kernels)
        self.state = RowState(max_batch_size, self.max_seq_len + 1, self.device)
        self.logits = torch.empty(max_batch_size, model_cfg.vocab_size, dtype=dtype, device=self.device)
        self.graphs = None
        if self.fast:
            from miles.rollout.cuda_graphs import DecodeGraphs, pool_segments

            self.graphs = DecodeGraphs(owner, self.ledger, reserve=pool_segments(model_cfg, max_batch_size))
        # with graphs, the logits buffer they write is theirs; the eager (CPU) engine keeps the tag empty
        self.memory.register("cuda_graph", [self.logits] if self.graphs else [], policy="discard")
        self.loop = DecodeLoop(self, share_prefix=self.fast if share_prefix is None else share_prefix)
        self.weight_version = 0
        self.lock = threading.RLock()  # held by each forward step and by weight updates
        self._params = dict(self.model.named_parameters())
        self._synced = synced  # what a release of "weights" discards and a sync writes
        self._unsynced: set[int] = set()  # ids of parameters discarded by a release and not written since
        self._gen: torch.Generator | None = None

    # ---- generation -------------------------------------------------------------------------------------

    @classmethod
    def from_config(cls, cfg, device, owner: str = "engine/0", ledger: MemoryLedger | None = None) -> "EmbeddedEngine":
        """The engine of a run (``cfg``: a RunConfig): the one the RolloutManager holds in-process and the one
        ``miles serve`` serves."""
        r = cfg.rollout
        return cls(
            cfg.model,
            max_batch_size=r.max_batch_size,
            max_seq_len=r.max_seq_len,
            device=device,
            seed=cfg.seed,
            ledger=ledger,
            owner=owner,
            weights_policy="host" if cfg.handoff.engine_host_mirror else "discard",
            true_on_policy=cfg.true_on_policy,
        )

    def generate(
        self,
        requests: list[GenerateRequest],
        *,
        seed: int | None = None,
        on_output: Callable[[int, GenerateOutput], None] | None = None,
    ) -> list[GenerateOutput]:
        """Outputs in request order. A call made while another runs joins it (continuous batching across
        calls); it then shares the running call's random stream, so ``seed`` reproduces only a call that runs alone.
        ``on_output(i, output)`` is called from the engine's thread as each request finishes (a server answers
        each of its callers then, as SGLang does, not when the batch's longest request ends)."""
        for r in requests:
            self._check_request(r)
        return self.loop.generate(requests, seed if seed is not None else torch.seed() & 0x7FFFFFFF, on_output)

    def start(self, seed: int) -> None:
        """A new decode loop starts: its random stream (the reference sampler's generator, the kernel's seed)."""
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(seed)
        self.state.seed.fill_(seed)

    def _check_request(self, r: GenerateRequest) -> None:
        if not r.input_ids:
            raise EngineError(f"request {r.rid}: input_ids is empty; send at least one token")
        bad = [t for t in r.input_ids if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise EngineError(
                f"request {r.rid}: token ids {bad[:5]} are outside the vocabulary [0, {self.cfg.vocab_size})"
            )
        need = len(r.input_ids) + r.sampling.max_new_tokens
        if need > self.max_seq_len:
            raise EngineError(
                f"request {r.rid}: prompt {len(r.input_ids)} + max_new_tokens {r.sampling.max_new_tokens} = "
                f"{need} exceeds the engine's max_seq_len {self.max_seq_len}; shorten it or raise rollout.max_seq_len"
            )
        if not 0 <= r.sampling.min_new_tokens <= r.sampling.max_new_tokens:
            raise EngineError(
                f"request {r.rid}: min_new_tokens {r.sampling.min_new_tokens} must be in [0, max_new_tokens "
                f"{r.sampling.max_new_tokens}]"
            )
        if len(r.sampling.stop_token_ids) > STOP_SLOTS:
            raise EngineError(
                f"request {r.rid}: {len(r.sampling.stop_token_ids)} stop token ids; the engine holds at most "
                f"{STOP_SLOTS} per request on the device"
            )
        paused = [t for t in ENGINE_TAGS if self.memory.is_offloaded(t)]
        if paused:
            raise EngineError(f"the engine's memory is released; call onload({paused}) before generate")
        if self._unsynced:
            raise WeightsNotSynced(self.unsynced_message())

    @property
    def weights_synced(self) -> bool:
        """False from a release of discarded weights until every parameter has been written again."""
        return not self._unsynced

    def unsynced_message(self) -> str:
        return (
            f"the engine's weights were discarded by offload(['weights']) and {len(self._unsynced)} of "
            f"{len(self._synced)} tensors have not been written since; sync the weights (update_weights_*) first"
        )

    def prefill(self, b: PrefillBatch) -> int:
        """Prefill the batch's prompts into the KV cache and sample each admitted row's first token (written into
        the RowState); returns the weight version it ran under."""
        st, dev = self.state, self.device
        with self.lock:
            args = (
                self.cache,
                self.rope,
                b.ids_UP.to(dev),
                torch.tensor(b.lens, device=dev),
                torch.tensor(b.kv_slots, device=dev),
                None if b.kv_src is None else torch.tensor(b.kv_src, device=dev),
            )
            logits = forward_prefill(self.model, *args, fused=self.fused)[torch.tensor(b.src, device=dev)]
            if b.suppress:
                suppress_stops(st, b.rows, logits)
            temperature = st.temperature[b.rows]
            tok, lp = sample(
                logits,
                temperature,
                st.seed,
                self._gen,
                top_p_R=st.top_p[b.rows] if b.flexible else None,
                top_k_R=st.top_k[b.rows] if b.flexible else None,
            )
            advance(st, b.rows, tok, self.model.kernels.sampled_log_probs(logits, tok, temperature, lp))
            return self.weight_version

    def step(self, b: StepBatch) -> int:
        """One decode step over slots [0, b.R) (graphed on CUDA, eager otherwise); returns the weight version it ran
        under. ``b.flexible``: top-p / top-k rows (sampled outside the graph); ``b.suppress``: stop tokens masked in
        rows short of min_new_tokens."""
        with self.lock:
            self._step(b.R, bound=b.bound, flexible=b.flexible, suppress=b.suppress)
            return self.weight_version

    @torch.no_grad()
    def _step(self, R: int, *, bound: int, flexible: bool, suppress: bool = False) -> None:
        st, rows, logits = self.state, slice(0, R), self.logits[:R]

        prefix = (st.prefix_slot[:R], st.prefix_len[:R]) if self.loop.share_prefix else None

        def forward():
            args = (self.cache, self.rope, st.tokens[:R], st.lens[:R], logits)
            if self.fused is not None:
                decode_step_fused(self.model, self.fused, *args, prefix=prefix)
            else:
                decode_step(self.model, *args, bound=bound, prefix=prefix)

        def finish():
            if suppress:
                suppress_stops(st, rows, logits)
            tp, tk = (st.top_p[:R], st.top_k[:R]) if flexible else (None, None)
            tok, lp = sample(logits, st.temperature[:R], st.seed, self._gen, top_p_R=tp, top_k_R=tk)
            advance(st, rows, tok, self.model.kernels.sampled_log_probs(logits, tok, st.temperature[:R], lp))

        if self.graphs is None:
            forward()
            finish()
        elif flexible:  # top-p / top-k sort on the reference path, outside the graph
            self.graphs.run(("decode", R), forward)
            finish()
        else:  # the whole step (forward, sampling, bookkeeping) is one graph: one launch per step
            self.graphs.run(("step", R), lambda: (forward(), finish()))

    def output(
        self, req: GenerateRequest, ids: list[int], lps: list[float], reason: str, versions: list[int]
    ) -> GenerateOutput:
        return GenerateOutput(
            rid=req.rid,
            output_ids=ids,
            output_log_probs=lps,
            finish_reason=reason,
            weight_version=self.weight_version,
            output_versions=versions,
        )

    # ---- control surface ----------------------------------------------------------------------------------
    def abort(self, rids: Iterable[str] | str = "all") -> None:
        """Finish the given in-flight requests (or all) at the next decode step with finish_reason 'abort'."""
        self.loop.abort(rids)

    def pause_generation(self, mode: str = "in_place") -> None:
        """SGLang's modes: "in_place" holds the running rows between decode steps (KV kept); "retract" returns them
        to the queue with their tokens (KV dropped: memory may be released, weights changed; they are prefilled
        again on continue); "abort" ends every request (finish reason 'abort') and holds new ones."""
        if mode not in ("in_place", "abort", "retract"):
            raise EngineError(f"pause_generation mode {mode!r} is not supported; use 'abort', 'retract' or 'in_place'")
        if mode == "abort":
            self.abort("all")
        with self.lock:  # once this returns no decode step runs until continue_generation
            self.loop.pause(retract=mode == "retract")

    def continue_generation(self) -> None:
        self.loop.resume()

    def flush_cache(self) -> None:
        """Drop cached prefixes. The embedded engine keeps no prefix cache between calls, so nothing is kept."""

    def offload(self, tags: Iterable[str]) -> int:
        """Graphs point at the weights', the cache's and their own buffers: releasing any of these drops them."""
        tags = _check_tags(tags)
        phase = "release_" + "+".join(tags)
        with self.lock:
            if "weights" in tags and self.memory.tags["weights"].policy == "discard":
                self._unsynced = {id(p) for p in self._synced}
            freed = self.graphs.release(phase) if self.graphs is not None else 0
            return freed + self.memory.offload(tags, phase=phase)

    def onload(self, tags: Iterable[str]) -> int:
        tags = _check_tags(tags)
        with self.lock:
            moved = self.memory.onload(tags, phase="resume_" + "+".join(tags))
            if "kv_cache" in tags and not self.fast:
                # a discarded cache resumes with the allocator's bytes, NaN included; the reference attention
                # masks positions past each row's length, but a mask lets NaN through (0 * NaN), so start clean.
                # The Triton kernel reads only filled positions and needs no memset.
                for t in self.cache.tensors():
                    t.zero_()
            return moved

    # ---- weights ------------------------------------------------------------------------------------------
    def _target(self, name: str) -> torch.Tensor:
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return self._params["model.embed_tokens.weight"]
        if name not in self._params:
            raise EngineError(f"weight {name!r} is not a parameter of this model (e.g. {next(iter(self._params))!r})")
        return self._params[name]

    def _check_weight(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        p = self._target(name)
        if shape != tuple(p.shape) or dtype != p.dtype:
            raise EngineError(f"weight {name}: got {dtype} {shape}, the engine holds {p.dtype} {tuple(p.shape)}")

    def update_weights_from_tensor(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        """Copy the named tensors in (all validated before any is written); set ``version`` when given."""
        items = list(named_tensors)
        for name, t in items:
            self._check_weight(name, t.dtype, tuple(t.shape))
        if self.memory.is_offloaded("weights"):
            raise EngineError("weights are released; onload(['weights']) before updating them")
        with self.lock, torch.no_grad():
            for name, t in items:
                self._target(name).copy_(t, non_blocking=True)
            self._unsynced.difference_update(id(self._target(name)) for name, _ in items)
            if version is not None:
                self.weight_version = int(version)

    def update_weights_from_disk(self, path: str, version: int | None = None) -> None:
        """``path``: a HF checkpoint directory or a safetensors file (loaded whole, as SGLang loads a checkpoint),
        or a disk-delta sync root (the version's delta applied to the weights held now)."""
        from miles.sync.disk_delta.transport import load_version

        if is_hf_checkpoint(path):
            from miles.model.checkpoint import tensors_for_update

            return self.update_weights_from_tensor(tensors_for_update(self.model, path), version)
        if str(path).endswith(".safetensors"):
            from safetensors.torch import load_file

            return self.update_weights_from_tensor(load_file(str(path)).items(), version)
        # load_version never writes into its input and returns only the tensors that changed
        named = load_version(path, version, self.named_weights(), local_version=self.weight_version, changed_only=True)
        self.update_weights_from_tensor(named.items(), version)

    def update_weights_from_bucket(self, handle, version: int | None = None) -> None:
        """Apply a flat bucket sent by handle (shared memory on CPU, CUDA IPC on GPU; see miles.sync.flat_bucket).
        Inside an update opened by ``begin_weight_update`` the bucket lands in that update instead."""
        from miles.sync.flat_bucket import OpenedBuffers, check_handle

        check_handle(handle)  # the handle may come from the network: validated whole before anything is opened
        if not hasattr(self, "_opened"):
            self._opened = OpenedBuffers()
        if self.weight_receiver().is_open:
            from miles.sync.buckets import PieceMeta
            from miles.sync.receiver import receive_flat

            pieces = [PieceMeta(m.name, m.offset, m.nbytes) for m in handle.metas]
            receive_flat(self._opened.buffer(handle), pieces, [self.weight_receiver()])
            if version is not None:
                self.set_weight_version(version)
            return
        for m in handle.metas:
            self._check_weight(m.name, getattr(torch, m.dtype), m.shape)
        self.update_weights_from_tensor(self._opened.tensors(handle), version)

    def set_weight_version(self, version: int) -> None:
        """Set the version; an update opened by ``begin_weight_update`` is committed into the weights first."""
        receiver = self.weight_receiver()
        with self.lock:  # weights and version change together between two decode steps
            names = [s.name for s in receiver.manifest.specs] if receiver.is_open else []
            if receiver.commit():
                self._unsynced.difference_update(id(self._target(n)) for n in names)
            self.weight_version = int(version)

    # ---- weight sync, receive side (transactions, broadcast, RDT; see miles.sync.receiver) ---------------------
    def weight_receiver(self):
        if getattr(self, "_receiver", None) is None:
            from miles.sync.receiver import WeightReceiver

            self._receiver = WeightReceiver(self._target, self.lock)
        return self._receiver

    def begin_weight_update(self, manifest) -> None:
        """Open an update (miles.sync.buckets.WeightManifest): validated whole before any byte moves; pieces then
        land in it, ``set_weight_version`` commits it, ``abort_weight_update`` drops it (weights untouched)."""
        if self.memory.is_offloaded("weights"):
            raise EngineError("weights are released; onload(['weights']) before updating them")
        self.weight_receiver().begin(manifest)

    def abort_weight_update(self) -> None:
        self.weight_receiver().abort()

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
        connect_timeout_s: float | None = None,
    ) -> None:
        from miles.sync.weight_group import join_group

        join_group(
            master_address,
            master_port,
            rank_offset,
            world_size,
            group_name,
            backend,
            connect_timeout_s=connect_timeout_s,
        )

    def update_weights_from_distributed(
        self, names, dtypes, shapes, group_name: str, version: int | None = None, load_format: str | None = None
    ) -> None:
        """One call's broadcasts from rank 0 (``load_format``: miles.sync.weight_group.FORMATS; None = one per
        tensor, SGLang's default), into an open update, else checked whole and applied."""
        from miles.sync.weight_group import receive_broadcast

        receive_broadcast(
            group_name, names, dtypes, shapes, [self.weight_receiver()], self.device, load_format,
            check=self._check_weight, apply=self.update_weights_from_tensor,
        )  # fmt: skip
        if version is not None:
            self.set_weight_version(version)

    def broadcast_formats(self) -> tuple[str, ...]:
        from miles.sync.weight_group import FORMATS

        return FORMATS

    def destroy_weights_update_group(self, group_name: str) -> None:
        from miles.sync.weight_group import leave_group

        leave_group(group_name)

    def group_ranks(self) -> int:
        return 1  # this process

    def in_weights_group(self, group_name: str) -> bool:
        from miles.sync.weight_group import in_group

        return in_group(group_name)

    def update_weights_from_rdt(self, tensors, pieces, version: int | None = None) -> None:
        """One RDT round: ``tensors`` (Ray resolves the ObjectRef argument) is ``[flat uint8 bucket]``."""
        from miles.sync.receiver import receive_rdt

        receive_rdt(tensors, pieces, [self.weight_receiver()])
        if version is not None:
            self.set_weight_version(version)

    def update_weights_in_place(self, shared, version: int) -> dict[str, float]:
        """One whole update read from the trainer's own tensors (miles.sync.in_place): handles opened once and
        kept, the bytes copied once, committed with ``version``; on failure the update is aborted."""
        from miles.sync.in_place import InPlaceEndpoint

        if getattr(self, "_in_place", None) is None:
            self._in_place = InPlaceEndpoint([self])
        return self._in_place.update(shared, version)

    def named_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.hf_state_dict().items()}


def is_hf_checkpoint(path) -> bool:
    """A directory holding a HF checkpoint (its config.json), not a disk-delta root."""
    import os

    return os.path.isdir(str(path)) and os.path.isfile(os.path.join(str(path), "config.json"))


def _check_tags(tags: Iterable[str]) -> list[str]:
    tags = [tags] if isinstance(tags, str) else list(tags)
    bad = [t for t in tags if t not in ENGINE_TAGS]
    if bad:
        raise EngineError(f"unknown memory tag(s) {bad}; valid tags: {list(ENGINE_TAGS)}")
    return tags
