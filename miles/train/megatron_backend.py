"""The Megatron-core trainer backend (GPU): the same policy, loss and contracts as TorchBackend, with
Megatron's GPTModel (local layer spec, no Transformer Engine), bf16 through ``Float16Module`` and Megatron's
mixed-precision optimizer (FP32 master weights; the distributed optimizer when world size > 1).

Policy forwards (scoring and loss) pass ``fp32_output=False`` (miles.policy.precision), so the [T, V] logits
stay bf16 and go straight into ``miles.policy.logprob.log_probs_and_entropy``; no FP32 copy of all logits
exists. miles trains no value head (GRPO/GSPO/PPO-clip with group advantages); a critic forward would keep
Megatron's default ``fp32_output=True``, since its scalar outputs are tiny. Weights enter and leave in Hugging Face names through miles.train.megatron_convert. The loss code is
TorchBackend's own (this class inherits train_step / sft_step and overrides the model-specific pieces), so
both backends optimise the same objective.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from miles.config import MEGATRON_NOT_INVARIANT, TrainerConfig
from miles.memory import MemoryLedger, TaggedMemory
from miles.model.config import ModelConfig
from miles.model.decoder import DTYPES, build_decoder
from miles.policy.logprob import log_probs_and_entropy
from miles.policy.precision import megatron_policy_forward_kwargs
from miles.train.megatron_convert import hf_to_megatron, megatron_to_hf
from miles.train.torch_backend import TRAIN_TAGS, NonFiniteTrainingError, TorchBackend

INSTALL_HINT = "the megatron backend needs megatron-core: pip install 'miles[gpu]'"


def import_megatron():
    """The megatron.core modules this backend uses; a clear ImportError with the install hint when missing."""
    try:
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return dict(
        parallel_state=parallel_state,
        tensor_parallel=tensor_parallel,
        DDP=DistributedDataParallel,
        DDPConfig=DistributedDataParallelConfig,
        GPTModel=GPTModel,
        local_spec=get_gpt_layer_local_spec,
        OptimizerConfig=OptimizerConfig,
        get_optimizer=get_megatron_optimizer,
        Float16Module=Float16Module,
        TransformerConfig=TransformerConfig,
    )


def transformer_config(mc: dict, cfg: ModelConfig):
    """Megatron's TransformerConfig for an HF Llama/Qwen2 config: RMSNorm, SwiGLU, RoPE, GQA, bf16, no dropout,
    no fusions that need Apex or Transformer Engine."""
    return mc["TransformerConfig"](
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.attention_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        perform_initialization=False,
        use_cpu_initialization=False,
        attention_softmax_in_fp32=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
    )


class SdpaCoreAttention(torch.nn.Module):
    """Core attention for Megatron's local spec through ``torch.nn.functional.scaled_dot_product_attention``
    (flash / memory-efficient kernels), instead of the local spec's unfused baddbmm + softmax that materialises
    [b * heads, s, s] scores. Causal self-attention only; q/k/v come as [s, b, heads, head_dim]."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
        **unused,
    ):
        super().__init__()
        self.config, self.softmax_scale = config, softmax_scale

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **unused,
    ):
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise ValueError(
                "SdpaCoreAttention supports causal attention without masks, biases or packed sequences; "
                "use trainer.megatron_attention=local"
            )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1]
        )
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def layer_spec(mc: dict, attention: str):
    """Megatron's local layer spec (no Transformer Engine), with SDPA core attention when ``attention == 'sdpa'``."""
    spec = mc["local_spec"](normalization="RMSNorm")
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
    return spec


def build_gpt(mc: dict, tcfg, cfg: ModelConfig, device: torch.device, attention: str = "local"):
    """A GPTModel (local spec) with the HF config's shapes, on ``device``; weights are loaded afterwards.

    The local spec's torch RMSNorm is created on the CPU whatever the config says, hence the final ``.to``."""
    return mc["GPTModel"](
        tcfg,
        layer_spec(mc, attention),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(cfg.rope_theta),
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
    ).to(device)


