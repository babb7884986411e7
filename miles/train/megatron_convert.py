"""Weight names and layouts between Hugging Face (Llama / Qwen2) and Megatron-core's GPTModel (local spec, TP = 1).

Pure tensor code, no megatron import: the CPU suite checks the round trip bit-exactly. Megatron fuses q/k/v
into one ``linear_qkv`` whose rows are grouped per KV head ([q heads of group 0, k_0, v_0, q heads of group
1, k_1, v_1, ...]) and gate/up into one ``linear_fc1`` ([gate; up]); RMSNorm weights sit under
``input_layernorm`` / ``pre_mlp_layernorm`` / ``final_layernorm`` in the local (non Transformer Engine) spec.

    mcore = hf_to_megatron(hf_state, model_cfg)      # dict Megatron name -> tensor
    hf = dict(megatron_to_hf(mcore.items(), model_cfg))
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from miles.model.config import ModelConfig

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_SIMPLE = {  # Megatron layer suffix -> HF layer suffix (one tensor each)
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """HF q [Hq*D, ...], k/v [Hkv*D, ...] -> Megatron linear_qkv [(Hq + 2 Hkv) * D, ...], grouped per KV head."""
    g, d, rest = cfg.num_key_value_heads, cfg.head_dim, q.shape[1:]
    per = cfg.num_attention_heads // g
    return torch.cat([q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], 1).reshape(
        -1, *rest
    )


def split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_qkv``."""
    g, d, rest = cfg.num_key_value_heads, cfg.head_dim, qkv.shape[1:]
    per = cfg.num_attention_heads // g
    q, k, v = qkv.reshape(g, (per + 2) * d, *rest).split([per * d, d, d], 1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_megatron(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF-named tensors (tied checkpoints may omit lm_head.weight) -> Megatron-named tensors."""
    out = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for m_suffix, h_suffix in _SIMPLE.items():
            out[dst + m_suffix] = hf[src + h_suffix]
        a = src + "self_attn."
        out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], cfg
        )
        if cfg.attention_bias:
            out[dst + "self_attention.linear_qkv.bias"] = fuse_qkv(
                hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], cfg
            )
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]]
        )
    return out


def megatron_to_hf(named: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron-named tensors -> (HF name, tensor), streaming; the split tensors are views of the fused ones.

    A tied model yields no lm_head.weight (as HF checkpoints and TorchBackend.named_weights do)."""
    for name, t in named:
        if name == "embedding.word_embeddings.weight":
            yield "model.embed_tokens.weight", t
        elif name == "decoder.final_layernorm.weight":
            yield "model.norm.weight", t
        elif name == "output_layer.weight":
            if not cfg.tie_word_embeddings:
                yield "lm_head.weight", t
        elif (m := _LAYER.fullmatch(name)) is not None:
            yield from _layer_to_hf(int(m.group(1)), m.group(2), t, cfg)
        else:
            raise KeyError(
                f"no HF name for Megatron parameter {name!r}; megatron_convert knows the local GPT spec only "
                "(dense Llama/Qwen2: no MoE, no MLA, no TE fused layernorm-linear)"
            )


def _layer_to_hf(i: int, suffix: str, t: torch.Tensor, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    p = f"model.layers.{i}."
    if suffix in _SIMPLE:
        yield p + _SIMPLE[suffix], t
    elif suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        for proj, part in zip(("q_proj", "k_proj", "v_proj"), split_qkv(t, cfg)):
            yield f"{p}self_attn.{proj}.{kind}", part
    elif suffix == "mlp.linear_fc1.weight":
        gate, up = t.chunk(2)
        yield p + "mlp.gate_proj.weight", gate
        yield p + "mlp.up_proj.weight", up
    else:
        raise KeyError(f"no HF name for Megatron parameter decoder.layers.{i}.{suffix!r} (local GPT spec only)")
