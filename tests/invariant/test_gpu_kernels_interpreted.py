"""The GPU path's Triton kernels on CPU under TRITON_INTERPRET=1: each matches the CPU invariant op, a decode step's
attention equals the full sequence's at every position, and engine and trainer agree end to end on the Triton path.
The interpreter checks indexing, masks and tiles (its arithmetic is numpy's); the bits on the GPU are checked by
test_true_on_policy_gpu. Skipped unless TRITON_INTERPRET=1 (the interpreter is slow)."""

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1 (and on the GPU in test_true_on_policy_gpu)",
)

DTYPES = [torch.float32, torch.bfloat16]


def _r(g, dtype, *shape):
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_triton_op_matches_the_cpu_invariant_op(dtype):
    from miles.invariant import cpu, gpu

    g = torch.Generator().manual_seed(0)
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    x, w, b = _r(g, dtype, 70, 96), _r(g, dtype, 150, 96) * 0.1, _r(g, dtype, 150)
    assert (gpu.linear(x, w, b).float() - F.linear(x.float(), w.float(), b.float())).abs().max() < tol * 4
    assert torch.equal(gpu.linear(x[3:5], w, b), gpu.linear(x, w, b)[3:5])  # the same tile arithmetic for M = 2
    nw = _r(g, dtype, 96)
    assert (gpu.rms_norm(x, nw, 1e-6).float() - cpu.rms_norm(x, nw, 1e-6).float()).abs().max() <= tol * 8
    gate, up = _r(g, dtype, 33, 40), _r(g, dtype, 33, 40)
    assert (gpu.silu_mul(gate, up).float() - cpu.silu_mul(gate, up).float()).abs().max() <= tol * 8
    logits, tok = _r(g, dtype, 33, 5000), torch.randint(0, 5000, (33,), generator=g)
    temp = torch.where(torch.arange(33) % 3 == 0, 0.0, 0.7)  # greedy rows report at temperature 1
    assert (gpu.token_log_probs(logits, tok, temp) - cpu.token_log_probs(logits, tok, temp)).abs().max() < 1e-5


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (6, 2, 24), (18, 1, 16)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decode_steps_attention_equals_the_full_sequences_at_every_position(dtype, heads, kv_heads, head_dim):
    from miles.invariant import gpu

    g = torch.Generator().manual_seed(1)
    T = 70  # two key blocks and a partial third
    q, k, v = (
        _r(g, dtype, 2, heads, T, head_dim),
        _r(g, dtype, 2, kv_heads, T, head_dim),
        _r(g, dtype, 2, kv_heads, T, head_dim),
    )
    full = gpu.attention(q, k, v, torch.arange(T)[None])
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=kv_heads != heads)
    assert (full.float() - ref).abs().max() < (1e-5 if dtype == torch.float32 else 3e-2)
    cache_k = torch.cat([k, torch.full((2, kv_heads, 9, head_dim), float("nan"), dtype=dtype)], 2)  # stale slots
    cache_v = torch.cat([v, torch.full((2, kv_heads, 9, head_dim), float("nan"), dtype=dtype)], 2)
    for t in (0, 15, 16, 63, 64, 69):
        step = gpu.decode_attention(torch.tensor([t + 1, t + 1]))(q[:, :, t].contiguous(), cache_k, cache_v)
        assert torch.equal(step, full[:, :, t]), t


def test_a_decode_row_reads_its_prompt_from_the_shared_slot_below_the_prefix_length():
    from miles.invariant import gpu

    g = torch.Generator().manual_seed(2)
    q, k, v = _r(g, torch.float32, 1, 4, 40, 16), _r(g, torch.float32, 1, 2, 40, 16), _r(g, torch.float32, 1, 2, 40, 16)
    full = gpu.attention(q, k, v, torch.arange(40)[None])
    ck, cv = torch.zeros(3, 2, 48, 16), torch.zeros(3, 2, 48, 16)
    ck[0, :, :20], cv[0, :, :20] = k[0, :, :20], v[0, :, :20]  # the group's prompt, in its first slot
    ck[2, :, 20:40], cv[2, :, 20:40] = k[0, :, 20:], v[0, :, 20:]  # row 2's own positions
    prefix = (torch.tensor([0, 1, 0]), torch.tensor([20, 0, 20]))
    q_rows = q[0, :, 39][None].expand(3, 4, 16).contiguous()
    out = gpu.decode_attention(torch.tensor([40, 40, 40]), prefix=prefix)(q_rows, ck, cv)
    assert torch.equal(out[2], full[0, :, 39])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_and_trainer_agree_bit_for_bit_on_the_triton_path(dtype, monkeypatch):
    from tests.invariant.onpolicy import compare, engine, model_cfg, prompts, rollout, trainer

    monkeypatch.setenv("MILES_INVARIANT_IMPL", "triton")
    cfg = model_cfg(dtype)
    samples = rollout(engine(cfg, True, slots=5, share_prefix=True), prompts(4), n=3)  # 12 requests, 5 slots
    ours, theirs, _ = compare(trainer(cfg, True), samples)
    assert torch.equal(ours, theirs)