def init_parallel_state(mc: dict, world_size: int, seed: int) -> None:
    """Megatron's process groups (TP = PP = 1, data parallel over all ranks) and its CUDA RNG tracker.

    A single-GPU run has no process group yet: one is created for world size 1 (NCCL over a free local port)."""
    if not dist.is_initialized():
        if world_size != 1:
            raise RuntimeError(
                f"world_size = {world_size} but torch.distributed is not initialised; the TrainActor "
                "initialises it before building the backend"
            )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ps = mc["parallel_state"]
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    mc["tensor_parallel"].model_parallel_cuda_manual_seed(seed)


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """FP32 master weights and Adam moments of a Megatron (possibly chained) mixed-precision optimizer."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in getattr(opt, "fp32_from_float16_groups", []) + getattr(opt, "shard_fp32_from_float16_groups", []):
            out += [p for p in group if p is not None]
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            out += [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    return out


class MegatronBackend(TorchBackend):
    """One data-parallel rank of the policy, trained with Megatron-core (GPU only).

    backend = MegatronBackend(model_cfg, trainer_cfg, rank=0, world_size=1, device="cuda", temperature=1.0)
    metrics = backend.train_step(batch)           # GRPO/GSPO/PPO-clip, same loss code as TorchBackend
    backend.offload()                             # bf16 params + FP32 master/Adam state to host, grads dropped
    backend.onload()
    for name, tensor in backend.named_weights():  # HF names, full tensors in model_cfg.dtype
        ...
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        cfg: TrainerConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        device="cuda",
        seed: int = 0,
        temperature: float = 1.0,
        ledger: MemoryLedger | None = None,
        offload_policy: str = "host",
        disk_dir: str | None = None,
        distributed_optimizer: bool | None = None,
        true_on_policy: bool = False,
    ):
        """``distributed_optimizer``: shard FP32 masters and Adam state over the data-parallel ranks; default: when
        world_size > 1 (with one rank it is Megatron's distributed-optimizer code path over a group of one).
        ``true_on_policy`` is refused: GPTModel's forward runs Megatron's own modules (see RunConfig's check)."""
        if true_on_policy:
            raise ValueError(f"true_on_policy = true needs {MEGATRON_NOT_INVARIANT}")
        mc = import_megatron()
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(
                f"the megatron backend runs on CUDA only (device={device}); use trainer.backend=torch on CPU"
            )
        if cfg.precision != "bf16" or cfg.optimizer != "adamw" or cfg.optimizer_offload != "none":
            raise ValueError(
                f"the megatron backend supports precision=bf16, optimizer=adamw, optimizer_offload=none "
                f"(got {cfg.precision}, {cfg.optimizer}, {cfg.optimizer_offload}); use trainer.backend=torch"
            )
        self.cfg, self.model_cfg = cfg, model_cfg
        self.rank, self.world_size, self.temperature = rank, world_size, temperature
        torch.manual_seed(seed)
        init_parallel_state(mc, world_size, seed)
        self.tcfg = transformer_config(mc, model_cfg)
        hf = build_decoder(model_cfg, seed=seed, device=self.device).hf_state_dict()  # same weights as TorchBackend
        policy = self._load(
            mc["Float16Module"](self.tcfg, build_gpt(mc, self.tcfg, model_cfg, self.device, cfg.megatron_attention)), hf
        )
        self.ref_model = (
            self._load(
                mc["Float16Module"](
                    self.tcfg, build_gpt(mc, self.tcfg, model_cfg, self.device, cfg.megatron_attention)
                ),
                hf,
            )
            .eval()
            .requires_grad_(False)
            if cfg.kl_coef
            else None
        )
        del hf
        dist_opt = world_size > 1 if distributed_optimizer is None else distributed_optimizer
        ddp_cfg = mc["DDPConfig"](
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=dist_opt
        )
        self.model = mc["DDP"](self.tcfg, ddp_cfg, policy)
        self.optimizer = mc["get_optimizer"](
            mc["OptimizerConfig"](
                optimizer="adam",
                lr=cfg.lr,
                weight_decay=cfg.weight_decay,
                adam_beta1=cfg.betas[0],
                adam_beta2=cfg.betas[1],
                clip_grad=cfg.max_grad_norm,
                bf16=True,
                params_dtype=torch.bfloat16,
                use_distributed_optimizer=dist_opt,
            ),
            [self.model],
        )
        self._zero_grads()
        self.ledger = ledger or MemoryLedger()
        self.memory = TaggedMemory(f"trainer/{rank}", self.ledger, self.device, disk_dir=disk_dir)
        mode = "discard" if offload_policy == "none" else offload_policy
        self.offload_enabled = offload_policy != "none"
        self.memory.register("params", list(self.model.parameters()), policy=mode)
        self.memory.register("grads", lambda: [b.grad_data for b in self.model.buffers], policy="discard")
        self.memory.register("optimizer", lambda: optimizer_tensors(self.optimizer), policy=mode)
        if self.ref_model is not None:
            self.memory.register("ref", list(self.ref_model.parameters()), policy=mode)

    def _load(self, module: torch.nn.Module, hf: dict[str, torch.Tensor]) -> torch.nn.Module:
        mcore = hf_to_megatron(hf, self.model_cfg)
        params = dict(module.module.named_parameters())
        missing = set(params) ^ set(mcore)
        if missing:
            raise KeyError(f"Megatron and converted HF parameter names differ: {sorted(missing)[:8]}")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(mcore[name])
        return module

    def _models(self) -> list:
        return [m for m in (self.model, self.ref_model) if m is not None]

    # ---- math -----------------------------------------------------------------------------------------------
    def _token_log_probs(self, model, tokens_NL: torch.Tensor, with_entropy: bool = False):
        inp = tokens_NL[:, :-1]
        N, T = inp.shape
        position_ids = torch.arange(T, device=inp.device).expand(N, T)
        logits = model(inp, position_ids, None, **megatron_policy_forward_kwargs(model))  # [N, T, V] bf16
        V = logits.shape[-1]
        lp, ent = log_probs_and_entropy(
            logits.reshape(N * T, V),
            tokens_NL[:, 1:].reshape(-1),
            temperature=self.temperature,
            chunk_size=self.cfg.logprob_chunk_size,
            with_entropy=with_entropy,
            entropy_requires_grad=with_entropy and self.cfg.entropy_coef > 0,
        )
        pad = lp.new_zeros(N, 1)
        lp = torch.cat([pad, lp.view(N, T)], 1)
        ent = torch.cat([pad, ent.view(N, T)], 1) if ent is not None else None
        return lp, ent

    def _optimizer_step(self, where: str, loss: torch.Tensor) -> float:
        self.model.finish_grad_sync()  # all-reduce (or reduce-scatter) of the FP32 grad buffers across DP ranks
        ok, grad_norm, _ = self.optimizer.step()  # clips to cfg.max_grad_norm, updates FP32 masters, copies to bf16
        self._zero_grads()
        # Megatron skips a step with non-finite gradients only under an fp16 grad scaler; with bf16 it steps, so a
        # NaN norm here means NaN weights: stop before the driver syncs them to the engines or checkpoints them
        if not ok or (grad_norm is not None and not math.isfinite(grad_norm)):
            raise NonFiniteTrainingError(
                f"{where}: grad_norm = {grad_norm} (loss = {loss.item()}) is not finite "
                f"({'Megatron skipped the step' if not ok else 'the trainer weights are no longer finite'}); "
                "nothing was synced to the engines. Check the rewards and advantages for NaN, or lower trainer.lr; "
                "the rerun resumes from the last checkpoint"
            )
        return float(grad_norm)

    def _zero_grads(self) -> None:
        if not (hasattr(self, "memory") and self.memory.is_offloaded("grads")):  # a paused buffer has no bytes to zero
            self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    # ---- weights ------------------------------------------------------------------------------------------
    def _megatron_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        paused = self.memory.is_offloaded("params")
        for name, p in self.model.module.module.named_parameters():
            yield name, (self.memory.backup_view("params", p) if paused else p.detach())

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor in model_cfg.dtype); read from the host backup when params are offloaded."""
        dtype = DTYPES[self.model_cfg.dtype]
        for name, t in megatron_to_hf(self._megatron_weights(), self.model_cfg):
            yield name, t.to(dtype).contiguous()

    def weights_to_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.named_weights()  # no LoRA here (refused by the config): every sync sends every weight

    def state_dict(self) -> dict:
        return {
            "model": {k: v.cpu().clone() for k, v in self.named_weights()},
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self._load(self.model.module, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def clear_memory(self) -> None:
        self._zero_grads()
        torch.cuda.empty_cache()

    def offload(self, tags=TRAIN_TAGS, phase: str = "offload_train") -> int:
        if not self.offload_enabled:
            return 0
        self._zero_grads()
        return self.memory.offload([t for t in tags if t in self.memory.tags], phase)

    def onload(self, tags=TRAIN_TAGS, phase: str = "onload_train") -> int:
        moved = self.memory.onload([t for t in tags if t in self.memory.tags], phase)
        self._zero_grads()  # the grad buffer comes back with undefined bytes (discard policy); backward accumulates into it
        return moved
