"""Rotary position embeddings: the frequencies (plain, or Llama 3's scaled ones), the standard cos/sin and the
rotation. The decoder, the engine's tables and the invariant scalar-math tables (miles.invariant.rope) share them."""

from __future__ import annotations

import math

import torch


def rope_inv_freq(cfg, device) -> torch.Tensor:
    """The rotary frequencies [head_dim / 2]; rope_type 'llama3' divides the low ones by rope_factor and blends
    the band between the low- and high-frequency wavelengths (Llama 3.1's long-context scaling)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.int64).float() / d))
    if cfg.rope_type == "default":
        return inv_freq
    old_len, factor = cfg.rope_original_max_position_embeddings, cfg.rope_factor
    lo, hi = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    middle = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(middle, blended, scaled)


def rotary_cos_sin(position_ids_BT: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    freqs = position_ids_BT.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [B, 1, T, D]


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    """x * cos + rotate_half(x) * sin, each product rounded to x's dtype before the sum (torch's own order)."""
    return x * cos + rotate_half(x) * sin
