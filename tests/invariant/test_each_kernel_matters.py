"""Each invariant op matters: swapped for torch's standard op on both sides, the engine's log-probs and the trainer's
part wherever torch's op gives a row different bits in the engine's call than in the trainer's on this machine.

Which of torch's CPU ops vary depends on the CPU and the ATen build: matmul (FP32) and attention vary here (MKL
picks kernels by row count, SDPA reduces over the keys it is given); torch's row reductions and elementwise ops
reduce each row alike at these sizes on AVX512 (AMD EPYC here), so their swap cannot show here and is skipped
with the reason; the invariant ops do not depend on that (miles.invariant.exact), and the gpu-marked
test shows the swaps on an H200, where torch's reductions change with the row count."""

import pytest
import torch
import torch.nn.functional as F

from miles.invariant import cpu, exact, ops
from miles.rollout.decode_attention import decode_attention_reference
from tests.invariant.onpolicy import compare, engine, model_cfg, prompts, rollout, trainer


def _std_linear(x, w, b):
    return F.linear(x, w, b)


def _std_attention(q, k, v, qpos):
    return ops.standard_attention(q, k, v, qpos.expand(q.shape[0], q.shape[2]))


def _std_decode_attention(filled, *, bound=None, prefix=None):
    return lambda q, k_cache, v_cache: decode_attention_reference(
        q, k_cache, v_cache, filled, bound=bound, prefix=prefix
    )


def _std_log_probs(logits, tokens, temperature):
    inv_t = torch.where(temperature > 0, temperature.reciprocal(), torch.ones_like(temperature))
    return torch.log_softmax(logits.float() * inv_t[:, None], -1).gather(-1, tokens.long()[:, None])[:, 0]


def _std_tree_sum(x, dim=-1):
    return x.sum(dim)


SWAPS = {  # op -> (module, attribute, torch's version) pairs swapped together
    "matmul": [(cpu, "linear", _std_linear)],
    "attention": [(cpu, "attention", _std_attention), (cpu, "decode_attention", _std_decode_attention)],
    "rms_norm": [(cpu, "rms_norm", ops.standard_rms_norm)],
    "silu": [(cpu, "silu_mul", ops.standard_silu_mul)],
    "log_softmax": [(cpu, "token_log_probs", _std_log_probs)],
    "exp": [(exact, "exp", torch.exp)],
    "tree_sums": [(exact, "tree_sum", _std_tree_sum)],  # RMSNorm's, the log-softmax's and attention's block sums
}


def _rows_vary(fn, full: torch.Tensor, counts=(1, 2, 3, 5, 7, 11)) -> bool:
    """Does fn give the first rows other bits when called on fewer rows (as the engine does) than on all (as the
    trainer does)?"""
    whole = fn(full)
    return any(not torch.equal(fn(full[:n].clone()), whole[:n]) for n in counts)


def torch_op_varies(op: str, dtype: torch.dtype) -> bool:
    """Whether torch's version of ``op`` gives a row different bits in an engine-shaped call than in a trainer-shaped
    one here, at the test model's sizes (hidden 64, intermediate 160, vocab 264, head_dim 16)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    if op == "matmul":
        return any(
            _rows_vary(lambda x, w=r(n, k): F.linear(x, w), r(600, k))
            for k, n in ((64, 64), (64, 160), (160, 64), (64, 264))
        )
    if op == "rms_norm":
        w = r(64)
        return _rows_vary(lambda x: ops.standard_rms_norm(x, w, 1e-6), r(600, 64))
    if op == "silu":
        return _rows_vary(lambda x: F.silu(x) * x, r(600, 160))
    if op == "log_softmax":
        return _rows_vary(lambda x: torch.log_softmax(x.float(), -1), r(600, 264))
    if op == "exp":
        return _rows_vary(lambda x: torch.exp(x.float()), r(600, 4, 24))
    if op == "tree_sums":  # rows of 64 and 264, and a query's key blocks (<= 4 here) with masked ones -0.0
        x = r(300, 3).double()
        padded = lambda n: torch.cat([x, torch.full((300, n), -0.0, dtype=x.dtype)], 1).sum(-1)  # noqa: E731
        return (
            _rows_vary(lambda t: t.float().sum(-1), r(600, 64))
            or _rows_vary(lambda t: t.float().sum(-1), r(600, 264))
            or not torch.equal(padded(1), x.sum(-1))
        )
    if op == "attention":  # SDPA over a whole sequence vs over a prompt (prefill) vs one query over a cache (decode)
        q, k, v = r(3, 4, 24, 16), r(3, 2, 24, 16), r(3, 2, 24, 16)
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        prompt = F.scaled_dot_product_attention(q[:, :, :9], k[:, :, :9], v[:, :, :9], is_causal=True, enable_gqa=True)
        kc, vc = torch.cat([k, r(3, 2, 8, 16)], 2), torch.cat([v, r(3, 2, 8, 16)], 2)
        steps = [decode_attention_reference(q[:, :, t], kc, vc, torch.full((3,), t + 1), bound=32) for t in range(24)]
        return not (torch.equal(prompt, full[:, :, :9]) and torch.equal(torch.stack(steps, 2), full))
    raise ValueError(op)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", list(SWAPS))
def test_swapping_one_invariant_op_for_torchs_breaks_the_equality_wherever_torchs_op_varies(op, dtype, monkeypatch):
    if not torch_op_varies(op, getattr(torch, dtype)):
        pytest.skip(
            f"torch's {op} gives each row the same bits for any row count here ({dtype}, "
            f"{torch.backends.cpu.get_cpu_capability()}): its swap cannot show on this CPU"
        )
    for module, name, standard in SWAPS[op]:
        monkeypatch.setattr(module, name, standard)
    cfg = model_cfg(dtype)
    samples = rollout(engine(cfg, True, share_prefix=True), prompts(5), n=3)
    ours, theirs, _ = compare(trainer(cfg, True), samples)
    assert not torch.equal(ours, theirs), f"torch's {op} varies by row count here, yet the log-probs still agree"


def test_without_a_swap_the_same_run_agrees():
    cfg = model_cfg("float32")
    samples = rollout(engine(cfg, True, share_prefix=True), prompts(5), n=3)
    ours, theirs, _ = compare(trainer(cfg, True), samples)
    assert torch.equal(ours, theirs)
