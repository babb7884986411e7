"""Advantage estimators, KL estimators, loss aggregations and dual-clip against values computed by hand."""

import math

import pytest
import torch

from miles.policy.advantages import compute_advantages, group_advantages
from miles.policy.kl import kl_estimate, kl_penalised_advantages
from miles.policy.loss import aggregate, clipped_surrogate, policy_loss

REWARDS = [1.0, 0.0, 0.5, 0.2, 0.2, 0.2]  # group 0 spread out, group 1 all equal
GROUPS = [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize(
    "estimator, expected",
    [
        # group 0: mean 0.5, population std sqrt(1/6) = 0.408248
        ("grpo", [1.224745, -1.224745, 0.0, 0.0, 0.0, 0.0]),
        ("drgrpo", [0.5, -0.5, 0.0, 0.0, 0.0, 0.0]),
        # 1 - (0 + 0.5) / 2, 0 - (1 + 0.5) / 2, 0.5 - (1 + 0) / 2
        ("rloo", [0.75, -0.75, 0.0, 0.0, 0.0, 0.0]),
        # batch mean 0.35, population std sqrt(0.635 / 6) = 0.325320
        ("reinforce++", [1.998030, -1.075862, 0.461084, -0.461084, -0.461084, -0.461084]),
        # group-centred [0.5, -0.5, 0, 0, 0, 0], divided by their batch std sqrt(0.5 / 6) = 0.288675
        ("reinforce++-baseline", [1.732051, -1.732051, 0.0, 0.0, 0.0, 0.0]),
    ],
)
def test_each_advantage_estimator_matches_the_hand_computed_values(estimator, expected):
    assert compute_advantages(REWARDS, GROUPS, estimator, eps=0.0) == pytest.approx(expected, abs=1e-5)


def test_rloo_equals_the_reward_minus_the_mean_of_the_other_samples_by_loop():
    rewards, groups = [0.3, 0.9, 0.1, 0.4, 1.0, 0.0, 0.7, 0.2], [0, 0, 0, 0, 1, 1, 1, 1]
    naive = [
        r - sum(rewards[j] for j in range(8) if groups[j] == g and j != i) / 3
        for i, (r, g) in enumerate(zip(rewards, groups))
    ]
    assert compute_advantages(rewards, groups, "rloo") == pytest.approx(naive, abs=1e-12)


def test_group_advantages_keeps_its_grpo_and_no_std_meanings():
    assert group_advantages(REWARDS, GROUPS) == compute_advantages(REWARDS, GROUPS, "grpo")
    assert group_advantages(REWARDS, GROUPS, normalize_std=False) == compute_advantages(REWARDS, GROUPS, "drgrpo")


def test_kl_estimators_match_their_formulas_at_one_token():
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])  # d = ref - lp = -ln 2
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(math.log(2), abs=1e-6)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2, abs=1e-6)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)


def test_k1_and_k3_averaged_over_policy_samples_approach_the_exact_kl():
    p, q = torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.2, 0.5, 0.3])
    exact = (p * (p / q).log()).sum().item()
    tokens = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    lp, ref = p.log()[tokens], q.log()[tokens]
    for kind in ("k1", "k3"):
        assert kl_estimate(lp, ref, kind).mean().item() == pytest.approx(exact, abs=5e-3)
    assert (kl_estimate(lp, ref, "k3") >= 0).all()


def test_kl_as_a_reward_penalty_subtracts_the_kl_still_to_come():
    adv = torch.tensor([1.0])
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    out = kl_penalised_advantages(adv, kl, mask, coef=0.5)  # penalties 0.05, 0.1, 0.15, (masked)
    assert out.tolist()[0] == pytest.approx([1 - 0.3, 1 - 0.25, 1 - 0.15, 1.0])


X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # third row: nothing counts


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("seq-mean-token-sum", (6 + 4) / 2),
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", 10 / (3 * 5)),  # constant: 3 rows x 5 tokens, whatever the lengths
    ],
)
def test_each_loss_aggregation_matches_the_hand_computed_value(mode, expected):
    assert aggregate(X, MASK, mode, norm_tokens=5).item() == pytest.approx(expected)


def test_dual_clip_caps_only_the_loss_of_negative_advantages():
    ratio, eps = torch.tensor([3.0, 3.0]), (0.2, 0.28)
    adv = torch.tensor([-1.0, 1.0])
    plain, _ = clipped_surrogate(ratio, adv, *eps)
    dual, _ = clipped_surrogate(ratio, adv, *eps, dual_clip=2.0)
    assert plain.tolist() == pytest.approx([3.0, -1.28])  # max(-r A, -clip(r) A)
    assert dual.tolist() == pytest.approx([2.0, -1.28])  # min(3, c |A|) for A < 0; A > 0 untouched


def test_clip_higher_uses_the_upper_epsilon_for_ratios_above_one():
    pg, clipped = clipped_surrogate(torch.tensor([1.5, 0.5]), torch.tensor([1.0, -1.0]), 0.2, 0.28)
    assert pg.tolist() == pytest.approx([-1.28, 0.8]) and clipped.tolist() == [True, True]


def test_policy_loss_weights_each_token_by_the_importance_weights():
    lp = torch.zeros(1, 3, requires_grad=True)
    mask = torch.ones(1, 3)
    w = torch.tensor([[2.0, 1.0, 0.5]])
    out = policy_loss(lp, lp.detach(), torch.tensor([1.0]), mask, is_weights=w)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-(2.0 + 1.0 + 0.5) / 3)  # ratio 1: -A w per token, token mean
    assert lp.grad.tolist()[0] == pytest.approx([-2 / 3, -1 / 3, -0.5 / 3])


def test_per_token_advantages_are_taken_as_given():
    lp = torch.zeros(1, 2, requires_grad=True)
    out = policy_loss(lp, lp.detach(), torch.tensor([[1.0, 3.0]]), torch.ones(1, 2))
    assert out.loss.item() == pytest.approx(-2.0)


def test_the_kl_loss_term_uses_the_chosen_estimator():
    lp = torch.full((1, 2), math.log(0.5))
    ref = torch.full((1, 2), math.log(0.25))
    k1 = policy_loss(lp, lp, torch.zeros(1), torch.ones(1, 2), ref_log_probs=ref, kl_coef=1.0, kl_estimator="k1")
    k3 = policy_loss(lp, lp, torch.zeros(1), torch.ones(1, 2), ref_log_probs=ref, kl_coef=1.0, kl_estimator="k3")
    assert k1.metrics["kl"] == pytest.approx(math.log(2), abs=1e-6)
    assert k3.metrics["kl"] == pytest.approx(math.log(2) - 0.5, abs=1e-6)
