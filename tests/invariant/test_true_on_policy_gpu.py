"""true_on_policy on a GPU (bf16): each Triton op gives a row the same bits for any row count, a decode step's
attention equals the full sequence's, and the CUDA engine (decode graphs, shared prompt slots, more requests than
slots, after a weight sync) reports the trainer's log-prob of every sampled token bit for bit. Swapping one op for
torch's breaks that wherever torch's op varies with the row count on this GPU."""

import pytest
import torch
import torch.nn.functional as F

from miles.policy.rollout_correction import first_mismatch

pytestmark = pytest.mark.gpu

ROWS = (1, 2, 3, 7, 16, 63, 64, 65, 300, 511)


def _rows_vary(fn, full: torch.Tensor) -> list[int]:
    """Row counts n at which fn(x[:n]) differs in any bit from fn(x)[:n]."""
    whole = fn(full)
    return [n for n in ROWS if not torch.equal(fn(full[:n].clone()), whole[:n])]


def _r(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda").to(dtype)


@pytest.mark.parametrize("k, n", [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152), (896, 151936)])
def test_the_triton_linear_gives_a_row_the_same_bits_for_any_row_count(k, n):
    from miles.invariant import gpu

    x, w, b = _r(1024, k), _r(n, k) * 0.05, _r(n)
    assert _rows_vary(lambda t: gpu.linear(t, w, b), x) == []
    assert _rows_vary(lambda t: gpu.linear(t, w, None), x) == []


def test_the_triton_row_ops_give_a_row_the_same_bits_for_any_row_count():
    from miles.invariant import gpu

    x, w = _r(1024, 576), _r(576)
    assert _rows_vary(lambda t: gpu.rms_norm(t, w, 1e-5), x) == []
    assert _rows_vary(lambda t: gpu.rms_norm(t, w[:64], 1e-6), _r(1024, 64)) == []  # Qwen3's per-head q/k norm
    gate, up = _r(1024, 1536), _r(1024, 1536, seed=1)
    assert _rows_vary(lambda t: gpu.silu_mul(t, up[: t.shape[0]]), gate) == []
    logits, tok = _r(1024, 49152), torch.randint(0, 49152, (1024,), device="cuda")
    temp = torch.full((1024,), 0.7, device="cuda")
    assert _rows_vary(lambda t: gpu.token_log_probs(t, tok[: t.shape[0]], temp[: t.shape[0]]), logits) == []


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (14, 2), (32, 8)])
def test_a_decode_steps_attention_equals_the_full_sequences_at_every_position_on_the_gpu(heads, kv_heads):
    from miles.invariant import gpu

    T, D = 300, 64
    q, k, v = _r(4, heads, T, D), _r(4, kv_heads, T, D, seed=1), _r(4, kv_heads, T, D, seed=2)
    full = gpu.attention(q, k, v, torch.arange(T, device="cuda")[None])
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (full.float() - ref.float()).abs().max() < 3e-2
    cache_k = torch.cat([k, torch.full((4, kv_heads, 20, D), float("nan"), device="cuda", dtype=k.dtype)], 2)
    cache_v = torch.cat([v, torch.full((4, kv_heads, 20, D), float("nan"), device="cuda", dtype=v.dtype)], 2)
    bad = []
    for t in range(T):
        filled = torch.full((4,), t + 1, device="cuda")
        step = gpu.decode_attention(filled)(q[:, :, t].contiguous(), cache_k, cache_v)
        if not torch.equal(step, full[:, :, t]):
            bad.append(t)
    assert bad == [], f"decode differs from the full sequence at positions {bad[:10]} (of {len(bad)})"


def _cfg(arch: str):
    from miles.model.config import ModelConfig

    return ModelConfig(
        architecture=arch,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=5000,
        max_position_embeddings=256,
        attention_bias=arch == "qwen2",
        dtype="bfloat16",
    )


