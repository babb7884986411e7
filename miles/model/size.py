"""Model sizes for planning: parameter counts (dense, MoE, MLA, DeepSeek-V4-like attention) from an HF
``config.json``, the KV cache per token, and the exact storages of the embedded decoder.

Nothing is allocated: the large models are counted from their config (miles.memory.traffic.weight_shapes gives
the weight shapes; this file adds the small pieces that matter for totals: low-rank norms, MTP layers, and the
active subset), and the embedded decoder is built on the meta device so the sizes are those of the very
tensors a run holds. Published configs ship in ``miles/model/hf_configs/`` (see its README for inferred
fields); ``stated_params`` reads the authors' round figures so the counts can be checked against them.

    hf = load_hf_config("kimi-k2")
    c = count_params(hf)            # ParamCount(total=1.026e12, active=3.26e10, mtp=0, ...)
    kv_bytes_per_token(hf, 2)       # bytes of KV cache per token (all layers)
    decoder_storages(model_cfg)     # {"params": [bytes per storage, ...]} for the embedded decoder (its base)
    adapter_storages(model_cfg)     # LoRA's A and B matrices (FP32), [] without model.lora
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from miles.memory.traffic import WeightShape, weight_shapes

HF_CONFIG_DIR = Path(__file__).parent / "hf_configs"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def available_hf_configs() -> list[str]:
    return sorted(p.stem for p in HF_CONFIG_DIR.glob("*.json"))


def resolve_hf_config(name_or_path: str) -> Path:
    """A shipped config by name (``kimi-k2``) or a path to any ``config.json``."""
    p = Path(name_or_path)
    if p.suffix == ".json" and p.is_file():
        return p
    if p.is_dir() and (p / "config.json").is_file():
        return p / "config.json"
    shipped = HF_CONFIG_DIR / f"{name_or_path}.json"
    if shipped.is_file():
        return shipped
    raise ValueError(
        f"model config {name_or_path!r} is neither a config.json path nor a shipped config; "
        f"shipped: {available_hf_configs()}"
    )


def load_hf_config(name_or_path: str) -> dict:
    return json.loads(resolve_hf_config(name_or_path).read_text())


def stated_params(hf: dict, key: str = "_total_params") -> float | None:
    """The authors' stated figure (``"284B"``, ``"1T"``) as a number of parameters, when present."""
    m = re.match(r"\s*([\d.]+)\s*([BT])", str(hf.get(key, "")))
    return float(m.group(1)) * {"B": 1e9, "T": 1e12}[m.group(2)] if m else None


@dataclass(frozen=True, slots=True)
class ParamCount:
    total: int  # main model (embeddings + output head included, MTP excluded: how DeepSeek states 671B)
    active: int  # per token: everything but the routed experts a token does not visit
    mtp: int  # multi-token-prediction layers (num_nextn_predict_layers), counted apart
    routed_experts: int  # the routed-expert share of total
    embedding: int  # input embeddings + untied output head


def _extra_shapes(hf: dict, h: int, L: int) -> list[WeightShape]:
    """Norms of the low-rank projections (MLA, DeepSeek-V4) and Qwen3's per-head q/k norms."""
    out = []
    if "kv_lora_rank" in hf:
        out += [
            WeightShape("attn.q_a_norm", 1, hf["q_lora_rank"], L, False),
            WeightShape("attn.kv_a_norm", 1, hf["kv_lora_rank"], L, False),
        ]
    elif "o_lora_rank" in hf:
        out += [
            WeightShape("attn.q_norm", 1, hf["q_lora_rank"], L, False),
            WeightShape("attn.kv_norm", 1, hf.get("head_dim", 0), L, False),
        ]
    elif str(hf.get("model_type", "")).startswith("qwen3"):
        hd = hf.get("head_dim") or h // hf["num_attention_heads"]
        out += [WeightShape("attn.qk_norm", 1, hd, 2 * L, False)]
    return out


