"""What ``SGLangClient`` does with answers a broken or foreign server gives (rollout.engine_urls points at servers
miles does not control): every malformed /generate answer is refused with EngineResponseError naming the server
and the fault, never turned into samples; a huge body is not read whole. The server here is a real HTTP server
on a loopback socket that answers whatever a test sets (cases E12-E20 of the 2026-12-04 reliability review)."""

from __future__ import annotations

import http.server
import json
import math
import socket
import threading
import time

import pytest

from miles.protocols.engine import GenerateRequest, SamplingParams
from miles.rollout.sglang_client import EngineResponseError, EngineUnavailable, SGLangClient

pytestmark = [pytest.mark.procs, pytest.mark.timeout(60)]  # procs: it starts processes or servers


class RawServer:
    """A loopback HTTP server answering every request with ``self.answer`` = (status, content type, body bytes)."""

    def __init__(self):
        owner = self
        self.answer = (200, "application/json", b"{}")

        class Handler(http.server.BaseHTTPRequestHandler):
            def _reply(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                status, ctype, body = owner.answer
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _reply

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    s = RawServer()
    yield s
    s.close()


def _reqs(n=4):
    return [GenerateRequest(rid=f"r{i}", input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=3)) for i in range(n)]


def _out(rid, ids, lps=None):
    lps = [-0.5] * len(ids) if lps is None else lps
    return {
        "text": "",
        "output_ids": ids,
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": "length", "length": len(ids)},
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
            "weight_version": "3",
        },
    }


def _answer(fake, body, ctype="application/json", status=200):
    fake.answer = (status, ctype, body if isinstance(body, bytes) else json.dumps(body).encode())


def test_a_well_formed_batch_answer_gives_one_output_per_request_in_order(fake):
    _answer(fake, [_out(f"r{i}", [5, 6, 7]) for i in range(4)])
    outs = SGLangClient(fake.url, vocab_size=264).generate(_reqs())
    assert [o.rid for o in outs] == ["r0", "r1", "r2", "r3"]
    assert all(o.output_ids == [5, 6, 7] and o.weight_version == 3 for o in outs)


@pytest.mark.parametrize(
    "body, message",
    [
        ([_out("r0", [5, 6, 7])], r"1 output\(s\) for 4 request\(s\)"),  # E14
        ([_out(f"r{i}", [-5, 10**12, 7]) for i in range(4)], r"output ids \[-5, 1000000000000\]"),  # E15
        ([_out(f"r{i}", [1.5, "x"]) for i in range(4)], r"output ids \[1.5, 'x'\] are not token ids"),  # E16
        ([_out(f"r{i}", [5, 6, 7], [-1.0]) for i in range(4)], r"3 output ids but 1 log-probs"),  # E17
        ([_out(f"r{i}", [5], [math.nan]) for i in range(4)], r"log-probs must be finite"),  # E18
        ([_out(f"r{3 - i}", [5]) for i in range(4)], r"output 0 answers rid 'r3', the request was 'r0'"),
        ([{"text": "no meta"}] * 4, r"no meta_info object"),
    ],
)
def test_a_malformed_generate_answer_is_refused_naming_the_fault(fake, body, message):
    _answer(fake, body)
    with pytest.raises(EngineResponseError, match=message):
        SGLangClient(fake.url, vocab_size=264).generate(_reqs())


def test_ids_beyond_the_models_vocabulary_are_refused(fake):
    _answer(fake, [_out(f"r{i}", [5, 300]) for i in range(4)])
    with pytest.raises(EngineResponseError, match=r"output ids \[300\] are not token ids in \[0, 264\)"):
        SGLangClient(fake.url, vocab_size=264).generate(_reqs())


@pytest.mark.parametrize(
    "body, ctype, message",
    [
        (b"{not json", "application/json", r"not valid JSON"),  # E12
        (b"<html>busy</html>", "text/html", r"expected JSON, got text/html"),  # E13
    ],
)
def test_a_body_that_is_not_json_is_an_engine_response_error_not_a_value_error(fake, body, ctype, message):
    _answer(fake, body, ctype)
    with pytest.raises(EngineResponseError, match=message) as err:
        SGLangClient(fake.url).generate(_reqs())
    assert isinstance(err.value, EngineUnavailable) and not isinstance(err.value, ValueError)


def test_a_huge_body_is_refused_after_the_bound_not_read_whole(fake):  # E20
    huge = b"[" + b" " * (80 * 2**20) + b"]"  # 80 MiB of nothing for 4 requests of 2 + 3 tokens
    _answer(fake, huge)
    with pytest.raises(EngineResponseError, match=r"the body exceeds \d+ bytes"):
        SGLangClient(fake.url).generate(_reqs())


async def _agenerate(client, reqs):
    try:
        return await client.agenerate(reqs)
    finally:
        await client.aclose()


def test_the_async_path_checks_the_same_way(fake):
    import asyncio

    _answer(fake, [_out("r0", [5, 6, 7])])
    with pytest.raises(EngineResponseError, match=r"1 output\(s\) for 4 request\(s\)"):
        asyncio.run(_agenerate(SGLangClient(fake.url), _reqs()))
    _answer(fake, b"[" + b" " * (80 * 2**20) + b"]")
    with pytest.raises(EngineResponseError, match=r"the body exceeds"):
        asyncio.run(_agenerate(SGLangClient(fake.url), _reqs()))


def test_a_5xx_is_engine_unavailable_with_the_servers_message(fake):  # E19
    _answer(fake, {"error": {"message": "boom"}}, status=500)
    with pytest.raises(EngineUnavailable, match=r"HTTP 500: boom"):
        SGLangClient(fake.url).generate(_reqs())


@pytest.fixture
def silent():
    """A loopback server that accepts connections, reads the request and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    held = []

    def hold():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=hold, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()
    for conn in held:
        conn.close()


def test_a_server_that_never_answers_is_engine_unavailable_at_the_clients_bound(silent):
    """E21 (a note): the wait is bounded, by default 600 s a request (a long generation is legitimate; the run's
    stall watchdog names a stuck generate sooner), and a hung server is an EngineUnavailable naming it."""
    import asyncio

    default = SGLangClient(silent)
    assert default.timeout_s == 600.0 and default.http.timeout.read == 600.0
    for call in (
        lambda c: c.generate(_reqs()),
        lambda c: asyncio.run(_agenerate(c, _reqs())),
    ):
        start = time.monotonic()
        with pytest.raises(EngineUnavailable, match=rf"{silent}/generate: ReadTimeout"):
            call(SGLangClient(silent, timeout_s=1.0))
        assert time.monotonic() - start < 30
