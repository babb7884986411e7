"""The low-precision recipes a Linear layer can run under, and the one place that maps a recipe to its
weight layout: which format quantizes a weight, with which block, and what a copy decodes to.

``precision`` in the trainer config names a recipe. "fp8" is tensorwise e4m3 (one FP32 scale per tensor),
"fp8_block" the 128x128 blockwise variant, "mxfp8" and "nvfp4" the block-scaled formats; "bf16" means no
quantization (and therefore no workspaces).
"""

from __future__ import annotations

import torch

from miles.quant import fp8, mxfp8
from miles.quant.fp8 import dequantize_fp8, quantize_fp8_blockwise, quantize_fp8_tensorwise
from miles.quant.layout import QuantizedTensor, check_blocks
from miles.quant.mxfp8 import dequantize_mxfp8, quantize_mxfp8
from miles.quant.nvfp4 import WEIGHT_BLOCK, dequantize_nvfp4, quantize_nvfp4

RECIPES = ("bf16", "fp8", "fp8_block", "mxfp8", "nvfp4")
USAGES = ("rowwise", "columnwise")  # forward / wgrad read rowwise; the backward's dgrad reads columnwise

_QUANTIZE = {
    "fp8": quantize_fp8_tensorwise,
    "fp8_block": quantize_fp8_blockwise,
    "mxfp8": quantize_mxfp8,
    "nvfp4": lambda x, name: quantize_nvfp4(x, name, WEIGHT_BLOCK),
}
WEIGHT_BLOCKS = {"fp8": (1, 1), "fp8_block": fp8.BLOCK, "mxfp8": mxfp8.BLOCK, "nvfp4": WEIGHT_BLOCK}
_DEQUANTIZE = {"fp8": dequantize_fp8, "fp8_block": dequantize_fp8, "mxfp8": dequantize_mxfp8, "nvfp4": dequantize_nvfp4}


def check_recipe(recipe: str) -> str:
    if recipe not in RECIPES:
        raise ValueError(f"precision {recipe!r} is not one of {RECIPES}; set trainer.precision to one of them")
    return recipe


def quantize_weight(w_OI: torch.Tensor, recipe: str, name: str, usage: str = "rowwise") -> QuantizedTensor:
    """Quantize a weight ``[out, in]``; the columnwise copy is the transpose ``[in, out]``, blocked along ``out``."""
    if check_recipe(recipe) == "bf16":
        raise ValueError(f"{name}: recipe 'bf16' has no quantized layout")
    src = w_OI.detach() if usage == "rowwise" else w_OI.detach().t()
    return _QUANTIZE[recipe](src.contiguous(), f"{name} ({usage} copy)")


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return _DEQUANTIZE[q.fmt](q, dtype)


def check_weight_layout(w_shape: tuple[int, int], recipe: str, name: str, training: bool = True) -> None:
    """Fail now, with the tensor and block named, if a weight cannot be laid out (both copies when training)."""
    if check_recipe(recipe) == "bf16":
        return
    for usage in USAGES[: 2 if training else 1]:
        shape = tuple(w_shape) if usage == "rowwise" else tuple(w_shape)[::-1]
        check_blocks(f"{name} ({usage} copy)", shape, WEIGHT_BLOCKS[recipe], recipe)
