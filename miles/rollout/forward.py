"""The engine's two forward passes over the decoder's own modules: prefill into cache slots, and one decode step.

The trainer's ``Decoder.forward`` serves full sequences; generation needs two other shapes. Prefill runs each
distinct prompt once (right-padded, causal SDPA: padding sits after every real token, so no mask is needed)
and writes its keys and values into every slot that shares it: a GRPO group's n samples cost one prefill.
Logits come only from each prompt's last position. A decode step takes one token per row at the row's own
position (``lens``), writes its K/V there and attends over the filled positions (miles.rollout.decode_attention);
its shapes depend only on the row count, so it is captured in CUDA graphs, and the logits go into a buffer
the caller owns.

    rope = RopeTable(model.config, max_len, device, dtype)
    logits_UV = prefill(model, cache, rope, ids_UP, lens_U, slots_N, src_N)
    decode_step(model, cache, rope, tokens_R, lens_R, out_RV, bound=b)
    fused = fuse_projections(model)                  # on CUDA: q|k|v and gate|up each one matmul
    logits_UV = prefill(model, cache, rope, ids_UP, lens_U, slots_N, src_N, fused=fused)   # the same, fused
    decode_step_fused(model, fused, cache, rope, tokens_R, lens_R, out_RV)   # Triton norm / rotary / SiLU

Every op of ``prefill`` and ``decode_step`` is the model's kernels' (miles.model.kernels), the same the trainer's
forward calls: with ``kernels=INVARIANT`` a token's logits here equal the trainer's bit for bit. The fused paths are
the standard kernels' CUDA fast path; an invariant engine does not take them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles.model.decoder import Decoder, KVCache, _rotate_half
from miles.model.kernels import STANDARD, Kernels
from miles.rollout.decode_attention import decode_attention


class RopeTable:
    """cos/sin for every position up to max_len, computed once by the kernels' own formula (bit-equal)."""

    def __init__(self, cfg, max_len: int, device, dtype, kernels: Kernels = STANDARD):
        pos = torch.arange(max_len, device=device)[None]
        cos, sin = kernels.rotary_cos_sin(cfg, pos, dtype)
        self.cos, self.sin = cos[0, 0], sin[0, 0]  # [max_len, head_dim]


@torch.no_grad()
def prefill(
    model: Decoder,
    cache: KVCache,
    rope: RopeTable,
    ids_UP: torch.Tensor,
    lens_U: torch.Tensor,
    slots_N: torch.Tensor,
    src_N: torch.Tensor | None,
    fused: "FusedProjections | None" = None,
) -> torch.Tensor:
    """Run U distinct prompts once; slot ``slots_N[i]`` gets prompt ``src_N[i]``'s K/V (``src_N`` None: prompt i's).
    Returns logits [U, V]. ``fused`` (the CUDA engine's): the fused matmuls and the decode step's Triton kernels."""
    if fused is not None:
        return _prefill_fused(model, fused, cache, rope, ids_UP, lens_U, slots_N, src_N)
    kern = model.kernels
    U, P = ids_UP.shape
    x = model.model.embed_tokens(ids_UP)
    cos, sin = rope.cos[:P][None, None], rope.sin[:P][None, None]
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(x, kern), cos, sin, kern)
        o = _cache_and_attend(kern, cache, i, slots_N, src_N, q, k, v)
        x = x + kern.linear(o.transpose(1, 2).reshape(U, P, -1), attn.o_proj)
        x = x + layer.mlp(layer.post_attention_layernorm(x, kern), kern)
    last = x[torch.arange(U, device=x.device), lens_U - 1]
    return kern.linear(model.model.norm(last, kern), model.lm_head)


def _cache_and_attend(kern: Kernels, cache: KVCache, i: int, slots_N, src_N, q, k, v) -> torch.Tensor:
    """Layer ``i``'s prompt K/V into their slots, then causal attention over the prompts ([U, heads, P, D])."""
    P = k.shape[2]
    cache.k[i][:, :, :P].index_copy_(0, slots_N, k if src_N is None else k[src_N])
    cache.v[i][:, :, :P].index_copy_(0, slots_N, v if src_N is None else v[src_N])
    return kern.attention(q, k, v, None, 0)


