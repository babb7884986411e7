"""A small MoE decoder built from an HF-style config dict, for the quantized-workspace traffic benchmark and
notebook: its weights are exactly the shapes ``miles.memory.traffic.weight_shapes`` enumerates for the same
config (embeddings, norms, q/k/v/o, a router, grouped gate/up/down experts, an untied output head)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from miles.quant import QuantizedGroupedLinear

SIZES = {
    "cpu": {
        "vocab_size": 128,
        "hidden_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "tie_word_embeddings": False,
        "bench_batch": 2,
        "bench_seq": 16,
    },
    "cuda": {
        "vocab_size": 32768,
        "hidden_size": 2048,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "n_routed_experts": 16,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 1024,
        "tie_word_embeddings": False,
        "bench_batch": 4,
        "bench_seq": 512,
    },
}


class MoEBlock(nn.Module):
    def __init__(self, cfg: dict, dtype: torch.dtype, device):
        super().__init__()
        h, nh, nkv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        E, mi = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        kw = {"dtype": dtype, "device": device}
        self.nh, self.nkv, self.hd, self.top_k = nh, nkv, hd, cfg["num_experts_per_tok"]
        self.input_layernorm = nn.RMSNorm(h, **kw)
        self.q_proj, self.k_proj = nn.Linear(h, nh * hd, bias=False, **kw), nn.Linear(h, nkv * hd, bias=False, **kw)
        self.v_proj, self.o_proj = nn.Linear(h, nkv * hd, bias=False, **kw), nn.Linear(nh * hd, h, bias=False, **kw)
        self.post_attention_layernorm = nn.RMSNorm(h, **kw)
        self.router = nn.Linear(h, E, bias=False, **kw)
        self.gate_proj = QuantizedGroupedLinear(E, h, mi, **kw)
        self.up_proj = QuantizedGroupedLinear(E, h, mi, **kw)
        self.down_proj = QuantizedGroupedLinear(E, mi, h, **kw)

    def attention(self, x_BTH: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTH.shape
        q = self.q_proj(x_BTH).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x_BTH).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x_BTH).view(B, T, self.nkv, self.hd).transpose(1, 2)
        k, v = (
            t[:, :, None].expand(B, self.nkv, self.nh // self.nkv, T, self.hd).reshape(B, self.nh, T, self.hd)
            for t in (k, v)
        )  # grouped KV heads by views + one copy: no host sync, so CUDA-graph capturable
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))

    def moe(self, x_BTH: torch.Tensor) -> torch.Tensor:
        x_NH = x_BTH.reshape(-1, x_BTH.shape[-1])
        weights_NK, experts_NK = self.router(x_NH).float().softmax(-1).topk(self.top_k, dim=-1)
        flat_e = experts_NK.flatten()
        order = torch.argsort(flat_e, stable=True)
        token = torch.arange(x_NH.shape[0], device=x_NH.device).repeat_interleave(self.top_k)[order]
        sizes = tuple(torch.bincount(flat_e, minlength=self.gate_proj.weight.shape[0]).tolist())
        xs = x_NH[token]
        y = self.down_proj(F.silu(self.gate_proj(xs, sizes)) * self.up_proj(xs, sizes), sizes)
        y = y * weights_NK.flatten()[order, None].to(y.dtype)
        # top-2 onto zeros: the two adds per token commute exactly, so index_add_ is deterministic on CUDA too
        return torch.zeros_like(x_NH).index_add_(0, token, y).view_as(x_BTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.input_layernorm(x))
        return x + self.moe(self.post_attention_layernorm(x))


class TinyMoE(nn.Module):
    """tokens [B, T] -> logits [B, T, V]; bf16 master weights by default."""

    def __init__(self, cfg: dict, *, dtype: torch.dtype = torch.bfloat16, device="cpu"):
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"], **kw)
        self.layers = nn.ModuleList(MoEBlock(cfg, dtype, device) for _ in range(cfg["num_hidden_layers"]))
        self.norm = nn.RMSNorm(cfg["hidden_size"], **kw)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False, **kw)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens_BT)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))
