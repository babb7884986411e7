"""Who may drive `miles serve` (miles.http_guard): not a web page (foreign Host, text/plain, cross-site), and with
an API key nobody without it (review 2026-12-03, defect 2)."""

from __future__ import annotations

import socket

import httpx
import pytest

from miles.cli.serve import main as serve_main
from miles.http_guard import allowed_hosts, exposure_warning, host_of
from miles.protocols.engine import EngineError, GenerateRequest, SamplingParams
from miles.rollout.sglang_client import SGLangClient

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]  # procs: it starts processes or servers

BUMP = b'{"new_version": "4242"}'
BROWSER_UA = "Mozilla/5.0 (X11; Linux x86_64; rv:78.0) Gecko/20100101 Firefox/78.0"


def _version(url: str) -> str:
    return httpx.get(url + "/get_weight_version").json()["weight_version"]


def test_a_cross_origin_text_plain_post_with_a_foreign_host_is_refused_and_the_weight_version_stays(serve):
    s = serve()
    port = s.url.rsplit(":", 1)[1]
    post = lambda headers: httpx.post(s.url + "/update_weight_version", content=BUMP, headers=headers)  # noqa: E731
    page = {"Content-Type": "text/plain", "Origin": "http://attacker.example"}
    refused = {
        "the review's request (DNS rebinding)": (post({**page, "Host": "attacker.example"}), 400),
        "a page posting to 127.0.0.1": (post(page), 403),
        "text/plain from a program": (post({"Content-Type": "text/plain"}), 415),
        "no Content-Type": (post({}), 415),
        "JSON marked cross-site": (post({"Content-Type": "application/json", "Sec-Fetch-Site": "cross-site"}), 403),
        "an <img> GET releasing memory": (
            httpx.get(s.url + "/release_memory_occupation", headers={"Sec-Fetch-Site": "cross-site"}),
            403,
        ),
    }
    for what, (r, status) in refused.items():
        assert r.status_code == status and r.json()["success"] is False, (what, r.status_code, r.text)
    assert _version(s.url) == "default"
    assert httpx.get(s.url + "/miles/memory").json()["tags"]["weights"]["paused"] is False
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        r = httpx.post(s.url + "/update_weight_version", json={"new_version": "3"}, headers={"Host": host})
        assert r.status_code == 200, (host, r.text)
    assert _version(s.url) == "3"


def test_with_an_api_key_every_endpoint_but_health_needs_the_bearer_header(serve, monkeypatch):
    s = serve(api_key="s3cret")
    assert httpx.get(s.url + "/health").status_code == 200
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(s.url + "/generate", json=body).status_code == 401
    wrong = httpx.post(s.url + "/generate", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "API key" in wrong.json()["message"]
    assert httpx.post(s.url + "/update_weight_version", json={"new_version": "9"}).status_code == 401
    assert _version_with(s.url, "s3cret") == "default"
    with pytest.raises(EngineError, match="401"):
        SGLangClient(s.url).set_weight_version(9)
    req = GenerateRequest(rid="k", input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2))
    assert len(SGLangClient(s.url, api_key="s3cret").generate([req])[0].output_ids) == 2
    monkeypatch.setenv("MILES_API_KEY", "s3cret")  # the manager's clients and spawned servers read it
    client = SGLangClient(s.url)
    client.set_weight_version(9)
    assert client.weight_version == 9


def _version_with(url: str, key: str) -> str:
    return httpx.get(url + "/get_weight_version", headers={"Authorization": f"Bearer {key}"}).json()["weight_version"]