def _prefill_fused(model, fused, cache, rope, ids_UP, lens_U, slots_N, src_N) -> torch.Tensor:
    """``prefill`` over the fused projections and the decode step's Triton kernels (residual add + RMSNorm,
    SiLU x up): one q|k|v and one gate|up matmul per layer, no FP32 copies of the hidden states."""
    from miles.rollout.kernels import add_rmsnorm, silu_mul

    cfg = model.config
    H, KVH, D, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    U, P = ids_UP.shape
    layers = model.model.layers
    x = model.model.embed_tokens(ids_UP).view(U * P, -1)  # the residual stream, updated in place
    h = add_rmsnorm(x, None, layers[0].input_layernorm.weight, eps)
    cos, sin = rope.cos[:P][None, None], rope.sin[:P][None, None]
    for i, layer in enumerate(layers):
        a = layer.self_attn
        qkv = F.linear(h, fused.qkv[i], fused.qkv_bias[i])
        if fused.adapters is not None:  # LoRA (miles.rollout.fused_adapters)
            fused.adapters.add_qkv(i, h, qkv)
        qkv = qkv.view(U, P, H + 2 * KVH, D)
        q, k, v = qkv[:, :, :H], qkv[:, :, H : H + KVH], qkv[:, :, H + KVH :]
        if cfg.qk_norm:  # Qwen3
            q, k = a.q_norm(q), a.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        o = _cache_and_attend(STANDARD, cache, i, slots_N, src_N, q, k, v)
        h = add_rmsnorm(x, a.o_proj(o.transpose(1, 2).reshape(U * P, -1)), layer.post_attention_layernorm.weight, eps)
        mlp = layer.mlp.down_proj(silu_mul(_gate_up(fused, i, h)))
        nxt = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else model.model.norm.weight
        h = add_rmsnorm(x, mlp, nxt, eps)
    last = h.view(U, P, -1)[torch.arange(U, device=h.device), lens_U - 1]  # already normed by model.norm
    return model.lm_head(last)


