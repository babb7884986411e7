"""Decode attention: one new query per row against that row's filled KV cache positions only.

Rows of a continuous batch have different lengths. The Triton kernel (miles.rollout.kernels) reads each row's
filled length from a device tensor and touches only those keys, split along the sequence so that a few rows
still fill the GPU; its grid is fixed by the row count, so it is captured in the decode CUDA graphs. The
reference path (CPU, and the test oracle) is SDPA over the cache cut at a host-known bound with a length mask.

    out_RHD = decode_attention(q_RHD, k_cache, v_cache, lens_R, bound=max_len_hint)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles.rollout.sampling import use_triton


def num_splits_for(rows: int, kv_heads: int, max_len: int, num_sms: int = 132, block_n: int = 64) -> int:
    """Sequence splits per (row, KV head): about two programs per multiprocessor, a power of two, at most 16."""
    want = max(1, -(-2 * num_sms // max(1, rows * kv_heads)))
    n = 1
    while n < want and n < 16 and n * block_n * 2 <= max_len:
        n *= 2
    return n


def decode_attention(
    q_RHD: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lens_R: torch.Tensor,
    *,
    bound: int | None = None,
    num_splits: int | None = None,
    fused: bool | None = None,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``bound``: an upper bound of lens (the reference path reads the cache up to it; the kernel ignores it).
    ``prefix``: (slot_R, len_R): row r reads its positions below len_R[r] from cache slot slot_R[r]."""
    if fused is None:
        fused = use_triton(q_RHD)
    if fused:
        from miles.rollout.kernels import decode_attention_triton

        R, KVH, S = q_RHD.shape[0], k_cache.shape[1], k_cache.shape[2]
        splits = num_splits or num_splits_for(R, KVH, S)
        return decode_attention_triton(q_RHD, k_cache, v_cache, lens_R, splits, prefix)
    return decode_attention_reference(q_RHD, k_cache, v_cache, lens_R, bound=bound, prefix=prefix)


def decode_attention_reference(
    q_RHD, k_cache, v_cache, lens_R, *, bound: int | None = None, prefix=None
) -> torch.Tensor:
    R, H, D = q_RHD.shape
    S = min(bound or k_cache.shape[2], k_cache.shape[2])
    k, v = k_cache[:R, :, :S], v_cache[:R, :, :S]
    if prefix is not None:  # each row's keys and values below its prefix length come from the slot that holds them
        slot, n = prefix
        held = (torch.arange(S, device=q_RHD.device)[None] < n[:, None])[:, None, :, None]
        k = torch.where(held, k_cache[slot, :, :S], k)
        v = torch.where(held, v_cache[slot, :, :S], v)
    mask = (torch.arange(S, device=q_RHD.device)[None] < lens_R[:, None])[:, None, None, :]
    gqa = H != k.shape[1]
    out = F.scaled_dot_product_attention(q_RHD[:, :, None], k, v, attn_mask=mask, enable_gqa=gqa)
    return out[:, :, 0]
