"""LoRA on the decoder's projections: ``y = x W^T + b + (alpha / rank) * (dropout(x) A^T) B^T``, the base frozen.

PEFT's LoRA, names included (``...q_proj.lora_A.weight`` [rank, in], ``...q_proj.lora_B.weight`` [out, rank]), so a
saved adapter loads with ``peft`` onto the Hugging Face base (miles.model.peft_format). Adapters are FP32 whatever
the base's dtype (PEFT's autocast_adapter_dtype): the delta is computed in FP32 and added to the base projection's
output, one rounding to its dtype. ``LoRALinear.adapt`` is that expression, for any matmul: the standard kernels
call it with ``F.linear``, the invariant ones (true_on_policy) with theirs, the trainer and the engine alike, so
both sides compute the same thing.

    model = build_decoder(cfg)                 # with cfg.lora.rank >= 1: adapters added, the base frozen
    [n for n, _ in adapter_parameters(model)]  # what trains, syncs and checkpoints
    with adapters_disabled(model): ...         # the base itself (the KL reference)
    merged_state_dict(model)                   # W + scale * B @ A under HF names (miles export --merged)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from miles.model.lora_config import ADAPTER_DTYPE, LoRAConfig, targets

ADAPTER_SEED_OFFSET = 0x10A  # the adapters' init stream, apart from the base's (same seed, same base either way)


class LoRALinear(nn.Module):
    """A projection with an adapter: the base's own ``weight`` / ``bias`` Parameters (frozen), ``lora_A`` and
    ``lora_B``. ``adapter_on`` False computes the base alone (bit for bit what the plain projection computes)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same Parameter objects, not copies
        device, dtype = base.weight.device, getattr(torch, ADAPTER_DTYPE)
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device, dtype=dtype)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.scale = alpha / rank
        self.adapter_on = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapt(x, F.linear(x, self.weight, self.bias), F.linear)

    def adapt(self, x: torch.Tensor, y: torch.Tensor, linear) -> torch.Tensor:
        """``y`` (the base projection of ``x``) plus the adapter's delta, computed with ``linear(x, W, bias)``."""
        if not self.adapter_on:
            return y
        a = self.lora_A.weight
        delta = linear(linear(self.lora_dropout(x.to(a.dtype)), a, None), self.lora_B.weight, None)
        return (y + delta * self.scale).to(y.dtype)

    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A in FP32 [out, in]: what merging adds to the base weight."""
        return (self.lora_B.weight.detach().float() @ self.lora_A.weight.detach().float()) * self.scale

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.lora_A.out_features}, scale={self.scale:g}"


def add_adapters(model: nn.Module, cfg: LoRAConfig, *, seed: int) -> None:
    """Put adapters on the projections ``cfg`` targets (model.config.lora) and freeze everything else. A is
    PEFT's init (uniform in +-1/sqrt(in), kaiming_uniform with a=sqrt(5)), B zeros: the model starts as the base.
    Drawn on the CPU from ``seed``, so every process and device gets the same adapters."""
    g = torch.Generator().manual_seed(seed + ADAPTER_SEED_OFFSET)
    for p in model.parameters():
        p.requires_grad_(False)
    for name, _, _ in targets(model.config):
        parent, leaf = name.rsplit(".", 1)
        m = LoRALinear(model.get_submodule(name), cfg.rank, cfg.alpha, cfg.dropout)
        bound = 1 / math.sqrt(m.in_features)
        with torch.no_grad():
            m.lora_A.weight.copy_(
                torch.rand(m.lora_A.weight.shape, generator=g, dtype=torch.float32) * 2 * bound - bound
            )
            m.lora_B.weight.zero_()
        setattr(model.get_submodule(parent), leaf, m)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    return ((n, p) for n, p in model.named_parameters() if is_adapter(n))


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    return ((n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The base model, exactly: every adapter skipped inside the block (the KL reference, at no memory cost)."""
    modules = [m for _, m in lora_modules(model)]
    was = [m.adapter_on for m in modules]
    for m in modules:
        m.adapter_on = False
    try:
        yield model
    finally:
        for m, on in zip(modules, was):
            m.adapter_on = on


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names with every adapter merged, ``W + scale * B @ A`` in FP32
    rounded once to the base's dtype (a tied head left out, as HF checkpoints do)."""
    delta = {f"{n}.weight": m.delta_weight() for n, m in lora_modules(model)}
    out = {}
    for name, t in model.hf_state_dict().items():
        if is_adapter(name):
            continue
        out[name] = (t.float() + delta[name]).to(t.dtype) if name in delta else t.detach()
    return out


def split_synced(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the parameters a weight sync writes, the frozen base it never touches): (all, []) without adapters, (the
    adapters, the rest) with them. Split by name, so an engine whose parameters are all frozen splits the same."""
    named = list(model.named_parameters())
    if not any(is_adapter(n) for n, _ in named):
        return [p for _, p in named], []
    return [p for n, p in named if is_adapter(n)], [p for n, p in named if not is_adapter(n)]