@torch.no_grad()
def decode_step(
    model: Decoder,
    cache: KVCache,
    rope: RopeTable,
    tokens_R: torch.Tensor,
    lens_R: torch.Tensor,
    out_RV: torch.Tensor,
    *,
    bound: int | None = None,
    num_splits: int | None = None,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One token per row at position ``lens_R[r]`` (its K/V written there); logits into ``out_RV``. ``prefix``:
    (slot_R, len_R), a row's positions below len_R read from cache slot slot_R (a group's shared prompt)."""
    kern = model.kernels
    R = tokens_R.shape[0]
    rows = torch.arange(R, device=tokens_R.device)
    x = model.model.embed_tokens(tokens_R[:, None])  # [R, 1, H]
    cos, sin = rope.cos[lens_R][:, None, None], rope.sin[lens_R][:, None, None]  # [R, 1, 1, D]
    filled = lens_R + 1
    attend = _decode_attention(kern, filled, bound, num_splits, prefix)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(x, kern), cos, sin, kern)
        cache.k[i][rows, :, lens_R] = k[:, :, 0]
        cache.v[i][rows, :, lens_R] = v[:, :, 0]
        o = attend(q[:, :, 0], cache.k[i], cache.v[i])
        x = x + kern.linear(o.reshape(R, 1, -1), attn.o_proj)
        x = x + layer.mlp(layer.post_attention_layernorm(x, kern), kern)
    h = model.model.norm(x[:, 0], kern)
    return kern.logits_into(h, model.lm_head.weight, out_RV)


def _decode_attention(kern: Kernels, filled, bound, num_splits, prefix):
    """The step's attention for every layer: the kernels' own (the invariant set's), or the engine's."""
    if kern.decode_attention is not None:
        return kern.decode_attention(filled, prefix=prefix, bound=bound)
    return lambda q, k, v: decode_attention(q, k, v, filled, bound=bound, num_splits=num_splits, prefix=prefix)


class FusedProjections:
    """Per layer, q|k|v and gate|up as one weight each, whose storage the modules' parameters are views of.

    Weight updates copy into the parameters, hence into these storages; TaggedMemory sees the same bytes (one
    storage where there were three and two). Built once, before the engine registers its weights. ``adapters``:
    LoRA's A matrices stacked the same way, applied next to the fused matmuls (miles.rollout.fused_adapters)."""

    def __init__(self, qkv: list, qkv_bias: list, gate_up: list, adapters=None):
        self.qkv, self.qkv_bias, self.gate_up, self.adapters = qkv, qkv_bias, gate_up, adapters


def _gate_up(fused: FusedProjections, i: int, h: torch.Tensor) -> torch.Tensor:
    gu = F.linear(h, fused.gate_up[i])
    if fused.adapters is not None:
        fused.adapters.add_gate_up(i, h, gu)
    return gu


def _fuse(params: list[torch.nn.Parameter]) -> torch.Tensor:
    whole = torch.cat([p.detach() for p in params], 0)
    off = 0
    for p in params:
        p.data = whole[off : off + p.shape[0]]
        off += p.shape[0]
    return whole


def fuse_projections(model: Decoder) -> FusedProjections:
    qkv, bias, gu = [], [], []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        qkv.append(_fuse([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
        bias.append(_fuse([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None)
        gu.append(_fuse([m.gate_proj.weight, m.up_proj.weight]))
    from miles.rollout.fused_adapters import FusedAdapters

    return FusedProjections(qkv, bias, gu, FusedAdapters.of(model, _fuse))


@torch.no_grad()
def decode_step_fused(
    model: Decoder,
    fused: FusedProjections,
    cache: KVCache,
    rope: RopeTable,
    tokens_R: torch.Tensor,
    lens_R: torch.Tensor,
    out_RV: torch.Tensor,
    *,
    num_splits: int | None = None,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``decode_step`` in about a dozen kernels per layer: residual add + RMSNorm, (Qwen3's q/k RMSNorm +)
    rotary + K/V write and SiLU x up are one Triton kernel each, q|k|v and gate|up one matmul each (miles.rollout.kernels)."""
    from miles.rollout.kernels import add_rmsnorm, rope_kv, silu_mul

    cfg = model.config
    H, KVH, D, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    R = tokens_R.shape[0]
    layers = model.model.layers
    x = model.model.embed_tokens(tokens_R)  # [R, hidden], contiguous: the residual stream, updated in place
    h = add_rmsnorm(x, None, layers[0].input_layernorm.weight, eps)
    filled = lens_R + 1
    for i, layer in enumerate(layers):
        qkv = F.linear(h, fused.qkv[i], fused.qkv_bias[i])
        if fused.adapters is not None:
            fused.adapters.add_qkv(i, h, qkv)
        a = layer.self_attn
        qk_norm = (a.q_norm.weight, a.k_norm.weight, a.q_norm.eps) if cfg.qk_norm else None  # Qwen3
        q = rope_kv(qkv, rope.cos, rope.sin, lens_R, cache.k[i], cache.v[i], H, KVH, D, qk_norm)
        o = decode_attention(q, cache.k[i], cache.v[i], filled, num_splits=num_splits, fused=True, prefix=prefix)
        h = add_rmsnorm(x, layer.self_attn.o_proj(o.reshape(R, -1)), layer.post_attention_layernorm.weight, eps)
        mlp = layer.mlp.down_proj(silu_mul(_gate_up(fused, i, h)))
        nxt = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else model.model.norm.weight
        h = add_rmsnorm(x, mlp, nxt, eps)
    return torch.mm(h, model.lm_head.weight.t(), out=out_RV)
