"""The objective options inside TorchBackend.train_step: the honest mismatch metric, TIS / MIS, KL in the reward,
and the LR schedule."""

import dataclasses

import pytest
import torch

from miles.config import TrainerConfig
from miles.samples import Sample, collate
from miles.train.torch_backend import TorchBackend


def _batch(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        prompt = torch.randint(0, 256, (4,), generator=g).tolist()
        resp = torch.randint(0, 256, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        samples.append(
            Sample(
                index=i,
                group=i // 4,
                prompt="",
                target="",
                prompt_ids=prompt,
                response_ids=resp,
                advantage=float(i % 4) - 1.5,
            )
        )
    return collate(samples, pad_id=256)


def _on_policy_batch(backend):
    """A batch whose 'engine' log-probs are the trainer's own: the true mismatch is 0."""
    batch = _batch()
    batch.rollout_log_probs = backend.forward_logprobs(batch) * batch.loss_mask
    return batch


def test_the_mismatch_metric_is_taken_before_any_update_of_the_step(tiny_model_cfg):
    b = TorchBackend(tiny_model_cfg, TrainerConfig(lr=1e-2, num_minibatches=2))
    batch = _on_policy_batch(b)
    m = b.train_step(batch)
    assert m["train_rollout_logprob_abs_diff"] < 1e-6 and abs(m["train_rollout_kl"]) < 1e-6
    # the measure after the first minibatch's optimizer step (what the metric used to be) sees the update
    after = b.forward_logprobs(batch)
    moved = ((after - batch.rollout_log_probs).abs() * batch.loss_mask).sum() / batch.loss_mask.sum()
    assert moved > 1e-3


def test_every_correction_equals_the_plain_loss_when_engine_and_trainer_agree(tiny_model_cfg):
    results = {}
    kinds = ("tis", "mis", "decoupled", "seq-mis")
    for kind in ("none", *kinds):
        b = TorchBackend(tiny_model_cfg, TrainerConfig(lr=1e-2, rollout_correction=kind))
        b.train_step(_on_policy_batch(b))
        results[kind] = dict(b.named_weights())
    for kind in kinds:
        assert all(torch.allclose(results["none"][k], v, atol=1e-6) for k, v in results[kind].items())


def test_tis_damps_the_update_of_tokens_the_engine_made_unlikely(tiny_model_cfg):
    b = TorchBackend(tiny_model_cfg, TrainerConfig(rollout_correction="tis", rollout_correction_cap=2.0))
    batch = _on_policy_batch(b)
    batch.rollout_log_probs = batch.rollout_log_probs + 5.0 * batch.loss_mask  # engine says p far higher
    m = b.train_step(batch)
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(5.0, abs=1e-4)
    assert m["rollout_is/clipped_frac"] == 0.0  # ratios exp(-5) < cap: weighted, not clipped


def test_decoupled_ppo_drops_the_tokens_a_stale_engine_made_far_less_likely(tiny_model_cfg):
    b = TorchBackend(tiny_model_cfg, TrainerConfig(rollout_correction="decoupled", rollout_correction_cap=2.0))
    batch = _on_policy_batch(b)
    batch.rollout_log_probs = batch.rollout_log_probs - 3.0 * batch.loss_mask  # behaviour weight e^3 > cap
    m = b.train_step(batch)
    assert m["rollout_is/masked_frac"] == 1.0 and m["pg_loss"] == 0.0


def test_the_sequence_mask_drops_every_sequence_beyond_the_band(tiny_model_cfg):
    b = TorchBackend(tiny_model_cfg, TrainerConfig(rollout_correction="seq-mis"))
    batch = _on_policy_batch(b)
    batch.rollout_log_probs = batch.rollout_log_probs + 1.0 * batch.loss_mask  # geometric mean e^-1 < 1/2
    m = b.train_step(batch)
    assert m["rollout_is/seq_masked_frac"] == 1.0 and m["pg_loss"] == 0.0


def test_mis_masks_every_token_beyond_the_band(tiny_model_cfg):
    b = TorchBackend(tiny_model_cfg, TrainerConfig(rollout_correction="mis"))
    batch = _on_policy_batch(b)
    batch.rollout_log_probs = batch.rollout_log_probs - 3.0 * batch.loss_mask
    m = b.train_step(batch)
    assert m["rollout_is/masked_frac"] == 1.0 and m["pg_loss"] == 0.0


def test_kl_in_the_reward_changes_the_update_only_once_the_policy_left_the_reference(tiny_model_cfg):
    cfg = TrainerConfig(lr=1e-2, kl_coef=0.5, kl_in="reward")
    a, b = TorchBackend(tiny_model_cfg, cfg), TorchBackend(tiny_model_cfg, dataclasses.replace(cfg, kl_coef=0.0))
    first_a, first_b = a.train_step(_batch()), b.train_step(_batch())
    assert "kl" not in first_a and first_a["pg_loss"] == pytest.approx(first_b["pg_loss"], abs=1e-6)
    assert a.train_step(_batch(seed=1))["pg_loss"] != pytest.approx(b.train_step(_batch(seed=1))["pg_loss"], abs=1e-6)


def test_the_lr_schedule_sets_the_optimizer_lr_per_rl_step(tiny_model_cfg):
    cfg = TrainerConfig(lr=1e-2, lr_schedule="linear", lr_warmup_steps=2, lr_decay_steps=4)
    b = TorchBackend(tiny_model_cfg, cfg)
    lrs = [b.train_step(_batch(), step=s)["lr"] for s in range(5)]
    assert lrs == pytest.approx([5e-3, 1e-2, 1e-2, 5e-3, 0.0])
    assert b.optimizer.param_groups[0]["lr"] == 0.0
