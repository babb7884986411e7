"""The invariant forward ops on CUDA: Triton kernels whose arithmetic for a row never depends on the call's shape.

- ``linear``: one tile shape (64 x 128 x 64, four warps, three stages) for every call, whatever M; no split-K; the
  K loop in order into one FP32 accumulator. An output element is then the same MMA sequence over the same K
  blocks in the engine's decode (M = rows), its prefill and the trainer (M = batch x length): tensor cores compute
  each element from its own row and column, and ``M`` is not specialised (M = 1 would compile another kernel).
- ``attention`` / ``decode_attention``: one kernel for the trainer's full sequences, the prefill and the decode step.
  A program is a tile of 16 query rows sharing one KV row (the trainer and the prefill: 16 positions of one head,
  aligned to 16; decode: the query heads of one KV head at the row's position); it walks key blocks of 64 from
  position 0 in order with the same online-softmax update, so a query at position t goes through blocks
  0..t // 64 in every use. Each tile's rows, positions and KV addresses come in as data, so the three uses run
  the same compiled kernel. Keys past a row's position score -inf and weigh exactly 0; no split of the keys.
- ``rms_norm``, ``silu_mul``, ``token_log_probs``: one program per row (a row's reduction in one fixed order) or
  per element, one compiled kernel each for engine and trainer.
Imported by miles.invariant.ops for CUDA tensors (and, under TRITON_INTERPRET=1 with MILES_INVARIANT_IMPL=triton,
for CPU tensors in the tests).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - ops imports this module for CUDA tensors only
    raise ImportError("true_on_policy on a GPU needs Triton: pip install 'miles[gpu]'") from e

# Triton's interpreter (the CPU tests) multiplies bf16 dot operands wrongly (numpy has no bf16): there, and only
# there, they are upcast to FP32 first, the same products (a bf16 x bf16 product is exact in FP32)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
LINEAR_TILE = dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=3)  # every call, every M: the invariant
ATTN_BM, ATTN_BN, ATTN_WARPS = 16, 64, 4
ROW_WARPS = 4
LOGPROB_BLOCK = 4096


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["M", "N"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                   UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    # y[M, N] = x[M, K] @ w[N, K].T (+ b): K blocks in order into one FP32 tile, one rounding at the store
    rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rn = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_ptr + rn[None, :] * K + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = _mma(a, b, acc, IEEE, UPCAST)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rm[:, None] * N + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    w = weight.contiguous()
    M, N = x2.shape[0], w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    t = LINEAR_TILE
    grid = (triton.cdiv(M, t["BM"]), triton.cdiv(N, t["BN"]))
    _linear_kernel[grid](
        x2, w, bias if bias is not None else w, y, M, N, K,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, UPCAST=INTERPRETED, BM=t["BM"], BN=t["BN"], BK=t["BK"],
        num_warps=t["num_warps"], num_stages=t["num_stages"],
    )  # fmt: skip
    return y.view(*x.shape[:-1], N)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, eps, BLOCK: tl.constexpr):
    # y = w * round(x / sqrt(mean(x^2) + eps)): the row's sum of squares by one fixed tree (BLOCK, ROW_WARPS)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    x = tl.load(x_ptr + row * H + offs, mask=ok, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / H + eps)
    n = (x * r).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * H + offs, (w * n).to(y_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    H = x.shape[-1]
    x2 = x.reshape(-1, H).contiguous()
    y = torch.empty_like(x2)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, H, eps, BLOCK=triton.next_power_of_2(H), num_warps=ROW_WARPS)
    return y.view(x.shape)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    # round(g / (1 + e^-g)) * u, elementwise: the same code for every element wherever it sits
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + offs, (s * u).to(y_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g, u = gate.contiguous(), up.contiguous()
    y = torch.empty_like(g)
    n = g.numel()
    _silu_mul_kernel[(triton.cdiv(n, 1024),)](g, u, y, n, BLOCK=1024, num_warps=ROW_WARPS)
    return y


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, desc_ptr, stride_n, sm_scale, D,
    D_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    # one tile of up to BM query rows over one KV row, described by 7 int64s: the first row's offset in q (and o;
    # rows are D apart), its position and the position step between rows (1: consecutive positions; 0: heads of
    # one position), the number of real rows, where the row's keys start (key j at kvb + j * stride_n), and the
    # prefix slot's start with its length (keys below pl read at pb). Every row of a tile lies in one key block.
    desc = desc_ptr + tl.program_id(0).to(tl.int64) * 7
    q_base, pos_base, pos_step = tl.load(desc), tl.load(desc + 1), tl.load(desc + 2)
    n_rows, kvb, pb, pl = tl.load(desc + 3), tl.load(desc + 4), tl.load(desc + 5), tl.load(desc + 6)
    i = tl.arange(0, BM)
    ic = tl.minimum(i, n_rows - 1)  # padding rows repeat the last real row (finite) and are not stored
    rows = q_base + ic * D
    pos = pos_base + ic * pos_step
    d = tl.arange(0, D_PAD)
    dok = d < D
    q = tl.load(q_ptr + rows[:, None] + d[None, :], mask=dok[None, :], other=0.0)
    last = tl.max(pos, 0)
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D_PAD], tl.float32)
    for n0 in range(0, last + 1, BN):
        n = n0 + tl.arange(0, BN)
        kv = tl.where(n < pl, pb, kvb)[:, None] + n[:, None] * stride_n + d[None, :]
        ok = (n[:, None] <= last) & dok[None, :]
        k = tl.load(k_ptr + kv, mask=ok, other=0.0)
        s = _mma(q, tl.trans(k), tl.zeros([BM, BN], tl.float32), IEEE, UPCAST)
        s = tl.where(n[None, :] <= pos[:, None], s * sm_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv, mask=ok, other=0.0)
        acc = _mma(p.to(v.dtype), v, acc * alpha[:, None], IEEE, UPCAST)
        m = m_new
    out = acc / l[:, None]
    tl.store(
        o_ptr + rows[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=(i < n_rows)[:, None] & dok[None, :]
    )


def _launch(q, k, v, desc: torch.Tensor) -> torch.Tensor:
    D = q.shape[-1]
    out = torch.empty_like(q)
    _attention_kernel[(desc.shape[0],)](
        q, k, v, out, desc, k.stride(-2), D**-0.5, D,
        D_PAD=max(16, triton.next_power_of_2(D)), BM=ATTN_BM, BN=ATTN_BN, IEEE=q.dtype == torch.float32,
        UPCAST=INTERPRETED, num_warps=ATTN_WARPS,
    )  # fmt: skip
    return out


def attention(q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, qpos_BT: torch.Tensor) -> torch.Tensor:
    """Query (b, h, t) at position qpos[b, t] over keys 0..qpos of row b. Tiles: 16 consecutive t of one (b, h);
    qpos[b, t] must be qpos[b, 0] + t with qpos[b, 0] a multiple of 16 for a tile to sit in one key block (the
    decoder's positions from 0 are; otherwise rows meet wholly masked blocks, which add only zeros)."""
    q, k, v = q_BHTD.contiguous(), k_BKSD.contiguous(), v_BKSD.contiguous()
    B, H, T, D = q.shape
    KVH, dev = k.shape[1], q.device
    t0 = torch.arange(0, T, ATTN_BM, device=dev)  # [tiles_t]
    bh = torch.arange(B * H, device=dev)[:, None]
    b, h = bh // H, bh % H
    start = qpos_BT.to(dev).expand(B, T)[:, 0].repeat_interleave(H)[:, None]
    kvb = b * k.stride(0) + (h // (H // KVH)) * k.stride(1)
    cols = [
        (bh * T + t0) * D,  # the tile's first query row
        start + t0,
        torch.ones_like(t0).expand(B * H, -1),
        (T - t0).clamp(max=ATTN_BM).expand(B * H, -1),
        kvb.expand(-1, t0.shape[0]),
        kvb.expand(-1, t0.shape[0]),
        torch.zeros_like(kvb).expand(-1, t0.shape[0]),
    ]
    desc = torch.stack([c.expand(B * H, t0.shape[0]) for c in cols], -1).reshape(-1, 7).contiguous()
    return _launch(q, k, v, desc)


def decode_attention(filled_R: torch.Tensor, *, prefix=None, bound=None):
    """Attention of one query per row at position filled_R[r] - 1 over the row's cache slot (``prefix``: (slot_R,
    len_R), positions below len_R[r] read from slot slot_R[r]), as a function of (q [R, H, D], k_cache, v_cache).
    Its tiles (the query heads of one KV head at the row's position) are described once per decode step, for every
    layer; nothing is read on the host, so the step runs inside the decode CUDA graphs. ``bound`` is not needed."""
    held: dict = {}

    def attend(q_RHD, k_cache, v_cache):
        q = q_RHD.contiguous()
        if "desc" not in held:
            held["desc"] = _decode_desc(q.shape, k_cache, filled_R, prefix)
        return _launch(q, k_cache, v_cache, held["desc"])

    return attend


def _decode_desc(q_shape, k_cache, filled_R, prefix) -> torch.Tensor:
    R, H, D = q_shape
    KVH, dev = k_cache.shape[1], filled_R.device
    G = H // KVH
    gi = torch.arange(0, G, ATTN_BM, device=dev)  # tiles of query heads per KV head (one unless G > 16)
    r = torch.arange(R, device=dev)[:, None, None]
    g = torch.arange(KVH, device=dev)[None, :, None]
    sb, sh = k_cache.stride(0), k_cache.stride(1)
    kvb = r * sb + g * sh
    if prefix is not None:
        slot, plen = prefix
        pb, pl = slot[:, None, None] * sb + g * sh, plen[:, None, None] + 0 * g
    else:
        pb, pl = kvb, torch.zeros_like(kvb)
    shape = (R, KVH, gi.shape[0])
    cols = [(r * H + g * G + gi) * D, filled_R[:, None, None] - 1, 0 * gi, (G - gi).clamp(max=ATTN_BM), kvb, pb, pl]
    return torch.stack([c.expand(shape) for c in cols], -1).reshape(-1, 7).contiguous()


@triton.jit
def _token_log_probs_kernel(logits_ptr, stride_r, tok_ptr, temp_ptr, lp_ptr, V, BLOCK: tl.constexpr):
    # one program per row: online max / sum of exp over the row's BLOCK tiles in order, then x_tok - max - log(sum)
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(temp_ptr + row).to(tl.float32)
    inv_t = tl.where(t > 0.0, 1.0 / t, 1.0)
    offs = tl.arange(0, BLOCK)
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = tl.load(logits_ptr + row * stride_r + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    tok = tl.load(tok_ptr + row)
    x_tok = tl.load(logits_ptr + row * stride_r + tok).to(tl.float32) * inv_t
    tl.store(lp_ptr + row, (x_tok - m) - tl.log(s))


def token_log_probs(logits_RV: torch.Tensor, tokens_R: torch.Tensor, temperature_R: torch.Tensor) -> torch.Tensor:
    logits = logits_RV if logits_RV.stride(-1) == 1 else logits_RV.contiguous()
    R, V = logits.shape
    lp = torch.empty(R, dtype=torch.float32, device=logits.device)
    _token_log_probs_kernel[(R,)](
        logits, logits.stride(0), tokens_R.long().contiguous(), temperature_R.float().contiguous(), lp, V,
        BLOCK=LOGPROB_BLOCK, num_warps=ROW_WARPS,
    )  # fmt: skip
    return lp
