"""`miles serve` as a real process over real sockets: a half-sent request is closed after --head-timeout-s, one
remote address cannot hold more than --max-connections-per-client (loopback is not capped), and the key comes from
a file, never argv (review 2026-12-04: S29 slowloris, S18 `--api-key` in `ps`)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from miles.cli.serve import main as serve_main
from miles.http_connections import guarded_protocol
from miles.rollout.launch import ServerProcess, miles_serve_argv
from tests.conftest import tiny_run_cfg

pytestmark = [pytest.mark.procs, pytest.mark.timeout(180)]  # procs: it starts processes or servers
HEAD_TIMEOUT_S, MAX_PER_CLIENT, KEY = 1.0, 24, "file-key-7f3a"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve_conn")
    cfg_path, key_file = d / "cfg.json", d / "key"
    cfg_path.write_text(json.dumps(tiny_run_cfg(d, "rollout.max_seq_len=48").to_dict()))
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    limits = ["--head-timeout-s", str(HEAD_TIMEOUT_S), "--max-connections-per-client", str(MAX_PER_CLIENT)]
    argv = miles_serve_argv(str(cfg_path), host="0.0.0.0", extra=["--api-key-file", str(key_file), *limits])
    proc = ServerProcess(argv)
    port = int(proc.start().rsplit(":", 1)[1])
    proc.url, proc.lan_url = f"http://127.0.0.1:{port}", (f"http://{_lan_ip()}:{port}" if _lan_ip() else "")
    yield proc
    proc.stop()


def _lan_ip() -> str:
    """This machine's address on its default route ("" when it has only loopback); no packet is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return ""
        ip = s.getsockname()[0]
    return "" if ip.startswith("127.") else ip


def _half_sent(url: str) -> socket.socket:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/js".encode())
    return sock


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(4096):
        out += chunk
    return out


def _generate(url: str, auth: str = f"Bearer {KEY}") -> int:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    return httpx.post(url + "/generate", json=body, headers={"Authorization": auth}, timeout=30).status_code


def test_a_half_sent_request_is_closed_within_the_head_timeout_and_a_full_one_is_served(served):
    socks = [_half_sent(served.url) for _ in range(8)]
    t0 = time.monotonic()
    assert _generate(served.url) == 200  # served while the half-sent ones wait
    answers = [_read_all(s) for s in socks]
    waited = time.monotonic() - t0
    assert all(a.startswith(b"HTTP/1.1 408") and b"did not arrive within 1.0 s" in a for a in answers), answers[0]
    assert waited < HEAD_TIMEOUT_S + 10, f"closed after {waited:.1f} s, bound {HEAD_TIMEOUT_S} s (+ slack)"
    for s in socks:
        s.close()
    assert _generate(served.url) == 200


def test_one_remote_address_holds_at_most_the_cap_while_loopback_clients_are_served(served):
    if not served.lan_url:
        pytest.skip("this machine has no address but loopback, and loopback clients are not capped")
    held = [_half_sent(served.lan_url) for _ in range(MAX_PER_CLIENT)]
    extra = _half_sent(served.lan_url)
    answer = _read_all(extra)  # refused at once, not after the head timeout
    assert answer.startswith(b"HTTP/1.1 503") and f"more than {MAX_PER_CLIENT} open connections".encode() in answer
    local = [_half_sent(served.url) for _ in range(MAX_PER_CLIENT + 8)]  # loopback: no cap, only the head timeout
    assert _generate(served.url) == 200
    for s in held + local:
        s.close()
    deadline = time.monotonic() + 10
    while _status_or_zero(served.lan_url) != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _generate(served.lan_url) == 200


def _status_or_zero(url: str) -> int:
    try:
        return _generate(url)
    except httpx.HTTPError:
        return 0


def test_the_key_comes_from_the_file_and_is_not_in_the_process_arguments(served):
    assert _generate(served.url, auth="") == 401 and _generate(served.url, auth="bearer " + KEY) == 200
    argv = Path(f"/proc/{served.proc.pid}/cmdline").read_bytes().decode()
    assert KEY not in argv and "--api-key-file" in argv


def test_an_api_key_on_the_command_line_warns_and_a_bad_key_file_is_one_clear_error(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(OSError, match="cannot listen on"):
            serve_main(["--api-key", "k", "--port", str(taken.getsockname()[1])])
    err = capsys.readouterr().err
    assert "--api-key puts the key in this process's arguments" in err and "--api-key-file" in err
    assert serve_main(["--api-key-file", str(tmp_path / "missing")]) == 2
    assert "--api-key-file" in capsys.readouterr().err
    (tmp_path / "empty").write_text("\n")
    assert serve_main(["--api-key-file", str(tmp_path / "empty")]) == 2
    assert "is empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_main(["--api-key", "k", "--api-key-file", str(tmp_path / "empty")])
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_connection_limits_refuse_a_negative_value():
    with pytest.raises(ValueError, match="must be >= 0"):
        guarded_protocol(-1.0, 10)
