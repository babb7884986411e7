"""The shipped data: a deterministic generator, committed test splits, train splits that avoid them."""

import json

from miles.data.generate import generate, generated_train, held_out_rows, split_path, write_test_splits
from miles.data.verify import countdown_reward, math_reward


def test_the_generator_is_deterministic_and_seeds_differ():
    assert generate("mixed", 40, seed=3) == generate("mixed", 40, seed=3)
    assert generate("mixed", 40, seed=3) != generate("mixed", 40, seed=4)


def test_the_committed_test_splits_are_what_the_generator_writes(tmp_path):
    write_test_splits(tmp_path)
    for name in ("mixed", "countdown"):
        assert (tmp_path / f"{name}_test.jsonl").read_text() == open(split_path(name)).read()


def test_mixed_test_split_has_32_problems_of_each_operation_at_level_2():
    rows = held_out_rows("mixed")
    tasks = [r["metadata"]["task"] for r in rows]
    assert len(rows) == 128 and all(tasks.count(t) == 32 for t in ("add", "sub", "mul", "word"))
    assert {r["metadata"]["level"] for r in rows} == {2}


def test_every_generated_answer_is_accepted_by_its_own_verifier():
    for r in generate("mixed", 200, seed=5, levels=(1, 2, 3)):
        assert math_reward(r["prompt"], f"The answer is {r['answer']}.", r["answer"]) == 1.0
    assert all(r["answer"].lstrip("-").isdigit() for r in generate("sub", 50, seed=0))


def test_difficulty_levels_grow_the_operands():
    small = generate("add", 100, seed=0, levels=(1,))
    large = generate("add", 100, seed=0, levels=(3,))
    assert max(int(r["answer"]) for r in small) <= 40 < min(int(r["answer"]) for r in large)


def test_countdown_problems_are_solvable_and_checked_by_the_countdown_verifier():
    rows = generate("countdown", 30, seed=2)
    assert all(r["metadata"]["verifier"] == "countdown" for r in rows)
    # brute force a solution of the 3-number ones: the generator only makes reachable targets
    import itertools

    for r in (r for r in rows if r["metadata"]["level"] == 1):
        goal, nums = r["answer"].split(" from ")
        nums = nums.split()
        found = any(
            countdown_reward("", f"\\boxed{{({a} {o1} {b}) {o2} {c}}}", r["answer"]) == 1.0
            for a, b, c in itertools.permutations(nums)
            for o1 in "+-*"
            for o2 in "+-*"
        )
        assert found, r


def test_train_splits_never_hold_a_test_prompt(tmp_path):
    path = generated_train("mixed", 3000, out_dir=tmp_path)
    train = {json.loads(line)["prompt"] for line in open(path)}
    test = {r["prompt"] for r in held_out_rows("mixed")}
    assert len(train) > 1000 and not train & test
