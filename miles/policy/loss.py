"""Policy losses on per-token log-probs: the clipped surrogate of GRPO / PPO (token ratios) or GSPO (sequence
ratio), with clip-higher, dual-clip, a KL term (k1 / k2 / k3), an entropy bonus and four loss aggregations.

All inputs are [N, T] FP32 with a [N, T] mask of the tokens that count. Aggregations:
token-mean (every token weighs the same), seq-mean-token-sum (each sequence's sum, averaged over sequences),
seq-mean-token-mean (each sequence's mean, averaged), seq-mean-token-sum-norm (Dr.GRPO: the sum over all tokens
divided by a constant, N x ``norm_tokens``, so neither length nor batch composition rescales a token's gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.policy.kl import kl_estimate
from miles.policy.objective import LOSS_AGGREGATIONS


@dataclass(frozen=True, slots=True)
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, float]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def aggregate(
    x_NT: torch.Tensor, mask_NT: torch.Tensor, mode: str = "token-mean", norm_tokens: int = 0
) -> torch.Tensor:
    """Reduce per-token terms to a scalar by ``mode`` (see the module docstring)."""
    if mode == "token-mean":
        return masked_mean(x_NT, mask_NT)
    seq_sum = (x_NT * mask_NT).sum(-1)
    if mode == "seq-mean-token-sum-norm":
        if norm_tokens < 1:
            raise ValueError(f"loss aggregation {mode!r} needs norm_tokens >= 1 (the generation budget)")
        return seq_sum.sum() / (x_NT.shape[0] * norm_tokens)
    lengths = mask_NT.sum(-1)
    rows = (lengths > 0).to(x_NT.dtype)  # a sequence with no counted token (e.g. overlong-filtered) is left out
    if mode == "seq-mean-token-sum":
        per_seq = seq_sum
    elif mode == "seq-mean-token-mean":
        per_seq = seq_sum / lengths.clamp_min(1.0)
    else:
        raise ValueError(f"loss aggregation {mode!r} is not one of {list(LOSS_AGGREGATIONS)}")
    return (per_seq * rows).sum() / rows.sum().clamp_min(1.0)


def clipped_surrogate(ratio, adv, eps_clip: float, eps_clip_high: float, dual_clip: float = 0.0):
    """Per-token PPO loss -min(r A, clip(r) A); with dual_clip = c > 1, a negative-advantage token's loss is also
    capped at -c A (Ye et al. 2020), so a huge ratio on a bad token cannot blow the update up."""
    clipped = ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    pg = torch.maximum(-ratio * adv, -clipped * adv)
    if dual_clip:
        pg = torch.where(adv < 0, torch.minimum(pg, -dual_clip * adv), pg)
    return pg, ((ratio - clipped).abs() > 1e-8)


def policy_loss(
    log_probs,
    old_log_probs,
    advantages,
    mask,
    *,
    kind: str = "grpo",
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.28,
    dual_clip: float = 0.0,
    loss_agg: str = "token-mean",
    norm_tokens: int = 0,
    ref_log_probs=None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy=None,
    entropy_coef: float = 0.0,
    is_weights=None,
) -> LossOutput:
    """``advantages``: [N] (one per sequence) or [N, T] (per token, e.g. with a KL reward penalty).
    ``is_weights``: [N, T] detached rollout-correction weights (TIS) multiplied into the policy-gradient terms."""
    adv = advantages[:, None].expand_as(log_probs) if advantages.dim() == 1 else advantages
    if kind == "gspo":
        n = mask.sum(-1).clamp_min(1.0)
        seq_log_ratio = ((log_probs - old_log_probs) * mask).sum(-1) / n
        ratio = torch.exp(seq_log_ratio)[:, None].expand_as(log_probs)
    else:  # grpo and ppo share the token-level clipped surrogate; they differ in where advantages come from
        ratio = torch.exp(log_probs - old_log_probs)
    pg, clipped = clipped_surrogate(ratio, adv, eps_clip, eps_clip_high, dual_clip)
    if is_weights is not None:
        pg = pg * is_weights
    loss = aggregate(pg, mask, loss_agg, norm_tokens)
    metrics = {"pg_loss": loss.item(), "clip_frac": masked_mean(clipped.float(), mask).item()}
    if ref_log_probs is not None and kl_coef:
        kl = aggregate(kl_estimate(log_probs, ref_log_probs, kl_estimator), mask, loss_agg, norm_tokens)
        loss = loss + kl_coef * kl
        metrics["kl"] = kl.item()
    if entropy is not None:
        ent = masked_mean(entropy, mask)
        metrics["entropy"] = ent.item()
        if entropy_coef:
            loss = loss - entropy_coef * ent
    metrics["loss"] = loss.item()
    return LossOutput(loss, metrics)
