"""QuantizedLinear / QuantizedGroupedLinear against dequantize + matmul written out here, workspace reuse,
and apply_precision."""

import pytest
import torch
from torch import nn

from miles.quant import QuantizedGroupedLinear, QuantizedLinear, apply_precision, dequantize, quantize_weight
from miles.quant import linear as qlinear

RECIPES = ["fp8", "fp8_block", "mxfp8", "nvfp4"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_quantized_linear_matches_reference(recipe):
    torch.manual_seed(0)
    lin = nn.Linear(128, 256, bias=True)
    layer = QuantizedLinear.from_linear(lin, recipe)
    x = torch.randn(3, 5, 128, requires_grad=True)
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    w_row = dequantize(quantize_weight(lin.weight, recipe, "w", "rowwise"))
    w_col = dequantize(quantize_weight(lin.weight, recipe, "w", "columnwise"))  # [in, out]
    assert torch.equal(y, x @ w_row.t() + lin.bias)
    assert torch.equal(x.grad, dy @ w_col.t())
    torch.testing.assert_close(lin.weight.grad, dy.reshape(-1, 256).t() @ x.detach().reshape(-1, 128))
    torch.testing.assert_close(lin.bias.grad, dy.sum((0, 1)))


def test_grouped_linear_matches_per_expert_reference():
    torch.manual_seed(0)
    g = QuantizedGroupedLinear(3, 64, 32, recipe="mxfp8")
    sizes = (4, 0, 6)
    x = torch.randn(10, 64, requires_grad=True)
    y = g(x, sizes)
    y.backward(torch.ones_like(y))
    parts = torch.split(x.detach(), list(sizes))
    ref = torch.cat([p @ dequantize(quantize_weight(g.weight[e], "mxfp8", "w")).t() for e, p in enumerate(parts)])
    assert torch.equal(y, ref)
    assert g.quant_workspace.num_builds == 6  # every expert's rowwise and columnwise copy, routed tokens or not
    assert torch.equal(g.weight.grad[1], torch.zeros(32, 64))


def test_workspace_is_reused_until_the_weight_changes():
    torch.manual_seed(0)
    layer = QuantizedLinear.from_linear(nn.Linear(64, 64, bias=False), "mxfp8")
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(4, 64)
    for _ in range(3):
        layer(x)
    assert layer.quant_workspace.num_builds == 1
    layer(x.requires_grad_()).sum().backward()
    assert layer.quant_workspace.num_builds == 2  # the columnwise copy
    opt.step()
    y = layer(x)
    assert layer.quant_workspace.num_builds == 3  # stale after the optimizer step: rebuilt on the miss
    assert torch.equal(y, x @ dequantize(quantize_weight(layer.weight, "mxfp8", "w")).t())


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(64, 64)
        self.q_proj = nn.Linear(64, 64)
        self.router = nn.Linear(64, 4, bias=False)
        self.experts = QuantizedGroupedLinear(4, 64, 32)
        self.lm_head = nn.Linear(64, 64, bias=False)
        self.tied = nn.Linear(64, 64, bias=False)
        self.tied.weight = self.embed_tokens.weight


def test_apply_precision_swaps_linears_but_keeps_embeddings_head_router_and_tied_layers():
    m = _Tiny()
    params_before = {n: p for n, p in m.named_parameters()}
    apply_precision(m, "nvfp4")
    assert isinstance(m.q_proj, QuantizedLinear) and m.q_proj.recipe == "nvfp4"
    assert type(m.router) is nn.Linear and type(m.lm_head) is nn.Linear and type(m.tied) is nn.Linear
    assert m.experts.recipe == "nvfp4"
    assert all(p is params_before[n] for n, p in m.named_parameters())  # optimizers and tags stay valid
    assert m.q_proj.name == "q_proj.weight"


def test_apply_precision_bf16_builds_no_workspace_and_back():
    m = apply_precision(_Tiny(), "mxfp8")
    apply_precision(m, "bf16")
    assert m.q_proj.quant_workspace is None and m.experts.quant_workspace is None
    x = torch.randn(2, 64)
    torch.testing.assert_close(m.q_proj(x), x @ m.q_proj.weight.t() + m.q_proj.bias)


def test_apply_precision_names_the_layer_that_does_not_fit_the_block():
    m = nn.Sequential()
    m.add_module("k_proj", nn.Linear(128, 64))
    with pytest.raises(ValueError, match=r"k_proj\.weight \(rowwise copy\).*128x128"):
        apply_precision(m, "fp8_block")
    with pytest.raises(ValueError, match="precision 'int4' is not one of"):
        apply_precision(m, "int4")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_scaled_mm_matches_reference():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need sm89+")
    torch.manual_seed(0)
    lin = nn.Linear(256, 512, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = QuantizedLinear.from_linear(lin, "fp8")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    fast = layer(x)
    qlinear.USE_SCALED_MM = False
    try:
        layer.quant_workspace.clear()
        ref = layer(x)
    finally:
        qlinear.USE_SCALED_MM = True
    torch.testing.assert_close(fast.float(), ref.float(), rtol=0.1, atol=0.1 * ref.abs().max().item())
