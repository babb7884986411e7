"""The torch <-> safetensors dtype table, tensor layouts, and a header reader that keeps byte offsets.

safetensors exposes no public dtype encoder and its loaders hide where each tensor's bytes live; the disk-delta
sync needs both (a delta is applied to raw bytes at a known offset), so this file owns them. A layout is the
triple (dtype, shape, nbytes) that must agree between the trainer, the baseline and every engine; two layouts
with the same byte count but a different dtype or shape (an fp16 checkpoint under a bf16 trainer) would make an
XOR delta silently corrupt weights, hence the explicit comparison.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

# safetensors name -> torch dtype; the FNUZ float8 variants and the unsigned types exist in recent torch only.
_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
}
TORCH_DTYPE: dict[str, torch.dtype] = {k: getattr(torch, v) for k, v in _NAMES.items() if hasattr(torch, v)}
SAFETENSORS_DTYPE: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPE.items()}

# A header larger than this is corrupt, not big: real headers are a few MB even for 100k tensors.
MAX_HEADER_BYTES = 100 << 20


def safetensors_dtype(dtype: torch.dtype) -> str:
    """torch dtype -> safetensors dtype string, or a ValueError listing what is supported."""
    try:
        return SAFETENSORS_DTYPE[dtype]
    except KeyError:
        raise ValueError(
            f"{dtype} has no safetensors dtype; supported: {sorted(str(d) for d in SAFETENSORS_DTYPE)}; "
            f"cast the tensor (e.g. complex128 -> complex64) before syncing"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    """safetensors dtype string -> torch dtype, or a ValueError listing what is supported."""
    try:
        return TORCH_DTYPE[name]
    except KeyError:
        raise ValueError(
            f"safetensors dtype {name!r} is not supported here; supported: {sorted(TORCH_DTYPE)}"
        ) from None


@dataclass(frozen=True, slots=True)
class Layout:
    """What a tensor's bytes mean: safetensors dtype string, shape (``()`` for a scalar), byte count."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "Layout":
        return cls(
            dtype=safetensors_dtype(tensor.dtype),
            shape=tuple(tensor.shape),
            nbytes=tensor.numel() * tensor.element_size(),
        )

    def expected_nbytes(self) -> int:
        return math.prod(self.shape) * torch_dtype(self.dtype).itemsize

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)} ({self.nbytes} bytes)"


def check_layout(
    name: str, got: Layout, expected: Layout, *, got_from: str, expected_from: str = "the trainer"
) -> None:
    """Raise a ValueError naming the tensor and both layouts unless ``got == expected``."""
    if got != expected:
        raise ValueError(
            f"tensor {name!r}: {got_from} has {got}, {expected_from} has {expected}; a byte-level delta "
            f"between different layouts corrupts weights. Re-export the baseline with the trainer's dtype and "
            f"shapes (or cast the trainer's tensor to the baseline's dtype)."
        )


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    """One tensor in a safetensors file: where its bytes are (absolute file offset) and what they mean."""

    file: str
    offset: int
    layout: Layout


def read_header(path: str | os.PathLike) -> tuple[dict[str, HeaderEntry], dict[str, str], int]:
    """Parse a safetensors header: 8-byte little-endian length, then JSON. Returns (entries, __metadata__, file
    size). Whole-file damage (a corrupt header) raises here; per-tensor problems (a byte range past the end of a
    truncated file, a byte count that disagrees with dtype x shape) are left to the reader of that tensor, which
    knows the layout the trainer expects and can name both."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(
                f"{path}: {size} bytes is too short for a safetensors file (needs an 8-byte header length)"
            )
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(
                f"{path}: corrupt header: header length {n} does not fit in a {size}-byte file; "
                f"re-export the checkpoint"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError(f"header is a {type(header).__name__}, not an object")
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: corrupt header ({e}); re-export the checkpoint") from None
    metadata = header.pop("__metadata__", None) or {}
    return {name: _entry(path, name, info, 8 + n) for name, info in header.items()}, metadata, size


def _entry(path: str, name: str, info, data_start: int) -> HeaderEntry:
    try:
        dtype, shape, (begin, end) = str(info["dtype"]), tuple(int(d) for d in info["shape"]), info["data_offsets"]
        begin, end = int(begin), int(end)
        if not 0 <= begin <= end:
            raise ValueError(f"data_offsets [{begin}, {end}) are not an interval")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{path}: corrupt header entry for tensor {name!r}: {info!r} ({e}); re-export the checkpoint"
        ) from None
    return HeaderEntry(
        file=path, offset=data_start + begin, layout=Layout(dtype=dtype, shape=shape, nbytes=end - begin)
    )
