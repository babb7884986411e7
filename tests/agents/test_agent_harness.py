"""The harness over a real HTTP session server whose policy replays a script (the tiny model cannot fix bugs)."""

import threading
import time
from pathlib import Path

import httpx
import pytest

from miles.agents.harness import Harness
from miles.agents.harness import create_app as harness_app
from miles.agents.launcher import ThreadServer, free_port_range
from miles.agents.policy import Completion
from miles.agents.run_token import new_token, token_headers
from miles.agents.session_server import SessionServer
from miles.agents.session_server import create_app as session_app
from miles.agents.swe_tasks import make_task
from miles.agents.tool_calls import format_tool_call
from miles.model.tokenizer import ByteTokenizer

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)


class ScriptedPolicy:
    """Answers each generate call with the next scripted text (a callable step runs first, then answers)."""

    def __init__(self):
        self.tok, self.script, self.lock = ByteTokenizer(), [], threading.Lock()

    def generate(self, rid, input_ids, sampling):
        with self.lock:
            step = self.script.pop(0) if self.script else "no more script"
        if callable(step):
            step = step()
        ids = self.tok.encode(step) + [self.tok.im_end_id]
        return Completion(output_ids=ids, output_log_probs=[-0.1] * len(ids), finish_reason="stop", weight_version=0)

    def abort(self, rids):
        pass


TOKEN = new_token()
AUTH = token_headers(TOKEN)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    port = free_port_range(3)
    policy = ScriptedPolicy()
    app = session_app(SessionServer(policy, policy.tok, instance_id="agent-a"), token=TOKEN)
    sessions = ThreadServer(app, port=port).start()
    instances = {"agent-a": sessions.url, "agent-b": sessions.url, "agent-dead": f"http://127.0.0.1:{port + 2}"}
    harness = Harness(tmp_path_factory.mktemp("sandboxes"), instances=instances, token=TOKEN)
    hs = ThreadServer(harness_app(harness), port=port + 1).start()
    yield policy, sessions.url, hs.url, harness
    hs.stop()
    sessions.stop()


def _run(hs_url, n=1, instance="agent-a", **spec):
    eps = [
        {
            "episode_id": f"ep{time.monotonic_ns()}-{i}",
            "instance_id": instance,
            "task_seed": 7,
            "max_turns": 3,
            "timeout_s": 30,
            **spec,
        }
        for i in range(n)
    ]
    r = httpx.post(f"{hs_url}/episodes", json={"episodes": eps}, headers=AUTH)
    assert r.status_code == 200, r.text
    return [e["episode_id"] for e in eps]


def _results(hs_url, ids, timeout_s=20.0):
    got, cursor, deadline = {}, 0, time.monotonic() + timeout_s
    while set(ids) - set(got) and time.monotonic() < deadline:
        body = httpx.get(f"{hs_url}/results", params={"cursor": cursor, "wait_s": 1}, timeout=5, headers=AUTH).json()
        cursor = body["cursor"]
        got |= {r["episode_id"]: r for r in body["results"] if r["episode_id"] in ids}
    assert not set(ids) - set(got), f"episodes {set(ids) - set(got)} did not finish in {timeout_s} s"
    return [got[i] for i in ids]


def test_an_agent_that_applies_the_fix_gets_reward_one_and_leaves_no_sandbox(stack):
    policy, s_url, h_url, harness = stack
    path, old, new = make_task(7).fix
    script = [
        format_tool_call("read_file", path=path),
        format_tool_call("edit_file", path=path, old=old, new=new),
        format_tool_call("run_test"),
        format_tool_call("submit"),
    ]
    policy.script = list(script)
    [r] = _results(h_url, _run(h_url, max_turns=6))
    assert (r["status"], r["reward"], r["passed"], r["num_tool_calls"], r["num_malformed"]) == (
        "completed",
        1.0,
        True,
        4,
        0,
    )
    assert old in r["transcript"][3]["content"] and r["transcript"][-1]["content"] == "submitted"
    assert r["transcript"][4]["tool_calls"][0]["function"]["name"] == "edit_file"
    rec = r["record"]
    assert rec["num_turns"] == 4 and sum(rec["loss_mask"]) == sum(len(policy.tok.encode(s)) + 1 for s in script)
    assert harness.sandboxes() == []


