"""The engine's Triton kernels: fused sampling and the decode attention over per-row filled lengths.

Imported only where ``miles.rollout.sampling.use_triton`` says so (CUDA, or TRITON_INTERPRET=1 in tests); the
naive versions they are tested against are ``sample_reference`` and ``decode_attention_reference``. Neither
kernel reads a length or a seed on the host, so both run inside the engine's CUDA graphs.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - use_triton() checks HAS_TRITON first
    raise ImportError("the engine's GPU kernels need Triton: pip install 'miles[gpu]'") from e

SAMPLE_BLOCK_V = 4096


@triton.jit
def _sample_kernel(logits_ptr, stride_r, temp_ptr, seed_ptr, tok_ptr, lp_ptr, V, BLOCK_V: tl.constexpr):
    # one program per row; every value of the row is read once and upcast in registers
    row = tl.program_id(0)
    t = tl.load(temp_ptr + row).to(tl.float32)
    greedy = t <= 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.maximum(t, 1e-6))
    seed = tl.load(seed_ptr)
    m = -float("inf")
    s = 0.0
    best = -float("inf")
    best_x = 0.0
    best_i = 0
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        ok = offs < V
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_r + offs, mask=ok, other=-float("inf")).to(tl.float32)
        x = x * inv_t
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.where(ok, tl.exp(x - m_new), 0.0), 0)
        m = m_new
        u = tl.rand(seed, row * V + offs)
        g = -tl.log(-tl.log(tl.minimum(tl.maximum(u, 1e-20), 1.0 - 1e-7)))
        score = tl.where(ok, tl.where(greedy, x, x + g), -float("inf"))
        b = tl.max(score, 0)
        bi = tl.argmax(score, 0)
        bx = tl.sum(tl.where(offs == v0 + bi, x, 0.0), 0)
        take = b > best
        best_x = tl.where(take, bx, best_x)
        best_i = tl.where(take, v0 + bi, best_i)
        best = tl.where(take, b, best)
    tl.store(tok_ptr + row, best_i.to(tl.int64))
    tl.store(lp_ptr + row, best_x - m - tl.log(s))


def fused_sample(logits_RV: torch.Tensor, temperature_R: torch.Tensor, seed_t: torch.Tensor):
    R, V = logits_RV.shape
    tok = torch.empty(R, dtype=torch.int64, device=logits_RV.device)
    lp = torch.empty(R, dtype=torch.float32, device=logits_RV.device)
    _sample_kernel[(R,)](logits_RV, logits_RV.stride(0), temperature_R, seed_t, tok, lp, V, BLOCK_V=SAMPLE_BLOCK_V)
    return tok, lp


@triton.jit
def _decode_attn_kernel(
    q_ptr, k_ptr, v_ptr, lens_ptr, acc_ptr, ml_ptr,
    sq_r, sq_h, sk_b, sk_h, sk_n, sm_scale, split_len,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    # grid (row, kv head, split): the query heads sharing one KV head attend over keys [split start, end) only
    row, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_filled = tl.load(lens_ptr + row)
    start = split * split_len
    end = tl.minimum(start + split_len, n_filled)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    heads = kvh * G + offs_g
    q = tl.load(q_ptr + row * sq_r + heads[:, None] * sq_h + offs_d[None, :], mask=offs_g[:, None] < G, other=0.0)
    m = tl.full([G_PAD], -float("inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    base = row.to(tl.int64) * sk_b + kvh * sk_h
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = offs_n < end
        kv_off = base + offs_n[:, None] * sk_n + offs_d[None, :]
        k = tl.load(k_ptr + kv_off, mask=ok[:, None], other=0.0)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        sc = tl.where(ok[None, :], sc * sm_scale, -float("inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        p = tl.exp(sc - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=ok[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = (row * (G * tl.num_programs(1)) + heads) * NUM_SPLITS + split  # [rows, heads, splits]
    keep = offs_g < G
    tl.store(acc_ptr + out[:, None] * D + offs_d[None, :], acc, mask=keep[:, None])
    tl.store(ml_ptr + out * 2, m, mask=keep)
    tl.store(ml_ptr + out * 2 + 1, l, mask=keep)


@triton.jit
def _decode_reduce_kernel(acc_ptr, ml_ptr, out_ptr, D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    # one program per (row, head): merge the splits' partial softmaxes (empty splits carry m = -inf, l = 0)
    rh = tl.program_id(0)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, D)
    m = tl.load(ml_ptr + (rh * NUM_SPLITS + offs_s) * 2)
    l = tl.load(ml_ptr + (rh * NUM_SPLITS + offs_s) * 2 + 1)
    m_all = tl.max(m, 0)
    w = tl.where(l > 0, tl.exp(m - m_all), 0.0)
    acc = tl.load(acc_ptr + (rh * NUM_SPLITS + offs_s)[:, None] * D + offs_d[None, :])
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + rh * D + offs_d, out.to(out_ptr.dtype.element_ty))


def decode_attention_triton(q_RHD, k_cache, v_cache, lens_R, num_splits: int, block_n: int = 64):
    """q [R, H, D]; caches [B >= R, KVH, S, D] (D contiguous); lens [R] filled positions (current token included)."""
    R, H, D = q_RHD.shape
    KVH, S = k_cache.shape[1], k_cache.shape[2]
    G = H // KVH
    split_len = -(-S // num_splits)
    split_len = -(-split_len // block_n) * block_n
    acc = torch.empty(R, H, num_splits, D, dtype=torch.float32, device=q_RHD.device)
    ml = torch.empty(R, H, num_splits, 2, dtype=torch.float32, device=q_RHD.device)
    out = torch.empty(R, H, D, dtype=q_RHD.dtype, device=q_RHD.device)
    _decode_attn_kernel[(R, KVH, num_splits)](
        q_RHD, k_cache, v_cache, lens_R, acc, ml,
        q_RHD.stride(0), q_RHD.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        D ** -0.5, split_len,
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        IEEE=q_RHD.dtype == torch.float32, num_warps=4,
    )  # fmt: skip
    _decode_reduce_kernel[(R * H,)](acc, ml, out, D=D, NUM_SPLITS=num_splits, num_warps=1)
    return out
