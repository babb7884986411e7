"""The RL loop with rollout.engine=sglang, served by the stand-in launcher (`miles serve` launched with SGLang's
argv, since real SGLang needs a CUDA build), and a killed server restarted by the router while its manager
keeps generating."""

from __future__ import annotations

import time

import pytest

from miles.driver import train
from tests.conftest import tiny_run_cfg

STANDIN = ("rollout.engine=sglang", "rollout.sglang_launcher=miles-serve")


@pytest.mark.timeout(300)
def test_the_loop_runs_over_two_launched_sglang_engines_with_every_sync_checked_bit_for_bit(tmp_path, ray_session):
    cfg = tiny_run_cfg(tmp_path, *STANDIN, "rollout.num_engines=2", "sync.check_weights=true", "dump_rollouts=false")
    rows = train(cfg, progress=False)  # check_weights raises if a server's weights differ from the trainer's
    assert [r["step"] for r in rows] == [0, 1] and [r["weight_version"] for r in rows] == [0, 1]
    assert all(r["sync/bytes"] > 0 and 0.0 <= r["reward"] <= 1.0 for r in rows)


@pytest.mark.timeout(240)
def test_a_killed_sglang_server_is_restarted_while_the_manager_keeps_generating(tmp_path):
    from miles.rollout.manager import RolloutManager

    cfg = tiny_run_cfg(tmp_path, *STANDIN, "rollout.num_engines=2", "rollout.max_batch_size=32")
    manager = RolloutManager(cfg, device="cpu")
    try:
        (router,) = manager.engines
        manager.set_weight_version(0)
        victim = router.clients[0].process
        old_pid = victim.pid
        victim.kill()
        batches, _ = manager.generate(0)  # served by the survivor (the router retries elsewhere)
        assert sum(len(b.sample_index) for b in batches) == 16  # 4 prompts x 4 samples, none lost
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (victim.alive and victim.pid != old_pid and all(router.alive)):
            time.sleep(0.5)
        assert victim.alive and victim.pid != old_pid and all(router.alive), router.events
        assert [e[1] for e in router.events if e[2] == 0][-1] == "recovered"
    finally:
        manager.close()
    assert not any(c.process.alive for c in router.clients)  # close stops what the manager launched