def _rollout_and_score(cfg, *, slots=24, prompts=12, n=4, seed=3, backend=None, eng=None):
    from miles.config import TrainerConfig
    from miles.protocols.engine import GenerateRequest, SamplingParams
    from miles.rollout.engine import EmbeddedEngine
    from miles.samples import collate
    from miles.train.torch_backend import TorchBackend
    from tests.invariant.onpolicy import prompts as make_prompts

    eng = eng or EmbeddedEngine(cfg, max_batch_size=slots, max_seq_len=256, device="cuda", true_on_policy=True)
    backend = backend or TorchBackend(
        cfg, TrainerConfig(lr=1e-3), device="cuda", offload_policy="none", true_on_policy=True
    )
    reqs = [
        GenerateRequest(
            rid=f"{g}-{j}",
            input_ids=p,
            sampling=SamplingParams(max_new_tokens=8 + (7 * g + 5 * j) % 40, temperature=1.0),
        )
        for g, p in enumerate(make_prompts(prompts, seed=seed, vocab=cfg.vocab_size))
        for j in range(n)
    ]
    from miles.samples import Sample

    samples = [
        Sample(index=i, group=i // n, prompt="", target="", prompt_ids=list(r.input_ids), response_ids=o.output_ids,
               rollout_log_probs=o.output_log_probs, advantage=float(i % 3 - 1))
        for i, (r, o) in enumerate(zip(reqs, eng.generate(reqs, seed=seed)))
    ]  # fmt: skip
    batch = collate(samples, pad_id=0)
    ours = backend.forward_logprobs(batch)
    return eng, backend, batch, ours


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_the_cuda_engine_reports_the_trainers_log_prob_of_every_sampled_token_bit_for_bit(arch):
    eng, backend, batch, ours = _rollout_and_score(_cfg(arch))
    assert eng.graphs is not None and eng.loop.share_prefix  # decode graphs and shared prompt slots are in play
    on = batch.loss_mask > 0
    where = first_mismatch(ours, batch.rollout_log_probs, batch.loss_mask)
    assert where is None, f"first differing token (row, position, trainer, engine): {where}"
    assert on.sum() > 500
    metrics = backend.train_step(batch, step=0)
    assert metrics["train_rollout_logprob_max_abs_diff"] == 0.0
    eng.update_weights_from_tensor(((k, t.detach().clone()) for k, t in backend.named_weights()), version=1)
    _, _, batch2, ours2 = _rollout_and_score(_cfg(arch), seed=5, backend=backend, eng=eng)
    where = first_mismatch(ours2, batch2.rollout_log_probs, batch2.loss_mask)
    assert where is None, f"after a weight sync, first differing token: {where}"


def _torch_linear(x, w, b):
    return F.linear(x, w, b)


def _torch_decode_attention(filled, *, prefix=None, bound=None):
    from miles.rollout.decode_attention import decode_attention

    return lambda q, k, v: decode_attention(q, k, v, filled, prefix=prefix, fused=True)


def _torch_attention(q, k, v, qpos):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def _torch_log_probs(logits, tokens, temperature):
    inv_t = torch.where(temperature > 0, temperature.reciprocal(), torch.ones_like(temperature))
    return torch.log_softmax(logits.float() * inv_t[:, None], -1).gather(-1, tokens.long()[:, None])[:, 0]


def _torch_rms_norm(x, w, eps):
    from miles.invariant.ops import standard_rms_norm

    return standard_rms_norm(x, w, eps)


GPU_SWAPS = {
    "matmul": [("linear", _torch_linear)],
    "attention": [("attention", _torch_attention), ("decode_attention", _torch_decode_attention)],
    "rms_norm": [("rms_norm", _torch_rms_norm)],
    "silu": [("silu_mul", lambda g, u: F.silu(g) * u)],
    "log_softmax": [("token_log_probs", _torch_log_probs)],
}


def _torch_varies(op: str) -> bool:
    x = _r(1024, 256)
    if op == "matmul":
        w = _r(5000, 256)
        return bool(_rows_vary(lambda t: F.linear(t, w), x))
    if op == "rms_norm":
        w = _r(256)
        return bool(_rows_vary(lambda t: _torch_rms_norm(t, w, 1e-6), x))
    if op == "silu":
        return bool(_rows_vary(lambda t: F.silu(t) * t, _r(1024, 704)))
    if op == "log_softmax":
        return bool(_rows_vary(lambda t: torch.log_softmax(t.float(), -1), _r(1024, 5000)))
    return True  # attention: the engine's split decode kernel against SDPA over the whole sequence


@pytest.mark.parametrize("op", list(GPU_SWAPS))
def test_swapping_one_op_for_torchs_breaks_the_equality_on_the_gpu_wherever_torchs_op_varies(op, monkeypatch):
    from miles.invariant import gpu

    if not _torch_varies(op):
        pytest.skip(f"torch's {op} gives each row the same bits for any row count on {torch.cuda.get_device_name()}")
    for name, standard in GPU_SWAPS[op]:
        monkeypatch.setattr(gpu, name, standard)
    _, _, batch, ours = _rollout_and_score(_cfg("qwen2"), prompts=6, n=4)
    assert first_mismatch(ours, batch.rollout_log_probs, batch.loss_mask) is not None
