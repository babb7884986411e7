"""The session server over SGLang's HTTP contract: `miles serve` as the engine, HttpPolicy as the client."""

import threading
import time

import pytest
import torch

from miles.agents.policy import HttpPolicy
from miles.agents.session_server import SessionError, SessionServer
from miles.model.tokenizer import ByteTokenizer
from miles.policy.logprob import log_probs_and_entropy
from miles.rollout.engine import EmbeddedEngine
from miles.rollout.launch import spawn_miles_servers
from tests.conftest import tiny_run_cfg

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)


@pytest.mark.timeout(80)
def test_sessions_over_http_keep_exact_tokens_and_a_flush_aborts_the_in_flight_turn(tmp_path):
    cfg = tiny_run_cfg(
        tmp_path, "model.max_position_embeddings=512", "rollout.max_seq_len=512", "rollout.max_batch_size=8"
    )
    [proc] = spawn_miles_servers(cfg, 1, device="cpu")
    try:
        server = SessionServer(HttpPolicy(proc.url), ByteTokenizer(), instance_id="agent-http")
        sid = server.open()
        messages = [{"role": "user", "content": "fix it"}]
        for i in range(2):
            reply = server.chat(sid, {"messages": messages, "max_tokens": 10, "temperature": 1.0})
            messages += [reply["choices"][0]["message"], {"role": "tool", "content": f"out {i}"}]
        rec = server.get(sid)
        seq = torch.tensor(rec["token_ids"])
        with torch.no_grad():  # same config and seed: the served engine's weights
            logits = EmbeddedEngine.from_config(cfg, "cpu").model(seq[None])[0, :-1]
        ref, _ = log_probs_and_entropy(logits, seq[1:])
        mask = torch.tensor(rec["loss_mask"][1:], dtype=torch.bool)
        assert mask.sum() > 0
        torch.testing.assert_close(torch.tensor(rec["log_probs"][1:])[mask], ref[mask], atol=1e-4, rtol=0)

        sid2, got = server.open(), {}
        t = threading.Thread(target=lambda: got.setdefault("r", _catch(server, sid2)))
        t.start()
        deadline = time.monotonic() + 10
        while not server.health()["running"] and time.monotonic() < deadline:
            time.sleep(0.01)
        out = server.flush(timeout_s=10)
        t.join(timeout=15)
        assert out["aborted_requests"] == 1 and out["still_running"] == []
        assert isinstance(got["r"], SessionError) and got["r"].status == 409
    finally:
        proc.stop()


def _catch(server, sid):
    try:
        return server.chat(
            sid, {"messages": [{"role": "user", "content": "go"}], "max_tokens": 400, "temperature": 1.0}
        )
    except SessionError as e:
        return e
