"""Per-token KL estimators between the policy and a reference, used as a loss term or as a reward penalty.

Tokens are sampled from the policy, so with d = log p_ref - log p_policy (Schulman, "Approximating KL divergence"):
k1 = -d (unbiased, can be negative), k2 = d^2 / 2 (biased, low variance), k3 = exp(d) - d - 1 (unbiased, >= 0).
"""

from __future__ import annotations

import torch

from miles.policy.objective import KL_ESTIMATORS


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL(policy || ref) estimate, same shape as the inputs; differentiable in ``log_probs``."""
    d = ref_log_probs - log_probs
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        return torch.exp(d) - d - 1
    raise ValueError(f"KL estimator {kind!r} is not one of {list(KL_ESTIMATORS)}")


def kl_penalised_advantages(
    advantages_N: torch.Tensor, kl_NT: torch.Tensor, mask_NT: torch.Tensor, coef: float
) -> torch.Tensor:
    """KL as a reward penalty: each token pays -coef * kl_t, so a token's return is the outcome advantage minus
    coef times the KL still to come from it (a reward-to-go, discount 1). Returns [N, T] advantages (detached)."""
    penalty = (coef * kl_NT * mask_NT).detach()
    to_go = penalty.flip(-1).cumsum(-1).flip(-1)  # sum over t' >= t
    return advantages_N[:, None] - to_go
