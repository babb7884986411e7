"""Mismatch metrics, TIS / MIS weights, LR schedules and DAPO's pieces against values computed by hand."""

import math

import pytest
import torch

from miles.policy.dapo import fill_groups, overlong_penalty, uniform_groups
from miles.policy.rollout_correction import correction_weights, mismatch_metrics
from miles.policy.schedule import lr_at
from miles.samples import Sample


def test_mismatch_metrics_are_the_mean_abs_difference_and_the_k3_kl():
    trainer = torch.tensor([[math.log(0.5), math.log(0.25), 0.0]])
    engine = torch.tensor([[math.log(0.25), math.log(0.25), -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    m = mismatch_metrics(trainer, engine, mask)
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(math.log(2) / 2)
    assert m["train_rollout_kl"] == pytest.approx((2 - 1 - math.log(2)) / 2)  # exp(d) - 1 - d at d = ln 2 and 0


def test_tis_truncates_the_importance_weight_at_the_cap():
    trainer = torch.tensor([[math.log(0.6), math.log(0.1), math.log(0.3)]])
    engine = torch.tensor([[math.log(0.2), math.log(0.2), math.log(0.3)]])  # ratios 3, 0.5, 1
    mask = torch.ones(1, 3)
    w, m, metrics = correction_weights(trainer, engine, mask, "tis", cap=2.0)
    assert w.tolist()[0] == pytest.approx([2.0, 0.5, 1.0]) and torch.equal(m, mask)
    assert metrics["rollout_is/clipped_frac"] == pytest.approx(1 / 3)


def test_mis_masks_tokens_whose_ratio_leaves_the_band():
    trainer = torch.tensor([[math.log(0.6), math.log(0.1), math.log(0.08), math.log(0.3)]])
    engine = torch.tensor([[math.log(0.2), math.log(0.2), math.log(0.2), math.log(0.3)]])  # 3, 0.5, 0.4, 1
    w, m, metrics = correction_weights(trainer, engine, torch.ones(1, 4), "mis", cap=2.0)
    assert m.tolist() == [[0.0, 1.0, 0.0, 1.0]] and torch.equal(w, torch.ones(1, 4))
    assert metrics["rollout_is/masked_frac"] == pytest.approx(0.5)


def test_decoupled_ppo_weighs_by_the_behaviour_ratio_and_zeroes_tokens_over_the_cap():
    trainer = torch.tensor([[math.log(0.6), math.log(0.1), math.log(0.3), 0.0]])
    engine = torch.tensor([[math.log(0.2), math.log(0.2), math.log(0.3), 0.0]])  # ratios 3, 0.5, 1; a pad
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, m, metrics = correction_weights(trainer, engine, mask, "decoupled", cap=2.0)
    # AReaL's behav_imp_weight with behav_imp_weight_cap: the weight, 0 above the cap, the token still counted
    assert w.tolist()[0][:3] == pytest.approx([0.0, 0.5, 1.0]) and torch.equal(m, mask)
    assert metrics["rollout_is/masked_frac"] == pytest.approx(1 / 3)


def test_the_sequence_mask_drops_whole_sequences_by_their_geometric_mean_ratio():
    log2 = math.log(2.0)
    trainer = torch.tensor([[log2, -log2, 0.0], [3 * log2, 0.0, 0.0], [-3 * log2, 0.0, 0.0]])
    engine = torch.zeros(3, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # geometric means: 1 (2 then 1/2), 2 (8 over 3 tokens: exactly the cap, kept), 1/8 (dropped)
    w, m, metrics = correction_weights(trainer, engine, mask, "seq-mis", cap=2.0)
    assert m.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]] and torch.equal(w, torch.ones(3, 3))
    assert metrics["rollout_is/seq_masked_frac"] == pytest.approx(1 / 3)


def test_no_correction_leaves_weights_and_mask_alone():
    mask = torch.tensor([[1.0, 0.0]])
    w, m, metrics = correction_weights(torch.zeros(1, 2), torch.ones(1, 2), mask, "none")
    assert torch.equal(w, torch.ones(1, 2)) and torch.equal(m, mask) and metrics == {}


@pytest.mark.parametrize(
    "schedule, min_ratio, expected",
    [
        ("constant", 0.0, [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", 0.0, [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]),
        ("linear", 0.1, [0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1]),
        (
            "cosine",
            0.0,
            [0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 - math.cos(math.pi / 4)), 0, 0],
        ),
    ],
)
def test_lr_schedules_warm_up_then_decay_as_computed_by_hand(schedule, min_ratio, expected):
    got = [lr_at(s, 1.0, schedule=schedule, warmup_steps=2, decay_steps=6, min_ratio=min_ratio) for s in range(8)]
    assert got == pytest.approx(expected, abs=1e-12)


def test_soft_overlong_punishment_ramps_over_the_buffer():
    got = [overlong_penalty(n, max_len=16, buffer_len=4, factor=1.0) for n in (10, 12, 13, 14, 16, 20)]
    assert got == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])


def _scored(groups_rewards):
    out = []
    for g, rewards in enumerate(groups_rewards):
        for r in rewards:
            out.append(Sample(index=len(out), group=g, prompt=f"p{g}", target="", prompt_ids=[1], reward=r))
    return out


def test_uniform_groups_are_those_whose_rewards_are_all_equal():
    assert uniform_groups(_scored([[1.0, 1.0], [0.0, 1.0], [0.3, 0.3]])) == {0, 2}


def test_dynamic_sampling_refills_from_new_prompts_until_the_batch_is_full():
    rounds = [_scored([[1.0, 1.0], [0.0, 1.0]]), _scored([[0.0, 0.0], [0.5, 1.0]]), _scored([[0.2, 0.9], [0, 1]])]
    samples, m = fill_groups(lambda k: rounds[k], num_groups=2, max_rounds=4)
    assert [s.reward for s in samples] == [0.0, 1.0, 0.5, 1.0]
    assert [s.group for s in samples] == [0, 0, 1, 1] and [s.index for s in samples] == [0, 1, 2, 3]
    assert m == {
        "dynamic_sampling/rounds": 2,
        "dynamic_sampling/dropped_groups": 2,
        "dynamic_sampling/padded_groups": 0,
    }


def test_dynamic_sampling_stops_at_the_bound_and_pads_with_dropped_groups():
    calls = []
    samples, m = fill_groups(lambda k: calls.append(k) or _scored([[1.0, 1.0], [0.0, 0.0]]), 3, max_rounds=2)
    assert calls == [0, 1] and len(samples) == 6  # the batch keeps its size
    assert m == {
        "dynamic_sampling/rounds": 2,
        "dynamic_sampling/dropped_groups": 4,
        "dynamic_sampling/padded_groups": 3,
    }
