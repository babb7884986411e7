"""The bytes-per-element x modules model: what one trainer offload moves, per tag, for a model config and a
low-precision recipe, with and without the quantized weight workspaces.

Pure functions over an HF-style ``config.json`` dict (dense, MoE, low-rank / MLA attention); no tensors are
built, so the planner can price a 284B model before launching it. Per element of a quantized weight, each
cached copy costs: fp8 1 B (+ one FP32 scale per tensor), fp8_block 1 B (+ one FP32 scale per 128x128 tile),
mxfp8 1 + 1/32 B (e8m0 scale per 1x32), nvfp4 0.5 + 1/16 B (e4m3 scale per 1x16, + one FP32 global scale).
Training keeps a rowwise and a columnwise copy, inference only the rowwise one. Block scales are stored in
128 x 4 tiles (blockwise FP8: rows of 4), so small layers pay padding; the model counts it. Master weights
cost ``param_bytes`` (bf16: 2) per element whatever the recipe.

    shapes = weight_shapes(json.load(open("deepseek-v4-flash.json")))
    offload_bytes(shapes, "mxfp8", clear_workspaces=False)  # {"params": ..., "quant_workspace": ...}
    workspace_share(shapes, "mxfp8")                         # fraction of the offload that clearing removes
"""

from __future__ import annotations

from dataclasses import dataclass

RECIPES = ("bf16", "fp8", "fp8_block", "mxfp8", "nvfp4")
SCALE_TILE_ROWS, SCALE_TILE_COLS = 128, 4
# Asymptotic bytes per weight element of one cached copy (large, tile-aligned layers).
BYTES_PER_ELEMENT = {
    "bf16": 0.0,
    "fp8": 1.0,
    "fp8_block": 1.0 + 4 / (128 * 128),
    "mxfp8": 1.0 + 1 / 32,
    "nvfp4": 0.5 + 1 / 16,
}


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


