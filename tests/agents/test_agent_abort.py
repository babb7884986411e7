"""Abort with real processes: N session-server processes on a port range, one harness process.

Episodes have a CPU-side long tail (some tests sleep 30 s); a rollout must keep its groups, flush every
instance, and leave no episode running and no sandbox behind, whatever the number of instances.
"""

import json
import signal
import threading
import time

import httpx
import pytest

from miles.agents.launcher import AgentProcesses, free_port_range
from miles.agents.rollout import AgentRollout
from miles.config import AgentConfig, RunConfig, apply_overrides

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)

TINY = json.dumps(
    dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
)
SLOW_S = 30.0


@pytest.fixture(scope="module")
def procs():
    base = free_port_range(6)
    with AgentProcesses.start(
        ports=[base + i for i in range(4)], harness_port=base + 4, model_json=TINY, max_seq_len=1024, timeout_s=80
    ) as p:
        p.base = base
        yield p


def _cfg(spec: str, **kw) -> AgentConfig:
    base = dict(
        session_ports=spec,
        oversample_factor=3,
        max_turns=1,
        max_tokens_per_turn=8,
        slow_test_fraction=0.2,
        slow_test_s=SLOW_S,
        flush_timeout_s=3.0,
        flush_retries=1,
        episode_timeout_s=60,
        test_timeout_s=40,
    )
    return AgentConfig(**(base | kw))


def _assert_nothing_left(procs, ports):
    h = procs.harness_url
    assert httpx.get(f"{h}/episodes", headers=procs.headers).json() == {}, "an episode is still running on the harness"
    assert httpx.get(f"{h}/sandboxes", headers=procs.headers).json()["sandboxes"] == [], "a sandbox was left behind"
    for port in ports:
        health = httpx.get(f"http://127.0.0.1:{port}/health").json()
        assert (health["running"], health["sessions"]) == (0, 0), f"instance on port {port}: {health}"


def test_one_port_and_a_port_range_give_the_plural_instance_map():
    assert AgentConfig(session_ports="8100").instances == {8100: "agent-8100"}
    assert list(AgentConfig(session_ports="8100-8103").instances.values()) == [f"agent-{p}" for p in range(8100, 8104)]
    cfg = apply_overrides(RunConfig(), ["agents.session_ports=9000-9001"])
    assert RunConfig.from_dict(cfg.to_dict()).agents.instances == {9000: "agent-9000", 9001: "agent-9001"}
    with pytest.raises(ValueError, match="should be one port .'8100'. or a range .'8100-8103'."):
        AgentConfig(session_ports="8100:8103")
    with pytest.raises(ValueError, match="need 1 <= first <= last <= 65535"):
        AgentConfig(session_ports="8103-8100")
    with pytest.raises(ValueError, match="agents.session_ports is empty"):
        AgentRollout(AgentConfig(), harness_url="http://127.0.0.1:1", token="t", num_groups=1, group_size=1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_instances", [1, 2, 4])
def test_after_an_abort_no_episode_runs_on_any_instance_and_no_sandbox_is_left(procs, num_instances):
    ports = [procs.base + i for i in range(num_instances)]
    spec = str(ports[0]) if num_instances == 1 else f"{ports[0]}-{ports[-1]}"
    rollout = AgentRollout(
        _cfg(spec), harness_url=procs.harness_url, token=procs.token, num_groups=2, group_size=2, seed=num_instances
    )
    step = rollout.collect(step=0)
    m = step.metrics
    assert len(step.groups) == 2 and all(len(g) == 2 for g in step.groups)
    assert {f.instance_id for f in step.flush} == {f"agent-{p}" for p in ports} and m["flush/ok"] == num_instances
    assert m["time/agent_rollout"] < SLOW_S / 2, f"the rollout waited for the tail: {m}"
    assert m.get("agent/episodes_cancelled", 0) + m.get("agent/episodes_aborted", 0) >= 1, m
    assert m["agent/buffer_groups"] == 4 and m["agent/episodes_unreported"] == 0
    _assert_nothing_left(procs, ports)


@pytest.mark.timeout(60)
def test_the_flush_of_a_hung_instance_fails_alone_and_the_others_are_flushed_within_the_timeout(procs):
    ports = [procs.base + i for i in range(4)]
    procs.signal_instance(ports[-1], signal.SIGSTOP)
    try:
        cfg = _cfg(f"{ports[0]}-{ports[-1]}", flush_timeout_s=1.0, flush_retries=1)
        rollout = AgentRollout(
            cfg, harness_url=procs.harness_url, token=procs.token, num_groups=2, group_size=2, seed=5
        )
        step = rollout.collect(step=0)
    finally:
        procs.signal_instance(ports[-1], signal.SIGCONT)
    by_id = {f.instance_id: f for f in step.flush}
    bad = by_id.pop(f"agent-{ports[-1]}")
    assert not bad.ok and bad.attempts == 2 and "Timeout" in bad.error and bad.harness["still_running"] == []
    assert all(f.ok and f.seconds < cfg.flush_timeout_s for f in by_id.values()), by_id
    assert step.metrics["flush/failed_instances"] == f"agent-{ports[-1]}" and step.metrics["flush/ok"] == 3
    assert step.metrics["time/agent_flush"] < 2 * 2 * cfg.flush_timeout_s + 2
    _assert_nothing_left(procs, ports)


@pytest.mark.timeout(60)
def test_a_harness_that_crashes_mid_episode_gives_zero_reward_samples_and_a_reported_error(procs):
    ports = [procs.base, procs.base + 1]
    instances = {f"agent-{p}": url for p, url in procs.session_urls.items()}
    with AgentProcesses.start(
        ports=[], harness_port=procs.base + 5, token=procs.token, instances=instances
    ) as crashing:
        cfg = _cfg(f"{ports[0]}-{ports[1]}", slow_test_fraction=1.0, slow_test_s=5.0)
        rollout = AgentRollout(cfg, harness_url=crashing.harness_url, token=procs.token, num_groups=2, group_size=2)
        threading.Timer(1.0, crashing.kill_harness).start()
        t0 = time.monotonic()
        step = rollout.collect(step=0)
    assert time.monotonic() - t0 < 20
    assert "the harness stopped answering" in step.metrics["agent/harness_error"]
    assert [r["status"] for g in step.groups for r in g] == ["lost"] * 4 and step.metrics["agent/reward"] == 0.0
    assert step.metrics["flush/failed"] == 2 and "harness" in step.flush[0].error
    for port in ports:  # the session side was still flushed
        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["sessions"] == 0


def test_the_launcher_hands_its_token_to_every_process_outside_argv_and_they_require_it(procs):
    pids = [p.pid for p in procs.procs] + [procs.harness.pid]
    for pid in pids:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().decode()
        assert procs.token not in argv and len(procs.token) >= 40, argv
    urls = [procs.harness_url + "/episodes"] + [f"{url}/v1/models" for url in procs.session_urls.values()]
    for url in urls:
        assert httpx.get(url).status_code == 401 and httpx.get(url, headers=procs.headers).status_code == 200, url
