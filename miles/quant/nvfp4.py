"""NVFP4: e2m1 elements packed two per byte, an e4m3 scale per 16 elements, one FP32 global scale per tensor.

Activations use 1x16 blocks; weights use 16x16 blocks, so a weight's rowwise and columnwise copies decode to
the same values (the tile scale is stored once per row of the tile, i.e. still one e4m3 byte per 16
elements, the layout the 1x16-scaled GEMM reads). The global scale maps the tensor's amax onto the largest
product of the two narrow formats (6 * 448), so block scales use e4m3's whole range.
"""

from __future__ import annotations

import torch

from miles.quant.layout import FP4_MAX, FP8_MAX, QuantizedTensor, check_blocks, dtype_or, padded_scales

WEIGHT_BLOCK = (16, 16)
ACTIVATION_BLOCK = (1, 16)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code 0..7; bit 3 is the sign
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)  # midpoints whose even (round-half-to-even) neighbour is the upper code
PACKED = dtype_or("float4_e2m1fn_x2", torch.uint8)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (ties to the even code), saturating at 6; returns 4-bit codes (uint8)."""
    a = x.abs()
    mids = torch.tensor(_MIDPOINTS, dtype=a.dtype, device=a.device)
    code = torch.bucketize(a, mids, right=False)  # a == midpoint goes to the lower code ...
    code = code + torch.isin(a, torch.tensor(_TIES_UP, dtype=a.dtype, device=a.device)).long()  # ... unless odd
    return (code | ((x < 0).long() << 3)).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, device=codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) > 0, -mag, mag)


def pack_pairs(codes_RC: torch.Tensor) -> torch.Tensor:
    """Two codes per byte, the first element of each pair in the low nibble."""
    return (codes_RC[:, 0::2] | (codes_RC[:, 1::2] << 4)).contiguous()


def unpack_pairs(packed_RH: torch.Tensor) -> torch.Tensor:
    p = packed_RH.view(torch.uint8)
    return torch.stack([p & 15, p >> 4], dim=2).reshape(p.shape[0], -1)


def quantize_nvfp4(x_RC: torch.Tensor, name: str = "tensor", block: tuple[int, int] = WEIGHT_BLOCK) -> QuantizedTensor:
    if block not in (WEIGHT_BLOCK, ACTIVATION_BLOCK):
        raise ValueError(f"{name}: nvfp4 block {block} is not one of {WEIGHT_BLOCK} (weights), {ACTIVATION_BLOCK}")
    check_blocks(name, tuple(x_RC.shape), block, "nvfp4")
    r, c = x_RC.shape
    br = block[0]
    x = x_RC.float()
    amax = x.abs().amax()
    global_scale = torch.where(amax > 0, amax / (FP4_MAX * FP8_MAX), torch.ones_like(amax)).reshape(1)
    tiles = x.reshape(r // br, br, c // 16, 16)
    block_amax = tiles.abs().amax(dim=(1, 3))
    scale_e4m3 = (block_amax / FP4_MAX / global_scale).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    decode = scale_e4m3.float() * global_scale  # [r/br, c/16]
    safe = torch.where(decode > 0, decode, torch.ones_like(decode))
    codes = e2m1_codes(torch.where(decode[:, None, :, None] > 0, tiles / safe[:, None, :, None], 0.0))
    data = pack_pairs(codes.reshape(r, c)).view(PACKED)
    per_row = scale_e4m3.view(torch.uint8).repeat_interleave(br, dim=0)  # one byte per 1x16 of every row
    scales = padded_scales(per_row, 0, torch.uint8).view(torch.float8_e4m3fn)
    return QuantizedTensor("nvfp4", name, (r, c), block, data, scales, global_scale)


def dequantize_nvfp4(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    r, c = q.shape
    values = e2m1_values(unpack_pairs(q.data)).reshape(r, c // 16, 16)
    scales = q.scale_inv[:r, : c // 16].float() * q.global_scale
    return (values * scales[:, :, None]).reshape(r, c).to(dtype)
