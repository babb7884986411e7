"""The invariant CPU ops match the standard ones to rounding, keep each row's bits whatever else is in the call, and
their backward is the standard op's."""

import pytest
import torch
import torch.nn.functional as F

from miles.invariant import cpu, ops
from miles.model.decoder import build_decoder
from miles.model.kernels import INVARIANT, STANDARD
from tests.invariant.onpolicy import model_cfg

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _close(a, b, dtype):
    assert (a.float() - b.float()).abs().max() <= TOL[dtype] * max(1.0, b.float().abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_invariant_op_matches_the_standard_op_to_rounding(dtype):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    x, w, b = r(33, 64), r(48, 64) * 0.1, r(48)
    _close(cpu.linear(x, w, b), F.linear(x, w, b), dtype)
    nw = r(64)
    _close(cpu.rms_norm(x, nw, 1e-6), ops.standard_rms_norm(x, nw, 1e-6), dtype)
    gate, up = r(33, 40), r(33, 40)
    _close(cpu.silu_mul(gate, up), F.silu(gate) * up, dtype)
    q, k, v = r(2, 4, 9, 16), r(2, 2, 9, 16), r(2, 2, 9, 16)
    qpos = torch.arange(9)[None].expand(2, 9)
    _close(
        cpu.attention(q, k, v, qpos), F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), dtype
    )
    logits, tok, temp = r(33, 264), torch.randint(0, 264, (33,), generator=g), torch.full((33,), 0.7)
    ref = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, tok[:, None])[:, 0]
    assert (cpu.token_log_probs(logits, tok, temp) - ref).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_querys_attention_is_the_same_bits_over_any_key_count_and_any_masked_contents(dtype):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 30, 16, generator=g).to(dtype) for _ in range(3))
    full = cpu.attention(q, k[:, :2], v[:, :2], torch.arange(30)[None])
    for t in (0, 5, 17, 29):
        for extra in (0, 3, 40):
            garbage = torch.full((1, 2, extra, 16), float("nan"), dtype=dtype)
            kk, vv = torch.cat([k[:, :2, : t + 1], garbage], 2), torch.cat([v[:, :2, : t + 1], garbage], 2)
            one = cpu.attention(q[:, :, t : t + 1], kk, vv, torch.tensor([[t]]))
            assert torch.equal(one, full[:, :, t : t + 1]), (t, extra)


def test_decode_attention_through_a_shared_prompt_slot_equals_attention_over_the_whole_sequence():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 12, 16, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    full = cpu.attention(q, k, v, torch.arange(12)[None])
    cache_k, cache_v = torch.zeros(3, 2, 20, 16), torch.zeros(3, 2, 20, 16)
    cache_k[0, :, :7], cache_v[0, :, :7] = k[0, :, :7], v[0, :, :7]  # the prompt, in the group's first slot
    cache_k[2, :, 7:12], cache_v[2, :, 7:12] = k[0, :, 7:], v[0, :, 7:]  # row 2's own answer positions
    rows_q = q[0, :, 11][None].expand(3, 4, 16)
    prefix = (torch.tensor([0, 1, 0]), torch.tensor([7, 0, 7]))
    out = cpu.decode_attention(torch.tensor([12, 12, 12]), bound=15, prefix=prefix)(rows_q, cache_k, cache_v)
    assert torch.equal(out[2], full[0, :, 11])


def test_the_invariant_decoders_gradients_are_the_standard_decoders_to_rounding():
    cfg = model_cfg("float32")
    ids = torch.randint(0, 264, (3, 11), generator=torch.Generator().manual_seed(3))
    grads = {}
    for kern in (STANDARD, INVARIANT):
        m = build_decoder(cfg, seed=0, kernels=kern)
        m(ids).float().log_softmax(-1)[..., 5].sum().backward()
        grads[kern.name] = {n: p.grad for n, p in m.named_parameters()}
    for n, gs in grads["standard"].items():
        gi = grads["invariant"][n]
        assert (gi - gs).abs().max() <= 1e-4 * max(1.0, gs.abs().max().item()), n
