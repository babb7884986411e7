"""``apply_precision``: put a model's Linear layers under a low-precision recipe, in place.

Every ``nn.Linear`` becomes a ``QuantizedLinear`` holding the *same* Parameter objects (optimizers, tagged
memory and weight sync keep working); grouped expert layers switch recipe. Embeddings, the output head and
MoE routers stay in high precision, as do layers whose weight is tied to an embedding. Layouts are checked
here, so a dimension that does not split into the recipe's blocks fails before the first step.
"""

from __future__ import annotations

from torch import nn

from miles.quant.linear import QuantizedGroupedLinear, QuantizedLinear
from miles.quant.recipe import check_recipe

KEEP_HIGH_PRECISION = ("lm_head", "embed_tokens", "router", "gate", "score", "output")  # last name component


def _tied_to_embedding(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def apply_precision(model: nn.Module, precision: str) -> nn.Module:
    """Swap ``nn.Linear`` layers for ``QuantizedLinear`` under ``precision`` ("bf16" leaves them alone)."""
    check_recipe(precision)
    tied = _tied_to_embedding(model)
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, QuantizedGroupedLinear):
                child.name = f"{full}.weight"
                child.set_recipe(precision)
            elif isinstance(child, QuantizedLinear):
                setattr(parent, child_name, QuantizedLinear(child.weight, child.bias, precision, child.name))
            elif type(child) is nn.Linear and precision != "bf16":
                if child_name in KEEP_HIGH_PRECISION or id(child.weight) in tied:
                    continue
                setattr(parent, child_name, QuantizedLinear.from_linear(child, precision, f"{full}.weight"))
    return model
