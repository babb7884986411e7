"""The dashboard's HTTP API: JSON endpoints, the one-request sample payload, and what it refuses."""

from __future__ import annotations

import tracemalloc

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from test_dashboard_store import parse_payload

from miles.dashboard.server import DashboardServer, create_app, main, parse_args
from miles.rollout_dump import RolloutDumpWriter

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)


@pytest.fixture(scope="module")
def client(long_run_dir):
    return TestClient(create_app(long_run_dir), base_url="http://127.0.0.1", raise_server_exceptions=False)


def test_the_json_endpoints_describe_the_run(client):
    assert client.get("/api/info").json()["follow"] is False
    assert client.get("/api/config").json()["synthetic"] is True
    metrics = client.get("/api/metrics").json()
    assert [r["step"] for r in metrics["rows"]] == [1, 2, 3] and metrics["next_offset"] > 0
    assert client.get(f"/api/metrics?offset={metrics['next_offset']}").json()["rows"] == []
    ledger = client.get("/api/ledger").json()["rows"]
    assert {e["pool"] for e in ledger} == {"device", "host"} and {e["step"] for e in ledger} == {1, 2, 3}
    steps = client.get("/api/steps").json()["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3] and steps[-1]["max_tokens"] == 65536
    samples = client.get("/api/steps/3/samples").json()["samples"]
    assert len(samples) == 16 and samples[1]["num_tokens"] == 65536 and "token_start" in samples[1]


def test_one_request_carries_a_whole_64k_token_sample(client):
    r = client.get("/api/steps/3/samples/1")
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    assert int(r.headers["content-length"]) == len(r.content)
    header, cols = parse_payload(r.content)
    assert header["num_tokens"] == 65536 and header["sample"]["prompt_len"] == 2048
    assert header["step_num_samples"] == 16 and header["sample"]["response_text"]
    for name in (
        "tokens",
        "loss_mask",
        "rollout_log_probs",
        "train_log_probs",
        "advantages",
        "entropy",
        "token_text_len",
    ):
        assert len(cols[name]) == 65536, name
    assert len(cols["token_text"]) == int(cols["token_text_len"].sum())


def test_the_page_and_its_scripts_are_served_locally(client):
    page = client.get("/")
    assert page.status_code == 200 and "/static/app.js" in page.text
    assert "http" not in page.text.replace("http-equiv", "")  # nothing from a CDN
    for name in ("app.js", "strip.js", "charts.js", "style.css"):
        r = client.get(f"/static/{name}")
        assert r.status_code == 200 and "https://" not in r.text, name


@pytest.mark.parametrize(
    "url",
    [
        "/static/../store.py",
        "/static/..%2Fstore.py",
        "/static/%2e%2e/%2e%2e/atomic.py",
        "/static/..%2F..%2Fatomic.py",
        "/static//etc/passwd",
        "/api/steps/..%2F..%2Fetc/samples",
        "/api/steps/3/samples/..%2F..%2Fconfig.json",
        "/api/steps/3%2F..%2F..%2F/samples/1",
        "/api/steps/%2e%2e/samples",
        "/../config.json",
        "/api/../../etc/passwd",
    ],
)
def test_path_parameters_cannot_leave_the_run_or_static_dirs(client, url):
    r = client.get(url)
    assert r.status_code in (404, 422), (url, r.status_code)
    assert "def " not in r.text and "root:" not in r.text


def test_a_step_symlinked_out_of_the_run_dir_is_not_served(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "outside"
    sample = {"tokens": [1, 2, 3], "prompt_len": 1}
    RolloutDumpWriter(run_dir=run).write_step(1, [sample])
    RolloutDumpWriter(run_dir=outside).write_step(2, [sample])
    (run / "rollouts" / "step_000002").symlink_to(outside / "rollouts" / "step_000002")
    c = TestClient(create_app(run), base_url="http://127.0.0.1", raise_server_exceptions=False)
    assert c.get("/api/steps/2/samples").status_code == 404
    assert c.get("/api/steps/2/samples/0").status_code == 404
    assert [s["step"] for s in c.get("/api/steps").json()["steps"]] == [1]


@pytest.mark.parametrize(
    "url",
    [
        "/api/metrics?offset=abc",
        "/api/metrics?offset=-1",
        "/api/metrics?offset=1.5",
        "/api/ledger?offset=%00",
        "/api/ledger?max_bytes=0",
        "/api/ledger?max_bytes=999999999999",
        "/api/metrics?offset=99999999999999999999999",
        "/api/steps/abc/samples",
        "/api/steps/-1/samples",
        "/api/steps/1.5/samples/0",
        "/api/steps/3/samples/x",
        "/api/steps/3/samples/-1",
        "/api/steps/3/samples/16",
        "/api/steps/3/samples/99999999999999999999",
        "/api/steps/99999999999999999999999/samples",
        "/api/steps/7/samples/0",
        "/api/nope",
    ],
)
def test_malformed_or_missing_values_are_4xx_never_500(client, url):
    r = client.get(url)
    assert 400 <= r.status_code < 500, (url, r.status_code, r.text[:200])


def test_an_offset_past_the_end_is_an_empty_page(client):
    assert client.get("/api/metrics?offset=123456789").json() == {"rows": [], "next_offset": 123456789}


def test_the_dashboard_binds_loopback_by_default(long_run_dir):
    assert parse_args([str(long_run_dir)]).host == "127.0.0.1"
    with DashboardServer(long_run_dir) as server:
        assert server.sock.getsockname()[0] == "127.0.0.1" and server.url.startswith("http://127.0.0.1:")
        assert httpx.get(server.url + "api/info").json()["name"] == "run"


def test_a_request_naming_another_host_is_refused(client):
    """DNS rebinding: a page on evil.example re-points its name at 127.0.0.1 and reads the dashboard."""
    assert client.get("/api/config", headers={"Host": "evil.example:8642"}).status_code == 400
    assert client.get("/api/config", headers={"Host": "localhost:8642"}).status_code == 200


def test_main_refuses_a_missing_run_dir(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_a_huge_dump_streams_without_being_loaded_whole(tmp_path):
    n = 1 << 19
    rng = np.random.default_rng(0)
    sample = {
        "tokens": rng.integers(0, 50000, n).tolist(),
        "prompt_len": 16,
        "token_text": ["ab"] * n,
        "rollout_log_probs": rng.normal(size=n).tolist(),
        "train_log_probs": rng.normal(size=n).tolist(),
        "advantages": np.ones(n).tolist(),
        "entropy": np.ones(n).tolist(),
    }
    RolloutDumpWriter(run_dir=tmp_path).write_step(1, [sample])
    del sample
    with DashboardServer(tmp_path) as server:
        chunks, total = 0, 0
        tracemalloc.start()
        try:
            with httpx.stream("GET", server.url + "api/steps/1/samples/0", timeout=60) as r:
                size = int(r.headers["content-length"])
                for chunk in r.iter_raw():
                    chunks, total = chunks + 1, total + len(chunk)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert total == size > 26 * n
    assert chunks > 10
    # loading the dump whole would trace at least its size (parsing it, several times that); streaming traces a few
    # chunks plus whatever the server's other threads allocate meanwhile (measured 2.9-3.6 MB of 14.2 MB)
    assert peak < size / 2, f"peak {peak} bytes traced while streaming {size} bytes"
