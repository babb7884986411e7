"""Block layouts shared by the quantized formats: divisibility checks that name the tensor, scale-tile padding,
and the container every format returns (``QuantizedTensor``).

A quantized copy is always stored with its reduction dim last: a rowwise copy of a weight ``[out, in]`` is
``[out, in]``, a columnwise copy (used by the backward's dgrad) is the transpose ``[in, out]``. Scales of the
block-scaled formats are padded to whole 128 x 4 tiles, the layout the tensor-core GEMMs read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_TILE = (128, 4)  # rows x scale-columns of one scale tile (MXFP8 / NVFP4 / blockwise FP8 columns)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def check_blocks(name: str, shape: tuple[int, ...], block: tuple[int, int], fmt: str) -> None:
    """Raise if a 2-D ``shape`` does not split into whole ``block``s; the message names the tensor and the block."""
    if len(shape) != 2:
        raise ValueError(f"{name}: {fmt} quantizes 2-D weights, got shape {tuple(shape)}")
    for dim, (size, b) in enumerate(zip(shape, block)):
        if size % b:
            raise ValueError(
                f"{name}: shape {tuple(shape)} does not split into {fmt} blocks of {block[0]}x{block[1]} "
                f"(dim {dim} = {size} is not a multiple of {b}); pad that dimension to a multiple of {b} "
                f"or leave this layer in bf16"
            )


def padded_scales(
    scales_RS: torch.Tensor,
    fill: float,
    dtype: torch.dtype,
    rows_tile: int = SCALE_TILE[0],
    cols_tile: int = SCALE_TILE[1],
) -> torch.Tensor:
    """Scales ``[R, S]`` placed top-left in a ``[round_up(R, rows_tile), round_up(S, cols_tile)]`` buffer."""
    r, s = scales_RS.shape
    out = torch.full(
        (round_up(r, rows_tile), round_up(s, cols_tile)), fill, dtype=scales_RS.dtype, device=scales_RS.device
    )
    out[:r, :s] = scales_RS
    return out.to(dtype) if out.dtype != dtype else out


def dtype_or(name: str, fallback: torch.dtype) -> torch.dtype:
    """torch's narrow dtype when this build has it (float8_e8m0fnu, float4_e2m1fn_x2), else a same-size stand-in."""
    return getattr(torch, name, fallback)


@dataclass(slots=True)
class QuantizedTensor:
    """One quantized copy of a 2-D tensor. ``shape`` is the logical ``[rows, cols]`` (reduction dim last)."""

    fmt: str  # "fp8", "fp8_block", "mxfp8", "nvfp4"
    name: str
    shape: tuple[int, int]
    block: tuple[int, int]  # (rows, cols) one scale covers; (rows, cols) of the whole tensor for tensorwise
    data: torch.Tensor
    scale_inv: torch.Tensor  # decode scale(s): value = data * scale_inv (NVFP4: * global_scale too)
    global_scale: torch.Tensor | None = None  # NVFP4 only: one FP32 decode scale for the whole tensor

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.scale_inv, self.global_scale) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
