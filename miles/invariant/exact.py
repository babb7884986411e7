"""CPU building blocks whose result for an element depends only on that element's inputs, never on its place.

ATen's CPU loops run a tensor's body through SIMD code (Sleef for transcendental functions) and its tail through
scalar libm, and split work over threads by size, so ``torch.exp(x)[i]`` or ``torch.sigmoid(x)[i]`` can depend on
where ``x[i]`` sits. Engine and trainer lay tokens out differently, so no such op may touch a value whose bits must
agree. What is left is used here: single IEEE operations (add, sub, mul, div, sqrt: correctly rounded in the vector
body and in the scalar tail alike; separate kernels, so never contracted into an FMA), exact ones (max, abs, where,
round, clamp, integer and bit operations, conversions), and reductions whose order is fixed by the code:

- ``tree_sum``: an aligned pairwise tree. Padding leaves are -0.0, the identity of IEEE addition (x + -0.0 = x for
  every x, +0.0 included), so a row summed over 40 or over 64 positions of which the last ones are padding gives
  the same bits, and so does a causal row whose masked keys are -0.0.
- ``exact_matmul``: each row of ``a`` and of ``b`` rounded to a fixed-point grid of ``bits_for(K)`` bits below
  its own largest element (a no-op for bf16 values within 2^13 of the row maximum), then an FP64 matmul whose
  every partial sum is an integer multiple of the grid below 2^53: exact, so any BLAS order, blocking or thread
  split gives the same number, rounded once to FP32.
- ``exp`` / ``log``: range reduction and a polynomial, written in the single operations above.
"""

from __future__ import annotations

import math
import weakref

import torch

LOG2E = 1.4426950408889634
LN2_HI = 0.693359375  # 355 / 512: n * LN2_HI is exact for |n| < 2^15
LN2_LO = -2.12194440054690583e-4  # ln 2 - LN2_HI
EXP_POLY = [1.0 / math.factorial(k) for k in range(7, 1, -1)]  # 1/7! ... 1/2!, Horner from the top
LOG_POLY = [1.0 / (2 * k + 1) for k in range(5, 0, -1)]  # atanh series: 1/11 ... 1/3
SQRT2 = math.sqrt(2.0)


def pow2_f64(e: torch.Tensor) -> torch.Tensor:
    """2.0 ** e in FP64 for integer ``e`` in [-1022, 1023], built from the exponent bits (exact)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def pow2_f32(e: torch.Tensor) -> torch.Tensor:
    """2.0 ** e in FP32 for integer ``e`` in [-126, 127], built from the exponent bits (exact)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` by an aligned pairwise tree (leaves (0,1), (2,3), ... then pairs of pairs), padded to a power
    of two with -0.0. The same bits for a row whatever the other rows, the tensor's length and its layout."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        x = torch.cat([x, x.new_full((*x.shape[:-1], width - n), -0.0)], -1)
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def bits_for(k: int) -> int:
    """Grid bits per operand so that a dot product of ``k`` terms is exact in FP64: k * 2^(2 bits) <= 2^53."""
    return (53 - max(0, (k - 1).bit_length())) // 2


def _row_exponent(x32: torch.Tensor) -> torch.Tensor:
    """Per row of [R, K] FP32, the smallest e with |x| < 2^e for the whole row (zeros and subnormals: -126)."""
    top = x32.abs().amax(-1).view(torch.int32).to(torch.int64) >> 23
    return top - 126


def to_grid(x: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, K] -> FP64 [R, K]: each row rounded (half to even) to multiples of 2^(e - bits), |x| < 2^e over the row."""
    x32 = x.float()
    e = _row_exponent(x32)[:, None]
    return torch.round(x32.double() * pow2_f64(bits - e)).mul_(pow2_f64(e - bits))


def exact_matmul(a_MK: torch.Tensor, b_NK: torch.Tensor) -> torch.Tensor:
    """FP32 [M, N] = a @ b.T with each row of ``a`` and ``b`` on its own fixed-point grid, summed exactly.

    Each product of grid values is an integer multiple of 2^(e_a + e_b - 2 bits) below 2^(e_a + e_b), and k of them
    stay below 2^53 multiples, so FP64 holds every partial sum exactly: the BLAS may order, block and split the sum
    over K as it likes (it does, by M). One rounding to FP32 at the end."""
    bits = bits_for(a_MK.shape[-1])
    return (to_grid(a_MK, bits) @ weight_grid(b_NK, bits).T).float()


_GRIDS: dict[int, tuple] = {}  # id(weight) -> (weakref to it, its state, its grid); dropped when the weight dies


def weight_grid(w: torch.Tensor, bits: int) -> torch.Tensor:
    """``to_grid(w, bits)``, kept per weight tensor that takes no gradient (the engine's) while its storage address
    and version counter stay: every write through torch (a weight sync's copy_, also into a byte view) bumps the
    counter; a storage moved by an offload comes back at a new address or with the same bytes (a host backup), or
    is written by the sync the engine requires after a discard. A trainer's weights are gridded afresh each call."""
    if w.requires_grad or w.is_inference():
        return to_grid(w, bits)
    state = (w.data_ptr(), w._version, tuple(w.shape), tuple(w.stride()), w.dtype, bits)
    hit = _GRIDS.get(id(w))
    if hit is not None and hit[0]() is w and hit[1] == state:
        return hit[2]
    grid = to_grid(w, bits)
    key = id(w)
    _GRIDS[key] = (weakref.ref(w, lambda _, key=key: _GRIDS.pop(key, None)), state, grid)
    return grid


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x for FP32 ``x``: x = n ln2 + r (Cody-Waite, |r| <= ln2 / 2), e^r by its Taylor polynomial to r^7 (error
    below 1e-8 relative), times 2^n from the exponent bits. Below -87 gives 0 (true value < 1.7e-38), above 88 inf."""
    xc = x.clamp(-87.0, 88.0)
    n = torch.round(xc * LOG2E)
    r = (xc - n * LN2_HI) - n * LN2_LO
    p = torch.full_like(r, EXP_POLY[0])
    for c in EXP_POLY[1:]:
        p = p * r + c
    p = (p * r + 1.0) * r + 1.0
    y = p * pow2_f32(n)
    y = torch.where(x > 88.0, torch.full_like(y, math.inf), y)
    return torch.where(x < -87.0, torch.zeros_like(y), y)


def log(x: torch.Tensor) -> torch.Tensor:
    """ln x for positive normal FP32 ``x``: x = m 2^e with m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh(u) with
    u = (m - 1) / (m + 1), |u| <= 0.172, by its series to u^11 (error below 1e-9 relative)."""
    bits = x.view(torch.int32)
    e = (bits >> 23) - 127
    m = ((bits & 0x007FFFFF) | 0x3F800000).view(torch.float32)  # [1, 2)
    high = m > SQRT2
    m = torch.where(high, m * 0.5, m)
    e = torch.where(high, e + 1, e).float()
    u = (m - 1.0) / (m + 1.0)
    u2 = u * u
    p = torch.full_like(u, LOG_POLY[0])
    for c in LOG_POLY[1:]:
        p = p * u2 + c
    p = p * u2 + 1.0
    ln_m = (u + u) * p
    return e * LN2_HI + (e * LN2_LO + ln_m)


def reciprocal_sqrt(x: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(x): two correctly rounded operations (``torch.rsqrt`` is one, computed differently by position)."""
    return torch.sqrt(x).reciprocal()
