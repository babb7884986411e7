"""Policy losses on per-token log-probs: GRPO / PPO-clip (token ratios), GSPO (sequence ratio), KL (k3).

All inputs are [N, T] FP32 with a [N, T] mask of the tokens that count; losses average over masked tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, float]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def policy_loss(
    log_probs,
    old_log_probs,
    advantages_N,
    mask,
    *,
    kind: str = "grpo",
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.28,
    ref_log_probs=None,
    kl_coef: float = 0.0,
    entropy=None,
    entropy_coef: float = 0.0,
) -> LossOutput:
    adv = advantages_N[:, None].expand_as(log_probs)
    if kind == "gspo":
        n = mask.sum(-1).clamp_min(1.0)
        seq_log_ratio = ((log_probs - old_log_probs) * mask).sum(-1) / n
        ratio = torch.exp(seq_log_ratio)[:, None].expand_as(log_probs)
    else:  # grpo and ppo share the token-level clipped surrogate; they differ in where advantages come from
        ratio = torch.exp(log_probs - old_log_probs)
    clipped = ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    pg = -torch.minimum(ratio * adv, clipped * adv)
    loss = masked_mean(pg, mask)
    metrics = {"pg_loss": loss.item(), "clip_frac": masked_mean(((ratio - clipped).abs() > 1e-8).float(), mask).item()}
    if ref_log_probs is not None and kl_coef:
        d = ref_log_probs - log_probs
        kl = masked_mean(torch.exp(d) - d - 1, mask)
        loss = loss + kl_coef * kl
        metrics["kl"] = kl.item()
    if entropy is not None:
        ent = masked_mean(entropy, mask)
        metrics["entropy"] = ent.item()
        if entropy_coef:
            loss = loss - entropy_coef * ent
    metrics["loss"] = loss.item()
    return LossOutput(loss, metrics)
