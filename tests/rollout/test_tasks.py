import re

import pytest

from miles.config import TaskConfig
from miles.policy.advantages import group_advantages
from miles.reward.scorer import Job, RewardScorer
from miles.rollout.tasks import RewardError, Task, numeric_credit, positional_credit


def test_tasks_are_deterministic_per_step_and_answers_are_correct():
    t = Task(TaskConfig(name="reverse"), seed=1)
    assert t.problems(3, 5) == t.problems(3, 5) != t.problems(4, 5)
    for p in t.problems(0, 20):
        assert p.target == p.prompt.removeprefix("rev ").removesuffix("=")[::-1]
    for p in Task(TaskConfig(name="sort"), seed=0).problems(0, 20):  # the quickstart's task
        assert p.target == "".join(sorted(p.prompt.removeprefix("sort ").removesuffix("="))) != ""
    for p in Task(TaskConfig(name="add", max_len=3), seed=0).problems(0, 20):
        a, b = p.prompt.removesuffix("=").split("+")
        assert int(p.target) == int(a) + int(b)


def test_partial_credit_rewards_rank_answers_sensibly():
    assert positional_credit("", "cba", "cba") == 1.0
    assert 0 < positional_credit("", "cbx", "cba") < 1.0
    assert positional_credit("", "cbx", "cba") > positional_credit("", "xxx", "cba") == 0.0
    assert numeric_credit("", "579", "579") == 1.0 and numeric_credit("", "abc", "579") == 0.0


def _boom(prompt, response, target):
    raise ZeroDivisionError("bad reward")


def test_a_reward_function_that_raises_names_itself_and_the_sample():
    t = Task(TaskConfig(name="reverse", reward=f"{__name__}:_boom"), seed=0)
    job = Job(t.reward, "rev ab=", "ba", "ba")
    with pytest.raises(
        RewardError, match=re.escape(f"reward function {__name__}:_boom raised ZeroDivisionError: bad reward")
    ):
        RewardScorer(None, on_error=None).score([job])
    report = RewardScorer(None, on_error=0.25).score([job])  # the default policy: scored and counted
    assert report.values == [0.25] and report.errors == 1 and report.first.prompt == "rev ab="


def test_a_tasks_own_reward_runs_in_the_scoring_process():
    t = Task(TaskConfig(name="reverse"), seed=0)
    assert t.reward.quick is positional_credit and not t.reward.call


def test_custom_reward_spec_must_be_importable():
    with pytest.raises(ValueError, match="should be 'module:function'"):
        Task(TaskConfig(reward="nocolon"), seed=0)
    with pytest.raises(ValueError, match="cannot be loaded"):
        Task(TaskConfig(reward="no_such_module:fn"), seed=0)


def test_group_advantages_are_normalised_within_each_group():
    adv = group_advantages([1.0, 0.0, 0.5, 0.5], [0, 0, 1, 1])
    assert adv[0] == pytest.approx(1.0, abs=1e-4) and adv[1] == pytest.approx(-1.0, abs=1e-4)
    assert adv[2] == adv[3] == 0.0
