"""Per-token log-probs (and entropy) of chosen tokens from [T, V] logits without an FP32 copy of all logits.

Logits stay in the model's dtype (bf16/fp16). The eager path upcasts one chunk of ``chunk_size`` tokens at a
time to FP32 just before the log-softmax, applies the temperature after the upcast (dividing in bf16 first
rounds the logits a second time), and recomputes each chunk in the backward pass, so neither pass holds more
than a few [C, V] FP32 buffers. On CUDA a fused Triton kernel (``miles.policy.fused_logprob``) does the same
math in one streaming pass. The trainer and the rollout engine both call ``log_probs_and_entropy``, so train
and rollout log-probs agree.

Choose the implementation with ``impl=`` or the environment variable ``MILES_LOGPROB_IMPL``:
``auto`` (fused kernel on CUDA when Triton is installed, eager otherwise), ``eager`` or ``fused``. ``invariant``
(the trainer with ``true_on_policy``) takes the log-probs from ``miles.invariant.ops.token_log_probs``, the function
the engine reports each sampled token's log-prob with, so both are the same bits; its entropy and its backward are
the eager path's.
"""

from __future__ import annotations

import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
IMPLS = ("auto", "eager", "fused", "invariant")


def log_probs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    entropy_requires_grad: bool = False,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(tokens[t] | logits[t] / temperature) for [T, V] logits and [T] tokens.

    Returns FP32 ``(log_probs_T, entropy_T or None)``. Gradients flow to ``logits`` through the log-probs,
    and through the entropy only when ``entropy_requires_grad``. Logits must be finite and tokens valid ids in
    [0, V) (mask padded positions after the call, not with -100 here: the fused kernel does not bounds-check).
    """
    _check_inputs(logits, tokens, temperature, chunk_size)
    if logits.shape[0] == 0:
        empty_T = logits[:, :0].float().sum(-1)  # FP32 [0], still attached to the graph of ``logits``
        return empty_T, (empty_T.detach().clone() if with_entropy else None)
    chosen = resolve_impl(impl, logits)
    if chosen == "fused":
        from miles.policy.fused_logprob import fused_log_probs_and_entropy

        lp, ent = fused_log_probs_and_entropy(logits, tokens, temperature, with_entropy, entropy_requires_grad)
    elif chosen == "invariant":
        lp, ent = _InvariantLogProbs.apply(logits, tokens, temperature, chunk_size, with_entropy, entropy_requires_grad)
    else:
        lp, ent = _ChunkedLogProbs.apply(logits, tokens, temperature, chunk_size, with_entropy, entropy_requires_grad)
    return lp, (ent if with_entropy else None)


def resolve_impl(impl: str | None, logits: torch.Tensor) -> str:
    """'eager' or 'fused' for these logits, from ``impl`` or else ``MILES_LOGPROB_IMPL`` (default 'auto')."""
    choice = impl if impl is not None else os.environ.get("MILES_LOGPROB_IMPL", "auto")
    if choice not in IMPLS:
        raise ValueError(f"log-prob impl {choice!r} is not one of {IMPLS}; fix impl= or MILES_LOGPROB_IMPL")
    fused_ok = HAS_TRITON and logits.is_cuda
    if choice == "fused" and not fused_ok:
        raise ValueError(
            f"impl='fused' needs CUDA logits and Triton (device={logits.device}, HAS_TRITON={HAS_TRITON}); "
            "use impl='eager' or 'auto', or pip install 'miles[gpu]'"
        )
    if choice == "auto":
        return "fused" if fused_ok else "eager"
    return choice


class _InvariantLogProbs(torch.autograd.Function):
    """Log-probs by the engine's invariant log-softmax; entropy and backward as ``_ChunkedLogProbs``."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature, chunk_size, with_entropy, entropy_requires_grad):
        from miles.invariant.ops import token_log_probs

        T = logits.shape[0]
        tokens = tokens.long()
        temperature_T = torch.full((T,), temperature, dtype=torch.float32, device=logits.device)
        lp_T = token_log_probs(logits, tokens, temperature_T)
        ent_T = torch.empty(T, dtype=torch.float32, device=logits.device) if with_entropy else lp_T.new_empty(0)
        if with_entropy:
            for s in range(0, T, chunk_size):
                rows = slice(s, s + chunk_size)
                _forward_chunk(logits[rows], tokens[rows], temperature, torch.empty_like(lp_T[rows]), ent_T[rows])
        ctx.save_for_backward(logits, tokens, ent_T)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        if not (with_entropy and entropy_requires_grad):
            ctx.mark_non_differentiable(ent_T)
        return lp_T, ent_T

    @staticmethod
    def backward(ctx, grad_lp_T, grad_ent_T):
        return _ChunkedLogProbs.backward(ctx, grad_lp_T, grad_ent_T)


