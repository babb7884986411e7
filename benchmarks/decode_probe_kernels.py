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
