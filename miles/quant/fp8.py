"""FP8 e4m3 with FP32 decode scales: one scale per tensor (tensorwise) or per 128x128 tile (blockwise)."""

from __future__ import annotations

import torch

from miles.quant.layout import FP8_MAX, QuantizedTensor, check_blocks, padded_scales

E4M3 = torch.float8_e4m3fn
BLOCK = (128, 128)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest-even e4m3, saturating at +-448 (a plain cast would give NaN above the range)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(E4M3)


def quantize_fp8_tensorwise(x_RC: torch.Tensor, name: str = "tensor") -> QuantizedTensor:
    if x_RC.dim() != 2:
        raise ValueError(f"{name}: fp8 quantizes 2-D weights, got shape {tuple(x_RC.shape)}")
    x = x_RC.float()
    amax = x.abs().amax()
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).reshape(1)
    data = to_e4m3(x / scale_inv)
    return QuantizedTensor("fp8", name, tuple(x_RC.shape), tuple(x_RC.shape), data, scale_inv)


def quantize_fp8_blockwise(x_RC: torch.Tensor, name: str = "tensor") -> QuantizedTensor:
    """128x128 tiles, one FP32 scale each; the scale grid's columns are padded to a multiple of 4."""
    check_blocks(name, tuple(x_RC.shape), BLOCK, "fp8_block")
    r, c = x_RC.shape
    tiles = x_RC.float().reshape(r // 128, 128, c // 128, 128)
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv_RS = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    data = to_e4m3(tiles / scale_inv_RS[:, None, :, None]).reshape(r, c)
    scales = padded_scales(scale_inv_RS, 1.0, torch.float32, rows_tile=1, cols_tile=4)
    return QuantizedTensor("fp8_block", name, (r, c), BLOCK, data, scales)


def dequantize_fp8(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    r, c = q.shape
    if q.fmt == "fp8":
        return (q.data.float() * q.scale_inv).to(dtype)
    s = q.scale_inv[: r // 128, : c // 128]
    tiles = q.data.float().reshape(r // 128, 128, c // 128, 128) * s[:, None, :, None]
    return tiles.reshape(r, c).to(dtype)
