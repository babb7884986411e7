"""The optimizer and its state offloader, built from a TrainerConfig: the two calls the trainer backend makes.

``trainer.optimizer = "muon"`` puts hidden 2-D matrices under torch.optim.Muon and every other parameter (1-D
norms and biases, and, when names are given, embeddings and the output head) under torch.optim.AdamW, both with
``trainer.lr`` and ``trainer.weight_decay`` (Muon scales its update to AdamW's RMS, so one LR fits both).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from miles.config import TrainerConfig
from miles.memory.ledger import MemoryLedger
from miles.optim.disk_offload import DiskOptimizerStateOffloader
from miles.optim.muon import MuonWithAdamW
from miles.optim.offload import ChunkedOptimizerStateOffloader

ADAMW_BY_NAME = ("embed", "lm_head")  # 2-D, but Muon is not meant for them


def build_optimizer(params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]], cfg: TrainerConfig):
    """torch.optim.AdamW, or MuonWithAdamW for ``optimizer = "muon"``; pass ``model.named_parameters()`` so
    embeddings and the head go to AdamW (with bare tensors every 2-D parameter goes to Muon)."""
    named = [(item if isinstance(item, tuple) else ("", item)) for item in params]
    named = [(n, p) for n, p in named if p.requires_grad]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW([p for _, p in named], lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas)
    is_matrix = [p.ndim == 2 and not any(k in n for k in ADAMW_BY_NAME) for n, p in named]
    return MuonWithAdamW(
        [p for (_, p), m in zip(named, is_matrix) if m],
        [p for (_, p), m in zip(named, is_matrix) if not m],
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        betas=cfg.betas,
    )


def make_offloader(
    cfg: TrainerConfig,
    optimizer,
    master_params: list[torch.Tensor] | None,
    rank: int,
    *,
    ledger: MemoryLedger | None = None,
    owner: str | None = None,
) -> ChunkedOptimizerStateOffloader | None:
    """The offloader for ``trainer.optimizer_offload`` (None for "none"). Call order in the trainer:

    offloader = make_offloader(cfg, optimizer, master_params=None, rank=rank, ledger=ledger)
    each step:  backward -> offloader.restore() -> optimizer.step() -> zero_grad -> offloader.offload()
    checkpoint: offloader.flush(); save(optimizer.state_dict())   # state_dict() restores first
    resume:     optimizer.load_state_dict(sd)                     # works offloaded or not

    When an offloader exists, do not register the "optimizer" tag with TaggedMemory: its bytes are owned here.
    """
    if cfg.optimizer_offload == "none":
        return None
    common = dict(
        chunk_bytes=cfg.optimizer_offload_chunk_bytes,
        master_params=master_params,
        ledger=ledger,
        owner=owner or f"trainer/{rank}",
    )
    if cfg.optimizer_offload == "host":
        return ChunkedOptimizerStateOffloader(optimizer, **common)
    return DiskOptimizerStateOffloader(optimizer, directory=cfg.optimizer_offload_dir, rank=rank, **common)
