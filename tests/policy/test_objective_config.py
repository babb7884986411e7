"""Objective choices in the run config: incompatible ones are refused when the config is built, naming the fix."""

import pytest

from miles.config import RunConfig, TrainerConfig, apply_overrides
from miles.policy.objective import resolved_trainer
from miles.recipes import quickstart


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.n_samples_per_prompt=1"],
            "set rollout.n_samples_per_prompt=4 or rollout.advantage_estimator=reinforce++",
        ),
        (
            [
                "rollout.n_samples_per_prompt=1",
                "rollout.advantage_estimator=reinforce++",
                "rollout.dynamic_sampling=true",
            ],
            "n_samples_per_prompt = 1 makes every group uniform",
        ),
        (["rollout.advantage_estimator=ppo"], "rollout.advantage_estimator = 'ppo' is not one of"),
        (["rollout.overlong_buffer_len=8"], "must be below rollout.max_new_tokens = 8"),
        (["rollout.dynamic_sampling_max_rounds=0"], "dynamic_sampling_max_rounds = 0 must be >= 1"),
        (["trainer.dual_clip=0.5"], "trainer.dual_clip = 0.5 must be > 1"),
        (
            ["trainer.rollout_correction=tis", "trainer.rollout_correction_cap=1"],
            "must be > 1 (the importance-weight cap",
        ),
        (["trainer.loss_agg=sum"], "trainer.loss_agg = 'sum' is not one of"),
        (
            ["trainer.lr_schedule=cosine", "num_steps=50", "trainer.lr_warmup_steps=60"],
            "set trainer.lr_decay_steps above the warmup",
        ),
        (["trainer.lr_min_ratio=2"], "trainer.lr_min_ratio = 2.0 must be in [0, 1]"),
        (["task.name=swe", "rollout.dynamic_sampling=true"], "agent episodes (task.name = 'swe') are not resampled"),
    ],
)
def test_incompatible_objective_choices_are_refused_with_the_fix(overrides, message):
    with pytest.raises(ValueError) as e:
        apply_overrides(quickstart(), overrides)
    assert message in str(e.value)


def test_a_direct_construction_is_checked_too():
    with pytest.raises(ValueError, match="trainer.kl_estimator = 'k4' is not one of"):
        TrainerConfig(kl_estimator="k4")


def test_kl_in_the_reward_without_a_coefficient_warns():
    with pytest.warns(UserWarning, match="adds no penalty; set trainer.kl_coef"):
        apply_overrides(quickstart(), ["trainer.kl_in=reward"])


def test_run_dependent_defaults_are_filled_for_the_trainer():
    cfg = apply_overrides(quickstart(), ["num_steps=30", "rollout.max_new_tokens=12", "trainer.lr_schedule=cosine"])
    t = resolved_trainer(cfg)
    assert (t.loss_norm_tokens, t.lr_decay_steps) == (12, 30)
    assert (cfg.trainer.loss_norm_tokens, cfg.trainer.lr_decay_steps) == (0, 0)  # the config itself keeps "default"


def test_every_objective_combination_of_the_menu_builds():
    for est in ("grpo", "drgrpo", "rloo", "reinforce++", "reinforce++-baseline"):
        for agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
            cfg = apply_overrides(quickstart(), [f"rollout.advantage_estimator={est}", f"trainer.loss_agg={agg}"])
            assert isinstance(cfg, RunConfig)
