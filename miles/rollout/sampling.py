"""Sampling the next token of every row, with the sampled token's log-prob, without an FP32 copy of the logits.

Each row has its own temperature (0 = greedy; its log-prob is then reported at temperature 1, as the trainer
computes it). Temperature-only sampling is a Gumbel-max draw: argmax(x / T + g) with g = -log(-log u) is a
sample of softmax(x / T). On CUDA one Triton program per row streams the row's bf16 logits once, keeping an
online max and sum-exp (the log-normaliser) and the running Gumbel argmax in registers, and reads its seed
from a device tensor, so the kernel runs inside a CUDA graph and the step never waits on the host. Top-p and
top-k need a sort, so they take the reference path (torch ops, FP32 [rows, vocab]), which is also the CPU
path and the one the kernel is tested against.

    tok_R, lp_R = sample(logits_RV, temperature_R, seed_t, generator)   # seed_t: int64 [1] on the device
"""

from __future__ import annotations

import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
FORCE_REFERENCE = os.environ.get("MILES_ENGINE_KERNELS", "auto") == "reference"  # tests compare both paths


def use_triton(t: torch.Tensor) -> bool:
    """The Triton kernels run on CUDA tensors (or anywhere under TRITON_INTERPRET=1, which the CPU tests use)."""
    if FORCE_REFERENCE or not HAS_TRITON:
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def sample(
    logits_RV: torch.Tensor,
    temperature_R: torch.Tensor,
    seed_t: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    top_p_R: torch.Tensor | None = None,
    top_k_R: torch.Tensor | None = None,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_R int64, log_prob_R fp32). ``fused=None``: the kernel when it can (no top-p / top-k rows)."""
    if fused is None:
        fused = use_triton(logits_RV) and top_p_R is None and top_k_R is None
    if fused:
        from miles.rollout.kernels import fused_sample

        return fused_sample(logits_RV, temperature_R, seed_t)
    return sample_reference(logits_RV, temperature_R, generator, top_p_R=top_p_R, top_k_R=top_k_R)


def sample_reference(
    logits_RV: torch.Tensor,
    temperature_R: torch.Tensor,
    generator: torch.Generator | None,
    *,
    top_p_R: torch.Tensor | None = None,
    top_k_R: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive version: FP32 log-softmax of logits / T, filtered by top-k then top-p, then a multinomial draw."""
    greedy = temperature_R <= 0
    inv_t = torch.where(greedy, torch.ones_like(temperature_R), 1.0 / temperature_R.clamp_min(1e-6)).float()
    logp = torch.log_softmax(logits_RV.float() * inv_t[:, None], -1)
    probs = logp.exp()
    if top_k_R is not None or top_p_R is not None:
        probs = _filter(probs, top_p_R, top_k_R)
    drawn = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    tok = torch.where(greedy, logits_RV.argmax(-1), drawn)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def _filter(probs_RV: torch.Tensor, top_p_R: torch.Tensor | None, top_k_R: torch.Tensor | None) -> torch.Tensor:
    """Zero the tokens outside each row's top-k (k = 0: all) and nucleus (the smallest set with mass >= top_p)."""
    sorted_p, idx = probs_RV.sort(-1, descending=True)
    drop = torch.zeros_like(sorted_p, dtype=torch.bool)
    rank = torch.arange(probs_RV.shape[-1], device=probs_RV.device)[None]
    if top_k_R is not None:
        drop |= (top_k_R[:, None] > 0) & (rank >= top_k_R[:, None])
    if top_p_R is not None:
        drop |= sorted_p.cumsum(-1) - sorted_p > top_p_R[:, None]
    return torch.zeros_like(probs_RV).scatter(-1, idx, sorted_p.masked_fill(drop, 0.0))