def full_fp32_log_probs_and_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The naive reference: upcast all [T, V] logits to FP32 at once, then the same math with autograd."""
    x_TV = logits.float()
    if temperature != 1.0:
        x_TV = x_TV / temperature
    logp_TV = torch.log_softmax(x_TV, dim=-1)
    lp_T = logp_TV.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    ent_T = -(logp_TV.exp() * logp_TV).sum(-1) if with_entropy else None
    return lp_T, ent_T


def _check_inputs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, chunk_size: int) -> None:
    if logits.dim() != 2 or tokens.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [T, V] and tokens [T], got {tuple(logits.shape)} and {tuple(tokens.shape)}; "
            "flatten batch and sequence dims first (logits.flatten(0, -2), tokens.flatten())"
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _upcast_chunk(logits_CV: torch.Tensor, temperature: float) -> torch.Tensor:
    # Temperature after the upcast: bf16 division would round every logit once more before the softmax.
    x_CV = logits_CV.float()
    if temperature == 1.0:
        return x_CV
    # Divide in place when the upcast made a fresh copy (one FP32 buffer instead of two); never into FP32 input.
    return x_CV.div_(temperature) if logits_CV.dtype != torch.float32 else x_CV / temperature


def _forward_chunk(logits_CV, tokens_C, temperature, lp_out_C, ent_out_C) -> None:
    # A function of its own so the chunk's FP32 buffers are freed before the next chunk allocates its own.
    logp_CV = torch.log_softmax(_upcast_chunk(logits_CV, temperature), dim=-1)
    lp_out_C.copy_(logp_CV.gather(-1, tokens_C.unsqueeze(-1)).squeeze(-1))
    if ent_out_C is not None:
        ent_out_C.copy_(-(logp_CV.exp() * logp_CV).sum(-1))


class _ChunkedLogProbs(torch.autograd.Function):
    """Chunked forward; the backward recomputes each chunk's softmax instead of saving FP32 [T, V] state."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature, chunk_size, with_entropy, entropy_requires_grad):
        T = logits.shape[0]
        tokens = tokens.long()
        lp_T = torch.empty(T, dtype=torch.float32, device=logits.device)
        ent_T = torch.empty(T, dtype=torch.float32, device=logits.device) if with_entropy else lp_T.new_empty(0)
        for s in range(0, T, chunk_size):
            rows = slice(s, s + chunk_size)
            _forward_chunk(logits[rows], tokens[rows], temperature, lp_T[rows], ent_T[rows] if with_entropy else None)
        ctx.save_for_backward(logits, tokens, ent_T)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        if not (with_entropy and entropy_requires_grad):
            ctx.mark_non_differentiable(ent_T)
        return lp_T, ent_T

    @staticmethod
    def backward(ctx, grad_lp_T, grad_ent_T):
        logits, tokens, ent_T = ctx.saved_tensors
        grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
        temperature, C = ctx.temperature, ctx.chunk_size
        has_ent_grad = grad_ent_T is not None and ent_T.numel() > 0
        for s in range(0, logits.shape[0], C):
            rows = slice(s, s + C)
            g_ent = _column(grad_ent_T, rows, logits) if has_ent_grad else None
            _backward_chunk(
                logits[rows],
                tokens[rows],
                temperature,
                _column(grad_lp_T, rows, logits),
                g_ent,
                ent_T[rows] if has_ent_grad else None,
                grad_logits[rows],
            )
        return grad_logits, None, None, None, None, None


def _backward_chunk(logits_CV, tokens_C, temperature, g_lp_C1, g_ent_C1, ent_C, grad_out_CV) -> None:
    # d lp / d x = onehot - p ;  d H / d x = -p * (log p + H) ;  d x / d logit = 1 / temperature
    x_CV = _upcast_chunk(logits_CV, temperature)
    g_lp_C1 = g_lp_C1 / temperature
    if g_ent_C1 is None:
        g_CV = torch.softmax(x_CV, dim=-1).mul_(-g_lp_C1)
    else:
        logp_CV = torch.log_softmax(x_CV, dim=-1)
        weight_CV = logp_CV.add(ent_C[:, None]).mul_(g_ent_C1 / temperature).add_(g_lp_C1)
        g_CV = logp_CV.exp_().mul_(weight_CV).neg_()
    g_CV.scatter_add_(-1, tokens_C[:, None], g_lp_C1)
    grad_out_CV.copy_(g_CV)


def _column(grad_T: torch.Tensor | None, rows: slice, logits: torch.Tensor) -> torch.Tensor:
    """[C, 1] FP32 slice of an incoming per-token gradient (zeros where autograd passed None)."""
    if grad_T is None:
        return torch.zeros(len(range(*rows.indices(logits.shape[0]))), 1, dtype=torch.float32, device=logits.device)
    return grad_T[rows, None].float()