def model_shapes(hf: dict) -> list[WeightShape]:
    """Every weight of the main model (no MTP), grouped into identical shapes."""
    h, L = hf["hidden_size"], hf["num_hidden_layers"]
    return weight_shapes(hf) + _extra_shapes(hf, h, L)


def _moe_layer_params(hf: dict) -> int:
    """Parameters of one MoE decoder layer (what an MTP layer repeats, plus its projections)."""
    one = dict(hf, num_hidden_layers=1, first_k_dense_replace=0, vocab_size=1, tie_word_embeddings=True)
    return sum(w.numel for w in model_shapes(one)) - hf["hidden_size"] * 2  # drop the 1-row embedding and final norm


def count_params(hf: dict) -> ParamCount:
    shapes = model_shapes(hf)
    total = sum(w.numel for w in shapes)
    routed = sum(w.numel for w in shapes if w.name.startswith("mlp.experts"))
    experts = hf.get("n_routed_experts") or hf.get("num_experts") or 0
    k = hf.get("num_experts_per_tok", 0)
    active = total - (routed - routed * k // experts if experts else 0)
    embedding = sum(w.numel for w in shapes if w.name in ("embed_tokens", "lm_head"))
    h = hf["hidden_size"]
    n_mtp = hf.get("num_nextn_predict_layers", 0)
    mtp = n_mtp * (_moe_layer_params(hf) + 2 * h * h + 3 * h) if experts else n_mtp * 0
    return ParamCount(total=total, active=active, mtp=mtp, routed_experts=routed, embedding=embedding)


def kv_bytes_per_token(hf: dict, dtype_bytes: int = 2) -> int:
    """KV cache bytes per token over all layers.

    MLA: the latent (kv_lora_rank + qk_rope_head_dim) per layer. DeepSeek-V4-like (one shared KV head): head_dim
    per layer divided by the layer's compress ratio (0 = uncompressed); an approximation of its compressed and
    sliding-window layers. Otherwise K and V: 2 x kv_heads x head_dim per layer.
    """
    L = hf["num_hidden_layers"]
    if "kv_lora_rank" in hf:
        return (hf["kv_lora_rank"] + hf["qk_rope_head_dim"]) * L * dtype_bytes
    if "o_lora_rank" in hf:
        per = hf.get("num_key_value_heads", 1) * hf["head_dim"]
        ratios = list(hf.get("compress_ratios", []))[:L] + [0] * max(0, L - len(hf.get("compress_ratios", [])))
        return int(sum(per / (r or 1) for r in ratios) * dtype_bytes)
    hd = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return 2 * hf.get("num_key_value_heads", hf["num_attention_heads"]) * hd * L * dtype_bytes


def decoder_storages(model_cfg) -> dict[str, list[int]]:
    """Bytes of each distinct parameter storage of the embedded decoder (tied weights once), built on meta."""
    import torch

    from miles.model.decoder import Decoder

    with torch.device("meta"):
        model = Decoder(model_cfg)
    if model_cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    size = DTYPE_BYTES[model_cfg.dtype]
    return {"params": [p.numel() * size for p in model.parameters()]}


def adapter_storages(model_cfg) -> list[int]:
    """Bytes of each LoRA adapter matrix (A [rank, in] and B [out, rank] per targeted projection, FP32)."""
    from miles.model.lora_config import targets

    r = model_cfg.lora.rank
    return [n for _, i, o in targets(model_cfg) for n in (4 * r * i, 4 * o * r)] if r else []


def kv_cache_storages(model_cfg, max_batch: int, max_len: int) -> list[int]:
    """The embedded engine's KV cache: one K and one V tensor per layer, [batch, kv_heads, len, head_dim]."""
    n = max_batch * model_cfg.num_key_value_heads * max_len * model_cfg.head_dim * DTYPE_BYTES[model_cfg.dtype]
    return [n] * (2 * model_cfg.num_hidden_layers)
