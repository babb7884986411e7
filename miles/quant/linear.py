"""Linear layers that compute with a quantized copy of their high-precision weight, cached in a workspace.

The master weight stays a bf16 (or fp32) ``nn.Parameter`` the optimizer updates; the forward reads the
rowwise quantized copy, the backward's dgrad the columnwise one, and the weight gradient goes to the master
weight in high precision. On a CUDA device with FP8 tensor cores the tensorwise "fp8" recipe multiplies with
``torch._scaled_mm`` (activations quantized per call); every other case dequantizes the cached copy and runs a
matmul in the activation dtype (the reference path, and the CPU path). Activations are not quantized on the
reference path.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from miles.quant.fp8 import quantize_fp8_tensorwise
from miles.quant.layout import QuantizedTensor
from miles.quant.recipe import check_recipe, check_weight_layout, dequantize
from miles.quant.workspace import WeightWorkspace

USE_SCALED_MM = True  # False forces the dequantize + matmul reference path everywhere


def _scaled_mm_fits(x_MK: torch.Tensor, q: QuantizedTensor) -> bool:
    return (
        USE_SCALED_MM
        and q.fmt == "fp8"
        and x_MK.is_cuda
        and hasattr(torch, "_scaled_mm")
        and torch.cuda.get_device_capability(x_MK.device) >= (8, 9)
        and x_MK.shape[0] > 0
        and x_MK.shape[0] % 16 == 0
        and x_MK.shape[1] % 16 == 0
        and q.shape[0] % 16 == 0
    )


def quantized_matmul(x: torch.Tensor, q_NK: QuantizedTensor) -> torch.Tensor:
    """``x[..., K] @ W.T`` for a quantized ``W[N, K]`` (reduction dim last, as every copy is stored)."""
    x_MK = x.reshape(-1, x.shape[-1])
    if _scaled_mm_fits(x_MK, q_NK):
        xq = quantize_fp8_tensorwise(x_MK.contiguous(), "activation")  # _scaled_mm wants row-major A
        y = torch._scaled_mm(xq.data, q_NK.data.t(), scale_a=xq.scale_inv, scale_b=q_NK.scale_inv, out_dtype=x.dtype)
    else:
        y = x_MK @ dequantize(q_NK, x.dtype).t()
    return y.reshape(*x.shape[:-1], q_NK.shape[0])


class _QuantizedLinearFn(torch.autograd.Function):
    """y = x @ Q_row(W).T; dx = dy @ Q_col(W^T).T; dW = dy^T x in high precision (straight-through)."""

    @staticmethod
    def forward(ctx, x, weight, workspace: WeightWorkspace, key: str):
        ctx.save_for_backward(x, weight)
        ctx.workspace, ctx.key = workspace, key
        return quantized_matmul(x, workspace.get(key, weight, "rowwise"))

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = quantized_matmul(dy, ctx.workspace.get(ctx.key, weight, "columnwise"))
        if ctx.needs_input_grad[1]:
            dw = (dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])).to(weight.dtype)
        return dx, dw, None, None


class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` whose matmul runs on a cached quantized copy of its weight.

    layer = QuantizedLinear.from_linear(nn.Linear(256, 512, bias=False), "mxfp8")  # shares the Parameter
    y = layer(x)                  # builds the rowwise copy on the first call, reuses it after
    y.sum().backward()            # builds the columnwise copy for dgrad
    layer.quant_workspace.clear() # what clear_quantized_workspaces(model) does before an offload
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, recipe: str, name: str = "weight"):
        super().__init__()
        check_weight_layout(tuple(weight.shape), recipe, name)
        self.weight, self.bias = weight, bias
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.recipe, self.name = recipe, name
        self.quant_workspace = WeightWorkspace(recipe) if recipe != "bf16" else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str, name: str = "weight") -> "QuantizedLinear":
        return cls(linear.weight, linear.bias, recipe, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_workspace is None:
            return F.linear(x, self.weight, self.bias)
        y = _QuantizedLinearFn.apply(x, self.weight, self.quant_workspace, self.name)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, recipe={self.recipe}"


class _QuantizedGroupedFn(torch.autograd.Function):
    """One quantized matmul per group (expert); every expert's copies are built, routed tokens or not."""

    @staticmethod
    def forward(ctx, x_TK, weight_ENK, workspace: WeightWorkspace, name: str, group_sizes: tuple[int, ...]):
        ctx.save_for_backward(x_TK, weight_ENK)
        ctx.workspace, ctx.name, ctx.group_sizes = workspace, name, group_sizes
        parts = torch.split(x_TK, list(group_sizes))
        return torch.cat(
            [quantized_matmul(p, workspace.get(f"{name}{e}", weight_ENK[e], "rowwise")) for e, p in enumerate(parts)]
        )

    @staticmethod
    def backward(ctx, dy_TN):
        x_TK, weight_ENK = ctx.saved_tensors
        xs, dys = torch.split(x_TK, list(ctx.group_sizes)), torch.split(dy_TN, list(ctx.group_sizes))
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch.cat(
                [
                    quantized_matmul(d, ctx.workspace.get(f"{ctx.name}{e}", weight_ENK[e], "columnwise"))
                    for e, d in enumerate(dys)
                ]
            )
        if ctx.needs_input_grad[1]:
            dw = torch.stack([(d.t() @ x).to(weight_ENK.dtype) for d, x in zip(dys, xs)])
        return dx, dw, None, None, None


class QuantizedGroupedLinear(nn.Module):
    """``num_groups`` independent Linear layers (MoE experts) over token groups laid out back to back.

    experts_up = QuantizedGroupedLinear(8, 256, 512, recipe="mxfp8", dtype=torch.bfloat16)
    y_TN = experts_up(x_TK, group_sizes=(5, 0, 12, ...))   # tokens sorted by expert, one size per expert
    Each expert's weight is quantized on its own (workspace keys "weight0", "weight1", ...), as TE does.
    """

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        *,
        recipe: str = "bf16",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        init_std: float = 0.02,
        name: str = "weight",
    ):
        super().__init__()
        self.weight = nn.Parameter(
            torch.randn(num_groups, out_features, in_features, dtype=dtype, device=device) * init_std
        )
        self.name = name
        self.set_recipe(recipe)

    def set_recipe(self, recipe: str) -> None:
        check_weight_layout(tuple(self.weight.shape[1:]), check_recipe(recipe), f"{self.name}[expert]")
        self.recipe = recipe
        self.quant_workspace = WeightWorkspace(recipe) if recipe != "bf16" else None

    def forward(self, x_TK: torch.Tensor, group_sizes: tuple[int, ...]) -> torch.Tensor:
        group_sizes = tuple(int(g) for g in group_sizes)
        if len(group_sizes) != self.weight.shape[0] or sum(group_sizes) != x_TK.shape[0]:
            raise ValueError(
                f"group_sizes {group_sizes} must have {self.weight.shape[0]} entries summing to "
                f"the {x_TK.shape[0]} tokens"
            )
        if self.quant_workspace is None:
            return torch.cat([p @ self.weight[e].t() for e, p in enumerate(torch.split(x_TK, list(group_sizes)))])
        return _QuantizedGroupedFn.apply(x_TK, self.weight, self.quant_workspace, self.name, group_sizes)
