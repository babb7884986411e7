"""Answer extraction and equivalence (math-verify behind the reward contract), with the hard cases."""

import pytest

from miles.data.verify import (
    countdown_reward,
    equivalent,
    extract_answer,
    math_reward,
    math_reward_with_format,
)


@pytest.mark.parametrize(
    "response, answer, how",
    [
        ("First 2+2=4, then \\boxed{\\frac{3}{4}} and 9", "\\frac{3}{4}", "boxed"),
        ("a \\boxed{1} then \\boxed{x^{2}+1}", "x^{2}+1", "boxed"),
        ("We add them.\n#### 1,234\n", "1,234", "hashes"),
        ("So the answer is -7.", "-7", "answer_is"),
        ("The Answer is: 12 apples", "12 apples", "answer_is"),
        ("3 + 4 = 7, minus 2 gives 5", "5", "last_number"),
        ("It costs $1,250.50 in total", "1,250.50", "last_number"),
        ("no digits here", None, "none"),
    ],
)
def test_the_final_answer_is_taken_in_order_boxed_hashes_answer_is_last_number(response, answer, how):
    assert extract_answer(response) == (answer, how)


@pytest.mark.parametrize(
    "answer, gold",
    [
        ("3/4", "0.75"),
        ("\\frac{3}{4}", "0.75"),
        ("\\dfrac{6}{8}", "3/4"),
        ("\u22125", "-5"),  # a Unicode minus
        ("1,234", "1234"),
        ("12 apples", "12"),
        ("$45", "45"),
        ("45.0", "45"),
        ("\\sqrt{2}", "2^{1/2}"),
        ("x+1", "1+x"),
        ("-\\frac{1}{2}", "-0.5"),
    ],
)
def test_equivalent_answers_match(answer, gold):
    assert equivalent(answer, gold)


@pytest.mark.parametrize(
    "answer, gold", [("3/5", "0.75"), ("5", "-5"), ("1,235", "1234"), ("x-1", "x+1"), ("12", "120")]
)
def test_different_answers_do_not_match(answer, gold):
    assert not equivalent(answer, gold)


@pytest.mark.parametrize(
    "answer, gold",
    [("3/4", "0.75"), ("1,234", "1234"), ("12 apples", "12"), ("-7", "7"), ("0.5", "1/2"), ("45", "45.00"), ("8", "9")],
)
def test_the_plain_number_fast_path_agrees_with_math_verify(answer, gold):
    assert equivalent(answer, gold, fast=True) == equivalent(answer, gold, fast=False)


def test_math_reward_scores_the_extracted_answer_only():
    assert math_reward("What is 2+3?", "2 + 3 = 5", "5") == 1.0
    assert math_reward("What is 2+3?", "The answer is 5. Or maybe 6", "5") == 1.0  # marked beats the last number
    assert math_reward("What is 2+3?", "5 or 6", "5") == 0.0
    assert math_reward("q", "", "5") == 0.0


def test_the_format_reward_pays_only_for_a_marked_answer():
    assert math_reward_with_format("q", "\\boxed{5}", "5") == pytest.approx(1.0)
    assert math_reward_with_format("q", "5", "5") == pytest.approx(0.9)
    assert math_reward_with_format("q", "\\boxed{6}", "5") == pytest.approx(0.1)


def test_countdown_accepts_a_right_expression_and_refuses_reused_or_foreign_numbers():
    target = "24 from 3 4 5 6"
    assert countdown_reward("", "\\boxed{(6 - 3 + 5) * 3}", target) == 0.0  # 3 used twice
    assert countdown_reward("", "\\boxed{6 * 4 * (5 - 3) / 2}", target) == 0.0  # 2 is not given
    assert countdown_reward("", "I try: 6 * 4 = 24\n\\boxed{6 * 4}", target) == 1.0
    assert countdown_reward("", "\\boxed{(5 - 3) * 4 + 6 + 10}", target) == 0.0
    assert countdown_reward("", "\\boxed{6**4}", target) == 0.0
    with pytest.raises(ValueError, match="should read '<target> from"):
        countdown_reward("", "1", "24")


@pytest.mark.parametrize("response", ["the answer is  .", "The answer is\n\n", "answer is: ."])
def test_an_empty_answer_after_the_answer_is_scores_zero_instead_of_raising(response):
    assert math_reward("q", response, "7") == 0.0  # an IndexError here stopped the first H200 run
