"""The engine's Triton kernels: fused sampling and the decode attention over per-row filled lengths.

Imported only where ``miles.rollout.sampling.use_triton`` says so (CUDA, or TRITON_INTERPRET=1 in tests); the
naive versions they are tested against are ``sample_reference`` and ``decode_attention_reference``. Neither
kernel reads a length or a seed on the host, so both run inside the engine's CUDA graphs.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError as e:  # pragma: no cover - use_triton() checks HAS_TRITON first
    raise ImportError("the engine's GPU kernels need Triton: pip install 'miles[gpu]'") from e

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU tests run these kernels in Triton's interpreter
# one vocabulary tile per one-warp program of the first pass: rows x tiles programs fill the GPU (at 512 rows of a
# 152k vocabulary, 66 us a step against 80 us with 2048-token tiles and four warps: benchmarks/decode_probe.py)
SAMPLE_BLOCK_V, SAMPLE_WARPS = 1024, 1


@triton.jit
def _sample_tiles_kernel(logits_ptr, stride_r, temp_ptr, part_ptr, V, NUM_TILES, BLOCK_V: tl.constexpr):
    # pass 1, grid (row, tile): the tile's max of x / T, sum of exp(x / T - max), and argmax
    row, tile = tl.program_id(0), tl.program_id(1)
    t = tl.load(temp_ptr + row).to(tl.float32)
    inv_t = tl.where(t <= 0.0, 1.0, 1.0 / tl.maximum(t, 1e-6))
    offs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = offs < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_r + offs, mask=ok, other=-float("inf")).to(tl.float32) * inv_t
    m = tl.max(x, 0)
    s = tl.sum(tl.where(ok, tl.exp(x - m), 0.0), 0)
    out = part_ptr + (row * NUM_TILES + tile) * 3
    tl.store(out, m)
    tl.store(out + 1, s)
    tl.store(out + 2, (tile * BLOCK_V + tl.argmax(x, 0)).to(tl.float32))


@triton.jit
def _sample_pick_kernel(
    logits_ptr, stride_r, temp_ptr, seed_ptr, part_ptr, tok_ptr, lp_ptr, V, NUM_TILES,
    BLOCK_V: tl.constexpr, TILES_PAD: tl.constexpr,
):  # fmt: skip
    # pass 2, one program per row: the log-normaliser from the tiles; greedy rows take the argmax, sampled rows
    # invert the CDF at one uniform draw: the tile first, then the token inside it (one more tile read)
    row = tl.program_id(0)
    t = tl.load(temp_ptr + row).to(tl.float32)
    greedy = t <= 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.maximum(t, 1e-6))
    c = tl.arange(0, TILES_PAD)
    cok = c < NUM_TILES
    part = part_ptr + (row * NUM_TILES + c) * 3
    m = tl.load(part, mask=cok, other=-float("inf"))
    s = tl.load(part + 1, mask=cok, other=0.0)
    M = tl.max(m, 0)
    w = tl.where(cok, s * tl.exp(m - M), 0.0)
    S = tl.sum(w, 0)
    u = tl.rand(tl.load(seed_ptr), row) * S
    cw = tl.cumsum(w, 0)
    pick = tl.minimum(tl.sum(tl.where(cok & (cw <= u), 1, 0), 0), NUM_TILES - 1)
    before = tl.sum(tl.where(c < pick, w, 0.0), 0)
    offs = pick * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = offs < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_r + offs, mask=ok, other=-float("inf")).to(tl.float32) * inv_t
    p = tl.where(ok, tl.exp(x - M), 0.0)
    over = (tl.cumsum(p, 0) + before > u) & (p > 0)
    last = tl.max(tl.where(p > 0, offs, -1), 0)  # rounding can leave u past the tile's sum: take its last token
    drawn = tl.minimum(tl.min(tl.where(over, offs, V), 0), last)
    best = tl.sum(tl.where(c == tl.argmax(m, 0), tl.load(part + 2, mask=cok, other=0.0), 0.0), 0).to(tl.int32)
    tok = tl.where(greedy, best, drawn)
    x_tok = tl.load(logits_ptr + row.to(tl.int64) * stride_r + tok).to(tl.float32) * inv_t
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(lp_ptr + row, x_tok - M - tl.log(S))


def fused_sample(
    logits_RV: torch.Tensor,
    temperature_R: torch.Tensor,
    seed_t: torch.Tensor,
    *,
    block_v: int = SAMPLE_BLOCK_V,
    num_warps: int = SAMPLE_WARPS,
):
    R, V = logits_RV.shape
    tiles = triton.cdiv(V, block_v)
    part = torch.empty(R, tiles, 3, dtype=torch.float32, device=logits_RV.device)
    tok = torch.empty(R, dtype=torch.int64, device=logits_RV.device)
    lp = torch.empty(R, dtype=torch.float32, device=logits_RV.device)
    _sample_tiles_kernel[(R, tiles)](
        logits_RV, logits_RV.stride(0), temperature_R, part, V, tiles, BLOCK_V=block_v, num_warps=num_warps
    )
    _sample_pick_kernel[(R,)](
        logits_RV, logits_RV.stride(0), temperature_R, seed_t, part, tok, lp, V, tiles,
        BLOCK_V=block_v, TILES_PAD=triton.next_power_of_2(tiles), num_warps=num_warps,
    )  # fmt: skip
    return tok, lp


@triton.jit
def _decode_attn_kernel(
    q_ptr, k_ptr, v_ptr, lens_ptr, pslot_ptr, plen_ptr, acc_ptr, ml_ptr, out_ptr,
    sq_r, sq_h, sk_b, sk_h, sk_n, sm_scale, split_len,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    IEEE: tl.constexpr, HAS_PREFIX: tl.constexpr,
):  # fmt: skip
    # grid (row, kv head, split): the query heads sharing one KV head attend over keys [split start, end) only.
    # Positions below the row's shared-prefix length are read from the slot that holds the prefix (a GRPO group's
    # prompt, prefilled once into its first slot): the group's rows are neighbouring programs, so they read it
    # from L2 rather than each its own copy from memory
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
    if HAS_PREFIX:
        n_prefix = tl.load(plen_ptr + row)
        base_prefix = tl.load(pslot_ptr + row).to(tl.int64) * sk_b + kvh * sk_h
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = offs_n < end
        if HAS_PREFIX:
            kv_off = tl.where(offs_n < n_prefix, base_prefix, base)[:, None] + offs_n[:, None] * sk_n + offs_d[None, :]
        else:
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
    keep = offs_g < G
    if NUM_SPLITS == 1:  # the whole row in one program: normalise here, no partials and no reduce kernel
        o = (row * (G * tl.num_programs(1)) + heads)[:, None] * D + offs_d[None, :]
        tl.store(out_ptr + o, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=keep[:, None])
    else:
        out = (row * (G * tl.num_programs(1)) + heads) * NUM_SPLITS + split  # [rows, heads, splits]
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


def decode_attention_triton(
    q_RHD, k_cache, v_cache, lens_R, num_splits: int, prefix=None, *, block_n: int = 32, num_warps: int = 1,
    num_stages: int = 3,
):  # fmt: skip
    """q [R, H, D]; caches [B >= R, KVH, S, D] (D contiguous); lens [R] filled positions (current token included);
    ``prefix``: (slot_R, len_R), positions below len_R[r] read from cache slot slot_R[r] (None: every row its own).
    Small programs (one warp, 32 keys a block, three blocks in flight): at 512 rows of the 0.5B model, 256 positions
    of which 128 shared, 11.4 us a layer against 16.4 us with four warps and 64 keys (benchmarks/decode_probe.py)."""
    R, H, D = q_RHD.shape
    KVH, S = k_cache.shape[1], k_cache.shape[2]
    G = H // KVH
    split_len = -(-S // num_splits)
    split_len = -(-split_len // block_n) * block_n
    out = torch.empty(R, H, D, dtype=q_RHD.dtype, device=q_RHD.device)
    acc = ml = out  # one split writes ``out`` itself; more write per-split partials that a second kernel merges
    if num_splits > 1:
        acc = torch.empty(R, H, num_splits, D, dtype=torch.float32, device=q_RHD.device)
        ml = torch.empty(R, H, num_splits, 2, dtype=torch.float32, device=q_RHD.device)
    pslot, plen = prefix if prefix is not None else (lens_R, lens_R)
    _decode_attn_kernel[(R, KVH, num_splits)](
        q_RHD, k_cache, v_cache, lens_R, pslot, plen, acc, ml, out,
        q_RHD.stride(0), q_RHD.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        D ** -0.5, split_len,
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        IEEE=q_RHD.dtype == torch.float32, HAS_PREFIX=prefix is not None, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(R * H,)](acc, ml, out, D=D, NUM_SPLITS=num_splits, num_warps=1)
    return out


@triton.jit
def _add_rmsnorm_kernel(x_ptr, d_ptr, w_ptr, y_ptr, H, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
    # x += d (rounded to x's dtype, as torch adds), then y = w * (x * rsqrt(mean(x^2) + eps)) in the decoder's
    # order of roundings: the normalised row is cast to the model dtype before the weight multiplies it
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    x = tl.load(x_ptr + row * H + offs, mask=ok, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + tl.load(d_ptr + row * H + offs, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(x_ptr + row * H + offs, x, mask=ok)
    xf = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(xf * xf, 0) / H + eps)
    n = (xf * r).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * H + offs, (w * n).to(x.dtype), mask=ok)


def add_rmsnorm(x_NH: torch.Tensor, delta_NH: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """In place ``x += delta`` (when given), returns rmsnorm(x); x contiguous [N, H]."""
    N, H = x_NH.shape
    y = torch.empty_like(x_NH)
    d = delta_NH if delta_NH is not None else x_NH
    _add_rmsnorm_kernel[(N,)](x_NH, d, weight, y, H, eps, ADD=delta_NH is not None, BLOCK=triton.next_power_of_2(H))
    return y


@triton.jit
def _rope_kv_kernel(
    qkv_ptr, s_qkv, cos_ptr, sin_ptr, lens_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, sk_b, sk_h, sk_n,
    qn_ptr, kn_ptr, eps, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, NH_PAD: tl.constexpr,
    QK_NORM: tl.constexpr, MUL_RN: tl.constexpr,
):  # fmt: skip
    # one program per row, its q, k and v heads as one [heads, D] tile: (Qwen3) RMSNorm of each q and k head, then
    # rotary at the row's position; k and v into the cache. The rotated half is re-read at the swapped offsets
    row = tl.program_id(0)
    pos = tl.load(lens_ptr + row)
    hd = tl.arange(0, NH_PAD)[:, None]  # head index: q heads, then k, then v
    offs = tl.arange(0, D)[None, :]
    half = D // 2
    swap = tl.where(offs < half, offs + half, offs - half)
    real = hd < H + 2 * KVH
    src = qkv_ptr + row * s_qkv + hd * D
    x = tl.load(src + offs, mask=real, other=0.0)
    xr = tl.load(src + swap, mask=real, other=0.0)
    c = tl.load(cos_ptr + pos * D + offs).to(tl.float32)
    s = tl.load(sin_ptr + pos * D + offs).to(tl.float32)
    if QK_NORM:  # w * (x * rsqrt(mean(x^2) + eps)), rounded to the model dtype before the weight, as RMSNorm
        xf = x.to(tl.float32)
        r = tl.rsqrt(tl.sum(xf * xf, 1) / D + eps)[:, None]
        is_q = hd < H
        w = tl.where(is_q, tl.load(qn_ptr + offs), tl.load(kn_ptr + offs)).to(tl.float32)
        w_sw = tl.where(is_q, tl.load(qn_ptr + swap), tl.load(kn_ptr + swap)).to(tl.float32)
        normed = (w * (xf * r).to(x.dtype).to(tl.float32)).to(x.dtype)
        normed_r = (w_sw * (xr.to(tl.float32) * r).to(x.dtype).to(tl.float32)).to(x.dtype)
        x = tl.where(hd < H + KVH, normed, x)
        xr = tl.where(hd < H + KVH, normed_r, xr)
    xr = xr.to(tl.float32)
    xr = tl.where(offs < half, -xr, xr)
    # each product rounded to the model dtype before the sum, as torch's q * cos + rotate_half(q) * sin; mul_rn
    # because a plain product is fused into the add as one FMA on the GPU (the rounding in between elided),
    # which put bf16 q/k values an ulp off and the engine's log-probs off the trainer's (BENCHMARKS.md)
    if MUL_RN:
        a = libdevice.mul_rn(x.to(tl.float32), c).to(x.dtype).to(tl.float32)
        b = libdevice.mul_rn(xr, s).to(x.dtype).to(tl.float32)
    else:  # the interpreter (CPU tests) has no libdevice, and numpy does not fuse
        a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
        b = (xr * s).to(x.dtype).to(tl.float32)
    x = tl.where(hd < H + KVH, (a + b).to(x.dtype), x)
    tl.store(q_out_ptr + (row * H + hd) * D + offs, x, mask=hd < H)
    kv = tl.where(hd < H + KVH, hd - H, hd - H - KVH)
    dst = row.to(tl.int64) * sk_b + kv * sk_h + pos.to(tl.int64) * sk_n + offs
    tl.store(k_cache_ptr + dst, x, mask=(hd >= H) & (hd < H + KVH))
    tl.store(v_cache_ptr + dst, x, mask=(hd >= H + KVH) & real)


def rope_kv(qkv_RX, cos, sin, lens_R, k_cache, v_cache, H: int, KVH: int, D: int, qk_norm=None) -> torch.Tensor:
    """qkv [R, (H + 2 KVH) D] (q, k, v heads in order): q rotated -> [R, H, D]; k rotated and v into the caches.
    ``qk_norm``: (q_norm weight, k_norm weight, eps) of a Qwen3 layer, applied to each q and k head first."""
    R = qkv_RX.shape[0]
    q = torch.empty(R, H, D, dtype=qkv_RX.dtype, device=qkv_RX.device)
    qn, kn, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)
    _rope_kv_kernel[(R,)](
        qkv_RX, qkv_RX.stride(0), cos, sin, lens_R, q, k_cache, v_cache,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), qn, kn, eps,
        H=H, KVH=KVH, D=D, NH_PAD=triton.next_power_of_2(H + 2 * KVH), QK_NORM=qk_norm is not None,
        MUL_RN=not INTERPRETED, num_warps=4,
    )  # fmt: skip
    return q


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr):
    # [N, 2I] (gate | up) -> silu(gate) * up, rounded like F.silu(gate) * up
    row, blk = tl.program_id(0), tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    g = tl.load(gu_ptr + row * 2 * I + offs, mask=ok, other=0.0)
    u = tl.load(gu_ptr + row * 2 * I + I + offs, mask=ok, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * I + offs, (a * u).to(g.dtype), mask=ok)


def silu_mul(gu_NI2: torch.Tensor) -> torch.Tensor:
    N, I2 = gu_NI2.shape
    out = torch.empty(N, I2 // 2, dtype=gu_NI2.dtype, device=gu_NI2.device)
    _silu_mul_kernel[(N, triton.cdiv(I2 // 2, 1024))](gu_NI2, out, I2 // 2, BLOCK=1024)
    return out


@triton.jit
def _advance_kernel(
    tok_ptr, lp_ptr, finished_ptr, stopped_ptr, num_gen_ptr, lens_ptr, tokens_ptr, max_new_ptr, stop_ptr,
    out_ids_ptr, out_lps_ptr, seed_ptr, W, STOPS: tl.constexpr,
):  # fmt: skip
    # one program per row of a decode step over slots [0, R): rows.advance's bookkeeping in one kernel
    row = tl.program_id(0)
    live = tl.load(finished_ptr + row).to(tl.int32) == 0
    n = tl.load(num_gen_ptr + row)
    t = tl.load(tok_ptr + row)
    out = row.to(tl.int64) * W + n
    tl.store(out_ids_ptr + out, t)  # a finished row writes past its last token: never read
    tl.store(out_lps_ptr + out, tl.load(lp_ptr + row))
    stops = tl.load(stop_ptr + row * STOPS + tl.arange(0, STOPS))
    hit = tl.sum((stops == t).to(tl.int32), 0) > 0
    n_next = n + live.to(tl.int64)
    tl.store(num_gen_ptr + row, n_next)
    tl.store(lens_ptr + row, tl.load(lens_ptr + row) + live.to(tl.int64))
    tl.store(tokens_ptr + row, tl.where(live, t, tl.load(tokens_ptr + row)))
    stopped = (tl.load(stopped_ptr + row).to(tl.int32) != 0) | (live & hit)
    done = (n_next >= tl.load(max_new_ptr + row)) | hit
    tl.store(stopped_ptr + row, stopped.to(tl.int1))
    tl.store(finished_ptr + row, ((~live) | done).to(tl.int1))
    if row == 0:
        tl.store(seed_ptr, tl.load(seed_ptr) + 1)


def advance_rows(st, R: int, tok_R: torch.Tensor, lp_R: torch.Tensor) -> None:
    """``rows.advance(st, slice(0, R), tok, lp)`` as one kernel (the state's tensors updated in place)."""
    _advance_kernel[(R,)](
        tok_R, lp_R, st.finished, st.stopped, st.num_gen, st.lens, st.tokens, st.max_new, st.stop_ids,
        st.out_ids, st.out_lps, st.seed, st.out_ids.shape[1], STOPS=st.stop_ids.shape[1], num_warps=1,
    )  # fmt: skip
