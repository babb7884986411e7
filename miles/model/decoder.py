"""An HF-compatible decoder-only transformer (Llama / Qwen2 / Qwen3 layout and parameter names).

RMSNorm, rotary embeddings (plain, or Llama 3's scaled frequencies), grouped-query attention (Qwen3: RMSNorm on
each head's queries and keys), SwiGLU, tied or untied embeddings. The same module
serves the trainer (full sequences, causal) and the rollout engine (prefill + decode against a
preallocated KV cache). Parameter names equal Hugging Face's, so checkpoints load in ``transformers``.
Logits come out in the model's dtype; upcasting happens chunk by chunk in miles.policy.logprob.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from miles.model.config import ModelConfig
from miles.model.kernels import STANDARD, Kernels
from miles.model.rope import apply_rotary, rope_inv_freq, rotary_cos_sin  # noqa: F401 - importable from here
from miles.model.rope import rotate_half as _rotate_half  # noqa: F401

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RMSNorm(nn.Module):
    """Holds the weight; the arithmetic is the model's kernels' (``forward`` is the standard one)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, kern: Kernels = STANDARD):
        return kern.rms_norm(x, self.weight, self.eps)


@dataclass(slots=True)
class KVCache:
    """Preallocated keys and values: per layer [max_batch, kv_heads, max_len, head_dim]."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(cls, cfg: ModelConfig, max_batch: int, max_len: int, device, dtype) -> "KVCache":
        shape = (max_batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        return cls(
            [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)],
            [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)],
        )

    def tensors(self) -> list[torch.Tensor]:
        return self.k + self.v


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def qkv(self, x_BTH, cos, sin, kern: Kernels):
        """Rotated q [B, H, T, D], k and v [B, KVH, T, D] of the layer's input (the engine's prefill and decode too)."""
        cfg = self.cfg
        B, T, _ = x_BTH.shape
        q = kern.linear(x_BTH, self.q_proj).view(B, T, cfg.num_attention_heads, cfg.head_dim)
        k = kern.linear(x_BTH, self.k_proj).view(B, T, cfg.num_key_value_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q, kern), self.k_norm(k, kern)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = kern.linear(x_BTH, self.v_proj)
        v = v.view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x_BTH, cos, sin, mask_B1TS, cache: KVCache | None, cache_pos: int, kern: Kernels = STANDARD):
        B, T, _ = x_BTH.shape
        q, k, v = self.qkv(x_BTH, cos, sin, kern)
        if cache is not None:
            ck, cv = cache.k[self.layer_idx], cache.v[self.layer_idx]
            ck[:B, :, cache_pos : cache_pos + T] = k
            cv[:B, :, cache_pos : cache_pos + T] = v
            k, v = ck[:B, :, : cache_pos + T], cv[:B, :, : cache_pos + T]
        out = kern.attention(q, k, v, mask_B1TS, cache_pos)
        return kern.linear(out.transpose(1, 2).reshape(B, T, -1), self.o_proj)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, kern: Kernels = STANDARD):
        return kern.linear(kern.silu_mul(kern.linear(x, self.gate_proj), kern.linear(x, self.up_proj)), self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache, cache_pos, kern: Kernels = STANDARD):
        x = x + self.self_attn(self.input_layernorm(x, kern), cos, sin, mask, cache, cache_pos, kern)
        return x + self.mlp(self.post_attention_layernorm(x, kern), kern)


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # given its weight, Embedding skips its own normal_ init, which on the meta device (build_decoder) runs
        # torch's Python reference and imports torch._dynamo, slow, in every process that builds a model
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Decoder(nn.Module):
    """Causal LM. ``forward(input_ids [B,T], position_ids=None, mask=None, cache=None, cache_pos=0) -> logits [B,T,V]``.

    Training: ``model(tokens)`` (causal attention; right padding needs no mask). Generation: prefill with the
    left-padded prompt and a boolean mask [B,1,T,S] (True = attend), then decode one token at a time with
    ``cache_pos`` advancing. ``kernels`` (miles.model.kernels) is the arithmetic of every op, for the trainer and
    for the engine's prefill and decode alike: STANDARD, or INVARIANT (true on-policy; right padding only, no mask).
    """

    def __init__(self, cfg: ModelConfig, kernels: Kernels = STANDARD):
        super().__init__()
        self.config = cfg
        self.kernels = kernels
        self.model = DecoderBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self, seed: int) -> "Decoder":
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * self.config.init_std)
        return self

    def forward(
        self, input_ids_BT, position_ids_BT=None, mask_B1TS=None, cache: KVCache | None = None, cache_pos: int = 0
    ):
        B, T = input_ids_BT.shape
        if position_ids_BT is None:
            position_ids_BT = torch.arange(cache_pos, cache_pos + T, device=input_ids_BT.device).expand(B, T)
        kern = self.kernels
        x = self.model.embed_tokens(input_ids_BT)
        cos, sin = kern.rotary_cos_sin(self.config, position_ids_BT, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask_B1TS, cache, cache_pos, kern)
        return kern.linear(self.model.norm(x, kern), self.lm_head)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters under Hugging Face names; a tied lm_head is left out, as HF checkpoints do."""
        sd = {k: v for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        return sd


def build_decoder(cfg: ModelConfig, *, seed: int = 0, device="cpu", kernels: Kernels = STANDARD) -> Decoder:
    """A decoder in the config's dtype: loaded from ``cfg.checkpoint`` when set, else random-initialised; with
    ``cfg.lora.rank`` >= 1, FP32 adapters on the targeted projections and the base frozen (miles.model.lora)."""
    with torch.device("meta"):
        model = Decoder(cfg, kernels)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if cfg.checkpoint:
        from miles.model.checkpoint import load_weights

        load_weights(model, cfg.checkpoint)
    else:
        model.init_weights(seed)
    model = model.to(DTYPES[cfg.dtype])
    if cfg.lora.enabled:
        from miles.model.lora import add_adapters

        add_adapters(model, cfg.lora, seed=seed)
    return model
