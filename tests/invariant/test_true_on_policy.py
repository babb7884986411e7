"""true_on_policy on CPU: the engine's log-prob of every sampled token equals the trainer's bit for bit, in FP32 and
bf16, through prefill and decode, shared prompt slots, ragged prompts and answers, more requests than slots, and after
a train step and a weight sync. With the standard kernels the same comparison differs, so these tests can fail."""

import pytest
import torch

from miles.policy.rollout_correction import first_mismatch, mismatch_metrics
from tests.invariant.onpolicy import compare, engine, model_cfg, prompts, rollout, sync, trainer

DTYPES = ["float32", "bfloat16"]


@pytest.mark.parametrize("share_prefix", [False, True], ids=["own-slots", "shared-prompt-slot"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_sampled_tokens_engine_log_prob_equals_the_trainers_bit_for_bit(dtype, share_prefix):
    cfg = model_cfg(dtype)
    eng = engine(cfg, True, slots=7, share_prefix=share_prefix)  # 18 requests through 7 slots
    samples = rollout(eng, prompts(6), n=3)
    assert len({len(s.response_ids) for s in samples}) > 3 and len({len(s.prompt_ids) for s in samples}) > 3
    ours, theirs, _ = compare(trainer(cfg, True), samples)
    assert ours.numel() == sum(len(s.response_ids) for s in samples)
    flat = ours[None], theirs[None], torch.ones_like(ours)[None]
    assert torch.equal(ours, theirs), f"first differing token (index, trainer, engine): {first_mismatch(*flat)}"
    m = mismatch_metrics(*flat)
    assert m == {
        "train_rollout_logprob_abs_diff": 0.0,
        "train_rollout_logprob_max_abs_diff": 0.0,
        "train_rollout_kl": 0.0,
    }


@pytest.mark.parametrize("dtype", DTYPES)
def test_with_the_standard_kernels_the_same_comparison_differs(dtype):
    cfg = model_cfg(dtype)
    samples = rollout(engine(cfg, False), prompts(6), n=3)
    ours, theirs, _ = compare(trainer(cfg, False), samples)
    assert (ours - theirs).abs().max() > 0  # the comparison above is one that can fail


@pytest.mark.parametrize("dtype", DTYPES)
def test_after_a_train_step_and_a_weight_sync_the_log_probs_still_agree_bit_for_bit(dtype):
    cfg = model_cfg(dtype)
    eng, backend = engine(cfg, True, slots=5, share_prefix=True), trainer(cfg, True)
    first = rollout(eng, prompts(4, seed=2), n=2)
    _, _, batch = compare(backend, first)
    before = {n: t.detach().clone() for n, t in backend.named_weights()}
    metrics = backend.train_step(batch, step=0)
    assert metrics["train_rollout_logprob_max_abs_diff"] == 0.0 and metrics["train_rollout_kl"] == 0.0
    assert any(not torch.equal(before[n], t) for n, t in backend.named_weights()), "the step changed no weight"
    sync(backend, eng, version=1)
    second = rollout(eng, prompts(4, seed=5), n=2, seed=9)
    ours, theirs, _ = compare(backend, second)
    assert torch.equal(ours, theirs)


def test_a_temperature_below_one_is_applied_the_same_way_on_both_sides():
    cfg = model_cfg("bfloat16")
    samples = rollout(engine(cfg, True), prompts(4, seed=7), n=2, temperature=0.7)
    ours, theirs, _ = compare(trainer(cfg, True, temperature=0.7), samples)
    assert torch.equal(ours, theirs)


def test_a_step_whose_log_probs_differ_is_logged_with_the_first_differing_token(caplog):
    cfg = model_cfg("float32")
    samples = rollout(engine(cfg, True), prompts(3, seed=4), n=2)
    samples[1].rollout_log_probs[2] += 1e-3  # as if the engine had run another kernel for that one token
    backend = trainer(cfg, True)
    _, _, batch = compare(backend, samples)
    with caplog.at_level("WARNING"):
        metrics = backend.train_step(batch, step=4)
    assert metrics["train_rollout_logprob_max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    pos = len(samples[1].prompt_ids) + 2
    assert any("RL step 4" in m and "sample 1 (row 1), token position " + str(pos) in m for m in caplog.messages)
