"""Transformer Engine's cached quantized weights, read and dropped through TE's documented attributes.

A TE module (``transformer_engine.pytorch.Linear``, ``GroupedLinear``, ``LayerNormLinear``, ...) keeps its
quantized weights in ``module._fp8_workspaces: dict[str, QuantizedTensor]``; TE rebuilds an entry on the next
forward when it is missing. It caches only when the forward is given ``is_first_microbatch`` (Megatron
passes it), and nothing in TE clears the cache, so it lives until the process exits. The quantized tensors
are wrapper subclasses whose bytes live in inner tensors: ``_data`` / ``_transpose`` / ``_scale_inv``
(Float8Tensor), ``_rowwise_data`` / ``_columnwise_data`` / ``_rowwise_scale_inv`` / ``_columnwise_scale_inv``
(MXFP8, blockwise FP8, NVFP4) and ``_amax_rowwise`` / ``_amax_columnwise`` (NVFP4). TE cannot be installed
on the CPU machines, so this module never imports it; it reads those attributes by name (a gpu-marked test
exercises a real TE Linear where TE is installed).
"""

from __future__ import annotations

import torch
from torch import nn

WORKSPACE_ATTR = "_fp8_workspaces"
INNER_TENSOR_ATTRS = (
    "_data",
    "_transpose",
    "_scale_inv",
    "_rowwise_data",
    "_columnwise_data",
    "_rowwise_scale_inv",
    "_columnwise_scale_inv",
    "_amax_rowwise",
    "_amax_columnwise",
)


def _inner_tensors(value: object) -> list[torch.Tensor]:
    if type(value) is torch.Tensor:  # a plain tensor cached by an older TE
        return [value]
    return [t for a in INNER_TENSOR_ATTRS if isinstance(t := getattr(value, a, None), torch.Tensor)]


def workspace_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The inner tensors of every cached quantized weight of one TE module ([] for any other module)."""
    cache = getattr(module, WORKSPACE_ATTR, None)
    if not isinstance(cache, dict):
        return []
    return [t for v in cache.values() for t in _inner_tensors(v)]


def clear_workspaces(module: nn.Module) -> int:
    """Empty the module's cache; returns the bytes of the distinct storages it held."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in workspace_tensors(module)}
    getattr(module, WORKSPACE_ATTR).clear()
    return sum(storages.values())
