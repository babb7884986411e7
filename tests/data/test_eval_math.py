"""The eval figures: the unbiased pass@k estimator against brute-force enumeration, and the per-set summary."""

import itertools
from math import comb

import pytest

from miles.data.eval import ks_up_to, pass_at_k, summarize


@pytest.mark.parametrize(
    "n, c, k", [(4, 0, 1), (4, 1, 1), (4, 1, 2), (4, 2, 2), (5, 2, 3), (6, 3, 4), (4, 4, 4), (8, 1, 8)]
)
def test_pass_at_k_equals_the_share_of_k_subsets_holding_a_pass(n, c, k):
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(outcomes[i] for i in s) for s in subsets) / comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(brute)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="n=4, c=5, k=1"):
        pass_at_k(4, 5, 1)


def test_summary_gives_mean_at_k_pass_at_k_and_greedy_per_set():
    sampled = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.1]]
    out = summarize([1.0, 0.0, 0.0], sampled, 4)
    assert out["mean@4"] == pytest.approx((1 + 0 + 3.1) / 12)
    assert out["pass@4"] == pytest.approx(2 / 3)  # a 0.1 format bonus is not a pass
    assert out["pass@1"] == pytest.approx((1 / 4 + 0 + 3 / 4) / 3)
    assert out["greedy_pass@1"] == pytest.approx(1 / 3) and out["num_problems"] == 3
    assert ks_up_to(4) == [1, 2, 4] and ks_up_to(6) == [1, 2, 4, 6] and ks_up_to(1) == [1]
