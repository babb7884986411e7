"""DAPO in the rollout tail of a real RolloutManager (a tiny random model, in-process): dynamic sampling refills
and renumbers the batch within its bound, overlong filtering masks truncated responses out of the loss."""

from miles.config import apply_overrides
from miles.policy.dapo import uniform_groups
from miles.recipes import quickstart
from miles.rollout.manager import RolloutManager
from miles.sources import make_sources

TINY = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "rollout.num_prompts_per_step=3",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=4",
    "rollout.max_batch_size=16",
    "num_threads=1",
]


def test_dynamic_sampling_keeps_the_batch_size_and_counts_its_rounds():
    manager = RolloutManager(
        apply_overrides(quickstart(), TINY + ["rollout.dynamic_sampling=true"]), sources=make_sources
    )
    [batch], m = manager.generate(0)
    samples = manager.last_samples
    assert len(samples) == 12 and batch.tokens.shape[0] == 12
    assert [s.index for s in samples] == list(range(12)) and [s.group for s in samples] == [i // 4 for i in range(12)]
    rounds, dropped, padded = (m[f"dynamic_sampling/{k}"] for k in ("rounds", "dropped_groups", "padded_groups"))
    assert 1 <= rounds <= 4 and 3 * rounds >= dropped + (3 - padded)  # groups drawn >= dropped + kept
    assert padded == 0 or 3 * rounds == dropped + 3 - padded  # short of groups: every unequal one was kept
    # every group kept before the padding has unequal rewards; the padded ones are dropped (uniform) groups
    assert len(uniform_groups(samples)) == padded
    assert padded == 0 or rounds == 4  # padding only once the bound is spent


def test_overlong_filter_masks_truncated_responses_and_the_penalty_lowers_their_reward():
    base = apply_overrides(quickstart(), TINY)
    plain = RolloutManager(base, sources=make_sources)
    plain.generate(0)
    shaped = RolloutManager(
        apply_overrides(base, ["rollout.overlong_filter=true", "rollout.overlong_buffer_len=1"]), sources=make_sources
    )
    [batch], m = shaped.generate(0)
    cut = [s.finish_reason == "length" for s in shaped.last_samples]
    assert any(cut) and m["overlong_frac"] == sum(cut) / len(cut)  # a random model often runs to the budget
    assert m["score"] == sum(p.reward for p in plain.last_samples) / len(cut)  # the task's score, unshaped
    for row, (s, p) in enumerate(zip(shaped.last_samples, plain.last_samples)):
        assert s.response_ids == p.response_ids  # same engine, seed and prompts: only the shaping differs
        if s.finish_reason == "length":
            assert batch.loss_mask[row].sum() == 0 and s.reward == p.reward - 1.0 and s.metadata["score"] == p.reward
        else:
            assert batch.loss_mask[row].sum() == len(s.response_ids) and s.reward == p.reward
