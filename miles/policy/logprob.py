"""Per-token log-probs (and entropy) of chosen tokens from [T, V] logits without an FP32 copy of all logits.

Logits stay in the model's dtype; each chunk of ``chunk_size`` tokens is upcast to FP32 just before the
log-softmax, and the temperature is applied after the upcast. The trainer and the rollout engine both call
this function, so train and rollout log-probs agree.
"""

from __future__ import annotations

import torch


def _chunk(logits_CV: torch.Tensor, tokens_C: torch.Tensor, temperature: float, with_entropy: bool):
    x = logits_CV.float()
    if temperature != 1.0:
        x = x / temperature
    logz = torch.logsumexp(x, dim=-1)
    lp = x.gather(-1, tokens_C.unsqueeze(-1)).squeeze(-1) - logz
    ent = None
    if with_entropy:
        p = torch.softmax(x, dim=-1)
        ent = logz - (p * x).sum(-1)
    return lp, ent


def log_probs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    entropy_requires_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(tokens[t] | logits[t]) for [T, V] logits and [T] tokens; FP32 outputs of shape [T]."""
    if logits.dim() != 2 or tokens.shape != logits.shape[:1]:
        raise ValueError(f"expected logits [T, V] and tokens [T], got {tuple(logits.shape)} and {tuple(tokens.shape)}")
    T = logits.shape[0]
    if T == 0:
        empty = logits.new_zeros(0, dtype=torch.float32)
        return empty, (empty.clone() if with_entropy else None)
    lps, ents = [], []
    for s in range(0, T, chunk_size):
        lp, ent = _chunk(logits[s : s + chunk_size], tokens[s : s + chunk_size], temperature, with_entropy)
        lps.append(lp)
        if with_entropy:
            ents.append(ent if entropy_requires_grad else ent.detach())
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)
