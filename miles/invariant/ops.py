"""The invariant ops as the decoder calls them: one entry per op, the device's implementation chosen per call
(miles.invariant.cpu on CPU, the Triton kernels of miles.invariant.gpu on CUDA), and autograd through a Function
whose forward is the invariant op and whose backward is the standard one.

Only forward values must agree between engine and trainer, so each backward recomputes the op with standard torch
(nn.functional / SDPA / a bf16 matmul) and differentiates that: the same mathematical function, a few ulps away,
at the standard kernels' speed. ``MILES_INVARIANT_IMPL=triton`` (with ``TRITON_INTERPRET=1``) runs the Triton
kernels on CPU tensors, which the CPU tests use to check their indexing; ``auto`` picks by device.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from miles.invariant import cpu

IMPLS = ("auto", "cpu", "triton")


def _impl(t: torch.Tensor):
    choice = os.environ.get("MILES_INVARIANT_IMPL", "auto")
    if choice not in IMPLS:
        raise ValueError(f"MILES_INVARIANT_IMPL = {choice!r} is not one of {IMPLS}")
    if choice == "triton" or (choice == "auto" and t.is_cuda):
        from miles.invariant import gpu

        return gpu
    return cpu


def _recompute_grads(fn, inputs: tuple, needs: tuple, grad_out: torch.Tensor) -> tuple:
    """Gradients of the standard ``fn`` at ``inputs`` for those whose ``needs`` is set (None for the others)."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(bool(n)) for t, n in zip(inputs, needs)]
        wanted = [t for t in leaves if t.requires_grad]
        if not wanted:
            return tuple(None for _ in leaves)
        got = iter(torch.autograd.grad(fn(*leaves), wanted, grad_out, allow_unused=True))
    return tuple(next(got) if t.requires_grad else None for t in leaves)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _impl(x).linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        gx = (g2 @ weight).view_as(x) if ctx.needs_input_grad[0] else None
        gw = g2.T @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def standard_rms_norm(x, weight, eps):
    dtype = x.dtype
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _impl(x).rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gx, gw = _recompute_grads(
            lambda a, w: standard_rms_norm(a, w, ctx.eps), (x, weight), ctx.needs_input_grad[:2], g
        )
        return gx, gw, None


def standard_silu_mul(gate, up):
    return F.silu(gate) * up


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _impl(gate).silu_mul(gate, up)

    @staticmethod
    def backward(ctx, g):
        return _recompute_grads(standard_silu_mul, ctx.saved_tensors, ctx.needs_input_grad, g)


def standard_attention(q, k, v, qpos_BT):
    """SDPA with the causal-by-position mask of ``qpos`` (None: positions 0.., the usual causal attention)."""
    gqa = q.shape[1] != k.shape[1]
    if qpos_BT is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    seen = torch.arange(k.shape[2], device=q.device)[None, None, None, :] <= qpos_BT[:, None, :, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=seen, enable_gqa=gqa)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, qpos_BT, from_zero: bool):
        ctx.save_for_backward(q, k, v, qpos_BT)
        ctx.from_zero = from_zero
        return _impl(q).attention(q, k, v, qpos_BT)

    @staticmethod
    def backward(ctx, g):
        q, k, v, qpos = ctx.saved_tensors
        qpos = None if ctx.from_zero else qpos  # the usual causal attention: SDPA's flash backward
        grads = _recompute_grads(
            lambda a, b, c: standard_attention(a, b, c, qpos), (q, k, v), ctx.needs_input_grad[:3], g
        )
        return (*grads, None, None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T + bias, each output row independent of the others (see miles.invariant.cpu)."""
    return _Linear.apply(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNorm.apply(x, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _SiluMul.apply(gate, up)


def attention(q_BHTD, k_BKSD, v_BKSD, qpos_BT: torch.Tensor | None = None) -> torch.Tensor:
    """Query (b, t) attends to keys 0..qpos[b, t]; keys are indexed by absolute position from 0. ``qpos`` None:
    query t is at position t over as many keys (the trainer's sequences, the engine's prompts)."""
    B, _, T, _ = q_BHTD.shape
    from_zero = qpos_BT is None and k_BKSD.shape[2] == T
    if qpos_BT is None:
        qpos_BT = torch.arange(T, device=q_BHTD.device)[None]
    return _Attention.apply(q_BHTD, k_BKSD, v_BKSD, qpos_BT.expand(B, T), from_zero)


def decode_attention(filled_R: torch.Tensor, *, prefix=None, bound=None):
    """A decode step's attention, ``attend(q [R, H, D], k_cache, v_cache) -> [R, H, D]``, built once per step for
    every layer: row r's query at position filled_R[r] - 1 over its cache slot (positions below the prefix length
    read from the prefix slot), the same reduction ``attention`` gives that position in a full sequence."""
    return _impl(filled_R).decode_attention(filled_R, prefix=prefix, bound=bound)


def token_log_probs(logits_RV: torch.Tensor, tokens_R: torch.Tensor, temperature_R: torch.Tensor) -> torch.Tensor:
    """FP32 log softmax(logits / T)[token] per row (T <= 0: at temperature 1), engine and trainer alike."""
    return _impl(logits_RV).token_log_probs(logits_RV, tokens_R, temperature_R)
