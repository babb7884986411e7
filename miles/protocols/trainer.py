"""The trainer side's surfaces, declared below its users.

``TrainerGroup``: what the plan executor and the driver call on all train ranks at once, one result per rank
(``miles.train.actor.TrainGroup`` over Ray actors; ``miles.colocated.LocalTrainer``, one rank in this process).
``TrainerBackend``: what one rank's model and optimizer offer (``miles.train.torch_backend.TorchBackend``, and
``MegatronBackend`` through it); its memory moves by tag through a ``TaggedMemory`` (``params``, ``grads``,
``optimizer``, ``ref``, ``quant_workspace``).

    if supports(group, TrainerGroup): ...   # miles.protocols.engine.supports: objects and Ray handles alike
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class TrainerGroup(Protocol):
    def build(self) -> list:
        """The plan's ``trainer.build`` step: each rank creates its model and optimizer."""
        ...

    def clear_memory(self) -> list:
        """Drop what each rank can rebuild (quantized workspaces, allocator caches)."""
        ...

    def offload(self, tags: Iterable[str]) -> list[int]:
        """Bytes each rank moved off the device."""
        ...

    def onload(self, tags: Iterable[str]) -> list[int]:
        """Bytes each rank moved back onto the device."""
        ...

    def update_weights(self, version: int | None) -> list[dict]:
        """Send the weights to the connected engines as ``version``; each rank's sync metrics."""
        ...


@runtime_checkable
class TrainerBackend(Protocol):
    def train_step(self, batch, step: int | None = None) -> dict[str, float]:
        """One RL step on this rank's TrainBatch; its metrics. ``last_log_probs`` then holds the log-probs."""
        ...

    def sft_step(self, batch) -> dict[str, float]:
        """One supervised step on reference answers."""
        ...

    def set_lr(self, lr: float) -> None: ...

    def forward_logprobs(self, batch) -> torch.Tensor:
        """The log-probs of the batch's tokens under the current weights (no update)."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What trains, by Hugging Face name (every weight, or the LoRA adapters)."""
        ...

    def weights_to_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What the next weight sync sends: ``named_weights``, plus a warmed-up LoRA base once."""
        ...

    def weights_synced(self) -> None:
        """The engines now hold what ``weights_to_sync`` gave."""
        ...

    def state_dict(self) -> dict:
        """``{"model": ..., "optimizer": ...}`` for a checkpoint (collective over the ranks)."""
        ...

    def load_state_dict(self, state: dict) -> None: ...

    def offload(self, tags: Iterable[str]) -> int:
        """Bytes moved off the device for these tags."""
        ...

    def onload(self, tags: Iterable[str]) -> int:
        """Bytes moved back onto the device for these tags."""
        ...

    def clear_memory(self) -> None: ...
