"""The bytes-per-element x modules model against the MemoryLedger of real offloads, and against the
parameter counts the model authors publish."""

import json

import pytest
import torch

from benchmarks.quant_traffic import measure_recipe
from miles.memory.traffic import (
    BYTES_PER_ELEMENT,
    RECIPES,
    WeightShape,
    copy_bytes,
    offload_bytes,
    weight_shapes,
    workspace_share,
)
from miles.model.size import HF_CONFIG_DIR
from miles.model.toy_moe import SIZES, TinyMoE

CONFIGS = HF_CONFIG_DIR  # the HF configs shipped with miles (not a path outside the repository)
CFG = SIZES["cpu"]  # 1 layer, 4 experts: every dim a multiple of 128, so every recipe fits


@pytest.mark.parametrize("recipe", RECIPES)
def test_traffic_model_matches_the_ledger_of_a_real_offload(recipe):
    for clear in (False, True):
        row = measure_recipe(CFG, recipe, clear, torch.device("cpu"))
        assert abs(row["measured_over_predicted"] - 1) <= 0.02, row
        assert row["measured_by_tag"] == row["predicted_by_tag"]  # exact, tag by tag


def test_weight_shapes_cover_every_parameter_of_the_moe_model():
    model = TinyMoE(CFG)
    assert sum(w.numel for w in weight_shapes(CFG)) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("recipe", ["fp8", "fp8_block", "mxfp8", "nvfp4"])
def test_large_aligned_layers_cost_the_nominal_bytes_per_element(recipe):
    n = 4096 * 8192
    assert copy_bytes(4096, 8192, recipe) / n == pytest.approx(BYTES_PER_ELEMENT[recipe], rel=1e-6)


def test_small_layers_pay_scale_tile_padding():
    # mxfp8 [64, 64]: 2 scale columns padded to 4, 64 rows padded to 128
    assert copy_bytes(64, 64, "mxfp8") == 64 * 64 + 128 * 4
    assert copy_bytes(64, 64, "nvfp4") == 64 * 32 + 128 * 4 + 4


def test_training_keeps_two_copies_and_inference_one():
    w = WeightShape("w", 4096, 4096, count=3)
    from miles.memory.traffic import workspace_bytes

    assert workspace_bytes(w, "mxfp8", training=True) == 2 * workspace_bytes(w, "mxfp8", training=False)
    assert workspace_bytes(WeightShape("e", 4096, 4096, quantized=False), "mxfp8") == 0


@pytest.mark.parametrize(
    "name,billions,tol",
    [
        ("deepseek-v4-flash", 284, 0.01),
        ("deepseek-v3", 671, 0.01),
        ("glm-4.5", 355, 0.015),
        ("qwen3-30b-a3b", 30.5, 0.01),
        ("qwen3-8b", 8.2, 0.01),
    ],
)
def test_weight_shapes_reproduce_published_parameter_counts(name, billions, tol):
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    assert sum(w.numel for w in weight_shapes(cfg)) / 1e9 == pytest.approx(billions, rel=tol)


def test_clearing_share_and_sharding():
    shapes = weight_shapes(json.loads((CONFIGS / "deepseek-v4-flash.json").read_text()))
    assert 0.49 < workspace_share(shapes, "mxfp8") < 0.52  # ~2.06 B of workspace per 2 B of bf16 weight
    assert workspace_share(shapes, "bf16") == 0
    one = offload_bytes(shapes, "mxfp8", clear_workspaces=False)
    four = offload_bytes(shapes, "mxfp8", clear_workspaces=False, world_size=4)
    assert four["quant_workspace"] == one["quant_workspace"] // 4
    fsdp = offload_bytes(shapes, "mxfp8", clear_workspaces=False, world_size=4, shard_workspaces=False)
    assert fsdp["quant_workspace"] == one["quant_workspace"] and fsdp["params"] == four["params"]
    with_adam = offload_bytes(shapes, "mxfp8", clear_workspaces=True, optimizer_bytes=12)
    assert with_adam["optimizer"] == 6 * with_adam["params"]


@pytest.mark.parametrize("arch,tie", [("qwen2", True), ("llama", False)])
def test_weight_shapes_cover_every_parameter_of_the_decoder(arch, tie):
    from miles.model.config import ModelConfig
    from miles.model.decoder import build_decoder

    cfg = ModelConfig(architecture=arch, tie_word_embeddings=tie, attention_bias=arch == "qwen2")
    model = build_decoder(cfg, seed=0, device="cpu")
    assert sum(w.numel for w in weight_shapes(cfg.to_hf())) == sum(p.numel() for p in model.parameters())
