"""The torch trainer backend: the decoder trained with GRPO/GSPO/PPO-clip on one rank or sharded with FSDP2.

A ``miles.protocols.trainer.TrainerBackend`` (train_step, sft_step, forward_logprobs, named_weights in HF names,
state_dict/load_state_dict, and offload/onload by tag through a TaggedMemory, clear_memory). Tags: ``params``,
``grads``, ``optimizer`` (``ref`` when KL is on). With LoRA (``model.lora.rank``): ``params`` are the adapters, the
frozen base is ``base`` (never moved by the handoff plan), and the KL reference is the base itself, adapters off
(miles.model.lora), with no ``ref`` copy. With ``model.lora.warmup = "base"`` the supervised warm-up fine-tunes the
base (adapters off, an optimizer of its own), ``end_warmup`` freezes it again, and the next sync sends it once
(``weights_to_sync``); checkpoints keep it from then on.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from collections.abc import Iterator

import torch

from miles.config import TrainerConfig
from miles.memory import MemoryLedger, TaggedMemory
from miles.model.config import ModelConfig
from miles.model.decoder import build_decoder
from miles.model.kernels import kernels_for
from miles.model.lora import adapters_disabled, is_adapter, split_synced
from miles.policy.kl import kl_estimate, kl_penalised_advantages
from miles.policy.logprob import log_probs_and_entropy
from miles.policy.loss import masked_mean, policy_loss
from miles.policy.objective import WEIGHTED_CORRECTIONS
from miles.policy.rollout_correction import correction_weights, first_mismatch, mismatch_metrics
from miles.policy.schedule import lr_at
from miles.samples import TrainBatch

TRAIN_TAGS = ("params", "grads", "optimizer", "quant_workspace")
log = logging.getLogger(__name__)


class NonFiniteTrainingError(RuntimeError):
    """A NaN or infinite gradient norm: the optimizer step was skipped, so the weights stay finite, and the run
    stops before anything is synced to the engines."""


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]


class TorchBackend:
    """One data-parallel rank of the policy.

    backend = TorchBackend(model_cfg, trainer_cfg, rank=0, world_size=1, temperature=1.0)
    metrics = backend.train_step(batch)           # one rollout batch: num_minibatches optimizer steps
    backend.offload()                             # params/optimizer to host, grads dropped
    backend.onload()
    for name, tensor in backend.named_weights():  # HF names, full tensors (collective under FSDP2)
        ...
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        cfg: TrainerConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        device="cpu",
        seed: int = 0,
        temperature: float = 1.0,
        ledger: MemoryLedger | None = None,
        offload_policy: str = "host",
        disk_dir: str | None = None,
        true_on_policy: bool = False,
    ):
        """``true_on_policy``: the forward (and the log-probs) by the invariant kernels the engine uses, so the
        trainer's log-prob of each sampled token equals the engine's bit for bit; the backward stays standard."""
        self.cfg, self.model_cfg = cfg, model_cfg
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.temperature = temperature
        torch.manual_seed(seed)
        self.model = build_decoder(model_cfg, seed=seed, device=self.device, kernels=kernels_for(true_on_policy))
        self.true_on_policy = true_on_policy
        self.logprob_impl = "invariant" if true_on_policy else None  # None: MILES_LOGPROB_IMPL / auto
        if cfg.precision != "bf16":
            from miles.quant import apply_precision

            apply_precision(self.model, cfg.precision)  # before the reference copy, so both are quantized alike
        self.lora = model_cfg.lora.enabled  # the base frozen, the adapters train (miles.model.lora)
        # the KL reference: a frozen copy of the initial model, or with LoRA the base itself (adapters_disabled)
        self.base_warmup = self.lora and model_cfg.lora.warmup == "base"
        self.base_trained = False  # the base is no longer the one the config builds (a base warm-up, or a checkpoint)
        self.base_unsent = False  # ... and the engines, built from the config, do not hold it yet
        self._adapter_optimizer = None  # set aside while the base warm-up's optimizer is self.optimizer
        copy_ref = cfg.kl_coef and not self.lora
        self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False) if copy_ref else None
        if world_size > 1:
            self._shard()
        self.optimizer = self._build_optimizer()
        self.ledger = ledger or MemoryLedger()
        from miles.optim import make_offloader

        # with trainer.optimizer_offload set, the offloader owns the optimizer state between steps (host or NVMe)
        self.optim_offloader = make_offloader(cfg, self.optimizer, None, rank, ledger=self.ledger)
        self.memory = TaggedMemory(f"trainer/{rank}", self.ledger, self.device, disk_dir=disk_dir)
        policy = "discard" if offload_policy == "none" else offload_policy
        self.offload_enabled = offload_policy != "none"
        trained, base = split_synced(self.model)  # (all, []) or (the adapters, the frozen base)
        self.memory.register("params", trained, policy=policy)
        if base:
            self.memory.register("base", base, policy=policy)  # in no plan step: resident for the run
        self.memory.register(
            "grads", lambda: [p.grad for p in self.model.parameters() if p.grad is not None], policy="discard"
        )
        if self.optim_offloader is None:
            self.memory.register("optimizer", lambda: optimizer_state_tensors(self.optimizer), policy=policy)
        if self.ref_model is not None:
            self.memory.register("ref", list(self.ref_model.parameters()), policy=policy)
        if cfg.precision != "bf16":
            from miles.quant import quantized_workspace_tensors

            self.memory.register("quant_workspace", lambda: quantized_workspace_tensors(self._models()), policy=policy)

    def _models(self) -> list:
        return [m for m in (self.model, self.ref_model) if m is not None]

    def _shard(self) -> None:
        from torch.distributed.fsdp import fully_shard

        for m in (self.model, self.ref_model):
            if m is None:
                continue
            for layer in m.model.layers:
                fully_shard(layer)
            fully_shard(m)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        from miles.optim import build_optimizer

        return build_optimizer(self.model.named_parameters(), self.cfg)

    # ---- math -----------------------------------------------------------------------------------------------
    def _token_log_probs(self, model, tokens_NL: torch.Tensor, with_entropy: bool = False):
        logits = model(tokens_NL[:, :-1])  # [N, L-1, V] in model dtype
        N, T, V = logits.shape
        lp, ent = log_probs_and_entropy(
            logits.reshape(N * T, V),
            tokens_NL[:, 1:].reshape(-1),
            temperature=self.temperature,
            chunk_size=self.cfg.logprob_chunk_size,
            with_entropy=with_entropy,
            entropy_requires_grad=with_entropy and self.cfg.entropy_coef > 0,
            impl=self.logprob_impl,
        )
        pad = lp.new_zeros(N, 1)
        lp = torch.cat([pad, lp.view(N, T)], 1)
        ent = torch.cat([pad, ent.view(N, T)], 1) if ent is not None else None
        return lp, ent

    @torch.no_grad()
    def forward_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Per-token log-probs [N, L] of the current policy (position t scores token t)."""
        return self._token_log_probs(self.model, batch.tokens.to(self.device))[0].cpu()

    def train_step(self, batch: TrainBatch, step: int | None = None) -> dict[str, float]:
        """One rollout batch: ``num_minibatches`` optimizer steps. ``step`` (the RL step) sets the LR schedule."""
        t0 = time.perf_counter()
        self.model.train()
        c = self.cfg
        metrics: dict[str, float] = {}
        if step is not None:
            metrics["lr"] = lr_at(
                step,
                c.lr,
                schedule=c.lr_schedule,
                warmup_steps=c.lr_warmup_steps,
                decay_steps=c.lr_decay_steps,
                min_ratio=c.lr_min_ratio,
            )
            self.set_lr(metrics["lr"])
        minibatches = batch.split(c.num_minibatches)
        # the policy's log-probs before this step's first optimizer step: the ratio's denominator, the mismatch
        # measure and the rollout correction's numerator. The first minibatch's training forward comes before any
        # optimizer step, so it gives them for that minibatch (None); the later ones are scored here, up front
        old = [None] + [self.forward_logprobs(mb) for mb in minibatches[1:]]
        seen = []
        where = f"RL step {step}" if step is not None else "a train step"
        for i, (mb, old_lp) in enumerate(zip(minibatches, old)):
            out, old_lp = self._minibatch_loss(mb, old_lp)
            out.loss.backward()
            seen.append(old_lp.cpu())
            metrics = _accumulate(metrics, out.metrics, len(minibatches))
            at = f"{where}, minibatch {i + 1} of {len(minibatches)}" if len(minibatches) > 1 else where
            metrics["grad_norm"] = self._optimizer_step(at, out.loss)
        self.last_log_probs = torch.cat(seen)  # [N, L] log-probs before the update (for dumps and dashboards)
        metrics |= mismatch_metrics(self.last_log_probs, batch.rollout_log_probs, batch.loss_mask)
        if self.true_on_policy and metrics["train_rollout_logprob_max_abs_diff"] != 0.0:
            _log_first_mismatch(where, self.last_log_probs, batch)
        metrics["train_time"] = time.perf_counter() - t0
        return metrics

    def _minibatch_loss(self, mb: TrainBatch, old_lp: torch.Tensor | None):
        """(LossOutput, old log-probs) of one minibatch under the configured objective."""
        c = self.cfg
        tokens, mask = mb.tokens.to(self.device), mb.loss_mask.to(self.device)
        lp, ent = self._token_log_probs(self.model, tokens, with_entropy=True)
        ref = self._reference_log_probs(tokens) if c.kl_coef else None
        old_lp = lp.detach() if old_lp is None else old_lp.to(self.device)
        advantages = mb.advantages.to(self.device)
        if ref is not None and c.kl_in == "reward":
            advantages = kl_penalised_advantages(advantages, kl_estimate(old_lp, ref, c.kl_estimator), mask, c.kl_coef)
        weights, mask, extra = correction_weights(
            old_lp, mb.rollout_log_probs.to(self.device), mask, c.rollout_correction, c.rollout_correction_cap
        )
        out = policy_loss(
            lp,
            old_lp,
            advantages,
            mask,
            kind=c.loss,
            eps_clip=c.eps_clip,
            eps_clip_high=c.eps_clip_high,
            dual_clip=c.dual_clip,
            loss_agg=c.loss_agg,
            norm_tokens=c.loss_norm_tokens,
            ref_log_probs=ref if c.kl_in == "loss" else None,
            kl_coef=c.kl_coef,
            kl_estimator=c.kl_estimator,
            entropy=ent,
            entropy_coef=c.entropy_coef,
            is_weights=weights if c.rollout_correction in WEIGHTED_CORRECTIONS else None,
        )
        out.metrics.update(extra)
        return out, old_lp

    @torch.no_grad()
    def _reference_log_probs(self, tokens_NL: torch.Tensor) -> torch.Tensor:
        """The KL reference's log-probs: the initial model's copy, or with LoRA the base (adapters off)."""
        if self.ref_model is not None:
            return self._token_log_probs(self.ref_model, tokens_NL)[0]
        with adapters_disabled(self.model):
            return self._token_log_probs(self.model, tokens_NL)[0]

    def sft_step(self, batch: TrainBatch) -> dict[str, float]:
        """One supervised step on the response tokens (cross-entropy), e.g. for a warm-up before RL. With
        ``model.lora.warmup = "base"`` (until ``end_warmup``) it fine-tunes the base, adapters off."""
        if self.base_warmup and not self.base_trained and self._adapter_optimizer is None:
            self._start_base_warmup()
        self.model.train()
        tokens, mask = batch.tokens.to(self.device), batch.loss_mask.to(self.device)
        base_only = adapters_disabled(self.model) if self._adapter_optimizer is not None else contextlib.nullcontext()
        with base_only:
            lp, _ = self._token_log_probs(self.model, tokens)
        loss = -masked_mean(lp, mask)
        loss.backward()
        return {"sft_loss": loss.item(), "grad_norm": self._optimizer_step("a supervised warm-up step", loss)}

    def _start_base_warmup(self) -> None:
        """The base trains (every weight but the adapters), under an optimizer of its own at the current lr."""
        lr = self.optimizer.param_groups[0]["lr"]
        for n, p in self.model.named_parameters():
            p.requires_grad_(not is_adapter(n))
        self._adapter_optimizer, self.optimizer = self.optimizer, self._build_optimizer()
        self.set_lr(lr)

    def end_warmup(self) -> None:
        """After a base warm-up: the base frozen again, its optimizer state dropped, the adapters' optimizer back
        (no step taken yet, so no state); the next ``weights_to_sync`` carries the base. Nothing to do otherwise."""
        if self._adapter_optimizer is None:
            return
        self.optimizer.zero_grad(set_to_none=True)
        for n, p in self.model.named_parameters():
            p.requires_grad_(is_adapter(n))
        self.optimizer, self._adapter_optimizer = self._adapter_optimizer, None
        self.base_trained = self.base_unsent = True

    def _optimizer_step(self, where: str, loss: torch.Tensor) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        norm_value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # the same on every rank
        if not math.isfinite(norm_value):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteTrainingError(
                f"{where}: grad_norm = {norm_value} (loss = {loss.item()}) is not finite; the optimizer step was "
                "skipped, the weights are those before it and nothing was synced to the engines. Check the rewards "
                "and advantages for NaN, or lower trainer.lr; the rerun resumes from the last checkpoint"
            )
        if self.optim_offloader is not None:
            self.optim_offloader.restore()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.optim_offloader is not None:
            self.optim_offloader.offload()
        return norm_value

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    # ---- weights ------------------------------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) pairs of what trains (every weight, or with LoRA the adapters: what a sync sends
        and a checkpoint keeps); read from the host backup when params are offloaded. Collective under FSDP2."""
        trained = self.trained_names()
        for name, p in self.model.named_parameters():
            if name not in trained:
                continue
            t = self.memory.backup_view("params", p) if self.memory.is_offloaded("params") else p.detach()
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            yield name, t

    def trained_names(self) -> set[str]:
        """What RL trains: every weight (a tied head once), or with LoRA the adapters (a base warm-up included)."""
        tied = self.model_cfg.tie_word_embeddings
        if self.lora:
            return {n for n, _ in self.model.named_parameters() if is_adapter(n)}
        return {n for n, p in self.model.named_parameters() if p.requires_grad and not (tied and n == "lm_head.weight")}

    def named_base(self) -> Iterator[tuple[str, torch.Tensor]]:
        """With LoRA: the frozen base's weights under HF names (a tied head once)."""
        tied = self.model_cfg.tie_word_embeddings
        for name, p in self.model.named_parameters():
            if not is_adapter(name) and not (tied and name == "lm_head.weight"):
                yield name, p.detach()

    def weights_to_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What the next sync sends: ``named_weights``, and once after a base warm-up (or a resume from one) the
        base as well; ``weights_synced`` records that the engines hold it."""
        yield from self.named_weights()
        if self.base_unsent:
            yield from self.named_base()

    def weights_synced(self) -> None:
        self.base_unsent = False

    def state_dict(self) -> dict:
        if self.optim_offloader is not None:
            self.optim_offloader.flush()  # msync file-backed state before a checkpoint reads it
        state = {
            "model": {k: v.cpu().clone() for k, v in self.named_weights()},
            "optimizer": self.optimizer.state_dict()
            if self.world_size == 1
            else _full_optim_state(self.model, self.optimizer),
        }
        if self.lora:  # the adapters are saved in PEFT's format, with its config (miles.model.peft_format)
            from miles.model.peft_format import adapter_config

            state["adapter_config"] = adapter_config(self.model_cfg)
        if self.base_trained:  # the base a warm-up trained: written as a HF checkpoint beside the adapter (base/)
            from dataclasses import replace

            from miles.model.lora_config import LoRAConfig

            state["base"] = {k: v.cpu().clone() for k, v in self.named_base()}
            state["base_config"] = replace(self.model_cfg, lora=LoRAConfig(), checkpoint="").to_hf()
        return state

    def load_state_dict(self, state: dict) -> None:
        own = dict(self.model.named_parameters())
        check_checkpoint_names(set(state["model"]), self.trained_names(), self.model_cfg)
        if self.lora:
            check_checkpoint_base(state.get("base"), {n for n, _ in self.named_base()}, self.model_cfg)
        with torch.no_grad():
            for name, t in (state.get("base") or {}).items():
                own[name].copy_(t)
        if state.get("base"):
            self.base_trained = self.base_unsent = True
        with torch.no_grad():
            for name, t in state["model"].items():
                p = own[name]
                if hasattr(p, "_local_tensor"):
                    from torch.distributed.tensor import distribute_tensor

                    p.copy_(distribute_tensor(t.to(self.device), p.device_mesh, p.placements))
                else:
                    p.copy_(t)
        if self.world_size == 1:
            from miles.optim.offload import own_loaded_state

            self.optimizer.load_state_dict(state["optimizer"])
            own_loaded_state(self.optimizer)  # torch.load's storages cannot be resized, so offload could not free them
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(
                self.model, self.optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True)
            )

    # ---- memory -------------------------------------------------------------------------------------------
    def offload(self, tags=TRAIN_TAGS, phase: str = "offload_train") -> int:
        if not self.offload_enabled:
            return 0
        self.optimizer.zero_grad(set_to_none=True)
        if self.cfg.clear_quantized_workspaces_on_offload:
            from miles.quant import clear_quantized_workspaces

            clear_quantized_workspaces(self._models())  # pure functions of the weights: rebuilt, not copied
        return self.memory.offload([t for t in tags if t in self.memory.tags], phase)

    def onload(self, tags=TRAIN_TAGS, phase: str = "onload_train") -> int:
        return self.memory.onload([t for t in tags if t in self.memory.tags], phase)

    def clear_memory(self) -> None:
        """Drop gradients and cached allocator blocks (nothing that needs a copy). No gc.collect(): tensors are
        freed by reference counting, and a full collection cost ~0.8 s per step on a 2-core machine."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _log_first_mismatch(where: str, trainer_log_probs: torch.Tensor, batch: TrainBatch) -> None:
    row, pos, ours, theirs = first_mismatch(trainer_log_probs, batch.rollout_log_probs, batch.loss_mask)
    log.warning(
        "true_on_policy: %s: the trainer's log-prob differs from the engine's; first at sample %d (row %d), token "
        "position %d: trainer %r, engine %r (a kernel outside miles.model.kernels, or weights not synced)",
        where, batch.sample_index[row], row, pos, ours, theirs,
    )  # fmt: skip


