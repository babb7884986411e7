"""A `miles serve` app on a real loopback socket, served by uvicorn from a thread of the test process: the real
embedded engine over real HTTP without paying a child process's torch import per test module."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from miles.rollout.engine import EmbeddedEngine
from miles.rollout.server import EngineServer
from tests.conftest import tiny_run_cfg


class ThreadedServer:
    """with ThreadedServer(EngineServer(engine)) as s: httpx.get(s.url + "/health")"""

    def __init__(self, server: EngineServer, host: str = "127.0.0.1"):
        import uvicorn

        self.server = server
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen(128)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self._uv = uvicorn.Server(uvicorn.Config(server.app, log_level="warning", access_log=False))
        self._thread = threading.Thread(target=self._uv.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "ThreadedServer":
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._uv.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "the server thread did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._uv.should_exit = True
        self._thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def serve_cfg(tmp_path_factory):
    return tiny_run_cfg(tmp_path_factory.mktemp("serve"), "rollout.max_batch_size=64", "rollout.max_seq_len=48")


@pytest.fixture
def serve(serve_cfg):
    """A fresh engine (quickstart's weights_policy 'discard') behind a fresh server: ``serve(**server_kwargs)``."""
    opened = []

    def start(**kwargs) -> ThreadedServer:
        s = ThreadedServer(
            EngineServer(EmbeddedEngine.from_config(serve_cfg, "cpu"), **{"batch_wait_ms": 5, **kwargs})
        ).__enter__()
        opened.append(s)
        return s

    yield start
    for s in opened:
        s.__exit__()
