"""The RL loop with rollout.engine=http (engines in `miles serve` processes behind the router), and the launch
path of a real SGLang server (skipped where sglang is not installed: it needs a CUDA build)."""

from __future__ import annotations

import json

import pytest

from miles.driver import train
from miles.rollout.launch import launch_sglang, sglang_available
from tests.conftest import tiny_run_cfg

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)


@pytest.mark.timeout(240)
def test_the_rl_loop_runs_over_http_engines_behind_a_router_with_check_weights(tmp_path, ray_session):
    cfg = tiny_run_cfg(
        tmp_path,
        "rollout.engine=http",
        "rollout.num_engines=2",
        "sync.check_weights=true",
        "num_steps=2",
        "dump_rollouts=false",
    )
    rows = train(cfg, progress=False)  # check_weights raises if an engine's weights differ from the trainer's
    assert [r["step"] for r in rows] == [0, 1] and [r["weight_version"] for r in rows] == [0, 1]
    assert all(r["sync/bytes"] > 0 for r in rows)
    ledger = [json.loads(line) for line in open(tmp_path / "run" / "ledger.jsonl")]
    owners = {e["owner"] for e in ledger if e.get("tag") in ("weights", "kv_cache")}
    assert {"engine/0", "engine/1"} <= owners  # the servers' memory moves reach the run's ledger


@pytest.mark.skipif(sglang_available(), reason="sglang is installed; the launch test below runs instead")
def test_launching_real_sglang_without_it_says_how_to_install_it():
    with pytest.raises(ImportError, match=r"pip install 'miles\[sglang\]'"):
        launch_sglang("/nonexistent")


@pytest.mark.gpu
@pytest.mark.skipif(not sglang_available(), reason="needs sglang (a CUDA build): pip install 'miles[sglang]'")
def test_a_real_sglang_server_generates_and_releases_memory_through_the_client(tmp_path):
    import os

    from miles.protocols.engine import GenerateRequest, SamplingParams

    model = os.environ.get("MILES_SGLANG_TEST_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
    client = launch_sglang(model, log_path=str(tmp_path / "sglang.log"))
    try:
        out = client.generate(
            [GenerateRequest(rid="0", input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=4))]
        )
        assert len(out[0].output_ids) == 4 and len(out[0].output_log_probs) == 4
        client.offload(["kv_cache", "weights"])
        client.onload(["kv_cache", "weights"])
        client.set_weight_version(3)
        assert client.weight_version == 3
    finally:
        client.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("num_engines", [1, 2])
def test_broadcast_reaches_every_http_engine_server(tmp_path, ray_session, num_engines):
    """Each server process joins the gloo group at its own rank (1, 2) and receives every tensor: a rank given
    twice or a server left out would stop the group from forming, and check_weights compares a server's weights
    with the trainer's after every sync."""
    cfg = tiny_run_cfg(
        tmp_path,
        "rollout.engine=http",
        f"rollout.num_engines={num_engines}",
        "sync.transport=broadcast",
        "sync.check_weights=true",
        "num_steps=2",
        "dump_rollouts=false",
    )
    rows = train(cfg, progress=False)
    assert [r["weight_version"] for r in rows] == [0, 1]
    assert all(r["engines/live"] == num_engines for r in rows)
