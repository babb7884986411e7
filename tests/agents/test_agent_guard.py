"""The review's attacks on the agent servers (2026-12-04, A1-A7), replayed as it ran them: a real harness process
and a real session-server process started the way a user starts them (the run token in the environment), and
requests from another local client that does not hold the token, sends a foreign Host or Origin, or names a path
or a server of its choosing. Nothing may be deleted, no code may run, no transcript may be read, no rollout fenced.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request

from miles.agents.launcher import ThreadServer, wait_ready
from miles.agents.run_token import TOKEN_ENV, new_token, token_headers
from miles.agents.swe_tasks import make_task
from miles.agents.tool_calls import format_tool_call, parse_tool_calls
from miles.ports import free_ports

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]  # procs: it starts processes or servers
TOKEN = new_token()
AUTH = token_headers(TOKEN)
TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
JSON = {"Content-Type": "application/json"}


def _start(module: str, port: int, log: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, TOKEN_ENV: TOKEN, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", module, "--port", str(port), *args]
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """``python -m miles.agents.harness --port P --root R`` and ``python -m miles.agents.session_server --port Q``
    (the review's commands), each with $MILES_AGENT_TOKEN set as a launcher sets it."""
    d = tmp_path_factory.mktemp("agent_guard")
    port = free_ports(2)
    harness = _start("miles.agents.harness", port, d / "harness.log", "--root", str(d / "root"))
    session = _start(
        "miles.agents.session_server",
        port + 1,
        d / "session.log",
        *("--model-json", json.dumps(TINY), "--max-seq-len", "256"),
    )
    try:
        h_url, s_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"
        wait_ready(h_url, 60, harness, d / "harness.log")
        wait_ready(s_url, 90, session, d / "session.log")
        yield h_url, s_url, d
    finally:
        for p in (harness, session):
            p.kill()
            p.wait(timeout=10)


class FakeModel:
    """A "session server" that a hostile caller controls: its replies are tool calls that make the sandbox's test
    write a marker file, then run the test (the review's A2)."""

    def __init__(self, marker: Path, task_seed: int):
        task = make_task(task_seed)
        head = task.files[task.test_file][:12]
        payload = f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')\n{head}"
        self.script = [
            format_tool_call("edit_file", path=task.test_file, old=head, new=payload),
            format_tool_call("run_test"),
            format_tool_call("submit"),
        ]
        self.requests = 0
        self.app = FastAPI()

        @self.app.post("/sessions")
        async def open_session(request: Request):
            self.requests += 1
            return {"session_id": "s"}

        @self.app.post("/sessions/s/v1/chat/completions")
        async def chat(request: Request):
            self.requests += 1
            text = self.script.pop(0) if self.script else format_tool_call("submit")
            calls, _ = parse_tool_calls(text)
            return {"choices": [{"message": {"role": "assistant", "content": "", "tool_calls": calls}}]}

        @self.app.delete("/sessions/s")
        async def close(request: Request):
            self.requests += 1
            return {}


def test_an_absolute_dotted_or_linked_episode_id_deletes_nothing_outside_the_root(servers):
    """A1: ``episode_id`` was joined to the root as a path and the result rmtree'd on the error path."""
    h_url, _, d = servers
    victim = d / "victim_dir"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep")
    (d / "root").mkdir(exist_ok=True)
    (d / "root" / "link").symlink_to(victim)
    review = {"episodes": [{"episode_id": str(victim), "instance_id": "x", "session_url": "http://127.0.0.1:1"}]}
    as_review = httpx.post(f"{h_url}/episodes", json=review)  # the review's request: no token
    bad_ids = [str(victim), f"../{victim.name}", "../../victim_dir", "..", ".", "a/b", "", "x" * 129, 5, "link"]
    with_token = {
        eid: httpx.post(f"{h_url}/episodes", json={"episodes": [{"episode_id": eid, "instance_id": "x"}]}, headers=AUTH)
        for eid in bad_ids
    }
    time.sleep(2.5)  # the review saw the victim gone 2 s after its POST
    assert (victim / "precious.txt").read_text() == "keep", "a directory outside the harness root was deleted"
    assert (d / "root" / "link").is_symlink()
    assert as_review.status_code == 401, as_review.text
    for eid, r in with_token.items():
        assert r.status_code == 400 and ("must be a name" in r.text or "not directly under" in r.text), (eid, r.text)


def test_a_caller_cannot_point_the_harness_at_a_model_of_its_choosing(servers):
    """A2: ``session_url`` came from the request, so the caller's fake model ran code through edit_file + run_test."""
    h_url, _, d = servers
    marker = d / "code_ran.txt"
    fake = FakeModel(marker, task_seed=3)
    server = ThreadServer(fake.app, port=free_ports(1)).start()
    try:
        episode = {"episode_id": "attack", "instance_id": "x", "session_url": server.url, "task_seed": 3}
        as_review = httpx.post(f"{h_url}/episodes", json={"episodes": [episode]})
        with_token = httpx.post(f"{h_url}/episodes", json={"episodes": [episode]}, headers=AUTH)
        unknown = httpx.post(
            f"{h_url}/episodes", json={"episodes": [{"episode_id": "a2", "instance_id": server.url}]}, headers=AUTH
        )
        time.sleep(3.0)  # the review's episode edited, ran and wrote its marker within a second
    finally:
        server.stop()
    assert not marker.exists(), "the caller's model ran code through the harness"
    assert fake.requests == 0
    assert as_review.status_code == 401, as_review.text
    assert with_token.status_code == 400 and "session_url is not accepted" in with_token.text
    assert unknown.status_code == 400 and "not instances of this harness" in unknown.text


def test_the_harness_answers_only_its_token_on_its_own_host_and_json_bodies(servers):
    """A3 (no Host check, no key) and A4 (text/plain bodies)."""
    h_url, _, _ = servers
    body = json.dumps({"episodes": []})
    cases = {
        "foreign Host, with the token": (httpx.post(f"{h_url}/episodes", content=body, headers={**AUTH, **JSON, "Host": "attacker.example"}), 400),
        "cross-site Origin": (httpx.post(f"{h_url}/episodes", content=body, headers={**AUTH, **JSON, "Origin": "http://attacker.example"}), 403),
        "text/plain": (httpx.post(f"{h_url}/episodes", content=body, headers={**AUTH, "Content-Type": "text/plain"}), 415),
        "no token": (httpx.post(f"{h_url}/episodes", content=body, headers=JSON), 401),
        "wrong token": (httpx.post(f"{h_url}/episodes", content=body, headers={**JSON, **token_headers("guess")}), 401),
        "results without token": (httpx.get(f"{h_url}/results"), 401),
        "flush without token": (httpx.post(f"{h_url}/flush", json={"instance_id": "x"}), 401),
        "sandboxes without token": (httpx.get(f"{h_url}/sandboxes"), 401),
        "the token": (httpx.post(f"{h_url}/episodes", content=body, headers={**AUTH, **JSON}), 200),
        "the token, lower-case scheme": (httpx.get(f"{h_url}/episodes", headers={"Authorization": f"bearer {TOKEN}"}), 200),
        "health, no token": (httpx.get(f"{h_url}/health"), 200),
    }  # fmt: skip
    for what, (r, status) in cases.items():
        assert r.status_code == status, (what, r.status_code, r.text[:200])
    assert "run token" in cases["no token"][0].text


def test_a_session_server_keeps_its_transcripts_sessions_and_fences_from_anyone_without_the_token(servers):
    """A5 (read transcripts with a foreign Host/Origin), A6 (flush fences a live rollout), A7 (fill the cap)."""
    _, s_url, _ = servers
    meta = {"metadata": {"rollout": "r", "step": 1}}
    sid = httpx.post(f"{s_url}/sessions", json=meta, headers=AUTH).json()["session_id"]
    turn = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert (
        httpx.post(f"{s_url}/sessions/{sid}/v1/chat/completions", json=turn, headers=AUTH, timeout=60).status_code
        == 200
    )
    foreign = {**AUTH, "Host": "attacker.example"}
    refused = {
        "open, foreign Host": (httpx.post(f"{s_url}/sessions", json=meta, headers=foreign), 400),
        "open, cross-site Origin": (httpx.post(f"{s_url}/sessions", json=meta, headers={**AUTH, "Origin": "http://attacker.example"}), 403),
        "chat, foreign Host": (httpx.post(f"{s_url}/sessions/{sid}/v1/chat/completions", json=turn, headers=foreign), 400),
        "transcript, foreign Host": (httpx.get(f"{s_url}/sessions/{sid}", headers=foreign), 400),
        "transcript, no token": (httpx.get(f"{s_url}/sessions/{sid}"), 401),
        "chat, no token": (httpx.post(f"{s_url}/sessions/{sid}/v1/chat/completions", json=turn), 401),
        "delete, no token": (httpx.delete(f"{s_url}/sessions/{sid}"), 401),
        "flush fence, no token": (httpx.post(f"{s_url}/flush", json={"rollout": "r", "step": 10**9}), 401),
        "text/plain": (httpx.post(f"{s_url}/sessions", content=b"{}", headers={**AUTH, "Content-Type": "text/plain"}), 415),
    }  # fmt: skip
    for what, (r, status) in refused.items():
        assert r.status_code == status and "token_ids" not in r.text, (what, r.status_code, r.text[:200])
    floods = [httpx.post(f"{s_url}/sessions", json={}).status_code for _ in range(50)]
    assert set(floods) == {401}
    assert httpx.get(f"{s_url}/health").json()["sessions"] == 1  # only the run's own session is open
    late = httpx.post(f"{s_url}/sessions", json={"metadata": {"rollout": "r", "step": 5}}, headers=AUTH)
    assert late.status_code == 200, late.text  # no fence was set by the unauthenticated flush
    record = httpx.get(f"{s_url}/sessions/{sid}", headers=AUTH).json()
    assert record["num_turns"] == 1 and not record["aborted"]
