"""The menu of RL objectives (names only, no torch) and the checks that refuse incompatible choices.

The fields live in RolloutConfig (advantage estimator, DAPO's sampling and overlong shaping) and TrainerConfig
(aggregation, clipping, KL, rollout correction, LR schedule); RunConfig calls ``check_objective`` when it is
built, so a bad combination fails before Ray starts, with the fix in the message.
"""

from __future__ import annotations

import dataclasses
import warnings

ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce++", "reinforce++-baseline")
GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce++-baseline")  # need n_samples_per_prompt >= 2
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
CORRECTIONS = ("none", "tis", "mis", "decoupled", "seq-mis")
WEIGHTED_CORRECTIONS = ("tis", "decoupled")  # the corrections that weigh each token's loss (the others mask)
LR_SCHEDULES = ("constant", "linear", "cosine")


def check_rollout(r) -> None:
    """Field-level checks of RolloutConfig's objective fields."""
    _one_of("rollout.advantage_estimator", r.advantage_estimator, ESTIMATORS)
    if r.dynamic_sampling_max_rounds < 1:
        raise ValueError(f"rollout.dynamic_sampling_max_rounds = {r.dynamic_sampling_max_rounds} must be >= 1")
    if r.overlong_buffer_len < 0 or r.overlong_penalty_factor < 0:
        raise ValueError(
            f"rollout.overlong_buffer_len = {r.overlong_buffer_len} and overlong_penalty_factor = "
            f"{r.overlong_penalty_factor} must be >= 0 (buffer 0 = no soft punishment)"
        )
    if r.overlong_buffer_len >= r.max_new_tokens:
        raise ValueError(
            f"rollout.overlong_buffer_len = {r.overlong_buffer_len} must be below rollout.max_new_tokens = "
            f"{r.max_new_tokens} (the punishment ramps over the last tokens of the budget); e.g. "
            f"rollout.overlong_buffer_len={max(r.max_new_tokens // 4, 1)}"
        )


def check_trainer(t) -> None:
    """Field-level checks of TrainerConfig's objective fields."""
    _one_of("trainer.loss_agg", t.loss_agg, LOSS_AGGREGATIONS)
    _one_of("trainer.kl_estimator", t.kl_estimator, KL_ESTIMATORS)
    _one_of("trainer.rollout_correction", t.rollout_correction, CORRECTIONS)
    _one_of("trainer.lr_schedule", t.lr_schedule, LR_SCHEDULES)
    if t.dual_clip and t.dual_clip <= 1:
        raise ValueError(f"trainer.dual_clip = {t.dual_clip} must be > 1 (typically 3), or 0 to turn it off")
    if t.rollout_correction_cap <= 1:
        raise ValueError(
            f"trainer.rollout_correction_cap = {t.rollout_correction_cap} must be > 1 (the importance-weight cap, "
            "typically 2)"
        )
    if t.loss_norm_tokens < 0 or t.lr_warmup_steps < 0 or t.lr_decay_steps < 0:
        raise ValueError(
            f"trainer.loss_norm_tokens = {t.loss_norm_tokens}, lr_warmup_steps = {t.lr_warmup_steps} and "
            f"lr_decay_steps = {t.lr_decay_steps} must be >= 0"
        )
    if not 0 <= t.lr_min_ratio <= 1:
        raise ValueError(f"trainer.lr_min_ratio = {t.lr_min_ratio} must be in [0, 1]")
    if t.kl_in not in ("loss", "reward"):
        raise ValueError(f"trainer.kl_in = {t.kl_in!r} must be 'loss' or 'reward'")


def check_objective(cfg) -> None:
    """Cross-section checks on a RunConfig."""
    r, t = cfg.rollout, cfg.trainer
    if r.n_samples_per_prompt < 2 and r.advantage_estimator in GROUP_ESTIMATORS:
        raise ValueError(
            f"rollout.advantage_estimator = {r.advantage_estimator!r} compares samples of one prompt, but "
            "rollout.n_samples_per_prompt = 1 (every advantage would be 0); set rollout.n_samples_per_prompt=4 "
            "or rollout.advantage_estimator=reinforce++ (batch-normalised)"
        )
    if r.dynamic_sampling and r.n_samples_per_prompt < 2:
        raise ValueError(
            "rollout.dynamic_sampling drops groups whose rewards are all equal, but rollout.n_samples_per_prompt "
            "= 1 makes every group uniform; set rollout.n_samples_per_prompt=4 or rollout.dynamic_sampling=false"
        )
    if (r.dynamic_sampling or r.overlong_filter or r.overlong_buffer_len) and cfg.task.name == "swe":
        raise ValueError(
            "rollout.dynamic_sampling / overlong_filter / overlong_buffer_len apply to generated tasks; agent "
            "episodes (task.name = 'swe') are not resampled or length-shaped; turn them off"
        )
    if t.kl_in == "reward" and not t.kl_coef:
        warnings.warn(
            "trainer.kl_in = 'reward' with trainer.kl_coef = 0 adds no penalty; set trainer.kl_coef", stacklevel=3
        )
    t = resolved_trainer(cfg)
    if t.lr_schedule != "constant" and t.lr_decay_steps <= t.lr_warmup_steps:
        raise ValueError(
            f"trainer.lr_schedule = {t.lr_schedule!r} decays from step lr_warmup_steps = {t.lr_warmup_steps} to "
            f"lr_decay_steps = {t.lr_decay_steps}; set trainer.lr_decay_steps above the warmup (0 = num_steps)"
        )


def resolved_trainer(cfg):
    """The trainer config with its run-dependent defaults filled: loss_norm_tokens 0 -> rollout.max_new_tokens,
    lr_decay_steps 0 -> num_steps. What the trainer backend receives."""
    t = cfg.trainer
    return dataclasses.replace(
        t,
        loss_norm_tokens=t.loss_norm_tokens or cfg.rollout.max_new_tokens,
        lr_decay_steps=t.lr_decay_steps or cfg.num_steps,
    )


def _one_of(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} = {value!r} is not one of {list(allowed)}")
