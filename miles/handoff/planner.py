"""The planner: replays a HandoffPlan against estimated sizes to predict device and host peaks before launch.

Sizes per GPU rank come from the model and the config: the embedded decoder exactly (built on the meta device:
the same tensors a run holds, so the predicted per-step bytes equal the ledger's), or any HF ``config.json``
(``handoff.plan_model``: dense, MoE, MLA) through miles.model.size. Trainer: ``params`` (model dtype), FP32
master weights and optimizer moments (``optimizer``: Adam 12 B / Muon 8 B per parameter with a megatron
backend; the torch backend keeps AdamW moments in the model dtype, created at the first train step), FP32
``grads`` (released before offload), ``quant_workspace`` (miles.memory.traffic), ``ref``. Engine: ``weights``
(bf16, or the rowwise quantized copy for trainer.precision fp8/mxfp8/nvfp4), ``kv_cache`` for
max_batch_size x max_seq_len tokens, ``cuda_graph`` (on a GPU: the decode graphs' logits buffer and reserved
pool, miles.rollout.cuda_graphs.graph_tag_storages; 0 on the CPU, which captures none). Sharding: trainer state evenly over
trainer.world_size ranks (FSDP2 / distributed optimizer); engines tile the same GPUs, so one GPU holds
num_engines / world_size of one engine's bytes. Host bytes are per node: ranks per node x per-rank backups,
priced as the OS sees them (one page-rounded arena per tag, or torch's power-of-two caching allocator).

    report = plan(cfg, "gb300")              # PlanReport: one row per executed step, peaks, budgets
    mode, reason = choose_mode(cfg)          # what colocate_memory_peak_device='auto' resolves to
    miles plan --recipe gb300_kimi_k2_plan --hardware gb300 --json     (miles.cli.plan)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from miles.config import RunConfig
from miles.handoff.hardware import GiB, HardwareProfile, get_profile
from miles.handoff.plan import HandoffPlan, Step

ALIGN = 64  # TaggedMemory's per-storage alignment inside an arena
HOST_ALLOCATORS = ("arena", "arena_kept", "caching")


@dataclass(frozen=True, slots=True)
class TagSize:
    owner: str  # "trainer" | "engine"
    tag: str
    storages: tuple[int, ...]  # bytes of each storage on one GPU (what the ledger sums)
    policy: str  # "host" | "disk" | "discard"
    lazy: bool = False  # created by the first train step (the torch backend's AdamW moments)
    grown: tuple[int, ...] = ()  # added by the first train step to a tag made at build (Megatron's Adam moments)

    @property
    def bytes(self) -> int:
        return sum(self.storages) + sum(self.grown)

    def footprint(self, allocator: str = "arena", grown: bool = True) -> int:
        """Host RAM one backup of this tag takes: one arena of 64-byte aligned blocks."""
        held = self.storages + (self.grown if grown else ())
        if self.policy != "host" or not sum(held):
            return 0
        from miles.memory.host_arena import arena_footprint, caching_allocator_footprint  # torch: imported late

        packed = sum(-(-n // ALIGN) * ALIGN for n in held)
        return caching_allocator_footprint(packed) if allocator == "caching" else arena_footprint(packed)


@dataclass(slots=True)
class Sizes:
    tags: dict[tuple[str, str], TagSize]
    train_transient: int  # device bytes live only inside a train step (grads of the torch backend, activations)
    grads_persist: bool  # a megatron-style grad buffer stays allocated until clear_memory / offload
    build_transient: int = 0  # extra device bytes while one model copy is built (the decoder starts in FP32)
    model: dict = field(default_factory=dict)  # what was sized (name, parameters, active, ...)
    # with model.lora.warmup = base: the warm-up's working set (the base's grads and AdamW state, made and dropped
    # inside it, and its activations); None: the warm-up's is a train step's
    warmup_transient: int | None = None


@dataclass(slots=True)
class PlannedStep:
    phase: str
    step: str
    moved: dict[str, int]  # tag -> bytes this step moved on one GPU (device side)
    device: int  # bytes held on one GPU after the step
    host: int  # host bytes per rank after the step (the ledger's count)
    host_node: int  # host RAM per node as the OS sees it (footprints x ranks per node)
    disk_node: int
    transient_device: int = 0  # extra device bytes inside the step (train working set, sync bucket)
    seconds: float = 0.0  # moved bytes over the host<->device link
    over: list[str] = field(default_factory=list)  # "device" / "host" when this step exceeds the budget


@dataclass(slots=True)
class PlanReport:
    recipe: str
    mode: str
    hardware: HardwareProfile
    gpus: int
    nodes: int
    ranks_per_node: int
    sizes: Sizes
    steps: list[PlannedStep]
    host_allocator: str = "arena"
    reason: str = ""

    @property
    def device_peak(self) -> int:
        return max(s.device + s.transient_device for s in self.steps)

    @property
    def host_peak(self) -> int:
        return max(s.host_node for s in self.steps)

    @property
    def host_budget(self) -> int:
        return self.hardware.host_bytes

    @property
    def device_budget(self) -> int:
        return self.hardware.hbm_bytes

    @property
    def fits_device(self) -> bool:
        return not any("device" in s.over for s in self.steps)

    @property
    def fits_host(self) -> bool:
        return not any("host" in s.over for s in self.steps)

    @property
    def handoff_seconds(self) -> float:
        """One steady RL step's handoff time at the link speed (the last rollout_to_train + train_to_rollout)."""
        per_step = len([s for s in self.steps if s.phase in ("rollout_to_train", "train_to_rollout")]) // max(
            self.num_steps, 1
        )
        moves = [s for s in self.steps if s.phase in ("rollout_to_train", "train_to_rollout")]
        return sum(s.seconds for s in moves[len(moves) - per_step :])

    @property
    def sync_bytes(self) -> int:
        """Bytes one GPU's engines receive per weight sync: their ``weights`` tag (with LoRA, the adapters only)."""
        return self.sizes.tags[("engine", "weights")].bytes

    @property
    def num_steps(self) -> int:
        return sum(1 for s in self.steps if s.phase == "train")


