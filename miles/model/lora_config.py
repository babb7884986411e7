"""``model.lora``: which projections of the decoder get low-rank adapters, at what rank, and the checks that refuse
an adapter that cannot work (a rank above a projection's size, a target that matches nothing) before any tensor
exists. Torch-free, so a config resolves without importing torch; the modules themselves are miles.model.lora.

    LoRAConfig(rank=4)                                   # all seven projections of every layer (all-linear)
    LoRAConfig(rank=16, target_modules=("q_proj", "v_proj"))
    LoRAConfig(rank=8, target_modules=(r"model\\.layers\\.[0-3]\\..*",))   # a regex over module names
    targets(model_cfg)   # [("model.layers.0.self_attn.q_proj", in_features, out_features), ...]
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from miles.config_check import check, did_you_mean

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer but the output head
WARMUPS = ("adapters", "base")  # model.lora.warmup
ADAPTER_DTYPE = "float32"  # adapters train and sync in FP32 whatever the base's dtype (PEFT's autocast_adapter_dtype)


@dataclass(kw_only=True, slots=True)
class LoRAConfig:
    rank: int = 0  # 0 = off (full fine-tuning); from 1: only low-rank adapters train, sync and checkpoint
    alpha: float = 32.0  # the adapter's output is scaled by alpha / rank (fixed alpha: LoRA Without Regret's 1/r)
    dropout: float = 0.0  # dropout on the adapter's input while training (the engine never drops)
    # projections that get adapters: names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), regexes
    # matched against whole module names (model.layers.0.self_attn.q_proj), or all-linear (all seven)
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    # what the supervised warm-up (trainer.warmup_sft_steps) trains: "adapters" (what RL trains), or "base": every
    # weight of the base, full fine-tuning with the adapters off, then the base is frozen and RL trains adapters on
    # it. A random-init base needs "base": its frozen random embeddings and head leave the adapters unable to learn
    # the answer format (the quickstart's warm-up loss stays above 3.2 after 100 steps at any rank; 0.95 with them
    # trained). The engines receive the warmed-up base once, then adapters only; checkpoints keep it (base/)
    warmup: str = "adapters"

    def __post_init__(self):
        check("model.lora.rank", self.rank, ge=0, fix="0 = full fine-tuning, or a LoRA rank from 1")
        check("model.lora.alpha", self.alpha, gt=0, fix="the adapter's scale is alpha / rank, e.g. 32")
        check("model.lora.dropout", self.dropout, ge=0, lt=1, fix="0 = none, e.g. 0.05")
        if not self.target_modules or not all(isinstance(t, str) and t.strip() for t in self.target_modules):
            raise ValueError(
                f"model.lora.target_modules = {self.target_modules!r} needs at least one non-empty name; "
                f"use {ALL_LINEAR} or projection names such as q_proj,v_proj"
            )
        if self.warmup not in WARMUPS:
            raise ValueError(
                f"model.lora.warmup = {self.warmup!r}{did_you_mean(self.warmup, WARMUPS)}: use adapters (the warm-up "
                "trains what RL trains) or base (the warm-up fine-tunes the base, which RL's adapters then start from)"
            )
        if not self.rank and self._changed():
            raise ValueError(
                f"model.lora is set ({self._changed()}) but model.lora.rank = 0 (off): set model.lora.rank to 1 or "
                "more to train adapters, or leave model.lora at its defaults for full fine-tuning"
            )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def _changed(self) -> str:
        """The fields set away from their defaults ("" when none is)."""
        defaults = {"alpha": 32.0, "dropout": 0.0, "target_modules": (ALL_LINEAR,), "warmup": "adapters"}
        return ", ".join(f"{k}={getattr(self, k)!r}" for k, v in defaults.items() if getattr(self, k) != v)


def projections(model_cfg) -> list[tuple[str, int, int]]:
    """Every projection of the decoder: (module name, in_features, out_features), layer by layer."""
    h, i, d = model_cfg.hidden_size, model_cfg.intermediate_size, model_cfg.head_dim
    q, kv = model_cfg.num_attention_heads * d, model_cfg.num_key_value_heads * d
    shapes = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }
    out = []
    for layer in range(model_cfg.num_hidden_layers):
        for name in PROJECTIONS:
            block = "self_attn" if name in PROJECTIONS[:4] else "mlp"
            out.append((f"model.layers.{layer}.{block}.{name}", *shapes[name]))
    return out


def _matches(pattern: str, module: str) -> bool:
    if pattern == ALL_LINEAR:
        return True
    if pattern in PROJECTIONS:
        return module.endswith("." + pattern)
    return re.fullmatch(pattern, module) is not None


def targets(model_cfg) -> list[tuple[str, int, int]]:
    """The projections ``model_cfg.lora`` puts adapters on; ValueError naming a target that matches none, or a rank
    larger than a targeted projection (its update would have more directions than the matrix has)."""
    lora = model_cfg.lora
    every = projections(model_cfg)
    for pattern in lora.target_modules:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(
                f"model.lora.target_modules entry {pattern!r} is not a valid regex ({e}); use a projection name "
                f"({', '.join(PROJECTIONS)}) or {ALL_LINEAR}"
            ) from None
        if not any(_matches(pattern, name) for name, _, _ in every):
            raise ValueError(
                f"model.lora.target_modules entry {pattern!r} matches no projection of the decoder"
                f"{did_you_mean(pattern, PROJECTIONS + (ALL_LINEAR,))} (use {ALL_LINEAR}, names from "
                f"{', '.join(PROJECTIONS)}, or a regex over whole module names such as {every[0][0]!r})"
            )
    chosen = [p for p in every if any(_matches(t, p[0]) for t in lora.target_modules)]
    too_small = [(n, i, o) for n, i, o in chosen if lora.rank > min(i, o)]
    if too_small:
        name, i, o = min(too_small, key=lambda p: min(p[1], p[2]))
        raise ValueError(
            f"model.lora.rank = {lora.rank} is larger than {name} ({i} in, {o} out): a rank above min(in, out) = "
            f"{min(i, o)} adds parameters but no directions; use model.lora.rank <= "
            f"{min(min(i, o) for _, i, o in chosen)} or leave that projection out of model.lora.target_modules"
        )
    return chosen


def adapter_numel(model_cfg) -> int:
    """Parameters of the adapters: rank x (in + out) per targeted projection."""
    if not model_cfg.lora.enabled:
        return 0
    return sum(model_cfg.lora.rank * (i + o) for _, i, o in targets(model_cfg))


def check_run(cfg) -> None:
    """What LoRA cannot run with (a RunConfig), refused with the fix."""
    lora = cfg.model.lora
    if not lora.enabled:
        return
    why = []
    if cfg.trainer.backend == "megatron":
        why.append("trainer.backend = 'megatron' (its layers have no adapters here): use trainer.backend=torch")
    if cfg.trainer.precision != "bf16":
        why.append(
            f"trainer.precision = {cfg.trainer.precision!r} (quantized Linear layers replace the adapted "
            "projections): use trainer.precision=bf16"
        )
    if cfg.rollout.engine == "sglang":
        why.append(
            "rollout.engine = 'sglang' (its servers take no adapter-only updates from miles): use "
            "rollout.engine=embedded or http"
        )
    if cfg.true_on_policy and lora.dropout:
        why.append(
            f"model.lora.dropout = {lora.dropout} with true_on_policy (dropout makes the trainer's forward differ "
            "from the engine's): use model.lora.dropout=0"
        )
    if why:
        raise ValueError(f"model.lora.rank = {lora.rank} (LoRA) needs " + "; ".join(why))
    if lora.warmup == "base":
        check_base_warmup(cfg)


def check_base_warmup(cfg) -> None:
    """What ``model.lora.warmup = "base"`` cannot run with, refused with the fix."""
    why = []
    if not cfg.trainer.warmup_sft_steps:
        why.append(
            "trainer.warmup_sft_steps >= 1 (no warm-up step would train the base): set it, or use "
            "model.lora.warmup=adapters"
        )
    if cfg.trainer.world_size != 1:
        why.append(
            f"trainer.world_size = 1 (it is {cfg.trainer.world_size}; the base's warm-up is not sharded here): "
            "fine-tune the base in its own full fine-tuning run and start LoRA from it with model.checkpoint"
        )
    if cfg.trainer.optimizer_offload != "none":
        why.append(
            f"trainer.optimizer_offload = 'none' (it is {cfg.trainer.optimizer_offload!r}; the warm-up's optimizer is "
            "replaced by the adapters' after it): use trainer.optimizer_offload=none"
        )
    if cfg.sync.transport == "disk-delta":
        why.append(
            "sync.transport other than 'disk-delta' (a base that changes after the engines are built is not "
            "supported by its delta chain yet): use sync.transport=tensor, broadcast or rdt"
        )
    if why:
        raise ValueError("model.lora.warmup = 'base' needs " + "; ".join(why))
