"""Peak bytes of the tensors a call allocates and holds at once, measured on CPU (where there is no allocator
peak counter) by a PyTorch dispatch mode that tracks the storages aten ops create. ``miles bench logprob`` and
notebook 03 compare log-prob implementations with it.

    extra = peak_extra_bytes(lambda: log_probs_and_entropy(logits, tokens))
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _LiveStorages(TorchDispatchMode):
    """Tracks bytes of tensor storages created by aten ops while active; ``peak`` is the max live sum."""

    def __init__(self):
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self.live: dict[int, tuple[object, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        inputs = {t.untyped_storage()._cdata for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            st = t.untyped_storage()
            if st._cdata not in inputs:  # a view of an input shares its storage: not a new allocation
                self.live.setdefault(st._cdata, (self._ref(st), st.nbytes()))
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes of tensors allocated by ``fn`` and alive at once (op granularity; kernel scratch not seen)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    with _LiveStorages() as rec:
        out = fn()
    del out
    return rec.peak