# ---- sizes ----------------------------------------------------------------------------------------------------
def estimate_sizes(cfg: RunConfig, *, cuda_graphs: bool = False) -> Sizes:
    """Per-GPU tag sizes for the run: from handoff.plan_model when set, else the embedded decoder exactly
    (``cuda_graphs``: its engines run on a GPU and hold decode graphs)."""
    return _hf_sizes(cfg) if cfg.handoff.plan_model else _decoder_sizes(cfg, cuda_graphs)


def _policies(cfg: RunConfig) -> tuple[str, str]:
    train = {"host": "host", "disk": "disk", "none": "discard"}[cfg.handoff.offload_train]
    return train, "host" if cfg.handoff.engine_host_mirror else "discard"


def _decoder_sizes(cfg: RunConfig, cuda_graphs: bool = False) -> Sizes:
    from miles.model.size import DTYPE_BYTES, adapter_storages, decoder_storages, kv_cache_storages
    from miles.rollout.cuda_graphs import graph_tag_storages

    m, r, t = cfg.model, cfg.rollout, cfg.trainer
    if t.world_size != 1:
        raise ValueError(
            f"exact decoder sizing is for one trainer rank (trainer.world_size = {t.world_size}); set "
            f"handoff.plan_model to an HF config to plan a sharded run"
        )
    train_pol, eng_pol = _policies(cfg)
    params = tuple(decoder_storages(m)["params"])
    seq = r.max_seq_len or m.max_position_embeddings
    kv = tuple(kv_cache_storages(m, r.max_batch_size, seq)) * r.num_engines
    tags = {
        ("trainer", "params"): TagSize("trainer", "params", params, train_pol),
        ("trainer", "optimizer"): TagSize("trainer", "optimizer", params * 2, train_pol, lazy=True),
        ("engine", "weights"): TagSize("engine", "weights", params * r.num_engines, eng_pol),
        ("engine", "kv_cache"): TagSize("engine", "kv_cache", kv, "discard"),
    }
    megatron = t.backend == "megatron"
    if megatron:  # built with FP32 master weights and an FP32 grad buffer; Adam's two FP32 moments at the first step
        fp32 = tuple(4 * n // DTYPE_BYTES[m.dtype] for n in params)
        tags[("trainer", "optimizer")] = TagSize("trainer", "optimizer", fp32, train_pol, grown=fp32 * 2)
        tags[("trainer", "grads")] = TagSize("trainer", "grads", (sum(fp32),), "discard")
    if cuda_graphs:
        graphs = tuple(graph_tag_storages(m, r.max_batch_size)) * r.num_engines
        tags[("engine", "cuda_graph")] = TagSize("engine", "cuda_graph", graphs, "discard")
    if t.kl_coef and not m.lora.enabled:
        tags[("trainer", "ref")] = TagSize("trainer", "ref", params, train_pol)
    base_warmup = None
    if m.lora.enabled:  # the base frozen and resident on both sides; adapters (FP32) train, sync and move
        base_warmup = sum(params)  # with model.lora.warmup = base, what the warm-up trains
        tags, params = _lora_tags(tags, params, m, r.num_engines, train_pol, eng_pol), tuple(adapter_storages(m))
    act = _activation_bytes(
        cfg,
        m.hidden_size,
        m.intermediate_size,
        m.num_hidden_layers,
        m.num_attention_heads,
        m.num_key_value_heads * m.head_dim,
        m.vocab_size,
        {"float32": 4}.get(m.dtype, 2),
    )
    warmup = None
    if m.lora.enabled and m.lora.warmup == "base":  # grads + AdamW's two moments of the base, a full model's step
        warmup = 3 * base_warmup + max(act, base_warmup)
    act += lora_activation_bytes(cfg) if m.lora.enabled else 0
    # grads (model dtype) live through the step; on top of them either the activations (forward/backward) or the
    # foreach AdamW's one parameter-sized temporary (sqrt of the second moment) during optimizer.step
    transient = (0 if megatron else sum(params)) + max(act, sum(params))  # Megatron's grads are in its buffer
    n = m.num_parameters
    base = decoder_storages(m)["params"]
    fp32_first = 4 * sum(base) // DTYPE_BYTES[m.dtype] if m.dtype != "float32" else 0  # build, then .to(dtype)
    model = {"name": f"embedded {m.architecture}", "parameters": n, "dtype": m.dtype, "exact": t.precision == "bf16"}
    if m.lora.enabled:
        model |= {"lora_rank": m.lora.rank, "adapter_parameters": sum(params) // 4}
    return Sizes(
        tags, transient, grads_persist=megatron, build_transient=fp32_first, model=model, warmup_transient=warmup
    )
    # quantized workspaces of the torch backend are not sized here


def _lora_tags(tags: dict, base: tuple, m, num_engines: int, train_pol: str, eng_pol: str) -> dict:
    """With LoRA: ``base`` on each side (in no plan step), ``params`` / ``weights`` / ``optimizer`` the adapters'."""
    from miles.model.size import adapter_storages

    adapters = tuple(adapter_storages(m))
    return tags | {
        ("trainer", "base"): TagSize("trainer", "base", base, train_pol),
        ("trainer", "params"): TagSize("trainer", "params", adapters, train_pol),
        ("trainer", "optimizer"): TagSize("trainer", "optimizer", adapters * 2, train_pol, lazy=True),
        ("engine", "base"): TagSize("engine", "base", base * num_engines, "host"),
        ("engine", "weights"): TagSize("engine", "weights", adapters * num_engines, eng_pol),
    }


def lora_activation_bytes(cfg: RunConfig) -> int:
    """What LoRA adds to a train step's saved activations (an estimate, as ``_activation_bytes``): each adapted
    projection keeps its input in FP32 for the adapter's gradient (nothing extra when the model is FP32)."""
    from miles.model.lora_config import targets

    m, r, t = cfg.model, cfg.rollout, cfg.trainer
    if m.dtype == "float32":
        return 0
    seqs = r.num_prompts_per_step * r.n_samples_per_prompt // t.world_size // t.num_minibatches
    tokens = seqs * (r.max_seq_len or m.max_position_embeddings)
    return tokens * sum(4 * i + 4 * m.lora.rank for _, i, _ in targets(m))


def _activation_bytes(
    cfg: RunConfig, h: int, inter: int, L: int, heads: int, kv: int, vocab: int, dtype: int, recompute: bool = False
) -> int:
    """An estimate of one micro-batch's saved activations and logits (not in the ledger; checked on the H200 bench).

    Eager decoder: per token and layer the saved hidden states (8h), K/V (2kv), MLP intermediates (4i) and the
    attention rows (2 x heads x T); with recompute only the layer input (2h). Logits in the model dtype plus
    three FP32 [chunk, V] buffers of the chunked log-prob path."""
    r, t = cfg.rollout, cfg.trainer
    seqs = r.num_prompts_per_step * r.n_samples_per_prompt // t.world_size // t.num_minibatches
    T = r.max_seq_len or cfg.model.max_position_embeddings
    tokens = T if recompute else seqs * T  # megatron-style: one sequence per micro-batch, layers recomputed
    per_layer = 2 * h * dtype if recompute else (8 * h + 2 * kv + 4 * inter) * dtype + 2 * heads * T * dtype
    logits = tokens * vocab * dtype + min(tokens, t.logprob_chunk_size) * vocab * 4 * 3
    return tokens * L * per_layer + logits


def _hf_sizes(cfg: RunConfig) -> Sizes:
    from miles.memory.traffic import offload_bytes, workspace_bytes
    from miles.model.size import count_params, kv_bytes_per_token, load_hf_config, model_shapes

    if cfg.model.lora.enabled:
        raise ValueError(
            f"handoff.plan_model = {cfg.handoff.plan_model!r} is sized for full fine-tuning; with model.lora.rank = "
            f"{cfg.model.lora.rank} the planner sizes the embedded decoder: leave handoff.plan_model empty and set "
            "model.* to the model's dimensions (as the h200_llama3_8b_lora recipe does)"
        )
    try:  # a hand-written config.json may lack a field or hold a zero where a count belongs
        hf = load_hf_config(cfg.handoff.plan_model)
        for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if isinstance(hf[k], bool) or not isinstance(hf[k], int) or hf[k] <= 0:
                raise ValueError(f"{k} = {hf[k]!r} is not a positive integer")
        shapes = model_shapes(hf)
        count = count_params(hf)
    except (KeyError, TypeError, AttributeError, ZeroDivisionError, ValueError) as e:
        raise ValueError(
            f"handoff.plan_model = {cfg.handoff.plan_model!r} is not a usable HF config.json "
            f"({type(e).__name__}: {e}); it needs a JSON object with vocab_size, hidden_size, num_hidden_layers, "
            "num_attention_heads (> 0), intermediate_size and the MoE/MLA fields its architecture uses"
        ) from None
    r, t, world = cfg.rollout, cfg.trainer, cfg.trainer.world_size
    N = count.total
    train_pol, eng_pol = _policies(cfg)
    megatron = t.backend == "megatron"
    opt_per_param = (12 if t.optimizer == "adamw" else 8) if megatron else (4 if t.optimizer == "adamw" else 2)
    share = lambda total: (total + world - 1) // world
    tags = {
        ("trainer", "params"): TagSize("trainer", "params", (share(N * 2),), train_pol),
        ("trainer", "optimizer"): TagSize(
            "trainer", "optimizer", (share(N * opt_per_param),), train_pol, lazy=not megatron
        ),
        ("trainer", "grads"): TagSize("trainer", "grads", (share(N * (4 if megatron else 2)),), "discard", lazy=True),
    }
    if t.precision != "bf16":
        ws = offload_bytes(shapes, t.precision, clear_workspaces=False)["quant_workspace"]
        pol = "discard" if t.clear_quantized_workspaces_on_offload else train_pol
        tags[("trainer", "quant_workspace")] = TagSize("trainer", "quant_workspace", (share(ws),), pol)
    if t.kl_coef:
        tags[("trainer", "ref")] = TagSize("trainer", "ref", (share(N * 2),), train_pol)
    if t.precision == "bf16":
        engine_weights = N * 2
    else:  # the engine serves the rowwise quantized copy; embeddings, head, routers and norms stay bf16
        engine_weights = sum(
            workspace_bytes(w, t.precision, training=False) if w.quantized else w.numel * 2 for w in shapes
        )
    seq = r.max_seq_len or cfg.model.max_position_embeddings
    kv = r.max_batch_size * seq * kv_bytes_per_token(hf, 2)
    tags[("engine", "weights")] = TagSize("engine", "weights", (share(engine_weights * r.num_engines),), eng_pol)
    tags[("engine", "kv_cache")] = TagSize("engine", "kv_cache", (share(kv * r.num_engines),), "discard")
    h, L = hf["hidden_size"], hf["num_hidden_layers"]
    transient = _activation_bytes(cfg, h, 0, L, hf["num_attention_heads"], 0, hf["vocab_size"], 2, recompute=True)
    return Sizes(
        tags,
        transient,
        grads_persist=megatron,
        model={
            "name": cfg.handoff.plan_model,
            "parameters": N,
            "active": count.active,
            "mtp": count.mtp,
            "engine_weight_bytes": engine_weights,
            "kv_bytes_per_token": kv_bytes_per_token(hf, 2),
            "exact": False,
        },
    )


# ---- replay ---------------------------------------------------------------------------------------------------
class _State:
    """What each tag holds on one GPU rank while the plan is replayed."""

    def __init__(self, sizes: Sizes, allocator: str):
        self.sizes, self.allocator = sizes, allocator
        self.created = {k: not s.lazy and s.owner == "engine" for k, s in sizes.tags.items()}  # trainer: at build
        self.resident = dict.fromkeys(sizes.tags, True)
        self.grown = dict.fromkeys(sizes.tags, False)  # a tag's ``grown`` storages exist (after the first train)
        self.kept: dict[tuple[str, str], int] = {}  # arena_kept: every host arena ever made stays mapped

    def size(self, key) -> int:
        t = self.sizes.tags[key]
        return (sum(t.storages) + (sum(t.grown) if self.grown[key] else 0)) if self.created[key] else 0

    def footprint(self, key) -> int:
        return self.sizes.tags[key].footprint(self.allocator, self.grown[key])

    def device(self) -> int:
        return sum(self.size(k) for k in self.sizes.tags if self.resident[k])

    def pool(self, pool: str, footprint: bool = False) -> int:
        if footprint and pool == "host" and self.allocator == "arena_kept":  # released arenas stay mapped
            return sum(self.kept.values())
        total = 0
        for k, s in self.sizes.tags.items():
            if not self.resident[k] and s.policy == pool and self.created[k]:
                total += self.footprint(k) if footprint else self.size(k)
        return total

    def move(self, step: Step, onto_device: bool) -> dict[str, int]:
        owner = step.owner
        moved = {}
        for tag in step.tags:
            key = (owner, tag)
            if key not in self.sizes.tags or self.resident[key] == onto_device:
                continue
            self.resident[key] = onto_device
            if self.size(key):
                moved[tag] = self.size(key)
                if not onto_device:
                    self.kept[key] = max(self.kept.get(key, 0), self.footprint(key))
        return moved


def replay(
    plan: HandoffPlan,
    sizes: Sizes,
    hw: HardwareProfile,
    ranks_per_node: int,
    num_steps: int = 2,
    allocator: str = "arena",
    sync_bucket: int = 0,
) -> list[PlannedStep]:
    """Every step the driver executes (init, then ``num_steps`` x rollout_to_train, train, train_to_rollout)."""
    st = _State(sizes, allocator)
    engines = sizes.tags[("engine", "weights")].bytes // max(sizes.tags[("trainer", "params")].bytes, 1)
    rows = [_row(st, "construct", "engines built", {}, hw, ranks_per_node, sizes.build_transient if engines else 0)]
    for s in plan.init:
        rows.append(_apply(st, "init", s, hw, ranks_per_node, sync_bucket))
    for _ in range(num_steps):
        for s in plan.rollout_to_train:
            rows.append(_apply(st, "rollout_to_train", s, hw, ranks_per_node, sync_bucket))
        rows.append(_train(st, hw, ranks_per_node))
        for s in plan.train_to_rollout:
            rows.append(_apply(st, "train_to_rollout", s, hw, ranks_per_node, sync_bucket))
    return rows


def _apply(st: _State, phase: str, s: Step, hw, rpn: int, sync_bucket: int) -> PlannedStep:
    transient = 0
    if s.verb in ("offload", "offload_kv", "offload_weights"):
        moved = st.move(s, onto_device=False)
    elif s.verb in ("onload", "onload_kv", "onload_weights"):
        moved = st.move(s, onto_device=True)
    elif s.verb == "build":
        moved, transient = {}, st.sizes.build_transient
        for k, t in st.sizes.tags.items():
            if t.owner == "trainer":
                st.created[k], st.resident[k] = not t.lazy, True
    elif s.verb == "warmup" and st.sizes.warmup_transient is not None:  # the base trains; the adapters' state waits
        moved, transient = {}, st.sizes.warmup_transient
    elif s.verb == "warmup":  # supervised steps: a train step's working set, its lazy state created
        row = _train(st, hw, rpn)
        row.phase, row.step = phase, str(s)
        return row
    elif s.verb == "clear_memory":
        moved = {}
        if ("trainer", "grads") in st.sizes.tags:
            st.created[("trainer", "grads")] = False  # the grad buffer is released, nothing is copied
    else:  # the sync: one staging bucket at a time on top of what is held
        moved, transient = {}, sync_bucket
    row = _row(st, phase, str(s), moved, hw, rpn, transient)
    return row


def _train(st: _State, hw, rpn: int) -> PlannedStep:
    for k, s in st.sizes.tags.items():
        if s.lazy and s.owner == "trainer" and st.resident[k]:
            st.created[k] = k != ("trainer", "grads") or st.sizes.grads_persist
        if s.grown and st.created[k] and st.resident[k]:
            st.grown[k] = True
    grads = st.sizes.tags.get(("trainer", "grads"))
    extra = st.sizes.train_transient + (grads.bytes if grads is not None and not st.sizes.grads_persist else 0)
    return _row(st, "train", "trainer.train_step", {}, hw, rpn, extra)


def _row(
    st: _State, phase: str, name: str, moved: dict, hw: HardwareProfile, rpn: int, transient: int = 0
) -> PlannedStep:
    device, host = st.device(), st.pool("host")
    host_node = st.pool("host", footprint=True) * rpn
    row = PlannedStep(
        phase,
        name,
        moved,
        device,
        host,
        host_node,
        st.pool("disk") * rpn,
        transient,
        sum(moved.values()) / hw.h2d_bytes_per_s,
    )
    if hw.unified:  # the cpu profile: device tensors and host backups share the same RAM
        if (device + transient) * rpn + host_node > hw.host_bytes:
            row.over += ["device", "host"]
    else:
        if device + transient > hw.hbm_bytes:
            row.over.append("device")
        if host_node > hw.host_bytes:
            row.over.append("host")
    return row


# ---- API ------------------------------------------------------------------------------------------------------
MAX_PLAN_STEPS = 100  # replayed RL steps at most: the peaks repeat from step 2 on, the rows grow without bound


def plan(
    cfg: RunConfig,
    hardware: str | HardwareProfile | None = None,
    *,
    mode: str | None = None,
    num_steps: int = 2,
    host_allocator: str = "arena",
) -> PlanReport:
    """Predict every executed step's bytes and the peaks of ``cfg`` on ``hardware`` (default cfg.handoff.hardware)."""
    if not 0 <= num_steps <= MAX_PLAN_STEPS:
        raise ValueError(
            f"plan num_steps (miles plan --steps) = {num_steps} must be in [0, {MAX_PLAN_STEPS}]; every RL step repeats the same "
            "moves, so the default 2 already shows the steady-state peaks"
        )
    if host_allocator not in HOST_ALLOCATORS:
        raise ValueError(
            f"host_allocator = {host_allocator!r} is not one of {HOST_ALLOCATORS}: 'arena' (exact, freed at "
            f"resume), 'arena_kept' (host_arena.keep_pinned: mapped for the run), 'caching' (torch pinned)"
        )
    hw = hardware if isinstance(hardware, HardwareProfile) else get_profile(hardware or cfg.handoff.hardware)
    mode = mode or cfg.handoff.colocate_memory_peak_device
    reason = ""
    if mode == "auto":
        mode, reason = choose_mode(cfg, hw)
    hp = HandoffPlan.from_config(cfg.handoff, mode=mode, reason=reason, warmup=cfg.trainer.warmup_sft_steps > 0)
    gpus = cfg.trainer.world_size
    rpn = min(gpus, hw.gpus_per_node)
    sizes = estimate_sizes(cfg, cuda_graphs=not hw.unified)
    bucket = min(cfg.sync.update_weight_buffer_size, sizes.tags[("engine", "weights")].bytes)
    steps = replay(hp, sizes, hw, rpn, num_steps, host_allocator, bucket)
    return PlanReport(cfg.recipe, mode, hw, gpus, hw.nodes_for(gpus), rpn, sizes, steps, host_allocator, reason)


def resolve_plan(cfg: RunConfig) -> HandoffPlan:
    """The run's HandoffPlan; ``colocate_memory_peak_device = 'auto'`` is decided here by ``choose_mode``."""
    warmup = cfg.trainer.warmup_sft_steps > 0
    if cfg.handoff.colocate_memory_peak_device != "auto":
        return HandoffPlan.from_config(cfg.handoff, warmup=warmup)
    mode, reason = choose_mode(cfg)
    return HandoffPlan.from_config(cfg.handoff, mode=mode, reason=reason, warmup=warmup)


def choose_mode(cfg: RunConfig, hardware: str | HardwareProfile | None = None) -> tuple[str, str]:
    """'auto': cpu when both its peaks fit (the default order), else gpu when its peaks fit; the reason says why."""
    hw = hardware if isinstance(hardware, HardwareProfile) else get_profile(hardware or cfg.handoff.hardware)
    cpu = plan(cfg, hw, mode="cpu")
    peaks = lambda r: (
        f"{r.mode} mode: host {r.host_peak / GiB:.1f} GiB/node (budget {r.host_budget / GiB:.1f}), "
        f"device {r.device_peak / GiB:.1f} GiB/GPU (budget {r.device_budget / GiB:.1f})"
    )
    if cpu.fits_host and cpu.fits_device:
        return "cpu", f"{peaks(cpu)} fits on {hw.name}"
    if not cfg.handoff.can_peak_on_device:
        raise ValueError(
            f"colocate_memory_peak_device='auto': {peaks(cpu)} does not fit, and 'gpu' needs "
            f"handoff.offload_train and handoff.offload_rollout; enable them or use more GPUs"
        )
    gpu = plan(cfg, hw, mode="gpu")
    if gpu.fits_host and gpu.fits_device:
        return "gpu", f"{peaks(cpu)} does not fit; {peaks(gpu)} fits on {hw.name}"
    raise ValueError(
        f"colocate_memory_peak_device='auto': neither mode fits on {hw.name}: {peaks(cpu)}; {peaks(gpu)}. "
        f"Use more GPUs (trainer.world_size), a smaller rollout (rollout.max_batch_size), or set "
        f"handoff.colocate_memory_peak_device explicitly to run anyway"
    )
