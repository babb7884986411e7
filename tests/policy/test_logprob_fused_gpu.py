"""The fused Triton log-prob kernel matches the full-FP32 reference on CUDA (forward, backward, entropy)."""

from __future__ import annotations

import pytest
import torch

from miles.policy.logprob import HAS_TRITON, full_fp32_log_probs_and_entropy, log_probs_and_entropy, resolve_impl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton"),
]

V = 151_936  # a real vocabulary: several V tiles plus a ragged last tile


def _inputs(dtype, T=67, V=V, seed=0, requires_grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(T, V, generator=g, device="cuda") * 4).to(dtype).requires_grad_(requires_grad)
    tokens = torch.randint(0, V, (T,), generator=g, device="cuda")
    return logits, tokens


def test_auto_picks_the_fused_kernel_on_cuda():
    assert resolve_impl(None, _inputs(torch.bfloat16, T=1)[0]) == "fused"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_log_probs_matches_reference(dtype, temperature):
    logits, tokens = _inputs(dtype)
    lp, ent = log_probs_and_entropy(logits, tokens, temperature=temperature, with_entropy=True, impl="fused")
    lp_ref, ent_ref = full_fp32_log_probs_and_entropy(logits, tokens, temperature=temperature)
    # Same math, different FP32 summation order over 151,936 terms: a few ulps of |log p| ~ 20.
    torch.testing.assert_close(lp, lp_ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("entropy_requires_grad", [False, True])
def test_fused_gradients_match_reference(dtype, entropy_requires_grad):
    logits, tokens = _inputs(dtype, requires_grad=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    w_lp, w_ent = (
        torch.randn(logits.shape[0], generator=g, device="cuda"),
        torch.randn(logits.shape[0], generator=g, device="cuda"),
    )

    def grad_of(lp, ent):
        loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if entropy_requires_grad else 0)
        return torch.autograd.grad(loss, logits)[0]

    grad = grad_of(
        *log_probs_and_entropy(
            logits,
            tokens,
            temperature=0.7,
            with_entropy=True,
            entropy_requires_grad=entropy_requires_grad,
            impl="fused",
        )
    )
    grad_ref = grad_of(*full_fp32_log_probs_and_entropy(logits, tokens, temperature=0.7))
    assert grad.dtype == dtype
    torch.testing.assert_close(
        grad.float(), grad_ref.float(), atol=1e-6, rtol=2**-7 if dtype != torch.float32 else 1e-4
    )


def test_fused_matches_eager_on_a_strided_view_and_ragged_rows():
    big, tokens = _inputs(torch.bfloat16, T=129)
    view = big[::2]  # row stride 2V: the kernel must use the stride, not assume contiguity
    fused, _ = log_probs_and_entropy(view, tokens[::2], impl="fused")
    eager, _ = log_probs_and_entropy(view, tokens[::2], impl="eager", chunk_size=16)
    torch.testing.assert_close(fused, eager, atol=2e-5, rtol=0)


def test_fused_row_offsets_do_not_overflow_int32():
    # 14,200 rows x 151,936 > 2**31 elements: the last rows are only reachable with 64-bit offsets.
    logits, tokens = _inputs(torch.bfloat16, T=14_200)
    lp, _ = log_probs_and_entropy(logits, tokens, impl="fused")
    lp_tail, _ = log_probs_and_entropy(logits[-8:], tokens[-8:], impl="eager")
    torch.testing.assert_close(lp[-8:], lp_tail, atol=2e-5, rtol=0)


def test_fused_empty_input_returns_fp32_empty():
    logits = torch.zeros(0, 64, device="cuda", dtype=torch.bfloat16)
    lp, ent = log_probs_and_entropy(logits, torch.zeros(0, device="cuda", dtype=torch.long), with_entropy=True)
    assert lp.shape == ent.shape == (0,) and lp.dtype == torch.float32
