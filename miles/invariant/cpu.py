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

from miles.invariant import exact

ATTENTION_CHUNK = 1 << 22  # elements of the [rows, heads, queries, keys, head_dim] products held at once


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
    last one given must not be needed). Scores are exact fixed-point dot products rounded to FP32 and scaled; the
    softmax takes the exact maximum, ``exact.exp`` and tree sums over keys with the masked ones -0.0, so neither
    the number of keys nor their masked contents change a bit. Rows go in chunks to bound the [.., keys, D] products."""
    B, H, T, D = q_BHTD.shape
    S = k_BKSD.shape[2]
    per_row = H * T * S * D
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
    if KVH != H:  # grouped-query attention: each KV head serves H / KVH query heads (exact copies)
        k, v = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
    bits = exact.bits_for(D)
    qg = exact.to_grid(q.reshape(-1, D), bits).view(B, H, T, D)
    kg = exact.to_grid(k.reshape(-1, D), bits).view(B, H, S, D)
    scores = torch.matmul(qg, kg.transpose(-1, -2)).float() * (D**-0.5)  # exact sums, one rounding
    seen = torch.arange(S, device=q.device)[None, None, None, :] <= qpos[:, None, :, None]  # [B, 1, T, S]
    scores = torch.where(seen, scores, float("-inf"))
    m = scores.amax(-1, keepdim=True)
    p = torch.where(seen, exact.exp(scores - m), -0.0)  # [B, H, T, S]
    den = exact.tree_sum(p, -1)
    pv = torch.where(seen[..., None], p[..., None] * v.float()[:, :, None], -0.0)  # [B, H, T, S, D]
    return (exact.tree_sum(pv, -2) / den[..., None]).to(q.dtype)


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


def decode_attention(q_RHD, k_cache, v_cache, lens_R, *, bound=None, prefix=None) -> torch.Tensor:
    """Row r's query at position lens_R[r] - 1 over its cache slot cut at ``bound`` (positions below prefix[1][r]
    read from slot prefix[0][r]): ``attention`` with one query per row, so the same bits as in a full sequence."""
    R = q_RHD.shape[0]
    S = min(bound or k_cache.shape[2], k_cache.shape[2])
    k, v = k_cache[:R, :, :S], v_cache[:R, :, :S]
    if prefix is not None:
        slot, n = prefix
        held = (torch.arange(S, device=q_RHD.device)[None] < n[:, None])[:, None, :, None]
        k = torch.where(held, k_cache[slot, :, :S], k)
        v = torch.where(held, v_cache[slot, :, :S], v)
    return attention(q_RHD[:, :, None], k, v, (lens_R - 1)[:, None])[:, :, 0]
