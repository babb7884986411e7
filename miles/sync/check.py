"""check_weights: after any transport, the engine's weights must equal the trainer's, bit for bit."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from miles.sync.buckets import byte_view


class WeightMismatch(AssertionError):
    """Engine weights differ from the trainer's after a sync."""


def weights_differ(
    trainer: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], engine: Mapping[str, torch.Tensor]
) -> list[str]:
    """Names whose engine tensor is missing or differs in dtype, shape or any byte (NaNs compare by bits)."""
    items = trainer.items() if isinstance(trainer, Mapping) else trainer
    bad = []
    for name, t in items:
        e = engine.get(name)
        if e is None or e.dtype != t.dtype or e.shape != t.shape:
            bad.append(name)
        elif not torch.equal(byte_view(e.cpu()), byte_view(t.cpu())):
            bad.append(name)
    return bad


def check_weights(trainer, engine: Mapping[str, torch.Tensor], *, label: str = "engine") -> None:
    """Raise WeightMismatch naming the tensors that differ (bit-equal comparison)."""
    bad = weights_differ(trainer, engine)
    if bad:
        raise WeightMismatch(
            f"check_weights: {len(bad)} {label} tensors differ from the trainer's after sync, e.g. "
            f"{bad[:3]}; the transport lost or reordered bytes, or the engine applied a stale bucket"
        )
