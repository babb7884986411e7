"""Session server, in-process over the embedded engine: exact tokens, log-probs, clear errors, flush."""

import threading
import time

import pytest
import torch

from miles.agents.policy import Completion, EmbeddedPolicy, parse_generate_response
from miles.agents.session_server import SessionError, SessionServer
from miles.agents.tool_calls import format_tool_call, parse_tool_calls
from miles.model.tokenizer import ByteTokenizer
from miles.policy.logprob import log_probs_and_entropy
from miles.rollout.engine import EmbeddedEngine
from tests.conftest import tiny_model

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)


@pytest.fixture(scope="module")
def server():
    cfg = tiny_model(max_position_embeddings=512)
    policy = EmbeddedPolicy(EmbeddedEngine(cfg, max_batch_size=8, max_seq_len=512, seed=0))
    yield SessionServer(policy, ByteTokenizer(), instance_id="agent-test")
    policy.close()


def _turns(server, sid, n, **body):
    messages = [{"role": "user", "content": "fix the bug"}]
    replies = []
    for i in range(n):
        r = server.chat(sid, {"messages": messages, "max_tokens": 12, "temperature": 1.0, **body})
        replies.append(r)
        messages += [r["choices"][0]["message"], {"role": "tool", "content": f"result {i}"}]
    return replies


def test_session_record_holds_the_exact_sampled_tokens_even_when_their_text_does_not_round_trip(server):
    tok = ByteTokenizer()
    sid = server.open()
    replies = _turns(server, sid, 3)
    rec = server.get(sid)
    ids, mask = rec["token_ids"], rec["loss_mask"]
    policy_ids = [t for t, m in zip(ids, mask) if m]
    assert policy_ids == [t for r in replies for t in r["miles"]["output_ids"]]
    assert [lp for lp, m in zip(rec["log_probs"], mask) if m] == [
        x for r in replies for x in r["miles"]["output_log_probs"]
    ]
    first = tok.apply_chat_template([{"role": "user", "content": "fix the bug"}])
    assert ids[: len(first)] == first and rec["prompt_len"] == len(first) and rec["num_turns"] == 3
    # random bytes from a tiny model rarely survive decode -> encode; the record never goes through text
    stops = set(tok.stop_token_ids)
    outs = [[t for t in r["miles"]["output_ids"] if t not in stops] for r in replies]
    assert any(tok.encode(tok.decode(o, skip_special_tokens=False)) != o for o in outs)


def test_recorded_log_probs_match_a_full_sequence_forward(server):
    sid = server.open()
    _turns(server, sid, 2, temperature=0.8)
    rec = server.get(sid)
    seq = torch.tensor(rec["token_ids"])
    with torch.no_grad():
        logits = server.policy.engine.model(seq[None])[0, :-1]
    ref, _ = log_probs_and_entropy(logits, seq[1:], temperature=0.8)
    mask = torch.tensor(rec["loss_mask"][1:], dtype=torch.bool)
    torch.testing.assert_close(torch.tensor(rec["log_probs"][1:])[mask], ref[mask], atol=1e-4, rtol=0)


def test_unknown_session_and_changed_history_are_clear_errors(server):
    with pytest.raises(SessionError, match="is not open on instance agent-test.*create one with POST /sessions") as e:
        server.chat("nope", {"messages": [{"role": "user", "content": "x"}]})
    assert e.value.status == 404
    sid = server.open()
    _turns(server, sid, 1)
    with pytest.raises(SessionError, match=r"messages\[0\] \(user\) differs from the session's record") as e:
        server.chat(
            sid,
            {
                "messages": [
                    {"role": "user", "content": "other"},
                    {"role": "assistant", "content": "a"},
                    {"role": "user", "content": "y"},
                ]
            },
        )
    assert e.value.status == 400
    with pytest.raises(SessionError, match="'messages' must be a non-empty list"):
        server.chat(sid, {"messages": "hello"})
    with pytest.raises(SessionError, match="max_tokens = 0 must be >= 1"):
        server.chat(sid, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})


def test_a_full_context_is_reported_as_context_length_exceeded(server):
    sid = server.open()
    with pytest.raises(SessionError) as e:
        server.chat(sid, {"messages": [{"role": "user", "content": "x" * 600}], "max_tokens": 8})
    assert e.value.code == "context_length_exceeded" and "max_seq_len 512" in str(e.value)


