"""RolloutManager with rollout.engine=http drives `miles serve` processes (a Router over two) through the same code
path as in-process engines, and gives the same samples, bytes and weights (no Ray: the manager runs here)."""

from __future__ import annotations

import pytest
import torch

from miles.rollout.manager import RolloutManager
from miles.rollout.router import Router
from miles.sources import make_sources
from miles.sync.tensor import TensorSync
from tests.conftest import tiny_run_cfg

pytestmark = [pytest.mark.procs, pytest.mark.timeout(180)]  # procs: it starts processes or servers


def test_http_rollout_matches_the_embedded_reference(tmp_path):
    embedded = RolloutManager(tiny_run_cfg(tmp_path, "rollout.num_engines=2"), sources=make_sources)
    http_cfg = tiny_run_cfg(tmp_path, "rollout.num_engines=2", "rollout.engine=http")
    http = RolloutManager(http_cfg, sources=make_sources)
    try:
        assert len(http.engines) == 1 and isinstance(http.engines[0], Router)
        for step in range(2):
            (b_emb,), m_emb = embedded.generate(step)
            (b_http,), m_http = http.generate(step)
            assert [s.response_ids for s in http.last_samples] == [s.response_ids for s in embedded.last_samples]
            torch.testing.assert_close(b_http.rollout_log_probs, b_emb.rollout_log_probs, atol=1e-6, rtol=0)
            assert m_http["reward"] == m_emb["reward"] and m_http["weight_version"] == step
            named = {k: v + 0.01 * (step + 1) for k, v in embedded.named_weights().items()}  # "trained" weights
            tags = ["cuda_graph", "kv_cache", "weights"]
            assert http.offload(tags) == embedded.offload(tags) > 0  # the same bytes leave both fleets
            assert http.onload(tags) == embedded.onload(tags) > 0  # weights come back empty (discarded): sync next
            for m in (embedded, http):  # what a train actor's TensorSync does: pause, buckets by handle, version
                sync = TensorSync(http_cfg.sync, "cpu")
                sync.connect([m])
                sync.update(named.items(), version=step + 1)
                sync.close()
            got = http.named_weights()
            assert all(torch.equal(got[k], v) for k, v in named.items()) and http.weight_versions() == [step + 1]
        events, _ = http.drain_ledger()
        assert {(e.owner, e.tag) for e in events} >= {("engine/0", "kv_cache"), ("engine/1", "weights")}
    finally:
        for e in http.engines:
            e.close()