def check_checkpoint_names(saved: set[str], trained: set[str], model_cfg: ModelConfig) -> None:
    """A checkpoint of what this run trains (all weights, or LoRA adapters of the same targets), or a ValueError."""
    if saved == trained:
        return
    what = lambda names: "LoRA adapters" if names and all(is_adapter(n) for n in names) else "full weights"  # noqa: E731
    missing, extra = sorted(trained - saved), sorted(saved - trained)
    lora = model_cfg.lora
    run = f"LoRA rank {lora.rank} on {lora.target_modules}" if lora.enabled else "full fine-tuning"
    raise ValueError(
        f"the checkpoint holds {what(saved)} ({len(saved)} tensors) and this run ({run}) trains {what(trained)} "
        f"({len(trained)} tensors): {len(missing)} missing, e.g. {missing[:2]}; {len(extra)} unknown, e.g. "
        f"{extra[:2]}. Resume with the model.lora settings it was saved with, or start a new run_dir"
    )


def check_checkpoint_base(saved: dict | None, base: set[str], model_cfg: ModelConfig) -> None:
    """A LoRA checkpoint holds the base (base/) exactly when its run's warm-up trained it, or a ValueError."""
    warmup = model_cfg.lora.warmup
    if saved is None and warmup == "base":
        raise ValueError(
            "the checkpoint holds no base/ (its run's warm-up trained the adapters, model.lora.warmup=adapters) and "
            "this run has model.lora.warmup=base: resume with model.lora.warmup=adapters, or start a new run_dir"
        )
    if saved is not None and warmup != "base":
        raise ValueError(
            "the checkpoint holds the base its warm-up trained (base/, model.lora.warmup=base) and this run has "
            f"model.lora.warmup={warmup}: resume with model.lora.warmup=base, or start a new run_dir"
        )
    if saved is not None and set(saved) != base:
        missing, extra = sorted(base - set(saved)), sorted(set(saved) - base)
        raise ValueError(
            f"the checkpoint's base/ does not fit this model: {len(missing)} tensors missing, e.g. {missing[:2]}; "
            f"{len(extra)} unknown, e.g. {extra[:2]}. Resume with the model settings it was saved with"
        )


def _accumulate(acc: dict, new: dict, n: int) -> dict:
    for k, v in new.items():
        acc[k] = acc.get(k, 0.0) + v / n
    return acc


def _full_optim_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
