"""The train/inference mismatch: how far the engine's log-probs are from the trainer's, and corrections for it.

The engine samples with its own kernels (and maybe another precision), so its log-probs differ from the trainer's
for the same weights; with async training (miles.async_config) the samples also come from older weights. The honest
measure compares the engine with the trainer *before* any optimizer step of the step (after one, the difference
measures the update). The weight w = p_trainer / p_engine of each token (the proximal over the behaviour policy) is
detached: it reweights or masks, it is not differentiated.

- ``tis``: w truncated at the cap multiplies each token's policy-gradient loss.
- ``mis``: tokens whose w leaves [1 / cap, cap] are masked out (weight 1 for the rest).
- ``decoupled``: decoupled PPO (Hilton et al. 2021; AReaL's ``use_decoupled_loss`` with ``behav_imp_weight_cap``):
  the clipped ratio is taken against the proximal policy (the trainer's log-probs, as always here) and w multiplies
  the loss, except that tokens whose w exceeds the cap weigh 0 (they stay in the loss's token count).
- ``seq-mis``: a sequence-level mask: a sequence whose geometric-mean w, exp(mean log w), leaves [1 / cap, cap] is
  masked out whole (a stale answer is judged as one decision, not token by token).
"""

from __future__ import annotations

import math

import torch

from miles.policy.objective import CORRECTIONS


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def mismatch_metrics(trainer_log_probs, engine_log_probs, mask) -> dict[str, float]:
    """|log p_trainer - log p_engine| (token mean and max) and KL(engine || trainer) by k3 on the engine's samples.
    With true_on_policy the three read exactly 0.0."""
    d = (trainer_log_probs - engine_log_probs).double()  # log(p_trainer / p_engine)
    m = mask.double()
    on = mask > 0
    return {
        "train_rollout_logprob_abs_diff": masked_mean(d.abs(), m).item(),
        "train_rollout_logprob_max_abs_diff": d.abs()[on].max().item() if on.any() else 0.0,
        "train_rollout_kl": masked_mean(torch.expm1(d) - d, m).item(),  # exp(d) - 1 - d, exact near 0
    }


def first_mismatch(trainer_log_probs, engine_log_probs, mask) -> tuple[int, int, float, float] | None:
    """(row, position, trainer log-prob, engine log-prob) of the first response token, in row-major order, whose two
    log-probs differ in any bit; None when every one agrees."""
    differ = (trainer_log_probs != engine_log_probs) & (mask > 0)
    if not differ.any():
        return None
    row, pos = (int(i) for i in differ.nonzero()[0])
    return row, pos, float(trainer_log_probs[row, pos]), float(engine_log_probs[row, pos])


def correction_weights(trainer_log_probs, engine_log_probs, mask, kind: str = "none", cap: float = 2.0):
    """(weights [N, T], mask [N, T], metrics): multiply the per-token policy-gradient terms by ``weights`` and
    aggregate over ``mask``. ``none`` returns ones and the mask unchanged."""
    if kind == "none":
        return torch.ones_like(mask), mask, {}
    ratio = torch.exp((trainer_log_probs - engine_log_probs).detach())
    if kind == "tis":
        weights = ratio.clamp(max=cap)
        return weights, mask, {"rollout_is/clipped_frac": masked_mean((ratio > cap).float(), mask).item()}
    if kind == "mis":
        keep = ((ratio >= 1.0 / cap) & (ratio <= cap)).to(mask.dtype)
        return torch.ones_like(mask), mask * keep, {"rollout_is/masked_frac": masked_mean(1 - keep, mask).item()}
    if kind == "decoupled":
        over = ratio > cap
        weights = torch.where(over, torch.zeros_like(ratio), ratio)
        return weights, mask, {"rollout_is/masked_frac": masked_mean(over.to(mask.dtype), mask).item()}
    if kind == "seq-mis":
        n = mask.sum(-1)
        log_w = ((trainer_log_probs - engine_log_probs).detach() * mask).sum(-1) / n.clamp_min(1.0)
        keep = ((log_w >= -math.log(cap)) & (log_w <= math.log(cap))).to(mask.dtype)
        rows = (n > 0).to(mask.dtype)
        frac = ((1 - keep) * rows).sum() / rows.sum().clamp_min(1.0)
        return torch.ones_like(mask), mask * keep[:, None], {"rollout_is/seq_masked_frac": frac.item()}
    raise ValueError(f"rollout correction {kind!r} is not one of {list(CORRECTIONS)}")
