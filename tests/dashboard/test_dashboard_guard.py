"""The dashboard behind miles.http_guard, over a real socket: Host allow-list (IPv6 loopback included),
cross-site requests refused, and a metrics offset that is not a line start is a 400 naming it (review
2026-12-03, C and defect 17)."""

from __future__ import annotations

import httpx
import pytest

from miles.dashboard.server import DashboardServer

pytestmark = [pytest.mark.procs, pytest.mark.timeout(60)]  # procs: it starts processes or servers


@pytest.fixture(scope="module")
def dashboard(long_run_dir):
    with DashboardServer(long_run_dir) as server:
        yield server.url.rstrip("/")


def test_a_cross_site_or_foreign_host_request_to_the_dashboard_is_refused_and_loopback_names_pass(dashboard):
    port = dashboard.rsplit(":", 1)[1]
    get = lambda headers: httpx.get(dashboard + "/api/config", headers=headers)  # noqa: E731
    assert get({"Host": f"evil.example:{port}"}).status_code == 400
    assert get({"Host": f"127.0.0.1.evil.example:{port}"}).status_code == 400
    assert get({"Host": f"127.0.0.1:{port}@evil.example"}).status_code == 400  # review 2026-12-04 B1 (S7's note)
    assert get({"Sec-Fetch-Site": "cross-site"}).status_code == 403
    assert get({"Origin": "http://evil.example"}).status_code == 403
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        r = get({"Host": host, "Sec-Fetch-Site": "same-origin"})
        assert r.status_code == 200 and r.json()["synthetic"] is True, (host, r.text)


def test_a_metrics_offset_inside_a_line_is_a_400_naming_the_offset(dashboard):
    for offset in (1, 1 << 60):
        r = httpx.get(dashboard + f"/api/metrics?offset={offset}")
        if offset == 1 << 60 and r.status_code == 200:  # a filesystem that can seek there: an empty page
            assert r.json()["rows"] == []
            continue
        assert r.status_code == 400 and f"offset = {offset}" in r.json()["detail"], (offset, r.text)
    assert httpx.get(dashboard + "/api/metrics?offset=0").status_code == 200