def test_binding_beyond_loopback_without_a_key_is_refused_and_a_taken_port_is_one_clear_error(capsys, monkeypatch):
    assert exposure_warning("miles serve", "127.0.0.1", "") == ""
    assert exposure_warning("miles serve", "0.0.0.0", "k") == ""
    monkeypatch.delenv("MILES_API_KEY", raising=False)
    assert serve_main(["--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--host 0.0.0.0 listens beyond this machine without an API key" in err and "--api-key-file" in err
    monkeypatch.setenv("MILES_API_KEY", "k")
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"miles serve cannot listen on 0.0.0.0:{port} \(.*\); pick another --port"):
            serve_main(["--host", "0.0.0.0", "--port", str(port)])
    with pytest.raises(SystemExit):
        serve_main(["--port", "99999"])
    assert "'99999' is not a port; use 0..65535" in capsys.readouterr().err


def test_the_host_allow_list_is_loopback_and_the_bound_host_and_reads_ipv6_host_headers():
    assert allowed_hosts("127.0.0.1") == ("localhost", "127.0.0.1", "::1")
    assert allowed_hosts("10.1.2.3", "box.lan") == ("localhost", "127.0.0.1", "::1", "10.1.2.3", "box.lan")
    assert allowed_hosts("0.0.0.0") == ("*",)
    assert [host_of(h) for h in ("[::1]:30000", "::1", "LocalHost:1", "http://a.example:80/x", "127.0.0.1.evil")] == [
        "::1",
        "::1",
        "localhost",
        "a.example",
        "127.0.0.1.evil",
    ]


@pytest.mark.parametrize(
    "host", ["127.0.0.1:{port}@evil.com", "localhost:{port}@evil.com", "[::1]:{port}@evil.com", "127.0.0.1:x{port}"]
)
def test_a_host_header_with_anything_but_a_port_after_a_loopback_name_is_refused(serve, host):
    """Review 2026-12-04 S7 (a note: browsers cannot send it): the port split kept '127.0.0.1' of
    '127.0.0.1:PORT@evil.com', so the request passed as loopback."""
    s = serve()
    host = host.format(port=s.url.rsplit(":", 1)[1])
    r = httpx.post(s.url + "/update_weight_version", json={"new_version": "9"}, headers={"Host": host})
    assert r.status_code == 400 and "Invalid host header" in r.json()["message"], (host, r.status_code, r.text)
    assert host_of(host) == host and _version(s.url) == "default"


def test_a_body_over_the_limit_is_refused_whole_or_chunked_and_the_server_keeps_serving(serve):
    s = serve(max_request_bytes=1000)
    big = b'{"new_version": "7", "pad": "' + b"x" * 2000 + b'"}'
    json_ct = {"Content-Type": "application/json"}
    r = httpx.post(s.url + "/update_weight_version", content=big, headers=json_ct)
    assert r.status_code == 413 and "limit of 1000 bytes" in r.json()["message"] and "--max-request-mb" in r.text

    def chunks():  # no Content-Length: the guard counts the bytes as they arrive
        for i in range(0, len(big), 256):
            yield big[i : i + 256]

    r = httpx.post(s.url + "/update_weight_version", content=chunks(), headers=json_ct)
    assert r.status_code == 413 and "more than 1000" in r.json()["message"]
    assert _version(s.url) == "default"
    ok = httpx.post(s.url + "/update_weight_version", json={"new_version": "5"})
    assert ok.status_code == 200 and _version(s.url) == "5"


def test_a_negative_body_limit_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        serve_main(["--max-request-mb", "-1"])
    assert "'-1' is not a size in MiB" in capsys.readouterr().err


def test_a_state_changing_get_needs_same_origin_evidence_or_the_key_and_post_always_works(serve):
    """Review 2026-12-04 S14: an <img> GET (no Origin, no Sec-Fetch-*) released the engine's weights. A program's
    GET (slime polls GET /flush_cache with requests, no headers of a browser) still passes, as on SGLang."""
    s = serve()
    img = {"User-Agent": BROWSER_UA, "Accept": "image/avif,image/webp,*/*"}  # an old browser's <img>: no Sec-Fetch-*
    for path in ("/release_memory_occupation", "/resume_memory_occupation", "/flush_cache"):
        for method in ("GET", "HEAD"):
            r = httpx.request(method, s.url + path, headers=img)
            assert r.status_code == 405 and r.headers["allow"] == "POST", (method, path, r.status_code)
    assert "send it as POST" in httpx.get(s.url + "/flush_cache", headers=img).json()["message"]
    assert httpx.get(s.url + "/miles/memory").json()["tags"]["weights"]["paused"] is False
    port = s.url.rsplit(":", 1)[1]
    same_origin = [{"Sec-Fetch-Site": "same-origin"}, {"Sec-Fetch-Site": "none"}, {"Origin": s.url}]
    for headers in same_origin:
        assert httpx.get(s.url + "/flush_cache", headers=headers).status_code == 200, headers
    other_port = {"Origin": f"http://127.0.0.1:{int(port) + 1}", "Sec-Fetch-Site": "same-site"}
    assert httpx.get(s.url + "/flush_cache", headers=other_port).status_code == 405
    assert httpx.post(s.url + "/flush_cache").status_code == 200
    for program in ({"User-Agent": "python-requests/2.32.3"}, {"User-Agent": "curl/8.5.0"}, {}):
        assert httpx.get(s.url + "/flush_cache", headers=program).status_code == 200, program
    assert httpx.get(s.url + "/get_weight_version").status_code == 200  # reads stay GET
    keyed = serve(api_key="k1")  # a GET that carries the key is a program's
    assert httpx.get(keyed.url + "/flush_cache", headers={"Authorization": "Bearer k1"}).status_code == 200


def test_the_bearer_scheme_is_read_in_any_case_and_the_key_exactly(serve):
    """Review 2026-12-04 S16: 'bearer KEY' was a 401 (RFC 7235: the scheme is case-insensitive)."""
    s = serve(api_key="MiXed-key")
    for auth in ("Bearer MiXed-key", "bearer MiXed-key", "BEARER MiXed-key", "Bearer  MiXed-key"):
        assert httpx.get(s.url + "/get_weight_version", headers={"Authorization": auth}).status_code == 200, auth
    for auth in ("Bearer mixed-key", "Basic MiXed-key", "BearerMiXed-key", "MiXed-key", "Bearer"):
        assert httpx.get(s.url + "/get_weight_version", headers={"Authorization": auth}).status_code == 401, auth


def test_a_100k_deep_json_body_is_a_400_and_the_connection_keeps_serving(serve):
    """Review 2026-12-04 S28: a 500 with a RecursionError traceback, then 'connection reset' on that connection."""
    s = serve()
    with httpx.Client() as client:  # one keep-alive connection
        for deep in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
            r = client.post(
                s.url + "/update_weight_version", content=deep, headers={"Content-Type": "application/json"}
            )
            assert r.status_code == 400 and "nested too deeply" in r.json()["message"], r.text[:200]
        assert client.post(s.url + "/update_weight_version", json={"new_version": "2"}).status_code == 200
    assert _version(s.url) == "2"


def test_a_page_on_another_local_port_gets_no_cors_answer_so_its_browser_never_sends_the_json_post(serve):
    """Review 2026-12-04 S9 (a note, kept): the Origin check ignores the port, so http://localhost:9999 passes it;
    but a JSON POST from a page needs a CORS preflight, which gets no Access-Control-Allow-* header, so the browser
    never sends it, and the requests a page can send without one are refused (text/plain: 415)."""
    s = serve()
    page = {"Origin": "http://localhost:9999"}
    pre = httpx.request(
        "OPTIONS",
        s.url + "/update_weight_version",
        headers={**page, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"},
    )
    assert pre.status_code >= 400 and not any(k.lower().startswith("access-control-") for k in pre.headers), pre.headers
    simple = httpx.post(s.url + "/update_weight_version", content=BUMP, headers={**page, "Content-Type": "text/plain"})
    assert simple.status_code == 415 and _version(s.url) == "default"
