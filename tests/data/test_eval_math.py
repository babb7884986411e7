"""The eval figures: the unbiased pass@k estimator against brute-force enumeration, and the per-set summary."""

import itertools
import json
from math import comb

import pytest

from miles.config import apply_overrides
from miles.data.eval import Evaluator, ks_up_to, pass_at_k, summarize
from miles.model.tokenizer import load_tokenizer
from miles.recipes import quickstart
from miles.reward.pool import RewardPool
from miles.samples import Sample


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


def test_v25_a_right_but_unmarked_answer_under_math_format_counts_as_passed(tmp_path):
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(json.dumps({"prompt": "What is 6 * 7?", "answer": "42"}) + "\n")
    cfg = apply_overrides(
        quickstart(),
        [f"data.eval={held_out}", "data.reward=math_format", "data.chat_template=false", f"run_dir={tmp_path / 'run'}"],
    )
    with RewardPool(1, timeout_s=5.0) as pool:  # every answer here is decided without sympy: no worker starts
        ev = Evaluator(cfg, load_tokenizer(cfg.model.tokenizer), [], pool=pool)
        texts = ["so 42", "\\boxed{42}", "\\boxed{41}", "no idea"]
        samples = [Sample(index=i, group=0, prompt="What is 6 * 7?", target="42", prompt_ids=[1], response_text=t,
                          metadata={"dataset": "held_out"}) for i, t in enumerate(texts)]  # fmt: skip
        ev.score(samples, step=0)
        assert pool.pids() == []
    assert [s.reward for s in samples] == pytest.approx([0.9, 1.0, 0.1, 0.0])
    assert [s.metadata["passed"] for s in samples] == [True, True, False, False]  # pass = a right answer
    passed = [[s.metadata["passed"] for s in samples]]
    assert summarize(None, [[s.reward for s in samples]], 4, sampled_passed=passed)["pass@1"] == 0.5
