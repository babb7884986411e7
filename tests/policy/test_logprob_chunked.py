"""The eager chunked log-prob path equals the full-FP32 reference and never holds FP32 [T, V] logits."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from miles.policy.logprob import full_fp32_log_probs_and_entropy, log_probs_and_entropy, resolve_impl

T, V = 37, 311  # T is deliberately not a multiple of any chunk size below


def _inputs(dtype, T=T, V=V, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, V, generator=g) * 4).to(dtype).requires_grad_(requires_grad)
    tokens = torch.randint(0, V, (T,), generator=g)
    return logits, tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_size", [1, 5, 16, 37, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_log_probs_matches_reference(dtype, chunk_size, temperature):
    logits, tokens = _inputs(dtype)
    lp, ent = log_probs_and_entropy(
        logits, tokens, temperature=temperature, chunk_size=chunk_size, with_entropy=True, impl="eager"
    )
    lp_ref, ent_ref = full_fp32_log_probs_and_entropy(logits, tokens, temperature=temperature)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, lp_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy_requires_grad", [False, True])
def test_chunked_gradients_match_reference(dtype, entropy_requires_grad):
    logits, tokens = _inputs(dtype, requires_grad=True)
    g = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)

    lp, ent = log_probs_and_entropy(
        logits,
        tokens,
        temperature=0.7,
        chunk_size=8,
        with_entropy=True,
        entropy_requires_grad=entropy_requires_grad,
        impl="eager",
    )
    loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if entropy_requires_grad else 0)
    (grad,) = torch.autograd.grad(loss, logits)

    lp_ref, ent_ref = full_fp32_log_probs_and_entropy(logits, tokens, temperature=0.7)
    loss_ref = (lp_ref * w_lp).sum() + ((ent_ref * w_ent).sum() if entropy_requires_grad else 0)
    (grad_ref,) = torch.autograd.grad(loss_ref, logits)

    assert grad.dtype == dtype and ent.requires_grad == entropy_requires_grad
    # Same FP32 math, rounded once to the logits' dtype: at most one ulp apart (2**-7 relative in bf16).
    torch.testing.assert_close(grad.float(), grad_ref.float(), atol=1e-6, rtol=0 if dtype == torch.float32 else 2**-7)


class _RecordFP32Shapes(TorchDispatchMode):
    """Records (op, shape) of every FP32 tensor going into or out of an aten op, forward and backward."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = torch.utils._pytree.tree_leaves((args, kwargs, out))
        for t in flat:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.seen.append((str(func.__name__), tuple(t.shape)))
        return out


def test_log_softmax_only_sees_fp32_chunks_of_chunk_size_rows():
    T_big, C = 100, 16
    logits, tokens = _inputs(torch.bfloat16, T=T_big, requires_grad=True)
    with _RecordFP32Shapes() as rec:
        lp, ent = log_probs_and_entropy(
            logits,
            tokens,
            temperature=0.7,
            chunk_size=C,
            with_entropy=True,
            entropy_requires_grad=True,
            impl="eager",
        )
        (lp.sum() + ent.sum()).backward()

    log_softmax_inputs = [shape for op, shape in rec.seen if op.startswith(("_log_softmax", "_softmax"))]
    assert log_softmax_inputs and all(shape[0] <= C and shape[-1] == V for shape in log_softmax_inputs)
    fp32_with_vocab = {shape for _, shape in rec.seen if len(shape) == 2 and shape[-1] == V}
    assert max(shape[0] for shape in fp32_with_vocab) <= C, fp32_with_vocab
    assert (T_big % C) in {shape[0] for shape in fp32_with_vocab}  # the ragged last chunk was seen
    assert logits.grad.dtype == torch.bfloat16


def test_empty_input_returns_fp32_empty_tensors_attached_to_the_graph():
    logits = torch.zeros(0, V, dtype=torch.bfloat16, requires_grad=True)
    lp, ent = log_probs_and_entropy(logits, torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert lp.shape == ent.shape == (0,) and lp.dtype == ent.dtype == torch.float32
    lp.sum().backward()
    assert logits.grad.shape == logits.shape


def test_ragged_last_chunk_and_chunk_larger_than_input_give_the_same_values():
    logits, tokens = _inputs(torch.bfloat16)
    ragged, _ = log_probs_and_entropy(logits, tokens, chunk_size=10, impl="eager")  # 10 + 10 + 10 + 7
    single, _ = log_probs_and_entropy(logits, tokens, chunk_size=4096, impl="eager")
    assert torch.equal(ragged, single)


def test_entropy_is_none_unless_asked_and_detached_unless_asked():
    logits, tokens = _inputs(torch.bfloat16, requires_grad=True)
    assert log_probs_and_entropy(logits, tokens)[1] is None
    _, ent = log_probs_and_entropy(logits, tokens, with_entropy=True)
    assert not ent.requires_grad


def test_auto_picks_eager_on_cpu_and_fused_on_cpu_is_refused_with_a_fix(monkeypatch):
    logits, tokens = _inputs(torch.bfloat16)
    assert resolve_impl(None, logits) == "eager"
    monkeypatch.setenv("MILES_LOGPROB_IMPL", "eager")
    assert resolve_impl(None, logits) == "eager"
    with pytest.raises(ValueError, match="impl='eager'"):
        log_probs_and_entropy(logits, tokens, impl="fused")
    with pytest.raises(ValueError, match="MILES_LOGPROB_IMPL"):
        log_probs_and_entropy(logits, tokens, impl="triton")


def test_bad_shapes_and_temperature_are_rejected_with_the_values():
    logits, tokens = _inputs(torch.bfloat16)
    with pytest.raises(ValueError, match=r"\(2, 37, 311\)"):
        log_probs_and_entropy(logits.expand(2, T, V), tokens)
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        log_probs_and_entropy(logits, tokens, temperature=0)
