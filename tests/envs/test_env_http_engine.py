"""Environment episodes through `miles serve` over HTTP (the SGLang client, the same engine protocol as SGLang):
every sampled token's log-prob, recomputed by the same model over the whole multi-turn trajectory, is the one the
server reported: the trajectory is exactly the sequence the engine conditioned on, turn after turn."""

from __future__ import annotations

import json

import pytest
import torch

from miles.config import apply_overrides
from miles.policy.logprob import log_probs_and_entropy
from miles.recipes import quickstart
from miles.rollout.engine import EmbeddedEngine
from miles.rollout.manager import RolloutManager
from miles.sources import make_sources

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)


@pytest.mark.timeout(300)
def test_multi_turn_episodes_over_http_keep_the_exact_tokens_the_engine_sampled_from(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"say hi {i}", "answer": "hi"}) + "\n" for i in range(2)))
    cfg = apply_overrides(
        quickstart(),
        [
            "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
            "model.max_position_embeddings=256", "rollout.max_seq_len=256", "rollout.max_batch_size=8",
            "rollout.max_new_tokens=6", "rollout.num_prompts_per_step=2", "rollout.n_samples_per_prompt=2",
            "rollout.engine=http", "num_threads=1", "env.name=faulty_envs:TwoTurnEnv", 'env.args={"turns": 3}',
            f"data.train={path}", f"run_dir={tmp_path / 'run'}",
        ],
    )  # fmt: skip
    m = RolloutManager(cfg, "cpu", sources=make_sources)
    try:
        _, metrics = m.generate(0)
    finally:
        m.close()
    assert metrics["env/episodes_done"] == 4 and metrics["env/turns"] == 3
    model = EmbeddedEngine.from_config(cfg, "cpu").model  # same config and seed: the served engine's weights
    for s in m.last_samples:
        seq = torch.tensor(s.tokens)
        with torch.no_grad():
            ref, _ = log_probs_and_entropy(model(seq[None])[0, :-1], seq[1:])
        p = len(s.prompt_ids)
        mask = torch.tensor(s.metadata["loss_mask"], dtype=torch.bool)
        assert int(mask.sum()) >= 3 and int((~mask).sum()) > 0  # three sampled turns, two env turns between them
        torch.testing.assert_close(torch.tensor(s.rollout_log_probs)[mask], ref[p - 1 :][mask], atol=1e-4, rtol=0)