def _cdiv(n: int, m: int) -> int:
    return -(-n // m)


@dataclass(frozen=True, slots=True)
class WeightShape:
    name: str
    rows: int  # output features (1 for a vector such as a norm weight or a bias)
    cols: int  # input features: the reduction dim of the forward
    count: int = 1  # identical tensors (layers x experts)
    quantized: bool = True  # False: embeddings, output head, routers, norms, biases

    @property
    def numel(self) -> int:
        return self.rows * self.cols * self.count


def copy_bytes(rows: int, cols: int, recipe: str) -> int:
    """Bytes of one quantized copy laid out ``[rows, cols]`` with the blocks along ``cols``."""
    n = rows * cols
    if recipe == "bf16":
        return 0
    if recipe == "fp8":
        return n + 4
    if recipe == "fp8_block":
        return n + 4 * _cdiv(rows, 128) * _up(_cdiv(cols, 128), SCALE_TILE_COLS)
    if recipe == "mxfp8":
        return n + _up(rows, SCALE_TILE_ROWS) * _up(_cdiv(cols, 32), SCALE_TILE_COLS)
    if recipe == "nvfp4":
        return _cdiv(n, 2) + _up(rows, SCALE_TILE_ROWS) * _up(_cdiv(cols, 16), SCALE_TILE_COLS) + 4
    raise ValueError(f"recipe {recipe!r} is not one of {RECIPES}")


def workspace_bytes(w: WeightShape, recipe: str, training: bool = True) -> int:
    """Cached copies of one weight shape (all ``count`` of them): rowwise, plus the transposed columnwise copy."""
    if not w.quantized:
        return 0
    per = copy_bytes(w.rows, w.cols, recipe) + (copy_bytes(w.cols, w.rows, recipe) if training else 0)
    return per * w.count


def offload_bytes(
    shapes: list[WeightShape],
    recipe: str,
    *,
    clear_workspaces: bool,
    training: bool = True,
    param_bytes: int = 2,
    grad_bytes: int = 0,
    optimizer_bytes: int = 0,
    world_size: int = 1,
    shard_workspaces: bool = True,
) -> dict[str, int]:
    """Bytes one offload moves per tag on one rank (an even 1/world_size shard of everything).

    ``grad_bytes`` / ``optimizer_bytes`` are per parameter element (0: freed or not offloaded; Adam with FP32
    master weights and moments: 12). The "quant_workspace" tag is 0 when the workspaces are cleared first.
    ``shard_workspaces=False`` for FSDP-style sharding, where each rank quantizes the all-gathered weight and
    so caches full-size copies of every layer it ran.
    """
    numel = sum(w.numel for w in shapes)
    ws = 0 if clear_workspaces else sum(workspace_bytes(w, recipe, training) for w in shapes)
    out = {
        "params": numel * param_bytes // world_size,
        "grads": numel * grad_bytes // world_size,
        "optimizer": numel * optimizer_bytes // world_size,
        "quant_workspace": ws // world_size if shard_workspaces else ws,
    }
    return {tag: b for tag, b in out.items() if b or tag in ("params", "quant_workspace")}


def workspace_share(shapes: list[WeightShape], recipe: str, **kw) -> float:
    """Fraction of an offload's bytes that clearing the workspaces removes."""
    kept = sum(offload_bytes(shapes, recipe, clear_workspaces=True, **kw).values())
    full = sum(offload_bytes(shapes, recipe, clear_workspaces=False, **kw).values())
    return 1 - kept / full if full else 0.0


def _attention(cfg: dict, h: int, L: int) -> list[WeightShape]:
    nh = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // nh
    if "o_lora_rank" in cfg:  # DeepSeek-V4-like: low-rank q, one shared KV head, grouped low-rank output
        qr, orank, g = cfg["q_lora_rank"], cfg["o_lora_rank"], cfg.get("o_groups", 1)
        nkv = cfg.get("num_key_value_heads", 1)
        out = [
            WeightShape("attn.wq_a", qr, h, L),
            WeightShape("attn.wq_b", nh * hd, qr, L),
            WeightShape("attn.wkv", nkv * hd, h, L),
            WeightShape("attn.wo_a", g * orank, nh * hd // g, L),
            WeightShape("attn.wo_b", h, g * orank, L),
        ]
        if "index_n_heads" in cfg:  # sparse-attention indexer
            ih, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
            out += [
                WeightShape("attn.indexer.wq_b", ih * ihd, qr, L),
                WeightShape("attn.indexer.wk", ihd, h, L),
                WeightShape("attn.indexer.weights_proj", ih, h, L, quantized=False),
            ]
        return out
    if "kv_lora_rank" in cfg:  # DeepSeek-V3 MLA
        qr, kvr = cfg["q_lora_rank"], cfg["kv_lora_rank"]
        nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        return [
            WeightShape("attn.q_a_proj", qr, h, L),
            WeightShape("attn.q_b_proj", nh * (nope + rope), qr, L),
            WeightShape("attn.kv_a_proj", kvr + rope, h, L),
            WeightShape("attn.kv_b_proj", nh * (nope + vd), kvr, L),
            WeightShape("attn.o_proj", h, nh * vd, L),
        ]
    nkv = cfg.get("num_key_value_heads", nh)
    out = [
        WeightShape("attn.q_proj", nh * hd, h, L),
        WeightShape("attn.k_proj", nkv * hd, h, L),
        WeightShape("attn.v_proj", nkv * hd, h, L),
        WeightShape("attn.o_proj", h, nh * hd, L),
    ]
    if cfg.get("attention_bias", cfg.get("model_type") == "qwen2"):  # Qwen2 has q/k/v biases
        out += [WeightShape("attn.qkv_bias", 1, (nh + 2 * nkv) * hd, L, quantized=False)]
    return out


def _mlp(prefix: str, h: int, inter: int, count: int) -> list[WeightShape]:
    return [
        WeightShape(f"{prefix}.gate_proj", inter, h, count),
        WeightShape(f"{prefix}.up_proj", inter, h, count),
        WeightShape(f"{prefix}.down_proj", h, inter, count),
    ]


def weight_shapes(cfg: dict) -> list[WeightShape]:
    """Every weight of a decoder described by an HF-style config, grouped into identical shapes.

    Covered: embeddings, output head (unless tied), per-layer norms, standard / MLA / DeepSeek-V4-like
    attention, dense MLPs, MoE experts (routed and shared) with high-precision routers. Left out: MTP / draft
    layers, DeepSeek-V4 hyper-connection mixers and KV compressors (small next to the experts).
    """
    h, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    shapes = [WeightShape("embed_tokens", V, h, quantized=False), WeightShape("norms", 1, h, 2 * L + 1, False)]
    if not cfg.get("tie_word_embeddings", False):
        shapes.append(WeightShape("lm_head", V, h, quantized=False))
    shapes += _attention(cfg, h, L)
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or 0
    dense_layers = min(cfg.get("first_k_dense_replace", 0), L) if experts else L
    if dense_layers:
        shapes += _mlp("mlp", h, cfg["intermediate_size"], dense_layers)
    if experts:
        moe_layers, mi = L - dense_layers, cfg["moe_intermediate_size"]
        shapes += [WeightShape("mlp.router", experts, h, moe_layers, quantized=False)]
        shapes += _mlp("mlp.experts", h, mi, moe_layers * experts)
        if cfg.get("n_shared_experts"):
            shapes += _mlp("mlp.shared_experts", h, mi * cfg["n_shared_experts"], moe_layers)
    return shapes
