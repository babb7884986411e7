"""A real RL run (Ray actors, weight sync every step) with true_on_policy: the mismatch metrics read exactly 0.0 in
metrics.jsonl at every step, and are not 0.0 with the standard kernels."""

import json

from miles.driver import train
from tests.conftest import tiny_run_cfg

QUICKSTART_SHAPE = [
    "model.hidden_size=128",
    "model.intermediate_size=384",
    "model.num_hidden_layers=4",
    "rollout.num_prompts_per_step=8",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=8",
    "rollout.max_batch_size=24",  # 32 rows through 24 slots
    "num_steps=3",
]


def _rl_rows(cfg):
    return [r for r in (json.loads(line) for line in open(f"{cfg.run_dir}/metrics.jsonl")) if "step" in r]


def test_rl_steps_with_true_on_policy_read_zero_mismatch_in_metrics_jsonl(tmp_path, ray_session):
    cfg = tiny_run_cfg(tmp_path / "on", *QUICKSTART_SHAPE, "true_on_policy=true")
    train(cfg, progress=False)
    rows = _rl_rows(cfg)
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["weight_version"] == r["step"] for r in rows)
    for r in rows:
        assert r["train_rollout_logprob_max_abs_diff"] == 0.0
        assert r["train_rollout_logprob_abs_diff"] == 0.0 and r["train_rollout_kl"] == 0.0


def test_the_same_run_with_the_standard_kernels_reads_a_nonzero_max(tmp_path, ray_session):
    cfg = tiny_run_cfg(tmp_path / "off", *QUICKSTART_SHAPE, "num_steps=1")
    train(cfg, progress=False)
    (row,) = _rl_rows(cfg)
    assert row["train_rollout_logprob_max_abs_diff"] > 0.0
