"""clear_quantized_workspaces: what it drops, when it skips (one log line, never an error), bit-equal outputs
after clear + offload + rebuild, the MoE traffic saving, and Transformer Engine's ``_fp8_workspaces``."""

import logging

import pytest
import torch
from torch import nn

from benchmarks.quant_traffic import measure_recipe, offload_once, train_step
from miles.model.toy_moe import SIZES, TinyMoE
from miles.quant import apply_precision, clear_quantized_workspaces, quantized_workspace_tensors

CFG = SIZES["cpu"]  # 1 layer, 4 experts: every dim a multiple of 128, so every recipe fits


def trained(recipe: str) -> TinyMoE:
    torch.manual_seed(0)
    model = apply_precision(TinyMoE(CFG), recipe)
    train_step(model, torch.randint(0, 128, (2, 16)))
    return model


def test_clear_drops_every_copy_and_reports_the_bytes():
    model = trained("mxfp8")
    held = sum(t.numel() * t.element_size() for t in quantized_workspace_tensors(model))
    report = clear_quantized_workspaces(model)
    assert report.skipped_reason is None and report.bytes_freed == held > 0
    assert report.cleared_modules == 4 + 3  # q/k/v/o and the three grouped expert layers
    assert quantized_workspace_tensors(model) == []


def test_clear_skips_with_one_log_line_when_cuda_graphs_are_captured(caplog):
    model = trained("mxfp8")
    held = quantized_workspace_tensors(model)
    with caplog.at_level(logging.INFO, logger="miles.quant"):
        report = clear_quantized_workspaces(model, cuda_graphs_captured=True)
    assert report.cleared_modules == 0 and report.bytes_freed == 0 and "CUDA graphs" in report.skipped_reason
    assert len(caplog.records) == 1 and "skipped" in caplog.records[0].getMessage()
    assert len(quantized_workspace_tensors(model)) == len(held)  # nothing dropped


def test_clear_on_unrelated_configs_skips_without_error(caplog):
    with caplog.at_level(logging.INFO, logger="miles.quant"):
        assert "no quantized" in clear_quantized_workspaces(trained("bf16")).skipped_reason
        assert clear_quantized_workspaces(apply_precision(TinyMoE(CFG), "nvfp4")).skipped_reason  # no forward yet
        assert clear_quantized_workspaces([]).skipped_reason
        assert clear_quantized_workspaces(nn.Linear(4, 4)).skipped_reason
    assert len(caplog.records) == 4


def test_bf16_with_cuda_graphs_and_clearing_on_moves_the_same_bytes_as_clearing_off():
    moved = {
        clear: offload_once(trained("bf16"), torch.device("cpu"), clear=clear, cuda_graphs_captured=True).moved
        for clear in (False, True)
    }
    assert moved[True] == moved[False]


def test_outputs_after_clear_offload_and_rebuild_are_bit_equal():
    row = measure_recipe(CFG, "nvfp4", clear=True, device=torch.device("cpu"))
    assert row["outputs_bit_equal_after_rebuild"] and row["clear_report"]["bytes_freed"] > 0


def test_mxfp8_moe_offload_moves_at_least_40_percent_fewer_bytes_with_clearing():
    off = measure_recipe(CFG, "mxfp8", clear=False, device=torch.device("cpu"))["measured_bytes"]
    on = measure_recipe(CFG, "mxfp8", clear=True, device=torch.device("cpu"))["measured_bytes"]
    assert 1 - on / off >= 0.40, (on, off)


class _TECachedWeight:
    """The documented storage attributes of a TE MXFP8 tensor (TE itself cannot be installed here)."""

    def __init__(self, rows, cols):
        self._rowwise_data = torch.zeros(rows, cols, dtype=torch.uint8)
        self._columnwise_data = torch.zeros(rows, cols, dtype=torch.uint8)
        self._rowwise_scale_inv = torch.zeros(rows, cols // 32, dtype=torch.uint8)
        self._columnwise_scale_inv = None


def test_te_style_workspaces_are_registered_and_cleared():
    model = nn.Sequential(nn.Linear(4, 4))
    model[0]._fp8_workspaces = {"weight": _TECachedWeight(64, 64)}
    assert len(quantized_workspace_tensors(model)) == 3
    report = clear_quantized_workspaces(model)
    assert report.cleared_modules == 1 and report.bytes_freed == 2 * 64 * 64 + 64 * 2
    assert model[0]._fp8_workspaces == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_transformer_engine_linear_workspaces_are_cleared():
    te = pytest.importorskip("transformer_engine.pytorch")
    recipe = pytest.importorskip("transformer_engine.common.recipe")
    layer = te.Linear(256, 256, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fp8_recipe = getattr(recipe, "Float8CurrentScaling", recipe.DelayedScaling)()
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        layer(x, is_first_microbatch=True).sum().backward()  # TE caches only when this is not None
    if not layer._fp8_workspaces:
        pytest.skip("this TE version caches no weight workspace for this recipe")
    report = clear_quantized_workspaces(layer)
    assert report.bytes_freed > 0 and layer._fp8_workspaces == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_skip_and_move_the_same_bytes_on_the_gpu():
    from benchmarks.quant_traffic import cuda_graph_check

    for recipe in ("bf16", "mxfp8"):
        r = cuda_graph_check(CFG, recipe, torch.device("cuda"))
        assert r["same_bytes"] and "CUDA graphs" in r["on"]["skipped_reason"], r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_allocator_agrees_with_the_ledger_on_offload_bytes():
    for recipe in ("fp8", "mxfp8", "nvfp4"):  # the larger size: 4-byte scales round up to 512 B blocks
        row = measure_recipe(SIZES["cuda"], recipe, clear=False, device=torch.device("cuda"))
        assert abs(row["measured_over_predicted"] - 1) <= 0.02 and abs(row["allocator_over_ledger"] - 1) <= 0.02, row
        assert row["outputs_bit_equal_after_rebuild"]
