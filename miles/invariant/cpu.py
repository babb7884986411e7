"""The invariant forward ops on CPU, in FP32 and bf16 (and fp16), from the building blocks of miles.invariant.exact.

Each op maps a row (a token's hidden state, a query, a row of logits) to its output by arithmetic that depends on
that row's values only: not on the other rows, their number, the row's place in the tensor or the thread split.
Attention reduces over keys by the aligned tree of ``exact.tree_sum`` with masked keys as -0.0, so a query at
position t gets the same bits from a prefill over the prompt, a decode step over the cache (any cache length) and
the trainer's forward over the whole sequence. Results are rounded to the model dtype where the standard decoder
rounds (the matmul output, the normalised row before the norm weight, SiLU before the product), with torch's own
elementwise casts and bf16 arithmetic, which are single correctly rounded operations in the vector body and in
the scalar tail alike (ATen rounds FP32 to bf16 with the same integer round-to-nearest-even in both).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles.invariant import exact

ATTENTION_CHUNK = 1 << 22  # elements of the [rows, heads, queries, keys or block x head_dim] temporaries at once
KEY_BLOCK = 16  # keys whose weighted values are summed exactly at once: 16 x 2^(25 + 24) <= 2^53
P_BITS, V_BITS = 25, 24  # grid bits of the softmax weights (absolute: p <= 1) and of the values (per block, column)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias), exact FP64 sum of fixed-point rows, rounded to FP32, bias added in
    FP32, then rounded to the input dtype (one matmul output rounding, as a bf16 GEMM with an FP32 accumulator)."""
    K = x.shape[-1]
    out = exact.exact_matmul(x.reshape(-1, K), weight)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)), the sum of squares by the aligned tree, the normalised row rounded to
    the model dtype before the weight multiplies it (the standard decoder's order of roundings)."""
    xf = x.float()
    mean = exact.tree_sum(xf * xf, -1) / x.shape[-1]
    n = xf * exact.reciprocal_sqrt(mean + eps)[..., None]
    return weight * n.to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: gate / (1 + e^-gate) in FP32, rounded to the model dtype, times up (as F.silu(g) * u)."""
    g = gate.float()
    return (g / (exact.exp(-g) + 1.0)).to(gate.dtype) * up


def attention(q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, qpos_BT: torch.Tensor) -> torch.Tensor:
    """Causal attention by absolute position: query (b, t) attends to keys 0..qpos[b, t] of row b (keys past the
    last one given must not be needed). The scores are exact fixed-point dot products rounded to FP32; the softmax
    weights p = exp(s - max) go on a fixed grid of 2^-25; the sum over keys is exact within each aligned block of
    ``KEY_BLOCK`` keys (values on a grid per block and column, from the block's keys up to the query: the same keys
    in a prefill, a decode step over any cache and the trainer's sequence), and the blocks add by the aligned tree
    with masked ones -0.0. Rows go in chunks to bound the [.., queries, block, D] temporaries."""
    B, H, T, D = q_BHTD.shape
    S = k_BKSD.shape[2]
    per_row = H * T * (S + KEY_BLOCK * D)
    step = max(1, ATTENTION_CHUNK // max(1, per_row))
    qpos_BT = qpos_BT.expand(B, T)
    outs = [
        _attention_rows(q_BHTD[b : b + step], k_BKSD[b : b + step], v_BKSD[b : b + step], qpos_BT[b : b + step])
        for b in range(0, B, step)
    ]
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _attention_rows(q, k, v, qpos):
    B, H, T, D = q.shape
    KVH, S = k.shape[1], k.shape[2]
    qpos = qpos.clamp(max=S - 1)  # a decode step's finished rows may sit past the cut: their output is not read
    if KVH != H:  # grouped-query attention: each KV head serves H / KVH query heads (exact copies)
        k, v = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
    bits = exact.bits_for(D)
    qg = exact.to_grid(q.reshape(-1, D), bits).view(B, H, T, D)
    kg = exact.to_grid(k.reshape(-1, D), bits).view(B, H, S, D)
    scores = torch.matmul(qg, kg.transpose(-1, -2)).float() * (D**-0.5)  # exact sums, one rounding
    seen = torch.arange(S, device=q.device)[None, None, None, :] <= qpos[:, None, :, None]  # [B, 1, T, S]
    scores = torch.where(seen, scores, float("-inf"))
    p = torch.where(seen, exact.exp(scores - scores.amax(-1, keepdim=True)), 0.0)
    pq = torch.round(p.double() * 2.0**P_BITS)  # integers <= 2^25
    acc = _weighted_values(pq, v.float(), qpos)
    return (acc / pq.sum(-1, keepdim=True)).float().to(q.dtype)  # the sum of integers is exact: any order


def _weighted_values(pq, v, qpos):
    """sum_j pq[.., t, j] v[.., j, :] per query, in FP64: exact within each key block, blocks added by the tree."""
    B, H, T, S = pq.shape
    D, KB = v.shape[-1], KEY_BLOCK
    nblk = -(-S // KB)
    pad = nblk * KB - S
    if pad:
        pq, v = F.pad(pq, (0, pad)), F.pad(v, (0, 0, 0, pad))
    vb = v.view(B, H, nblk, KB, D)
    top = vb.abs().cummax(3).values  # a column's largest |v| in its block up to each key
    per_block = pq.view(B, H, T, nblk, KB).transpose(2, 3) @ _on_grid(vb, top[:, :, :, -1:])  # whole blocks, exact
    # each query's own block, keys past the query zeroed, on the grid of its largest value up to the query
    c_t, r_t = (qpos // KB)[:, None, :].expand(B, H, T), (qpos % KB)[:, None, :].expand(B, H, T)
    rows = (torch.arange(B * H, device=v.device).view(B, H, 1) * nblk + c_t).reshape(-1)  # (b, h, block) per query
    mine = vb.reshape(B * H * nblk, KB, D).index_select(0, rows)  # [B*H*T, KB, D]
    keep = torch.arange(KB, device=v.device)[None, :, None] <= r_t.reshape(-1, 1, 1)
    mine = torch.where(keep, mine, 0.0)
    up_to_t = top.reshape(B * H * nblk * KB, D).index_select(0, rows * KB + r_t.reshape(-1))  # [B*H*T, D]
    p_mine = pq.view(B * H * T, nblk, KB)[torch.arange(B * H * T, device=v.device), c_t.reshape(-1)]
    step = _grid_step(up_to_t)
    diagonal = (p_mine[..., None] * torch.round(mine.double() * step.reciprocal()[:, None])).sum(1) * step
    blk = torch.arange(nblk, device=v.device)[:, None]
    own = c_t[..., None, None]
    parts = torch.where(
        blk < own, per_block.permute(0, 1, 3, 2, 4), torch.where(blk == own, diagonal.view(B, H, T, 1, D), -0.0)
    )
    return exact.tree_sum(parts, -2)


def _grid_step(top):
    """2^(e - 24) in FP64 where |top| < 2^e (FP32 ``top``): the grid step of values whose largest is ``top``."""
    return exact.pow2_f64(((top.contiguous().view(torch.int32).to(torch.int64) >> 23) - 126) - V_BITS)


def _on_grid(x, top):
    """x (FP32) rounded to multiples of the grid step of ``top``, as FP64 (scalings by powers of two: exact)."""
    step = _grid_step(top)
    return torch.round(x.double() * step.reciprocal()) * step


def token_log_probs(logits_RV: torch.Tensor, tokens_R: torch.Tensor, temperature_R: torch.Tensor) -> torch.Tensor:
    """log softmax(logits / T)[token] per row in FP32: the logits upcast first, times 1/T (a reciprocal of the FP32
    temperature; T <= 0 counts as 1: a greedy row reports its log-prob at temperature 1), then
    (x_tok - max) - log(sum exp(x - max)) with the sum by the aligned tree."""
    t = temperature_R.float()
    inv_t = torch.where(t > 0, t.reciprocal(), torch.ones_like(t))
    x = logits_RV.float() * inv_t[:, None]
    m = x.amax(-1)
    s = exact.tree_sum(exact.exp(x - m[:, None]), -1)
    x_tok = x.gather(-1, tokens_R.long()[:, None])[:, 0]
    return (x_tok - m) - exact.log(s)


def decode_attention(filled_R: torch.Tensor, *, prefix=None, bound=None):
    """Attention of one query per row at position filled_R[r] - 1 over its cache slot cut at ``bound`` (positions
    below prefix[1][r] read from slot prefix[0][r]), as a function of (q [R, H, D], k_cache, v_cache): ``attention``
    with one query per row, so the same bits as in a full sequence."""
    return lambda q, k_cache, v_cache: _decode_rows(q, k_cache, v_cache, filled_R, bound, prefix)


def _decode_rows(q_RHD, k_cache, v_cache, lens_R, bound, prefix) -> torch.Tensor:
    R = q_RHD.shape[0]
    S = min(bound or k_cache.shape[2], k_cache.shape[2])
    k, v = k_cache[:R, :, :S], v_cache[:R, :, :S]
    if prefix is not None:
        slot, n = prefix
        held = (torch.arange(S, device=q_RHD.device)[None] < n[:, None])[:, None, :, None]
        k = torch.where(held, k_cache[slot, :, :S], k)
        v = torch.where(held, v_cache[slot, :, :S], v)
    return attention(q_RHD[:, :, None], k, v, (lens_R - 1)[:, None])[:, :, 0]
