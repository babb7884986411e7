"""Typed configs: one small dataclass per component, composed into a RunConfig, validated when built.

Each field is documented once, next to itself. A recipe (miles.recipes) returns a RunConfig; the CLI and
notebooks change a few fields with ``apply_overrides(cfg, ["trainer.lr=1e-4"])`` (miles.config_overrides), which
parses each value by the field's type and re-runs validation, so every error names the value and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Literal

from miles.async_config import AsyncConfig, check_async
from miles.config_check import check, require_finite, user_name
from miles.config_overrides import (  # noqa: F401 (apply_overrides, apply_values re-exported for callers)
    apply_overrides,
    apply_values,
    build,
    user_dict,
)
from miles.data.config import DataConfig, EvalConfig, check_run
from miles.envs.config import EnvConfig
from miles.model.config import ModelConfig
from miles.model.lora_config import check_run as check_lora_run
from miles.placement import ClusterConfig, check_cluster
from miles.policy.objective import check_objective, check_rollout, check_trainer
from miles.ports import port_range
from miles.trackers import LogConfig

ROLLOUT_LEVELS = ("kv_cache", "weight")
MAX_THREADS = 4096


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    # the generated task when data.train is empty: reverse / sort / copy letters, add numbers, reverse in a chat
    # template, or swe (agents: fix a tiny repository so its test passes)
    name: Literal["reverse", "sort", "add", "copy", "chat_reverse", "swe"] = "reverse"
    min_len: int = 3  # shortest problem (letters or digits)
    max_len: int = 5  # longest problem
    alphabet: str = "abcdef"  # letters used by the letter tasks
    reward: str = ""  # "module:function" to replace the task's own reward (runs under data.reward_timeout_s); see miles.rollout.tasks.RewardFn

    def __post_init__(self):
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(
                f"task.min_len = {self.min_len}, task.max_len = {self.max_len}: need 1 <= min_len <= max_len"
            )
        if len(set(self.alphabet)) < 2:
            raise ValueError(f"task.alphabet = {self.alphabet!r} needs at least two distinct characters")


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    num_prompts_per_step: int = 8  # prompts per RL step (groups)
    n_samples_per_prompt: int = 4  # completions per prompt (group size for advantages)
    max_new_tokens: int = 16  # longest completion, in tokens
    temperature: float = 1.0  # sampling temperature
    top_p: float = 1.0  # nucleus sampling: the smallest token set with this probability mass; 1 = off
    # in-process engine, the same engine over HTTP (`miles serve`), or SGLang servers (miles.sglang_flags)
    engine: Literal["embedded", "http", "sglang"] = "embedded"
    num_engines: int = 1  # rollout engines, each with its own copy of the weights
    engine_urls: tuple[str, ...] = ()  # sglang: attach to these running servers instead of launching (never killed)
    sglang_args: tuple[str, ...] = ()  # sglang: extra server flags, e.g. --tp-size,4 (sglang_flags.KNOWN_FLAGS)
    sglang_launcher: str = "sglang.launch_server"  # module run with -m; "miles-serve" = the CPU stand-in
    sglang_ports: str = ""  # sglang: ports of the launched servers, "30000-30007"; "" = free ports
    engine_ready_timeout_s: float = 600.0  # sglang: how long a launched server may take to answer /health
    max_batch_size: int = 256  # KV cache rows preallocated per engine
    max_seq_len: int = 0  # KV cache length; 0 = model.max_position_embeddings
    # grpo: (r - group mean) / group std; drgrpo: r - group mean; rloo: r - mean of the group's others;
    # reinforce++: batch-whitened r; reinforce++-baseline: group-centred, then divided by the batch std
    advantage_estimator: Literal["grpo", "drgrpo", "rloo", "reinforce++", "reinforce++-baseline"] = "grpo"
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill from more prompts
    dynamic_sampling_max_rounds: int = 4  # generation rounds per step at most (then dropped groups fill the rest)
    overlong_filter: bool = False  # DAPO: responses cut at max_new_tokens are masked out of the loss
    overlong_buffer_len: int = 0  # DAPO soft punishment over the last N tokens of the budget; 0 = off
    overlong_penalty_factor: float = 1.0  # reward penalty at max_new_tokens (linear from 0 over the buffer)

    def __post_init__(self):
        require_finite("rollout", self)
        for name in ("num_prompts_per_step", "n_samples_per_prompt", "max_new_tokens", "num_engines", "max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} = {getattr(self, name)} must be >= 1")
        check("rollout.temperature", self.temperature, ge=1e-6, fix="greedy: use a small value like 1e-5")
        check("rollout.max_seq_len", self.max_seq_len, ge=0, fix="0 = model.max_position_embeddings")
        check("rollout.engine_ready_timeout_s", self.engine_ready_timeout_s, gt=0, fix="seconds, e.g. 600")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p = {self.top_p} must be in (0, 1]")
        check_rollout(self)


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    backend: Literal["torch", "megatron"] = "torch"  # torch (FSDP2 when world_size > 1); megatron needs a GPU
    world_size: int = 1  # data-parallel ranks (FSDP2 when > 1)
    lr: float = 1e-3  # learning rate of the RL steps
    weight_decay: float = 0.0  # decoupled weight decay (AdamW)
    betas: tuple[float, float] = (0.9, 0.99)  # Adam's decay rates (beta1, beta2)
    max_grad_norm: float = 1.0  # gradients are clipped to this global L2 norm
    loss: Literal["grpo", "gspo", "ppo"] = "grpo"  # grpo / ppo: clipped per-token ratios; gspo: one sequence ratio
    eps_clip: float = 0.2  # lower ratio clip (1 - eps_clip)
    eps_clip_high: float = 0.28  # upper ratio clip (1 + eps_clip_high)
    kl_coef: float = 0.0  # KL to the initial (reference) policy; 0 keeps no reference model
    entropy_coef: float = 0.0  # entropy bonus in the loss; 0 = off
    dual_clip: float = 0.0  # c > 1: a negative-advantage token's loss is capped at -c * A (0 = off)
    # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (Dr.GRPO's constant)
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    loss_norm_tokens: int = 0  # seq-mean-token-sum-norm's constant per sequence; 0 = rollout.max_new_tokens
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # per-token estimate of KL(policy || reference)
    kl_in: Literal["loss", "reward"] = "loss"  # KL as a loss term, or as a per-token reward penalty (reward-to-go)
    # importance correction with the engine's (behaviour) log-probs, w = p_train/p_engine per token (p_train: the
    # proximal policy, the trainer's before the step's update): tis = weight min(w, cap) on each token's loss;
    # mis = mask tokens whose w leaves [1/cap, cap]; decoupled = decoupled PPO (AReaL): weight w, tokens with
    # w > cap weigh 0; seq-mis = mask whole sequences whose geometric-mean w leaves [1/cap, cap]
    rollout_correction: Literal["none", "tis", "mis", "decoupled", "seq-mis"] = "none"
    rollout_correction_cap: float = 2.0  # the ratio cap of tis / mis / decoupled / seq-mis
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # after warmup, per RL step
    lr_warmup_steps: int = 0  # RL steps of linear warmup from lr / lr_warmup_steps
    lr_decay_steps: int = 0  # the decay reaches lr * lr_min_ratio at this RL step; 0 = num_steps
    lr_min_ratio: float = 0.0  # the decayed LR's floor, as a fraction of lr
    num_minibatches: int = 1  # optimizer steps per rollout batch
    logprob_chunk_size: int = 1024  # tokens per FP32 upcast chunk in the log-prob path
    warmup_sft_steps: int = 0  # supervised steps on reference answers before RL (not counted as RL steps)
    warmup_sft_lr: float = 3e-3  # learning rate of the supervised warm-up steps
    optimizer: Literal["adamw", "muon"] = "adamw"  # muon: hidden 2-D matrices under Muon, the rest under AdamW
    optimizer_offload: Literal["none", "host", "disk"] = "none"  # where optimizer state waits between steps
    optimizer_offload_dir: str = ""  # for optimizer_offload = "disk": a directory on local NVMe
    optimizer_offload_chunk_bytes: int = 64 << 20  # bytes moved per chunk to and from host or disk
    clear_quantized_workspaces_on_offload: bool = True  # free the low-precision weight copies on offload
    precision: Literal["bf16", "fp8", "mxfp8", "nvfp4"] = "bf16"  # low-precision recipe for Linear layers
    megatron_attention: Literal["local", "sdpa"] = (
        "local"  # megatron backend core attention: Megatron's unfused local one, or torch SDPA (flash)
    )

    def __post_init__(self):
        require_finite("trainer", self)
        check("trainer.world_size", self.world_size, ge=1, fix="data-parallel ranks; 1 = no FSDP")
        if not 0 < self.lr < 1:
            raise ValueError(f"trainer.lr = {self.lr} is out of range; use a value in (0, 1), e.g. 1e-4")
        check("trainer.warmup_sft_lr", self.warmup_sft_lr, gt=0, lt=1, fix="e.g. 3e-3 (a negative LR is ascent)")
        check("trainer.warmup_sft_steps", self.warmup_sft_steps, ge=0, fix="0 = no supervised warm-up")
        check("trainer.weight_decay", self.weight_decay, ge=0, fix="0 = none, e.g. 0.01 (negative grows the weights)")
        for i, beta in enumerate(self.betas):
            check(f"trainer.betas[{i}]", beta, ge=0, lt=1, fix="Adam's decay rates, e.g. trainer.betas=0.9,0.99")
        check("trainer.max_grad_norm", self.max_grad_norm, gt=0, fix="e.g. 1.0 (a negative norm is gradient ascent)")
        check("trainer.eps_clip", self.eps_clip, ge=0, lt=1, fix="the lower ratio clip 1 - eps_clip, e.g. 0.2")
        check(
            "trainer.eps_clip_high", self.eps_clip_high, ge=0, fix="the upper ratio clip 1 + eps_clip_high, e.g. 0.28"
        )
        check("trainer.kl_coef", self.kl_coef, ge=0, fix="0 turns the KL term (and the reference model) off")
        check("trainer.optimizer_offload_chunk_bytes", self.optimizer_offload_chunk_bytes, ge=1, fix="e.g. 64MiB")
        check("trainer.num_minibatches", self.num_minibatches, ge=1, fix="optimizer steps per rollout batch, e.g. 1")
        check("trainer.logprob_chunk_size", self.logprob_chunk_size, ge=1, fix="tokens per chunk, e.g. 1024")
        if self.megatron_attention not in ("local", "sdpa"):
            raise ValueError(f"trainer.megatron_attention = {self.megatron_attention!r} must be 'local' or 'sdpa'")
        check_trainer(self)
        if self.optimizer_offload == "disk" and not self.optimizer_offload_dir:
            raise ValueError(
                "trainer.optimizer_offload = 'disk' needs trainer.optimizer_offload_dir (a local NVMe directory)"
            )


@dataclass(kw_only=True, slots=True)
class SyncConfig:
    # tensor: shared-memory / CUDA IPC buckets; broadcast: a torch.distributed group (NCCL, gloo); rdt: Ray's
    # tensor transport; disk-delta: each version as a delta file the engines apply
    transport: Literal["tensor", "broadcast", "rdt", "disk-delta"] = "tensor"
    update_weight_buffer_size: int = 512 << 20  # bytes per bucket
    check_weights: bool = False  # compare engine and trainer weights bit-for-bit after every sync
    disk_delta_dir: str = ""  # for transport = "disk-delta"; "" = <run_dir>/weights
    engine_staging: Literal["shadow", "direct"] = (
        "shadow"  # shadow: a failed sync leaves the old weights (+1 copy in engine memory)
    )
    rdt_transport: Literal["auto", "nixl", "cuda_ipc", "nccl", "gloo"] = (
        "auto"  # auto: nixl if installed, else cuda_ipc on GPU, gloo on CPU
    )
    source: Literal["bucket", "in_place"] = (
        "bucket"  # tensor / rdt (cuda_ipc, gloo): staged buckets, or the trainer's own tensors
    )

    def __post_init__(self):
        require_finite("sync", self)
        if self.update_weight_buffer_size < 1 << 10:
            raise ValueError(
                f"sync.update_weight_buffer_size = {self.update_weight_buffer_size} bytes is too small; use >= 1 KiB"
            )
        if self.engine_staging not in ("shadow", "direct"):
            raise ValueError(
                f"sync.engine_staging = {self.engine_staging!r}; use 'shadow' (failure-safe) or 'direct' (no extra copy)"
            )
        if self.rdt_transport not in ("auto", "nixl", "cuda_ipc", "nccl", "gloo"):
            raise ValueError(f"sync.rdt_transport = {self.rdt_transport!r}; use auto, nixl, cuda_ipc, nccl or gloo")
        if self.source not in ("bucket", "in_place"):
            raise ValueError(
                f"sync.source = {self.source!r}; use 'bucket' (staged copies) or 'in_place' (engines read the "
                "trainer's tensors through handles opened once)"
            )
        if self.source == "in_place" and not (
            self.transport == "tensor" or (self.transport == "rdt" and self.rdt_transport in ("cuda_ipc", "gloo"))
        ):
            raise ValueError(
                f"sync.source = 'in_place' is a mode of the tensor transport and of rdt over cuda_ipc or gloo, "
                f"not of {self.transport!r} (rdt_transport {self.rdt_transport!r}); set sync.transport=tensor, "
                "sync.rdt_transport=cuda_ipc, or sync.source=bucket"
            )


GPU_ORDER_NEEDS = (
    "needs offload_train and offload_rollout; set handoff.offload_train=host (or disk) and "
    "handoff.offload_rollout=true, or use 'cpu'"
)


@dataclass(kw_only=True, slots=True)
class HandoffConfig:
    # where the trainer/engine handoff overlaps: cpu (each side offloads first, the host holds both copies a
    # moment), gpu (the other side onloads first, the overlap sits in device memory), auto (the planner picks)
    colocate_memory_peak_device: Literal["cpu", "gpu", "auto"] = "cpu"
    offload_train: Literal["host", "disk", "none"] = "host"  # where the trainer's tags go between steps
    offload_rollout: bool = True  # release engine memory while training
    offload_rollout_level: tuple[str, ...] = ROLLOUT_LEVELS  # engine tags released: subset of kv_cache, weight
    engine_host_mirror: bool = False  # keep a host copy of engine weights instead of waiting for the sync
    hardware: str = "auto"  # hardware profile for 'auto' and the planner (see miles.handoff.hardware)
    plan_model: str = (
        ""  # HF config.json (path, or name in miles/model/hf_configs) the planner sizes instead of `model`
    )

    def __post_init__(self):
        bad = [lvl for lvl in self.offload_rollout_level if lvl not in ROLLOUT_LEVELS]
        if bad:
            raise ValueError(
                f"handoff.offload_rollout_level has unknown level(s) {bad}; valid levels: {list(ROLLOUT_LEVELS)}"
            )
        if self.plan_model:
            from miles.model.size import resolve_hf_config

            resolve_hf_config(self.plan_model)  # raises naming the shipped configs
        if self.colocate_memory_peak_device == "gpu" and not self.can_peak_on_device:
            raise ValueError(f"handoff.colocate_memory_peak_device = 'gpu' {GPU_ORDER_NEEDS}")

    @property
    def can_peak_on_device(self) -> bool:
        """Whether the 'gpu' order is possible: the overlap sits in device memory only if both sides offload."""
        return self.offload_train != "none" and self.offload_rollout


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    session_ports: str = ""  # session-server instances: "8100" (one) or "8100-8103" (one per port); "" = no agents
    session_host: str = "127.0.0.1"  # where the session servers listen
    harness_url: str = ""  # a running agent harness ("http://host:port"); "" = start one locally
    oversample_factor: float = 1.5  # groups started = ceil(factor * rollout.num_prompts_per_step)
    abort_partial: Literal["buffer", "drop"] = "buffer"  # aborted groups: re-rolled first next step, or dropped
    flush_timeout_s: float = 5.0  # per instance, per attempt
    flush_retries: int = 2  # extra attempts per instance after a failed flush
    max_turns: int = 4  # model turns per episode before the final test run
    max_tokens_per_turn: int = 48  # longest model turn, in tokens
    episode_timeout_s: float = 120.0  # an episode still running after this is cancelled (zero reward)
    test_timeout_s: float = 30.0  # one run of the sandbox's test
    # the synthetic repository tasks' workload (miles.agents.swe_tasks): a share whose test is slow, the CPU-side
    # long tail of real agentic RL that makes flushing matter (the agents recipe sets it)
    slow_test_fraction: float = 0.0
    slow_test_s: float = 0.0  # how long a slow test runs

    def __post_init__(self):
        require_finite("agents", self)
        _ = self.instances  # parses session_ports, raises with the fix if malformed
        if self.oversample_factor < 1:
            raise ValueError(f"agents.oversample_factor = {self.oversample_factor} must be >= 1 (1 = no oversampling)")
        for name in ("flush_timeout_s", "episode_timeout_s", "test_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"agents.{name} = {getattr(self, name)} must be > 0 seconds")
        check("agents.flush_retries", self.flush_retries, ge=0, fix="extra attempts after a failed flush, e.g. 2")
        check("agents.max_turns", self.max_turns, ge=1, fix="model turns per episode, e.g. 4")
        check("agents.max_tokens_per_turn", self.max_tokens_per_turn, ge=1, fix="e.g. 48")
        check("agents.slow_test_fraction", self.slow_test_fraction, ge=0, le=1, fix="a share of tasks; 0 = none")
        check("agents.slow_test_s", self.slow_test_s, ge=0, fix="seconds a slow test runs")

    @property
    def instances(self) -> dict[int, str]:
        """port -> instance id, one per session-server port (the plural map the rollout flushes)."""
        return {port: f"agent-{port}" for port in parse_ports(self.session_ports)}


def parse_ports(spec: str) -> list[int]:
    """``"8100"`` -> [8100]; ``"8100-8103"`` -> [8100, 8101, 8102, 8103]; ``""`` -> []."""
    return port_range(spec, "agents.session_ports", "8100")


@dataclass(kw_only=True, slots=True)
class RunConfig:
    recipe: str = "custom"  # the recipe this config started from (a label; --recipe picks the base)
    seed: int = 0  # seeds the model init, sampling and data order
    num_steps: int = 20  # RL steps
    run_dir: str = "runs/latest"  # config.json, metrics.jsonl, ledger.jsonl, rollouts/ and checkpoints/ go here
    checkpoint_every: int = 10  # RL steps between checkpoints (0: only at the end)
    resume: bool = True  # continue from the last complete checkpoint in run_dir
    overwrite: bool = False  # consent to write into a non-run directory, or (resume=false) delete the run there
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when present, else the CPU
    ray_address: str = ""  # the former name of cluster.address, still read: moved there when the config is built
    num_threads: int = 0  # torch threads per actor; 0 = all cores
    dump_rollouts: bool = True  # per-step samples and per-token columns for the dashboard
    # seconds without progress before the run stops with every process's Python stacks in run_dir/stall-<UTC>/;
    # after 3 RL steps, generate/reward/train/sync get min(this, max(60, 10 x the slowest step)); 0 = off
    # (miles.stall.watchdog says what counts as progress)
    watchdog_s: float = 900.0
    # engine and trainer compute each sampled token's log-prob with the same invariant kernels (miles.model.kernels):
    # train_rollout_logprob_max_abs_diff reads exactly 0.0; slower forwards (benchmarks/true_on_policy.py)
    true_on_policy: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)  # the decoder: architecture, sizes, checkpoint, tokenizer
    task: TaskConfig = field(default_factory=TaskConfig)  # generated prompts with a known answer (without data.train)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # generation, engines and advantages
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # the policy update: optimizer, loss, KL, LR
    sync: SyncConfig = field(default_factory=SyncConfig)  # weights from the trainer to the engines after each step
    handoff: HandoffConfig = field(
        default_factory=HandoffConfig
    )  # memory: what each side releases while the other runs
    agents: AgentConfig = field(default_factory=AgentConfig)  # agentic rollouts (task.name = 'swe')
    data: DataConfig = field(default_factory=DataConfig)  # prompt datasets (data.train replaces `task`)
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out eval of data.eval
    env: EnvConfig = field(default_factory=EnvConfig)  # multi-turn environments (tool use) driving the episodes
    log: LogConfig = field(default_factory=LogConfig)  # experiment trackers
    # generation ahead of training by at most max_staleness versions; written `async` (miles.async_config)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # a Ray cluster to join, and where actors go on it

    def __post_init__(self):
        require_finite("", self)
        for f in dataclasses.fields(self):  # every section, those without a check of their own too
            if dataclasses.is_dataclass(section := getattr(self, f.name)):
                require_finite(user_name(f.name), section)
        check("seed", self.seed, ge=0, lt=2**32, fix="any integer in [0, 2**32)")
        # torch takes any count and crashes later (10**6 threads: a segfault); 4096 is above any one machine's
        # hardware threads
        check("num_threads", self.num_threads, ge=0, le=MAX_THREADS, fix="torch threads per actor; 0 = all cores")
        check("watchdog_s", self.watchdog_s, ge=0, fix="seconds without progress before a run is stopped; 0 = off")
        if self.num_steps < 0 or self.checkpoint_every < 0:
            raise ValueError(
                f"num_steps = {self.num_steps} and checkpoint_every = {self.checkpoint_every} must be >= 0"
            )
        if self.rollout.num_prompts_per_step * self.rollout.n_samples_per_prompt % self.trainer.world_size:
            raise ValueError(
                f"rollout.num_prompts_per_step * n_samples_per_prompt = "
                f"{self.rollout.num_prompts_per_step * self.rollout.n_samples_per_prompt} samples cannot be split over "
                f"trainer.world_size = {self.trainer.world_size} ranks; make it a multiple"
            )
        check_run(self)  # data / eval across sections (miles.data.config)
        if self.env.name and not self.data.train:
            raise ValueError(
                f"env.name = {self.env.name!r} needs task rows: set data.train (python -m miles.envs.calculator OUT_DIR "
                "writes the calculator's train and test splits)"
            )
        move_ray_address(self)
        check_cluster(self)  # pins per rank and per engine (miles.placement)
        if self.trainer.backend == "megatron" and self.device == "cpu":
            raise ValueError("trainer.backend = 'megatron' needs a GPU; use device=cuda or trainer.backend=torch")
        check_objective(self)
        check_async(self)
        check_true_on_policy(self)
        check_lora_run(self)  # what LoRA cannot run with (miles.model.lora_config)
        from miles.sglang_flags import check_sglang

        check_sglang(self)  # what SGLang servers cannot do with this config, refused with the fix
        h = self.handoff
        if self.sync.source == "in_place":
            why = []
            if h.offload_train != "none":
                why.append(
                    f"handoff.offload_train = {h.offload_train!r} (an engine holding a handle keeps the trainer's "
                    "memory alive, so the offload would free nothing): set handoff.offload_train=none"
                )
            if self.trainer.world_size > 1:
                why.append(f"trainer.world_size = {self.trainer.world_size} (FSDP gathers new full tensors every sync)")
            if self.rollout.engine == "http":
                why.append("rollout.engine = 'http' (engine servers take buckets)")
            if self.trainer.backend == "megatron":
                why.append("trainer.backend = 'megatron' (its HF-named weights are converted copies, new every sync)")
            if why:
                raise ValueError(
                    "sync.source = 'in_place' needs the trainer's weights resident at fixed addresses and "
                    f"embedded engines; {'; '.join(why)}; or use sync.source=bucket"
                )
        if (
            self.sync.transport == "disk-delta"
            and h.offload_rollout
            and "weight" in h.offload_rollout_level
            and not h.engine_host_mirror
        ):
            raise ValueError(
                "sync.transport = 'disk-delta' applies each version as a delta to the engine's weights, "
                "but the handoff discards them while training (offload_rollout_level has 'weight', no host "
                "mirror); set handoff.engine_host_mirror=true or handoff.offload_rollout_level=kv_cache"
            )

    def to_dict(self) -> dict:
        return user_dict(dataclasses.asdict(self))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        return build(cls, d)


def move_ray_address(cfg: RunConfig) -> None:
    """``ray_address`` (the field's former name) into ``cluster.address``, with a notice; both set differently is
    refused."""
    if not cfg.ray_address:
        return
    if cfg.cluster.address and cfg.cluster.address != cfg.ray_address:
        raise ValueError(
            f"ray_address = {cfg.ray_address!r} and cluster.address = {cfg.cluster.address!r} disagree; ray_address is "
            "the former name of cluster.address: set cluster.address only"
        )
    logging.getLogger("miles").warning(
        "ray_address is now cluster.address (--set cluster.address=%s); the old name still works", cfg.ray_address
    )
    cfg.cluster = dataclasses.replace(cfg.cluster, address=cfg.ray_address)
    cfg.ray_address = ""


# Why the Megatron trainer has no true_on_policy (README: the train/inference mismatch): said once, here.
MEGATRON_NOT_INVARIANT = (
    "trainer.backend = 'megatron' (Megatron-core's GPTModel computes the forward with its own modules: torch "
    "RMSNorm, Column/RowParallelLinear's own matmul, DotProductAttention, rotary from cos/sin it computes on the "
    "device, none of them row-invariant; and with tensor parallelism RowParallelLinear adds the ranks' partial "
    "sums in NCCL's all-reduce order, which no one-device engine reproduces): use trainer.backend=torch (FSDP2 "
    "shards the weights, not the sums)"
)


def check_true_on_policy(cfg: RunConfig) -> None:
    """true_on_policy needs both sides on miles' own kernels: the embedded engine (in process or behind `miles
    serve`), the torch trainer, no low-precision Linear recipe."""
    if not cfg.true_on_policy:
        return
    why = []
    if cfg.rollout.engine == "sglang":
        why.append("rollout.engine = 'sglang' (SGLang's kernels are not miles'): use rollout.engine=embedded or http")
    if cfg.trainer.backend == "megatron":
        why.append(MEGATRON_NOT_INVARIANT)
    if cfg.trainer.precision != "bf16":
        why.append(
            f"trainer.precision = {cfg.trainer.precision!r} (quantized Linear matmuls): use trainer.precision=bf16"
        )
    if why:
        raise ValueError("true_on_policy = true needs " + "; ".join(why))
