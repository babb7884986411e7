"""Rotary cos/sin tables computed element by element in scalar arithmetic, identical wherever they are built.

``torch.cos`` on CPU computes a tensor's body with SIMD and its tail with libm, so an entry could depend on the
length of the table it was computed in (the engine builds one of max_seq_len rows, the trainer one per batch).
Here every entry is cos(fp32(p * inv_freq_i)) by Python's ``math`` (one libm call per value), rounded to FP32 then
to the model dtype; inv_freq comes from the decoder's own formula, the same small tensor on every side. Tables are
cached per process and grow by doubling; an entry never depends on the size it was built at.
"""

from __future__ import annotations

import math
import threading

import torch

_LOCK = threading.Lock()
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> FP32 CPU (cos, sin) [rows, head_dim]


def _key(cfg) -> tuple:
    return (
        cfg.head_dim,
        cfg.rope_theta,
        cfg.rope_type,
        cfg.rope_factor,
        cfg.rope_low_freq_factor,
        cfg.rope_high_freq_factor,
        cfg.rope_original_max_position_embeddings,
    )


def _build(cfg, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    from miles.model.rope import rope_inv_freq

    inv = rope_inv_freq(cfg, "cpu").tolist()  # FP32 values as Python floats (exact)
    f32 = torch.tensor(
        [[float(p) * f for f in inv] for p in range(rows)], dtype=torch.float32
    )  # exact product, one rounding
    angles = f32.double().tolist()
    cos = torch.tensor([[math.cos(a) for a in row] for row in angles], dtype=torch.float32)
    sin = torch.tensor([[math.sin(a) for a in row] for row in angles], dtype=torch.float32)
    return torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)


def table(cfg, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 CPU (cos, sin) [>= rows, head_dim], the halves repeated as the decoder's ``cat((freqs, freqs))``."""
    key = _key(cfg)
    with _LOCK:
        have = _TABLES.get(key)
        if have is None or have[0].shape[0] < rows:
            size = max(rows, 2 * have[0].shape[0] if have is not None else 64)
            have = _TABLES[key] = _build(cfg, size)
    return have


def rotary_cos_sin(cfg, position_ids_BT: torch.Tensor, dtype: torch.dtype):
    """cos, sin [B, 1, T, head_dim] in ``dtype`` on the positions' device, looked up in the scalar-math table."""
    rows = int(position_ids_BT.max()) + 1 if position_ids_BT.numel() else 1
    cos, sin = table(cfg, rows)
    idx = position_ids_BT.cpu()
    dev = position_ids_BT.device
    return cos[idx].to(dtype).to(dev)[:, None], sin[idx].to(dtype).to(dev)[:, None]
