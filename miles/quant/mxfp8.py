"""MXFP8: e4m3 elements in 1x32 blocks along the reduction dim, one power-of-two (e8m0) scale per block.

The scale of a block is 2**(floor(log2(amax)) - 8), 8 being the exponent of e4m3's largest power of two, so
the block's largest element lands in [256, 512) and saturates at 448 (the OCP MX rule). Scales are stored as
biased exponents (uint8, viewed as float8_e8m0fnu where torch has it) in 128x4 tiles.
"""

from __future__ import annotations

import torch

from miles.quant.fp8 import to_e4m3
from miles.quant.layout import QuantizedTensor, check_blocks, dtype_or, padded_scales

BLOCK = (1, 32)
E4M3_EMAX = 8
E8M0 = dtype_or("float8_e8m0fnu", torch.uint8)


def e8m0_exponents(amax: torch.Tensor) -> torch.Tensor:
    """Unbiased shared exponents floor(log2(amax)) - 8, clamped to e8m0's range (amax == 0 gives any scale)."""
    _, exp = torch.frexp(amax)  # amax = m * 2**exp with m in [0.5, 1): floor(log2 amax) = exp - 1
    return (exp - 1 - E4M3_EMAX).clamp(-127, 127)


def quantize_mxfp8(x_RC: torch.Tensor, name: str = "tensor") -> QuantizedTensor:
    check_blocks(name, tuple(x_RC.shape), BLOCK, "mxfp8")
    r, c = x_RC.shape
    blocks = x_RC.float().reshape(r, c // 32, 32)
    exp_RS = e8m0_exponents(blocks.abs().amax(dim=2))
    data = to_e4m3(torch.ldexp(blocks, -exp_RS[:, :, None].float())).reshape(r, c)
    biased = (exp_RS + 127).to(torch.uint8)
    scales = padded_scales(biased, 127, torch.uint8).view(E8M0)
    return QuantizedTensor("mxfp8", name, (r, c), BLOCK, data, scales)


def dequantize_mxfp8(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    r, c = q.shape
    exp_RS = q.scale_inv.view(torch.uint8)[:r, : c // 32].float() - 127
    blocks = q.data.float().reshape(r, c // 32, 32)
    return torch.ldexp(blocks, exp_RS[:, :, None]).reshape(r, c).to(dtype)
