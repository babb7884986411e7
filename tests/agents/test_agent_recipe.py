"""The agent_swe recipe's rollout feeds the trainer: a RolloutManager's engine served as two session-server
instances (threads), a harness process, one kept step, one train step on the exact session tokens."""

import json
import math

import pytest

from miles.agents.launcher import free_port_range
from miles.config import apply_overrides
from miles.recipes import get_recipe
from miles.rollout.manager import RolloutManager
from miles.sources import make_sources
from miles.train.torch_backend import TorchBackend

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)


@pytest.mark.timeout(80)
def test_agent_swe_recipe_rolls_out_flushes_both_instances_and_trains_one_step(tmp_path):
    base = free_port_range(2)
    cfg = apply_overrides(
        get_recipe("agent_swe"),
        [
            f"agents.session_ports={base}-{base + 1}",
            f"run_dir={tmp_path / 'run'}",
            "model.hidden_size=32",
            "model.intermediate_size=64",
            "rollout.num_prompts_per_step=2",
            "rollout.n_samples_per_prompt=2",
            "agents.max_turns=2",
            "agents.max_tokens_per_turn=8",
            "agents.oversample_factor=2",
            "num_threads=1",
        ],
    )
    manager = RolloutManager(cfg, "cpu", sources=make_sources)
    try:
        batches, metrics = manager.generate(step=0)
    finally:
        manager.close()
    [batch] = batches
    assert batch.tokens.shape[0] == 4 and metrics["agent/groups_kept"] == 2 and metrics["flush/instances"] == 2
    assert metrics[f"flush/agent-{base}/ok"] == 1.0 and metrics[f"flush/agent-{base + 1}/ok"] == 1.0
    for s in manager.last_samples:  # the policy's tokens carry its log-probs; template and tool text carry none
        mask = s.metadata["loss_mask"]
        assert len(mask) == len(s.response_ids) == len(s.rollout_log_probs) and mask[0] == 1
        assert all(lp == 0.0 for lp, m in zip(s.rollout_log_probs, mask) if not m)
    by_index = {s.index: s for s in manager.last_samples}
    for row, idx in enumerate(batch.sample_index):  # only what the policy sampled is trained on
        assert (
            batch.loss_mask[row].sum().item()
            == sum(by_index[idx].metadata["loss_mask"])
            < len(by_index[idx].response_ids)
        )
    rows = [json.loads(line) for line in (tmp_path / "run" / "agent_episodes.jsonl").read_text().splitlines()]
    assert (
        len(rows) == 8
        and sum(r["kept"] for r in rows) == 4
        and {"num_turns", "num_malformed", "reward"} <= set(rows[0])
    )
    out = TorchBackend(cfg.model, cfg.trainer).train_step(batch)
    assert math.isfinite(out["loss"])
