"""Model-precision helpers: the FP32 graph placeholder, the temperature order, the Megatron forward kwargs."""

from __future__ import annotations

import torch

from miles.policy.logprob import log_probs_and_entropy
from miles.policy.precision import megatron_policy_forward_kwargs, zero_placeholder


def test_fp16_sum_of_70000_twos_overflows_but_the_placeholder_stays_zero():
    logits = torch.full((70_000,), 2.0, dtype=torch.float16, requires_grad=True)
    naive = 0 * logits.sum()
    assert torch.isinf(logits.sum()) and torch.isnan(naive)
    placeholder = zero_placeholder(logits)
    assert placeholder.dtype == torch.float32 and placeholder.item() == 0.0
    placeholder.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_dividing_by_the_temperature_after_the_upcast_is_closer_to_exact_than_before():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 4096, generator=g) * 4).bfloat16()
    tokens = torch.randint(0, 4096, (64,), generator=g)
    exact = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, tokens[:, None]).squeeze(-1)
    ours, _ = log_probs_and_entropy(logits, tokens, temperature=0.7)
    divided_in_bf16 = (logits / 0.7).float()  # the mistake: bf16 rounding after the division
    before, _ = log_probs_and_entropy(divided_in_bf16, tokens)
    err_ours = (ours.double() - exact).abs().max().item()
    err_before = (before.double() - exact).abs().max().item()
    assert err_ours < 1e-5 < err_before, (err_ours, err_before)


class _Wrapper(torch.nn.Module):
    """Stands in for Megatron's Float16Module: a wrapper whose forward declares ``fp32_output``."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *inputs, fp32_output=True, **kwargs):
        out = self.module(*inputs, **kwargs)
        return out.float() if fp32_output else out


class _DDP(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)


def test_megatron_kwargs_ask_for_model_precision_only_where_a_wrapper_accepts_it():
    inner = torch.nn.Linear(4, 8).bfloat16()
    model = _DDP(_Wrapper(inner))
    kwargs = megatron_policy_forward_kwargs(model)
    assert kwargs == {"fp32_output": False}
    assert model(torch.randn(2, 4).bfloat16(), **kwargs).dtype == torch.bfloat16
    assert megatron_policy_forward_kwargs(inner) == {}