def test_flush_aborts_an_in_flight_turn_and_drops_every_session(server):
    sids = [server.open() for _ in range(3)]
    got = {}

    def turn():
        try:
            server.chat(
                sids[0], {"messages": [{"role": "user", "content": "go"}], "max_tokens": 400, "temperature": 1.0}
            )
        except SessionError as e:
            got["error"] = e

    t = threading.Thread(target=turn)
    t.start()
    deadline = time.monotonic() + 10
    while not server.health()["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    out = server.flush(timeout_s=5.0)
    t.join(timeout=10)
    assert (
        not t.is_alive()
        and got["error"].status == 409
        and "aborted by a flush of instance agent-test" in str(got["error"])
    )
    assert out["aborted_requests"] == 1 and out["still_running"] == [] and out["aborted_sessions"] >= 3
    assert server.health()["sessions"] == 0
    with pytest.raises(SessionError, match="aborted by a flush") as e:
        server.chat(sids[1], {"messages": [{"role": "user", "content": "x"}]})
    assert e.value.status == 409


def test_after_a_flush_for_a_step_a_late_open_for_that_step_is_refused_and_later_steps_open(server):
    sid = server.open({"episode_id": "e0", "rollout": "r1", "step": 3})
    server.flush(timeout_s=1.0, rollout="r1", step=3)
    with pytest.raises(
        SessionError, match="step 3 of rollout r1 was asked for after a flush of instance agent-test"
    ) as e:
        server.open({"episode_id": "e1", "rollout": "r1", "step": 3})  # e.g. queued while the instance was stalled
    assert e.value.status == 409 and server.health()["sessions"] == 0
    with pytest.raises(SessionError, match="aborted by a flush"):
        server.chat(sid, {"messages": [{"role": "user", "content": "x"}]})
    later = server.open({"episode_id": "e2", "rollout": "r1", "step": 4})
    other_run = server.open({"episode_id": "e3", "rollout": "r2", "step": 0})  # another rollout is not fenced
    untagged = server.open()
    assert server.health()["sessions"] == 3
    for sid in (later, other_run, untagged):
        server.close(sid)


def test_embedded_policy_batches_concurrent_calls_and_matches_a_direct_generate(server):
    from miles.protocols.engine import SamplingParams

    sp = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=())
    outs: dict[int, Completion] = {}
    threads = [
        threading.Thread(target=lambda i=i: outs.__setitem__(i, server.policy.generate(f"b{i}", [1, 2, 3 + i], sp)))
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    from miles.protocols.engine import GenerateRequest

    ref = server.policy.engine.generate(
        [GenerateRequest(rid=f"r{i}", input_ids=[1, 2, 3 + i], sampling=sp) for i in range(4)]
    )
    assert [outs[i].output_ids for i in range(4)] == [r.output_ids for r in ref]


def test_tool_calls_are_parsed_and_malformed_ones_reported():
    calls, errors = parse_tool_calls(
        "ok " + format_tool_call("edit_file", path="a.py", old="-", new="+") + " <tool>{oops"
    )
    assert [c["function"]["name"] for c in calls] == ["edit_file"] and '"old": "-"' in calls[0]["function"]["arguments"]
    assert len(errors) == 1 and "not JSON after <tool>" in errors[0]
    assert parse_tool_calls('<tool>{"name": 3}')[1] == [
        "call 0: needs an object with a string 'name', got \"{'name': 3}\""
    ]


def test_sglang_generate_answers_are_read_from_either_field():
    d = {
        "text": "x",
        "meta_info": {
            "finish_reason": {"type": "length"},
            "weight_version": 3,
            "output_token_logprobs": [[-0.5, 7, None], [-1.0, 9, None]],
        },
    }
    c = parse_generate_response(d)
    assert (c.output_ids, c.output_log_probs, c.finish_reason, c.weight_version) == ([7, 9], [-0.5, -1.0], "length", 3)
    with pytest.raises(ValueError, match="ask with return_logprob=true"):
        parse_generate_response({"output_ids": [1, 2], "meta_info": {}})
