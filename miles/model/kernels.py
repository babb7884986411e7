"""The decoder's arithmetic as one set of kernels, chosen once per model: standard or invariant (true on-policy).

``STANDARD`` is torch's fastest kernels (cuBLAS / MKL matmuls, SDPA, the engine's decode attention); the engine's
log-prob of a sampled token then differs from the trainer's by a few 1e-2 in bf16 on real weights (issue 33), since
those kernels reduce in an order that depends on the batch shape and on prefill vs decode. ``INVARIANT`` computes
every row by arithmetic that depends only on the row (miles.invariant): the same weights give the same bits for a
token whether it came out of a prefill, a decode step over cached keys (shared prompt slots, CUDA graphs, any batch)
or the trainer's full-sequence forward, and one log-softmax serves the sampler's reported log-prob and the
trainer's. Only forward values are invariant; the trainer's backward recomputes each op with the standard kernels.

    model = build_decoder(cfg, kernels=kernels_for(true_on_policy=True))
    model.kernels.linear(x, layer.self_attn.q_proj)   # what every projection of the decoder and engine calls
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from miles.invariant import ops
from miles.invariant.rope import rotary_cos_sin as table_cos_sin
from miles.model.rope import rope_inv_freq, rotary_cos_sin


@dataclass(frozen=True, slots=True)
class Kernels:
    name: str
    linear: Callable  # (x [..., K], an nn.Linear or a quantized Linear) -> [..., N]
    logits_into: Callable  # (h [R, H], lm_head weight [V, H], out [R, V]): the engine's decode logits, in place
    rms_norm: Callable  # (x [..., H], weight [H], eps) -> [..., H]
    silu_mul: Callable  # (gate, up) -> silu(gate) * up
    rotary_cos_sin: Callable  # (model cfg, position_ids [B, T], dtype) -> cos, sin [B, 1, T, head_dim]
    attention: Callable  # (q [B,H,T,D], k [B,KVH,S,D], v, mask [B,1,T,S] | None, q_start) -> [B,H,T,D]
    decode_attention: (
        Callable | None
    )  # (q_RHD, k_cache, v_cache, filled_R, bound=, num_splits=, prefix=); None: the engine's
    sampled_log_probs: Callable  # (logits_RV, tokens_R, temperature_R, drawn_lp_R) -> the log-probs the engine reports

    @property
    def invariant(self) -> bool:
        return self.name == "invariant"


def _standard_rotary(cfg, position_ids_BT, dtype):
    return rotary_cos_sin(position_ids_BT, rope_inv_freq(cfg, position_ids_BT.device), dtype)


def _standard_attention(q, k, v, mask_B1TS, q_start: int):
    """SDPA: causal from position 0, or a query block at ``q_start`` over cached keys (mask: row t sees <= q_start + t)."""
    gqa = q.shape[1] != k.shape[1]  # SDPA shares KV heads without copying them
    if mask_B1TS is None and q_start == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if mask_B1TS is None:
        B, _, T, _ = q.shape
        mask_B1TS = torch.ones(B, 1, T, k.shape[2], dtype=torch.bool, device=q.device).tril(q_start)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1TS, enable_gqa=gqa)


def _linear_module(x, module):
    return module(x)  # nn.Linear, or miles.quant's QuantizedLinear under trainer.precision fp8 / mxfp8 / nvfp4


def _mm_into(h, weight, out):
    return torch.mm(h, weight.t(), out=out)


def _drawn(logits_RV, tokens_R, temperature_R, drawn_lp_R):
    return drawn_lp_R  # the sampler's own log-prob (its kernel's or the reference's log-softmax)


STANDARD = Kernels(
    name="standard",
    linear=_linear_module,
    logits_into=_mm_into,
    rms_norm=ops.standard_rms_norm,
    silu_mul=ops.standard_silu_mul,
    rotary_cos_sin=_standard_rotary,
    attention=_standard_attention,
    decode_attention=None,
    sampled_log_probs=_drawn,
)


def _invariant_attention(q, k, v, mask_B1TS, q_start: int):
    if mask_B1TS is not None:
        raise ValueError(
            "the invariant kernels take causal attention by position only (right-padded rows, no mask); "
            "left-padded generation with a mask needs kernels=STANDARD"
        )
    if q_start == 0:
        return ops.attention(q, k, v)
    return ops.attention(q, k, v, torch.arange(q_start, q_start + q.shape[2], device=q.device)[None])


def _invariant_linear(x, module):
    y = ops.linear(x, module.weight, module.bias)
    return module.adapt(x, y, ops.linear) if hasattr(module, "adapt") else y  # a LoRA projection (miles.model.lora)


def _invariant_logits_into(h, weight, out):
    return out.copy_(ops.linear(h, weight, None))


def _invariant_sampled(logits_RV, tokens_R, temperature_R, drawn_lp_R):
    return ops.token_log_probs(logits_RV, tokens_R, temperature_R)


INVARIANT = Kernels(
    name="invariant",
    linear=_invariant_linear,
    logits_into=_invariant_logits_into,
    rms_norm=ops.rms_norm,
    silu_mul=ops.silu_mul,
    rotary_cos_sin=table_cos_sin,
    attention=_invariant_attention,
    decode_attention=ops.decode_attention,
    sampled_log_probs=_invariant_sampled,
)


def kernels_for(true_on_policy: bool) -> Kernels:
    return INVARIANT if true_on_policy else STANDARD
