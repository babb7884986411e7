"""Quantize / dequantize of every format against references written here from the format definitions
(nearest representable value by exhaustive search over the code table, ties to the even code)."""

import math

import numpy as np
import pytest
import torch

from miles.quant.fp8 import dequantize_fp8, quantize_fp8_blockwise, quantize_fp8_tensorwise
from miles.quant.mxfp8 import dequantize_mxfp8, quantize_mxfp8
from miles.quant.nvfp4 import ACTIVATION_BLOCK, WEIGHT_BLOCK, dequantize_nvfp4, quantize_nvfp4, unpack_pairs
from miles.quant.recipe import check_weight_layout, dequantize, quantize_weight

E4M3_TABLE = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
E2M1_TABLE = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def nearest(values: np.ndarray, table: np.ndarray, vmax: float) -> np.ndarray:
    """Round each value to the nearest finite table entry, ties to the entry with an even code."""
    codes = np.arange(len(table))
    ok = np.isfinite(table)
    table, codes = table[ok], codes[ok]
    out = np.empty_like(values, dtype=np.float32)
    for i, v in enumerate(np.clip(values.ravel(), -vmax, vmax)):
        d = np.abs(table - v)
        best = np.flatnonzero(d == d.min())
        even = [b for b in best if codes[b] % 2 == 0]
        out.ravel()[i] = table[(even or list(best))[0]]
    return out


def rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.logspace(-2, 1, shape[-1])


def test_fp8_tensorwise_matches_reference():
    x = rand(16, 64)
    ref_scale = np.float32(np.abs(x.numpy()).max()) / np.float32(448)
    ref = nearest(x.numpy() / ref_scale, E4M3_TABLE, 448) * ref_scale
    q = quantize_fp8_tensorwise(x, "w")
    assert q.data.dtype == torch.float8_e4m3fn and q.scale_inv.dtype == torch.float32 and q.scale_inv.numel() == 1
    np.testing.assert_array_equal(dequantize_fp8(q).numpy(), ref)


def test_fp8_blockwise_matches_reference():
    x = rand(256, 384, seed=1)
    xn, ref = x.numpy(), np.empty((256, 384), np.float32)
    for i in range(2):
        for j in range(3):
            tile = xn[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            s = np.float32(np.abs(tile).max()) / np.float32(448)
            ref[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = nearest(tile / s, E4M3_TABLE, 448) * s
    q = quantize_fp8_blockwise(x, "w")
    assert q.scale_inv.shape == (2, 4)  # 3 scale columns padded to 4
    np.testing.assert_array_equal(dequantize_fp8(q).numpy(), ref)


def test_mxfp8_matches_reference_with_power_of_two_scales():
    x = rand(8, 96, seed=2)
    xn, ref, exps = x.numpy(), np.empty((8, 96), np.float32), np.empty((8, 3))
    for r in range(8):
        for b in range(3):
            blk = xn[r, b * 32 : (b + 1) * 32]
            e = math.floor(math.log2(float(np.abs(blk).max()))) - 8
            exps[r, b] = e
            ref[r, b * 32 : (b + 1) * 32] = nearest(blk / np.float32(2.0**e), E4M3_TABLE, 448) * np.float32(2.0**e)
    q = quantize_mxfp8(x, "w")
    assert q.scale_inv.dtype == torch.float8_e8m0fnu and q.scale_inv.shape == (128, 4)
    np.testing.assert_array_equal(q.scale_inv.view(torch.uint8)[:8, :3].numpy().astype(int) - 127, exps)
    np.testing.assert_array_equal(dequantize_mxfp8(q).numpy(), ref)


@pytest.mark.parametrize("block", [WEIGHT_BLOCK, ACTIVATION_BLOCK])
def test_nvfp4_matches_reference(block):
    x = rand(32, 48, seed=3)
    xn, br = x.numpy(), block[0]
    g = np.float32(np.abs(xn).max()) / np.float32(6 * 448)
    ref = np.empty_like(xn)
    for r in range(0, 32, br):
        for c in range(0, 48, 16):
            tile = xn[r : r + br, c : c + 16]
            s = nearest(np.array([np.float32(np.abs(tile).max()) / np.float32(6) / g]), E4M3_TABLE, 448)[0]
            decode = np.float32(s) * g
            ref[r : r + br, c : c + 16] = nearest(tile / decode, E2M1_TABLE, 6) * decode
    q = quantize_nvfp4(x, "w", block)
    assert q.data.shape == (32, 24) and q.global_scale.dtype == torch.float32
    assert q.scale_inv.dtype == torch.float8_e4m3fn and q.scale_inv.shape == (128, 4)
    np.testing.assert_array_equal(dequantize_nvfp4(q).numpy(), ref)


def test_nvfp4_packs_two_codes_per_byte_low_nibble_first():
    x = torch.tensor([[0.5, -6.0] + [0.0] * 14])  # global scale puts 6 on e2m1's 6: codes 1 and 15
    q = quantize_nvfp4(x, "w", ACTIVATION_BLOCK)
    assert q.data.dtype == getattr(torch, "float4_e2m1fn_x2", torch.uint8)
    assert q.data.view(torch.uint8)[0, 0].item() == 1 | (15 << 4)
    assert unpack_pairs(q.data)[0, :2].tolist() == [1, 15]


@pytest.mark.parametrize("recipe,rel", [("fp8", 2**-3), ("fp8_block", 2**-3), ("mxfp8", 2**-3), ("nvfp4", 0.5)])
def test_round_trip_error_is_within_format_precision(recipe, rel):
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(4))
    back = dequantize(quantize_weight(w, recipe, "w"))
    big = w.abs() > 0.25 * w.abs().max()  # well inside the normal range of every block
    assert ((back - w).abs()[big] / w.abs()[big]).max() <= rel
    assert torch.equal(dequantize(quantize_weight(w, recipe, "w")), back)  # deterministic


@pytest.mark.parametrize("recipe", ["fp8", "fp8_block", "nvfp4"])
def test_columnwise_copy_decodes_to_the_transpose_for_square_blocks(recipe):
    w = torch.randn(256, 128, generator=torch.Generator().manual_seed(5))
    row, col = quantize_weight(w, recipe, "w", "rowwise"), quantize_weight(w, recipe, "w", "columnwise")
    assert col.shape == (128, 256)
    assert torch.equal(dequantize(row), dequantize(col).t())


@pytest.mark.parametrize(
    "recipe,shape,block",
    [("mxfp8", (64, 48), "1x32"), ("fp8_block", (128, 192), "128x128"), ("nvfp4", (24, 32), "16x16")],
)
def test_indivisible_layout_names_the_tensor_and_the_block(recipe, shape, block):
    with pytest.raises(ValueError, match=rf"layers\.0\.q_proj\.weight.*{block}"):
        check_weight_layout(shape, recipe, "layers.0.q_proj.weight")
    with pytest.raises(ValueError, match=rf"layers\.0\.q_proj\.weight.*{block}"):
        quantize_weight(torch.zeros(shape), recipe, "layers.0.q_proj.weight", "rowwise")


def test_mxfp8_training_layout_needs_the_output_dim_divisible_too():
    check_weight_layout((64, 96), "mxfp8", "w", training=False)
    with pytest.raises(ValueError, match=r"w \(columnwise copy\).*1x32.*dim 1 = 40"):
        check_weight_layout((40, 96), "mxfp8", "w", training=True)
