"""An HF-compatible decoder-only transformer (Llama / Qwen2 / Qwen3 layout and parameter names).

RMSNorm, rotary embeddings (plain, or Llama 3's scaled frequencies), grouped-query attention (Qwen3: RMSNorm on
each head's queries and keys), SwiGLU, tied or untied embeddings. The same module
serves the trainer (full sequences, causal) and the rollout engine (prefill + decode against a
preallocated KV cache). Parameter names equal Hugging Face's, so checkpoints load in ``transformers``.
Logits come out in the model's dtype; upcasting happens chunk by chunk in miles.policy.logprob.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from miles.model.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig, device) -> torch.Tensor:
    """The rotary frequencies [head_dim / 2]; rope_type 'llama3' divides the low ones by rope_factor and blends
    the band between the low- and high-frequency wavelengths (Llama 3.1's long-context scaling)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.int64).float() / d))
    if cfg.rope_type == "default":
        return inv_freq
    old_len, factor = cfg.rope_original_max_position_embeddings, cfg.rope_factor
    lo, hi = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    middle = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(middle, blended, scaled)


def rotary_cos_sin(position_ids_BT: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    freqs = position_ids_BT.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [B, 1, T, D]


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


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

    def forward(self, x_BTH, cos, sin, mask_B1TS, cache: KVCache | None, cache_pos: int):
        cfg = self.cfg
        B, T, _ = x_BTH.shape
        q = self.q_proj(x_BTH).view(B, T, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_proj(x_BTH).view(B, T, cfg.num_key_value_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x_BTH).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            ck, cv = cache.k[self.layer_idx], cache.v[self.layer_idx]
            ck[:B, :, cache_pos : cache_pos + T] = k
            cv[:B, :, cache_pos : cache_pos + T] = v
            k, v = ck[:B, :, : cache_pos + T], cv[:B, :, : cache_pos + T]
        gqa = cfg.num_attention_heads != cfg.num_key_value_heads  # SDPA shares KV heads without copying them
        if mask_B1TS is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1TS, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache, cache_pos):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, cache_pos)
        return x + self.mlp(self.post_attention_layernorm(x))


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
    ``cache_pos`` advancing.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
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
        x = self.model.embed_tokens(input_ids_BT)
        cos, sin = rotary_cos_sin(position_ids_BT, rope_inv_freq(self.config, x.device), x.dtype)
        if mask_B1TS is None and cache is not None and (cache_pos > 0 or T == 1):
            mask_B1TS = torch.ones(B, 1, T, cache_pos + T, dtype=torch.bool, device=x.device).tril(cache_pos)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask_B1TS, cache, cache_pos)
        return self.lm_head(self.model.norm(x))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters under Hugging Face names; a tied lm_head is left out, as HF checkpoints do."""
        sd = {k: v for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        return sd


def build_decoder(cfg: ModelConfig, *, seed: int = 0, device="cpu") -> Decoder:
    """A decoder in the config's dtype: loaded from ``cfg.checkpoint`` when set, else random-initialised."""
    with torch.device("meta"):
        model = Decoder(cfg)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if cfg.checkpoint:
        from miles.model.checkpoint import load_weights

        load_weights(model, cfg.checkpoint)
    else:
        model.init_weights(seed)
    return model.to(DTYPES[cfg.dtype])
