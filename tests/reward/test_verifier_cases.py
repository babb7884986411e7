"""The verifier cases of the 2026-12-04 reliability review through the real scorer and reward pool: every one
scores within its bound (the linear fast path here, sympy under the time limit in a worker), the sympy bombs are
killed at the limit even past the tower guard, a user's hanging reward is a counted timeout, the scores equal
the in-process reference, and math-verify stays quiet."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.data.verify import SYMBOLIC
from miles.protocols.reward import Call
from miles.reward.catalog import reward_for
from miles.reward.pool import RewardPool
from miles.reward.scorer import Job, RewardScorer

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)

ROOT = Path(__file__).resolve().parents[2]
TAIL = "1 " + "a" * 40 + "!"
CASES = {  # review id: (verifier, response, target)
    "V1": ("math", "\\boxed{1 " + "a" * 20 + "!}", "1"),
    "V2": ("math", "\\boxed{1 " + "a" * 24 + "!}", "1"),
    "V3": ("math", "\\boxed{1 " + "a" * 28 + "!}", "1"),
    "V4": ("math", "#### " + TAIL, "1"),
    "V5": ("math", "1", TAIL),
    "V6": ("math", "\\boxed{9^{9^{9^{9}}}}", "5"),
    "V8": ("math", "\\boxed{9^{9^{9}}}", "5"),
    "V9": ("math", "\\boxed{((10!)!)!}", "5"),
    "V14": ("math_format", "\\boxed{1 " + "a" * 28 + "!}", "1"),
    "V18": ("math", "\\boxed{\\binom{10^{12}}{10^{6}}}", "5"),
    "V19": ("math", "\\boxed{10^{10^{10}}}", "5"),
}


@pytest.fixture(scope="module")
def pool():
    with RewardPool(2, timeout_s=3.0) as p:
        yield p


def test_every_verifier_case_of_the_review_scores_within_the_time_limit(pool, tmp_path):
    jobs = [Job(reward_for(v), "p", r, t) for v, r, t in CASES.values()]
    scorer = RewardScorer(pool, on_error=0.0, failures_dir=tmp_path)
    scorer.score([Job(reward_for("math"), "p", "\\boxed{x+1}", "1+x")])  # workers started and sympy loaded
    t0 = time.monotonic()
    report = scorer.score(jobs, label="step_000000")
    # each bounded by the limit (and a replacement worker's start after a kill; the shared machine is slow)
    assert time.monotonic() - t0 < len(jobs) * (3.0 + 10)
    expected = {"V14": 0.1}  # math_format: the boxed wrong answer keeps its format bonus
    assert dict(zip(CASES, report.values)) == {k: expected.get(k, 0.0) for k in CASES}


@pytest.mark.parametrize("case", ["V6", "V8", "V9", "V18", "V19"])
def test_a_sympy_bomb_past_the_tower_guard_is_killed_at_the_limit(pool, case):
    answer = CASES[case][1].removeprefix("\\boxed{").removesuffix("}")
    t0 = time.monotonic()
    (out,) = pool.run([Call(SYMBOLIC, (answer, "5"))])  # straight to sympy, as an answer the guard missed would go
    assert out.timed_out or out.value == 0.0, out
    assert time.monotonic() - t0 < 3.0 + 10


def test_v22_a_user_reward_that_hangs_is_a_counted_timeout_and_the_others_are_scored(pool, tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    hang, echo = reward_for("hostile_rewards:hang"), reward_for("hostile_rewards:echo")
    jobs = [Job(echo, "p", "1", "t"), Job(hang, "why", "zzz", "t"), Job(echo, "p", "2", "t")]
    report = RewardScorer(pool, on_error=0.5, failures_dir=tmp_path).score(jobs, label="step_000004")
    assert report.values == [1.0, 0.5, 2.0] and report.metrics() == {"reward/timeouts": 1, "reward/errors": 0}
    row = json.loads((tmp_path / "step_000004.json").read_text())
    assert row["kind"] == "timeout" and row["response"] == "zzz" and row["seconds"] >= 3.0


def test_pool_scoring_matches_reference(pool):
    answers = ["\\boxed{\\frac{3}{4}}", "#### 1,234", "The answer is x+1.", "3 + 4 = 7", "\\boxed{\\sqrt{2}}",
               "so 0.5", "\\boxed{12 apples}", "\\boxed{2^{2^{2}}}", "nothing", "\\boxed{-\\frac{1}{2}}"]  # fmt: skip
    golds = ["0.75", "1234", "1+x", "7", "2^{1/2}", "1/2", "12", "16", "3", "-0.5"]
    jobs = [Job(reward_for(v), "p", a, g) for v in ("math", "math_format", "countdown") for a in answers for g in golds]
    jobs += [Job(reward_for("countdown"), "p", "\\boxed{6 * 4}", "24 from 3 4 5 6")]
    assert RewardScorer(pool).score(jobs).values == RewardScorer(None).score(jobs).values


def test_v26_math_verify_says_nothing_about_its_disabled_timeouts():
    code = "from miles.data.verify import symbolic_equal; assert symbolic_equal('x+1', '1+x')"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "Timeout is disabled" not in r.stderr, r.stderr
