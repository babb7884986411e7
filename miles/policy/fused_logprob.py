"""Fused Triton kernel for per-token log-probs and entropy: one streaming pass over bf16/fp16 logits.

The eager chunked path reads the logits, writes and re-reads several FP32 [C, V] buffers per chunk; this
kernel reads each logit once, upcasts it in registers, scales it by 1/temperature (after the upcast; within
1 ulp of a division), and keeps an online max / sum-exp (and, for the entropy, an online sum of
exp(x - m) * (x - m)) in FP32. The backward pass
recomputes the softmax from the saved logits and per-row log-normaliser and writes the gradient directly in
the logits' dtype, so no FP32 [T, V] buffer exists in either pass. Imported lazily by
``miles.policy.logprob`` on CUDA; needs Triton (``pip install 'miles[gpu]'``).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - the dispatcher checks HAS_TRITON before importing us
    raise ImportError("the fused log-prob kernel needs Triton: pip install 'miles[gpu]'") from e

# One program per row streams the row in BLOCK_V tiles (32 FP32 values per thread). The fastest tile of
# `miles bench logprob --sweep` on one H200 (T=8192, V=151,936, bf16), forward and forward+backward; the sweep's
# figures are in benchmarks/results/logprob.gpu.json ("fused_sweep") and BENCHMARKS.md.
BLOCK_V = 8192
NUM_WARPS = 8


@triton.jit
def _logprob_fwd_kernel(
    logits_ptr,
    stride_t,
    tokens_ptr,
    lp_ptr,
    ent_ptr,
    logz_ptr,
    V,
    inv_temp,
    WITH_ENTROPY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_t
    offs = tl.arange(0, BLOCK)
    m = float("-inf")  # running max of x = logit / temperature
    s = 0.0  # sum exp(x - m)
    t = 0.0  # sum exp(x - m) * (x - m), for the entropy
    for start in range(0, V, BLOCK):
        cols = start + offs
        mask = cols < V
        x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(m == float("-inf"), 0.0, m - m_new)  # 0 on the first tile (s = t = 0 there)
        scale = tl.exp(shift)
        e = tl.exp(x - m_new)  # masked lanes: exp(-inf) = 0
        if WITH_ENTROPY:
            t = scale * (t + s * shift) + tl.sum(tl.where(mask, e * (x - m_new), 0.0), axis=0)
        s = s * scale + tl.sum(e, axis=0)
        m = m_new
    log_s = tl.log(s)
    tok = tl.load(tokens_ptr + row)
    x_tok = tl.load(row_ptr + tok).to(tl.float32) * inv_temp
    tl.store(lp_ptr + row, x_tok - m - log_s)
    tl.store(logz_ptr + row, m + log_s)
    if WITH_ENTROPY:
        tl.store(ent_ptr + row, log_s - t / s)


@triton.jit
def _logprob_bwd_kernel(
    logits_ptr,
    stride_t,
    tokens_ptr,
    logz_ptr,
    ent_ptr,
    grad_lp_ptr,
    grad_ent_ptr,
    grad_ptr,
    stride_g,
    V,
    inv_temp,
    HAS_LP_GRAD: tl.constexpr,
    HAS_ENT_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_t
    out_ptr = grad_ptr + row * stride_g
    offs = tl.arange(0, BLOCK)
    logz = tl.load(logz_ptr + row)
    tok = tl.load(tokens_ptr + row)
    g_lp = 0.0
    g_ent = 0.0
    ent = 0.0
    if HAS_LP_GRAD:
        g_lp = tl.load(grad_lp_ptr + row)
    # d lp / d x = onehot - p ;  d H / d x = -p * (log p + H) ;  d x / d logit = 1 / temperature
    if HAS_ENT_GRAD:
        g_ent = tl.load(grad_ent_ptr + row)
        ent = tl.load(ent_ptr + row)
    for start in range(0, V, BLOCK):
        cols = start + offs
        mask = cols < V
        logp = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp - logz
        p = tl.exp(logp)
        w = g_lp
        if HAS_ENT_GRAD:
            w = w + g_ent * (logp + ent)
        g = tl.where(cols == tok, g_lp, 0.0) - p * w
        tl.store(out_ptr + cols, (g * inv_temp).to(grad_ptr.dtype.element_ty), mask=mask)


def _forward(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool):
    T, V = logits.shape
    lp_T = torch.empty(T, dtype=torch.float32, device=logits.device)
    logz_T = torch.empty_like(lp_T)
    ent_T = torch.empty_like(lp_T) if with_entropy else lp_T.new_empty(0)
    _logprob_fwd_kernel[(T,)](
        logits,
        logits.stride(0),
        tokens,
        lp_T,
        ent_T,
        logz_T,
        V,
        1.0 / temperature,
        WITH_ENTROPY=with_entropy,
        BLOCK=BLOCK_V,
        num_warps=NUM_WARPS,
    )
    return lp_T, ent_T, logz_T


class _FusedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, temperature, with_entropy, entropy_requires_grad):
        lp_T, ent_T, logz_T = _forward(logits, tokens, temperature, with_entropy)
        ctx.save_for_backward(logits, tokens, logz_T, ent_T)
        ctx.temperature = temperature
        if not (with_entropy and entropy_requires_grad):
            ctx.mark_non_differentiable(ent_T)
        return lp_T, ent_T

    @staticmethod
    def backward(ctx, grad_lp_T, grad_ent_T):
        logits, tokens, logz_T, ent_T = ctx.saved_tensors
        T, V = logits.shape
        grad_logits = torch.empty((T, V), dtype=logits.dtype, device=logits.device)
        has_ent_grad = grad_ent_T is not None and ent_T.numel() > 0
        _logprob_bwd_kernel[(T,)](
            logits,
            logits.stride(0),
            tokens,
            logz_T,
            ent_T,
            _contiguous_f32(grad_lp_T, logz_T),
            _contiguous_f32(grad_ent_T if has_ent_grad else None, logz_T),
            grad_logits,
            grad_logits.stride(0),
            V,
            1.0 / ctx.temperature,
            HAS_LP_GRAD=grad_lp_T is not None,
            HAS_ENT_GRAD=has_ent_grad,
            BLOCK=BLOCK_V,
            num_warps=NUM_WARPS,
        )
        return grad_logits, None, None, None, None


def _contiguous_f32(grad_T: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like if grad_T is None else grad_T.float().contiguous()  # ``like`` is a placeholder never read


def fused_log_probs_and_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool, entropy_requires_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel entry used by ``log_probs_and_entropy``: FP32 ``(log_probs_T, entropy_T or empty)``."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return _FusedLogProbs.apply(logits, tokens.long().contiguous(), temperature, with_entropy, entropy_requires_grad)
