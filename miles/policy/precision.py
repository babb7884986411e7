"""Keeping the policy forward in model precision: the Megatron forward kwargs and the FP32 graph placeholder.

Megatron's mixed-precision wrapper (``Float16Module``) upcasts the last stage's output to FP32 unless its
forward gets ``fp32_output=False``; for [T, V] logits that is a full FP32 copy, which
``miles.policy.logprob`` exists to avoid. Ranks or micro-batches with nothing to score still need a loss that
touches the graph; ``zero_placeholder`` builds it with an FP32 sum, because a 16-bit sum of many logits can
overflow to inf and 0 * inf is NaN.
"""

from __future__ import annotations

import inspect

import torch


def megatron_policy_forward_kwargs(model: torch.nn.Module) -> dict:
    """Extra kwargs for a policy forward through a Megatron model so the logits stay bf16/fp16.

    Walks the ``.module`` wrapper chain (DDP -> Float16Module -> GPTModel) and returns
    ``{"fp32_output": False}`` when a wrapper's ``forward`` declares ``fp32_output``; ``{}`` otherwise (an
    unwrapped GPTModel already returns model-precision logits and would reject the keyword).
    Use: ``logits = model(tokens, position_ids, attention_mask, **megatron_policy_forward_kwargs(model))``.
    """
    seen: set[int] = set()
    m = model
    while isinstance(m, torch.nn.Module) and id(m) not in seen:
        seen.add(id(m))
        if "fp32_output" in inspect.signature(type(m).forward).parameters:
            return {"fp32_output": False}
        m = getattr(m, "module", None)
    return {}


def zero_placeholder(logits: torch.Tensor) -> torch.Tensor:
    """A 0-d FP32 zero that depends on every element of ``logits`` (keeps the graph, gives zero gradients).

    The sum is accumulated in FP32: ``logits.sum()`` in fp16 overflows past 65504 (e.g. 70,000 x 2.0),
    and ``0 * inf`` is NaN, which would poison the loss and every gradient.
    """
    return 0 * logits.sum(dtype=torch.float32)
