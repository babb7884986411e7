"""Quantized weight workspaces: the cached low-precision copies of each weight, and dropping them before an
offload.

With high-precision master weights, every quantized Linear keeps a quantized copy of its weight (rowwise for
the forward, columnwise for the backward) so it does not requantize on every call. The copies are a pure
function of the weight, so an offload should not copy them to host and back: ``clear_quantized_workspaces``
drops them and the next forward rebuilds them on a miss. Under captured CUDA graphs it must not (a graph
replays with the workspace addresses baked in), and it says so in one log line instead of failing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from miles.quant import te_adapter
from miles.quant.layout import QuantizedTensor
from miles.quant.recipe import check_recipe, quantize_weight

log = logging.getLogger("miles.quant")


class WeightWorkspace:
    """The quantized copies of one module's weights, keyed by (weight name, usage), rebuilt on a miss.

    A copy is valid while its weight's version counter and address are unchanged (an optimizer step bumps
    the counter; writes through ``.data`` do not, so call ``clear()`` after those).

    ws = WeightWorkspace("mxfp8")
    q = ws.get("weight", module.weight, "rowwise")   # a miss: quantizes and caches
    q = ws.get("weight", module.weight, "rowwise")   # a hit while the weight is unchanged
    ws.clear()                                       # drops every copy (returns the bytes); next get() rebuilds
    """

    def __init__(self, recipe: str):
        self.recipe = check_recipe(recipe)
        self.entries: dict[tuple[str, str], tuple[tuple[int, int], QuantizedTensor]] = {}
        self.num_builds = 0

    def get(self, key: str, weight: torch.Tensor, usage: str) -> QuantizedTensor:
        stamp = (weight._version, weight.data_ptr())
        hit = self.entries.get((key, usage))
        if hit is not None and hit[0] == stamp:
            return hit[1]
        q = quantize_weight(weight, self.recipe, key, usage)
        self.entries[(key, usage)] = (stamp, q)
        self.num_builds += 1
        return q

    def tensors(self) -> list[torch.Tensor]:
        return [t for _, q in self.entries.values() for t in q.tensors()]

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes for _, q in self.entries.values())

    def clear(self) -> int:
        freed = self.nbytes
        self.entries.clear()
        return freed


@dataclass(frozen=True, slots=True)
class ClearReport:
    cleared_modules: int
    bytes_freed: int
    skipped_reason: str | None = None


def _modules(model: nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    """Every submodule of a model or of a list of model chunks (pipeline stages)."""
    roots = [model] if isinstance(model, nn.Module) else list(model or [])
    seen: dict[int, nn.Module] = {}
    for root in roots:
        if isinstance(root, nn.Module):
            seen.update((id(m), m) for m in root.modules())
    return list(seen.values())


def workspaces(model: nn.Module | Iterable[nn.Module]) -> list[WeightWorkspace]:
    return [ws for m in _modules(model) if isinstance(ws := getattr(m, "quant_workspace", None), WeightWorkspace)]


def quantized_workspace_tensors(model: nn.Module | Iterable[nn.Module]) -> list[torch.Tensor]:
    """The tensors a TaggedMemory tag "quant_workspace" should hold (ours and Transformer Engine's)."""
    mods = _modules(model)
    ours = [t for ws in workspaces(mods) for t in ws.tensors()]
    return ours + [t for m in mods for t in te_adapter.workspace_tensors(m)]


def _graph_capture_underway() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def clear_quantized_workspaces(
    model: nn.Module | Iterable[nn.Module], *, cuda_graphs_captured: bool = False
) -> ClearReport:
    """Drop every cached quantized weight copy in ``model``; skip (one log line, no error) where unsafe or moot.

    Call it before pausing the trainer's tags: the freed copies are then never copied to host.
    """
    if cuda_graphs_captured or _graph_capture_underway():
        return _skip("CUDA graphs are captured and replay with the workspace addresses baked in; keeping them")
    mods = _modules(model)
    ours = [ws for ws in workspaces(mods) if ws.entries]
    te_mods = [m for m in mods if te_adapter.workspace_tensors(m)]
    if not ours and not te_mods:
        return _skip("no quantized weight workspaces to clear (bf16 precision, or no forward has run yet)")
    freed = sum(ws.clear() for ws in ours) + sum(te_adapter.clear_workspaces(m) for m in te_mods)
    return ClearReport(cleared_modules=len(ours) + len(te_mods), bytes_freed=freed)


def _skip(reason: str) -> ClearReport:
    log.info("clear_quantized_workspaces skipped: %s", reason)
    return ClearReport(cleared_modules=0, bytes_freed=0, skipped_reason=reason)
