"""The engine's Triton kernels against their references, on CPU under TRITON_INTERPRET=1 (Triton installed); the
same kernels run on the GPU in test_engine_gpu. Skipped otherwise: the interpreter is too slow for the CI."""

import importlib.util
import os

import pytest
import torch

from miles.rollout.rows import RowState, advance

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1 (and on the GPU in test_engine_gpu)",
)


def _state(S: int, R: int) -> RowState:
    g = torch.Generator().manual_seed(0)
    st = RowState(S, 12, "cpu")
    st.finished.copy_(torch.rand(S, generator=g) < 0.3)
    st.stopped.copy_(st.finished & (torch.rand(S, generator=g) < 0.5))
    st.num_gen.copy_(torch.randint(0, 6, (S,), generator=g))
    st.max_new.copy_(st.num_gen + torch.randint(1, 3, (S,), generator=g))  # some rows reach their length
    st.lens.copy_(torch.randint(3, 20, (S,), generator=g))
    st.tokens.copy_(torch.randint(0, 50, (S,), generator=g))
    st.stop_ids[:, :3] = torch.randint(0, 50, (S, 3), generator=g)
    st.out_ids.copy_(torch.randint(0, 50, st.out_ids.shape, generator=g))
    st.out_lps.normal_(generator=g)
    st.seed.fill_(41)
    return st


def test_the_fused_advance_kernel_updates_the_row_state_as_the_reference_does():
    S, R = 11, 9
    ref, got = _state(S, R), _state(S, R)
    tok = torch.randint(0, 50, (R,), generator=torch.Generator().manual_seed(1))
    tok[:3] = ref.stop_ids[:3, 1]  # three rows sample one of their stop tokens
    lp = -torch.rand(R)
    advance(ref, slice(0, R), tok, lp, fused=False)
    advance(got, slice(0, R), tok, lp, fused=True)
    for name in ("finished", "stopped", "num_gen", "lens", "tokens", "out_ids", "out_lps", "seed"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert ref.stopped[:3][~_state(S, R).finished[:3]].all()  # the stop tokens were seen (rows still live)


def test_the_fused_decode_step_covers_qwen3s_qk_norm_as_the_reference_step_does(tiny_model_cfg):
    from dataclasses import replace

    from miles.model.decoder import KVCache, build_decoder
    from miles.rollout.forward import RopeTable, decode_step, decode_step_fused, fuse_projections

    cfg = replace(tiny_model_cfg, architecture="qwen3", attention_bias=False)
    assert cfg.qk_norm
    torch.manual_seed(5)
    model, rope = build_decoder(cfg, seed=0), RopeTable(cfg, 64, "cpu", torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:  # weights other than ones, so that each element's weight matters
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    caches = [KVCache.allocate(cfg, 4, 64, "cpu", torch.float32) for _ in range(2)]
    for src, dst in zip(caches[0].tensors(), caches[1].tensors()):
        dst.copy_(src.normal_())
    tok, lens = torch.tensor([5, 17, 250]), torch.tensor([0, 10, 40])
    ref = decode_step(model, caches[0], rope, tok, lens, torch.empty(3, cfg.vocab_size))
    out = decode_step_fused(
        model, fuse_projections(model), caches[1], rope, tok, lens, torch.empty_like(ref), num_splits=2
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(caches[0].tensors(), caches[1].tensors()):
        torch.testing.assert_close(
            a, b, atol=1e-5, rtol=1e-5
        )  # the same normed, rotated K (and V) at each row's position
