"""Candidate kernels timed by benchmarks/decode_probe.py before any of them enters the engine."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CONFIGS = [
    triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s)
    for bm, bn, bk, w, s in [
        (128, 64, 64, 4, 4),
        (128, 128, 64, 8, 3),
        (64, 128, 64, 4, 4),
        (128, 64, 128, 8, 3),
        (64, 64, 128, 4, 4),
        (256, 64, 64, 8, 3),
    ]
]


@triton.autotune(configs=_CONFIGS, key=["M", "I", "K"])
@triton.jit
def _gate_up_silu_kernel(a_ptr, w_ptr, out_ptr, M, I, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # out[M, I] = silu(a @ Wg^T) * (a @ Wu^T), W = [Wg; Wu] of shape [2I, K]; each product rounded to bf16 first
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    a_p = a_ptr + offs_m[:, None] * K + offs_k[None, :]
    g_p = w_ptr + offs_n[None, :] * K + offs_k[:, None]
    u_p = g_p + I * K
    acc_g = tl.zeros([BM, BN], tl.float32)
    acc_u = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        km = (k0 + offs_k) < K
        a = tl.load(a_p, mask=(offs_m[:, None] < M) & km[None, :], other=0.0)
        g = tl.load(g_p, mask=km[:, None] & (offs_n[None, :] < I), other=0.0)
        u = tl.load(u_p, mask=km[:, None] & (offs_n[None, :] < I), other=0.0)
        acc_g = tl.dot(a, g, acc_g)
        acc_u = tl.dot(a, u, acc_u)
        a_p += BK
        g_p += BK
        u_p += BK
    g = acc_g.to(out_ptr.dtype.element_ty).to(tl.float32)
    u = acc_u.to(out_ptr.dtype.element_ty).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    o = out_ptr + offs_m[:, None] * I + offs_n[None, :]
    tl.store(o, (s * u).to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < I))


def gate_up_silu(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    M, K = a.shape
    I = w.shape[0] // 2
    out = torch.empty(M, I, dtype=a.dtype, device=a.device)
    grid = lambda meta: (triton.cdiv(I, meta["BN"]), triton.cdiv(M, meta["BM"]))  # noqa: E731
    _gate_up_silu_kernel[grid](a, w, out, M, I, K)
    return out


@triton.jit
def _attend_block(q, k, v, sc_ok, m, l, acc, sm_scale):
    # one online-softmax step over a block of keys; query rows whose scores are all masked stay as they were
    sc = tl.where(sc_ok, tl.dot(q, tl.trans(k)) * sm_scale, -float("inf"))
    m_new = tl.maximum(m, tl.max(sc, 1))
    m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
    p = tl.exp(sc - m_use[:, None])
    alpha = tl.exp(m - m_use)
    return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _attn_blocks_kernel(
    q_ptr, k_ptr, v_ptr, lens_ptr, pslot_ptr, plen_ptr, out_ptr, sq_r, sq_h, sk_b, sk_h, sk_n, sm_scale, R,
    G: tl.constexpr, GP: tl.constexpr, RB: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # grid (block of RB rows, kv head): the block's query heads as one [RB * GP, D] tile. The rows sharing the
    # block's first row's prompt attend over it together (each key block read once), then each row's own
    # positions with the other rows' scores masked
    blk, kvh = tl.program_id(0), tl.program_id(1)
    r0 = blk * RB
    offs_m = tl.arange(0, RB * GP)
    j_of, g_of = offs_m // GP, offs_m % GP
    rows = r0 + j_of
    live = rows < R
    offs_d = tl.arange(0, D)
    qmask = ((g_of < G) & live)[:, None]
    q = tl.load(
        q_ptr + rows[:, None] * sq_r + (kvh * G + g_of)[:, None] * sq_h + offs_d[None, :], mask=qmask, other=0.0
    )
    holder, n_shared = tl.load(pslot_ptr + r0), tl.load(plen_ptr + r0)
    pslot_m = tl.load(pslot_ptr + rows, mask=live, other=-1)
    plen_m = tl.load(plen_ptr + rows, mask=live, other=-1)
    shares = live & (pslot_m == holder) & (plen_m == n_shared)
    m = tl.full([RB * GP], -float("inf"), tl.float32)
    l = tl.zeros([RB * GP], tl.float32)
    acc = tl.zeros([RB * GP, D], tl.float32)
    base = holder.to(tl.int64) * sk_b + kvh * sk_h
    for n0 in range(0, n_shared, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = offs_n < n_shared
        kv_off = base + offs_n[:, None] * sk_n + offs_d[None, :]
        k = tl.load(k_ptr + kv_off, mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=ok[:, None], other=0.0)
        m, l, acc = _attend_block(q, k, v, shares[:, None] & ok[None, :], m, l, acc, sm_scale)
    for j in range(RB):
        r = r0 + j
        inside = r < R
        n_filled = tl.load(lens_ptr + r, mask=inside, other=0)
        ps, pl = tl.load(pslot_ptr + r, mask=inside, other=0), tl.load(plen_ptr + r, mask=inside, other=0)
        start = tl.where((ps == holder) & (pl == n_shared), pl, 0)
        own, pre = r.to(tl.int64) * sk_b + kvh * sk_h, ps.to(tl.int64) * sk_b + kvh * sk_h
        mine = j_of == j
        for n0 in range(start, n_filled, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            ok = offs_n < n_filled
            kv_off = tl.where(offs_n < pl, pre, own)[:, None] + offs_n[:, None] * sk_n + offs_d[None, :]
            k = tl.load(k_ptr + kv_off, mask=ok[:, None], other=0.0)
            v = tl.load(v_ptr + kv_off, mask=ok[:, None], other=0.0)
            m, l, acc = _attend_block(q, k, v, mine[:, None] & ok[None, :], m, l, acc, sm_scale)
    o = out_ptr + (rows * (G * tl.num_programs(1)) + kvh * G + g_of)[:, None] * D + offs_d[None, :]
    tl.store(o, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=qmask)


def decode_attention_blocks(
    q_RHD, k_cache, v_cache, lens_R, num_splits, prefix=None, *, fallback, group_rows=4, block_n=32, num_warps=4
):
    """miles.rollout.kernels.decode_attention_triton's signature; rows sharing a prompt in blocks of
    ``group_rows`` (bf16 only). Calls ``fallback`` where it does not apply (no shared prefix, or splits)."""
    if prefix is None or num_splits != 1:
        return fallback(q_RHD, k_cache, v_cache, lens_R, num_splits, prefix)
    R, H, D = q_RHD.shape
    KVH = k_cache.shape[1]
    G = H // KVH
    out = torch.empty_like(q_RHD)
    _attn_blocks_kernel[(triton.cdiv(R, group_rows), KVH)](
        q_RHD, k_cache, v_cache, lens_R, prefix[0], prefix[1], out,
        q_RHD.stride(0), q_RHD.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), D ** -0.5, R,
        G=G, GP=max(triton.next_power_of_2(G), triton.cdiv(16, group_rows)), RB=group_rows, D=D, BLOCK_N=block_n,
        num_warps=num_warps,
    )  # fmt: skip
    return out
