"""Starting the agent side: session-server processes on a port range, a harness process, or a server in a thread.

Each process logs to a file; a process that does not answer ``/health`` in time is reported with its log tail.
One random run token (miles.agents.run_token) guards all of them; it reaches the children in their environment,
never their argv, and miles' clients send it (``procs.headers``).

    procs = AgentProcesses.start(ports=[8100, 8101], harness_port=8090, model_json=cfg_json, max_seq_len=1024)
    ...                                  # procs.session_urls, procs.harness_url, procs.token
    procs.stop()
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from miles.agents.run_token import TOKEN_ENV, new_token, token_headers
from miles.http_connections import guarded_protocol
from miles.ports import free_ports


def free_port_range(n: int) -> int:
    """The first port p such that p .. p+n-1 are all free on 127.0.0.1 (miles.ports: below the ephemeral range)."""
    return free_ports(n)


def wait_ready(url: str, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> dict:
    """The server's /health answer, once it gives one; an error with the log tail if it never does."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            break
        try:
            r = httpx.get(f"{url}/health", timeout=1.0)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    logs = sorted(log.parent.glob(log.name)) if log else []
    tail = "".join(f.read_text()[-2000:] for f in logs)
    state = (
        f"exited with {proc.returncode}"
        if proc is not None and proc.poll() is not None
        else f"not ready after {timeout_s} s"
    )
    raise RuntimeError(f"{url} {state}; log tail:\n{tail}")


@dataclass
class AgentProcesses:
    """Session-server processes (one per port, instance id ``agent-<port>``) and optionally a harness process, whose
    instances are those session servers plus ``instances`` (id -> URL: servers started elsewhere, e.g. threads)."""

    host: str = "127.0.0.1"
    token: str = field(default_factory=new_token)
    ports: list[int] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)  # a contiguous range is one forking parent
    pids: dict[int, int] = field(default_factory=dict)  # port -> the pid serving it (read from /health)
    harness: subprocess.Popen | None = None
    harness_url: str = ""
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="miles-agents-")))

    @classmethod
    def start(
        cls,
        *,
        ports: list[int],
        harness_port: int = 0,
        engine: str = "embedded",
        model_json: str = "",
        max_seq_len: int = 0,
        seed: int = 0,
        host: str = "127.0.0.1",
        timeout_s: float = 60.0,
        device: str = "cpu",
        token: str = "",
        instances: dict[str, str] | None = None,
    ) -> "AgentProcesses":
        procs = cls(host=host, ports=list(ports), **({"token": token} if token else {}))
        owner: dict[int, subprocess.Popen] = {}
        try:
            for lo, hi in _runs(ports):
                proc = procs._spawn(
                    f"session-{lo}",
                    "miles.agents.session_server",
                    "--port",
                    f"{lo}-{hi}",
                    "--host",
                    host,
                    "--engine",
                    engine,
                    "--model-json",
                    model_json,
                    "--max-seq-len",
                    str(max_seq_len),
                    "--seed",
                    str(seed),
                    "--device",
                    device,
                )
                procs.procs.append(proc)
                owner |= {port: proc for port in range(lo, hi + 1)}
            if harness_port:
                known = {f"agent-{port}": url for port, url in procs.session_urls.items()} | (instances or {})
                procs.harness = procs._spawn(
                    "harness",
                    "miles.agents.harness",
                    "--port",
                    str(harness_port),
                    "--host",
                    host,
                    "--root",
                    str(procs.log_dir / "sandboxes"),
                    "--parent-pid",
                    str(os.getpid()),
                    *[f"--instance={iid}={url}" for iid, url in known.items()],
                )
                procs.harness_url = f"http://{host}:{harness_port}"
            for port in ports:
                health = wait_ready(f"http://{host}:{port}", timeout_s, owner[port], procs.log_dir / "session-*.log")
                procs.pids[port] = health["pid"]
            if procs.harness is not None:
                wait_ready(procs.harness_url, timeout_s, procs.harness, procs.log_dir / "harness.log")
        except BaseException:
            procs.stop()
            raise
        return procs

    def _spawn(self, name: str, module: str, *args: str) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", TOKEN_ENV: self.token}
        log = open(self.log_dir / f"{name}.log", "wb")
        return subprocess.Popen(
            [sys.executable, "-m", module, *args], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    @property
    def headers(self) -> dict[str, str]:
        """What a client of these servers sends (the run token)."""
        return token_headers(self.token)

    @property
    def session_urls(self) -> dict[int, str]:
        return {port: f"http://{self.host}:{port}" for port in self.ports}

    def signal_instance(self, port: int, sig: int = signal.SIGKILL) -> None:
        """Signal the one process serving ``port``: SIGKILL as a crash would, SIGSTOP to make it hang."""
        os.kill(self.pids[port], sig)

    def kill_harness(self) -> None:
        _kill(self.harness, signal.SIGKILL)

    def stop(self) -> None:
        """Session servers hold nothing worth a graceful exit: their process groups get SIGKILL. The harness gets
        SIGTERM (SIGKILL after 5 s)."""
        for p in self.procs:
            _kill(p, signal.SIGKILL)
        _kill(self.harness, signal.SIGTERM)
        for p in [*self.procs, self.harness]:
            if p is not None:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    _kill(p, signal.SIGKILL)
                    p.wait(timeout=5)

    def __enter__(self) -> "AgentProcesses":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _runs(ports: list[int]) -> list[tuple[int, int]]:
    """Contiguous runs: [8100, 8101, 8105] -> [(8100, 8101), (8105, 8105)]."""
    runs: list[list[int]] = []
    for p in ports:
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return [(lo, hi) for lo, hi in runs]


def _kill(p: subprocess.Popen | None, sig: int) -> None:
    if p is not None and p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass


class ThreadServer:
    """An ASGI app served by uvicorn in a daemon thread of this process (engines that must stay in-process).

    server = ThreadServer(app, port=8100).start()
    ...
    server.stop()
    """

    def __init__(self, app, *, port: int, host: str = "127.0.0.1"):
        import uvicorn

        self.url = f"http://{host}:{port}"
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", http=guarded_protocol())
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=f"uvicorn-{port}", daemon=True)

    def start(self, timeout_s: float = 30.0) -> "ThreadServer":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        if not self._server.started:
            raise RuntimeError(f"server at {self.url} did not start within {timeout_s} s (port taken?)")
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