def test_malformed_tool_calls_cost_turns_and_end_with_zero_reward(stack):
    policy, s_url, h_url, harness = stack
    policy.script = ["\x01garbage", "<tool>{not json", format_tool_call("read_file", path="../../etc/passwd")]
    [r] = _results(h_url, _run(h_url, max_turns=3))
    assert (r["status"], r["reward"], r["num_turns"], r["num_malformed"], r["num_tool_calls"]) == (
        "completed",
        0.0,
        3,
        2,
        1,
    )
    assert "not JSON after <tool>" in r["transcript"][5]["content"]
    assert "outside the repository" in r["transcript"][-1]["content"]
    assert harness.sandboxes() == []


def test_an_episode_whose_sandbox_is_destroyed_mid_episode_is_a_zero_reward_error(stack):
    policy, s_url, h_url, harness = stack

    def destroy():
        for box in Path(harness.root).iterdir():
            for f in box.iterdir():
                f.unlink()
        return format_tool_call("list_files")

    policy.script = [destroy]
    [r] = _results(h_url, _run(h_url, max_turns=1))
    assert r["status"] == "error" and r["reward"] == 0.0 and "cannot be scored" in r["error"]


def test_an_unreachable_session_server_is_a_zero_reward_error_not_a_hang(stack):
    _, _, h_url, _ = stack
    [r] = _results(h_url, _run(h_url, instance="agent-dead"))
    assert r["status"] == "error" and r["reward"] == 0.0 and "ConnectError" in r["error"]


def test_flush_cancels_only_that_instances_episodes_kills_their_tests_and_removes_their_sandboxes(stack):
    policy, s_url, h_url, harness = stack
    policy.script = [format_tool_call("run_test")] * 2
    a = _run(h_url, instance="agent-a", slow_s=30, max_turns=1)
    b = _run(h_url, instance="agent-b", slow_s=30, max_turns=1)
    deadline = time.monotonic() + 10
    while len(harness.procs) < 2 and time.monotonic() < deadline:  # both tests are running
        time.sleep(0.05)
    pids = {eid: p.pid for eid, p in harness.procs.items()}
    t0 = time.monotonic()
    out = httpx.post(f"{h_url}/flush", json={"instance_id": "agent-a"}, timeout=10, headers=AUTH).json()
    assert (
        time.monotonic() - t0 < 5
        and out["cancelled"] == 1
        and out["still_running"] == []
        and out["sandboxes_left"] == []
    )
    assert set(httpx.get(f"{h_url}/episodes", headers=AUTH).json()) == set(b) and harness.sandboxes() == b
    assert not Path(f"/proc/{pids[a[0]]}").exists() or "Z" in Path(f"/proc/{pids[a[0]]}/stat").read_text().split()[2]
    [r] = _results(h_url, a, timeout_s=5)
    assert r["status"] == "cancelled" and r["reward"] == 0.0 and "flushed with instance agent-a" in r["error"]
    httpx.post(f"{h_url}/flush", json={"instance_id": "agent-b"}, timeout=10, headers=AUTH)
    assert httpx.get(f"{h_url}/episodes", headers=AUTH).json() == {} and harness.sandboxes() == []


def test_a_bad_episode_spec_is_a_400_that_names_the_field(stack):
    _, _, h_url, _ = stack
    r = httpx.post(
        f"{h_url}/episodes",
        json={"episodes": [{"episode_id": "x", "instance_id": "agent-a", "bogus": 1}]},
        headers=AUTH,
    )
    assert r.status_code == 400 and "unknown episode field(s) ['bogus']" in r.text


def test_an_unknown_session_id_over_http_is_a_404_in_openai_error_shape(stack):
    _, s_url, _, _ = stack
    msg = {"messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(f"{s_url}/sessions/nope/v1/chat/completions", json=msg, headers=AUTH)
    err = r.json()["error"]
    assert (
        r.status_code == 404 and err["code"] == "unknown_session" and "create one with POST /sessions" in err["message"]
    )
    r = httpx.post(f"{s_url}/v1/chat/completions", json=msg, headers=AUTH)
    assert r.status_code == 400 and "needs 'session_id' in the body" in r.json()["error"]["message"]
