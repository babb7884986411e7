"""Low-precision weight layouts (FP8 tensorwise / 128x128 blockwise, MXFP8, NVFP4), Linear layers that cache
their quantized weights in workspaces, and dropping those workspaces before an offload (ours and Transformer
Engine's)."""

from miles.quant.layout import QuantizedTensor
from miles.quant.linear import QuantizedGroupedLinear, QuantizedLinear
from miles.quant.precision import apply_precision
from miles.quant.recipe import RECIPES, dequantize, quantize_weight
from miles.quant.workspace import ClearReport, WeightWorkspace, clear_quantized_workspaces, quantized_workspace_tensors

__all__ = [
    "RECIPES",
    "ClearReport",
    "QuantizedGroupedLinear",
    "QuantizedLinear",
    "QuantizedTensor",
    "WeightWorkspace",
    "apply_precision",
    "clear_quantized_workspaces",
    "dequantize",
    "quantize_weight",
    "quantized_workspace_tensors",
]
