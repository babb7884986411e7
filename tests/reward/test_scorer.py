"""The scorer on the reference path (everything in this process): what fails scores reward_on_error and is
counted, the first failure of a step lands in the run directory, 'raise' stops with the same facts, pure sympy
checks asked twice run once (and are remembered) and a user's calls never fold."""

import json

import pytest

from miles.protocols.reward import Reward, RewardError
from miles.reward.catalog import reward_for
from miles.reward.scorer import Job, RewardScorer

CALLS = []


def counting(prompt, response, target):
    CALLS.append(response)
    return float(response == target)


def test_a_raise_a_nan_and_a_bad_return_score_reward_on_error_and_are_counted(tmp_path):
    jobs = [
        Job(reward_for("countdown"), "p", "\\boxed{3}", "garbage"),  # the verifier raises on a bad target (V16)
        Job(reward_for("math"), "p", "\\boxed{5}", "5"),
        Job(Reward("nan", quick=lambda p, r, t: float("nan")), "p", "r", "t"),
        Job(Reward("text", quick=lambda p, r, t: "x"), "p", "r", "t"),
    ]
    report = RewardScorer(None, on_error=-1.0, failures_dir=tmp_path).score(jobs, label="step_000007")
    assert report.values == [-1.0, 1.0, -1.0, -1.0] and report.failed == ["error", "", "error", "error"]
    assert report.metrics() == {"reward/timeouts": 0, "reward/errors": 3}
    row = json.loads((tmp_path / "step_000007.json").read_text())
    assert row["reward"] == "countdown" and row["kind"] == "error" and row["errors"] == 3
    assert row["error"].startswith("ValueError: countdown target 'garbage'") and "Traceback" in row["traceback"]
    assert (row["prompt"], row["response"], row["target"]) == ("p", "\\boxed{3}", "garbage")


def test_reward_on_error_raise_stops_with_the_first_failure_after_writing_it(tmp_path):
    jobs = [Job(reward_for("math"), "p", "1", "1"), Job(reward_for("countdown"), "q", "r", "24")]
    with pytest.raises(RewardError, match=r"reward function countdown raised ValueError: countdown target '24'.*"
                       r"prompt='q'.*the first is in .*step_000002.json; fix it, or set data.reward_on_error"):  # fmt: skip
        RewardScorer(None, on_error=None, failures_dir=tmp_path).score(jobs, label="step_000002")
    assert json.loads((tmp_path / "step_000002.json").read_text())["prompt"] == "q"


def test_a_sympy_check_asked_twice_runs_once_and_a_users_calls_never_fold():
    math = reward_for("math")
    jobs = [Job(math, "p", "\\boxed{x+1}", "1+x")] * 3 + [Job(math, "p", "\\boxed{7}", "7")]
    report = RewardScorer(None).score(jobs)
    assert report.values == [1.0] * 4 and report.num_pool_calls == 1  # 7 == 7 never left this process
    scorer = RewardScorer(None)
    assert [scorer.score(jobs[:1]).num_pool_calls for _ in range(2)] == [1, 0]  # remembered across calls
    user = reward_for(f"{__name__}:counting")
    CALLS.clear()
    report = RewardScorer(None).score([Job(user, "p", "a", "a")] * 3)
    assert report.values == [1.0] * 3 and report.num_pool_calls == 3 and CALLS == ["a"] * 3


def test_check_rewards_imports_a_users_reward_here_unless_the_run_joins_a_cluster(tmp_path):
    from miles.config import apply_overrides
    from miles.recipes import quickstart
    from miles.reward.catalog import check_rewards

    with pytest.raises(ValueError, match=r"task.reward = 'nope_mod:fn' cannot be loaded \(ModuleNotFoundError"):
        check_rewards(apply_overrides(quickstart(), ["task.reward=nope_mod:fn"]))
    check_rewards(apply_overrides(quickstart(), ["task.reward=nope_mod:fn", "ray_address=auto"]))  # its nodes'
    with pytest.raises(ValueError, match="should be 'module:function'"):
        check_rewards(apply_overrides(quickstart(), ["task.reward=nocolon", "ray_address=auto"]))
