"""Server processes: start ``miles serve`` (or a real SGLang server) as a child process, wait until it answers
/health, stop and restart it. RolloutManager spawns its HTTP engines with these when ``rollout.engine = "http"``;
``launch_sglang`` starts a real SGLang server and returns its client.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref

import httpx

from miles.rollout.sglang_client import SGLangClient

log = logging.getLogger(__name__)
READY_PREFIX = "miles serve: listening on "  # the line a `miles serve` child prints with its URL
_LIVE: "weakref.WeakSet[ServerProcess]" = weakref.WeakSet()


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for servers that cannot report the port they bound)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """A child HTTP server. With ``port=0`` in argv the child prints the URL it bound (``miles serve`` does).

    proc = ServerProcess(miles_serve_argv(config_path, owner="engine/0"))
    url = proc.start()          # blocks until GET /health answers 200
    proc.kill()                 # SIGKILL (tests use it to simulate a crash)
    url = proc.restart()        # a fresh process (the port may change)
    proc.stop()
    """

    def __init__(
        self,
        argv: list[str],
        *,
        url: str = "",
        ready_timeout_s: float = 180.0,
        env: dict | None = None,
        log_path: str = "",
    ):
        self.argv, self.fixed_url, self.ready_timeout_s = list(argv), url, ready_timeout_s
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.url = ""
        _LIVE.add(self)

    def launch(self) -> None:
        """Start the process without waiting (call ``wait_ready`` next); lets several servers boot in parallel."""
        stderr = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 - lives as long as the child
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=stderr, env=self.env, text=True)
        self.url = self.fixed_url

    def wait_ready(self) -> str:
        deadline = time.monotonic() + self.ready_timeout_s
        if not self.url:
            self.url = self._read_url(deadline)
        threading.Thread(target=self._drain, args=(self.proc,), daemon=True).start()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server {' '.join(self.argv[:6])}... exited with code {self.proc.returncode} before "
                    f"answering /health{self._log_hint()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(
            f"server at {self.url} did not answer /health within {self.ready_timeout_s:.0f} s{self._log_hint()}"
        )

    def start(self) -> str:
        self.launch()
        return self.wait_ready()

    def _read_url(self, deadline: float) -> str:
        found: list[str] = []

        def read():
            for line in self.proc.stdout:
                if line.startswith(READY_PREFIX):
                    found.append(line[len(READY_PREFIX) :].strip())
                    return

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(max(0.0, deadline - time.monotonic()))
        if not found:
            code = self.proc.poll()
            self.stop()
            raise RuntimeError(
                f"server did not report its address ({'exit code ' + str(code) if code is not None else 'timeout'})"
                f"{self._log_hint()}"
            )
        return found[0]

    @staticmethod
    def _drain(proc: subprocess.Popen) -> None:
        for _ in proc.stdout or ():  # keep the pipe from filling up
            pass

    def _log_hint(self) -> str:
        return f"; see {self.log_path}" if self.log_path else "; its stderr went to this process's stderr"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout_s: float = 5.0) -> None:
        if not self.alive:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> str:
        self.stop()
        return self.start()


@atexit.register
def _stop_all() -> None:
    for p in list(_LIVE):
        p.stop(timeout_s=2.0)


def miles_serve_argv(
    config_path: str,
    *,
    owner: str = "engine/0",
    host: str = "127.0.0.1",
    port: int = 0,
    batch_wait_ms: float = 5.0,
    extra: list[str] = (),
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "miles.rollout.serve_cli",
        "--config",
        config_path,
        "--host",
        host,
        "--port",
        str(port),
        "--owner",
        owner,
        "--batch-wait-ms",
        str(batch_wait_ms),
        "--parent-pid",
        str(os.getpid()),
        *extra,
    ]


def spawn_miles_servers(
    cfg, num: int, *, device: str = "", batch_wait_ms: float = 5.0, log_dir: str = ""
) -> list[ServerProcess]:
    """``num`` ``miles serve`` processes for ``cfg`` (a RunConfig), booted in parallel, all answering /health."""
    d = cfg.to_dict()
    if device:
        d["device"] = device
    fd, path = tempfile.mkstemp(prefix="miles-serve-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(d, f)
    env = {"OMP_NUM_THREADS": str(cfg.num_threads)} if cfg.num_threads else {}
    procs = [
        ServerProcess(
            miles_serve_argv(path, owner=f"engine/{i}", batch_wait_ms=batch_wait_ms),
            env=env,
            log_path=os.path.join(log_dir, f"engine_{i}.log") if log_dir else "",
        )
        for i in range(num)
    ]
    try:
        for p in procs:
            p.launch()
        for p in procs:
            p.wait_ready()
    except Exception:
        for p in procs:
            p.stop()
        raise
    return procs


# ---- launching real SGLang --------------------------------------------------------------------------------------
def sglang_available() -> bool:
    try:
        import sglang  # noqa: F401
    except ImportError:
        return False
    return True


def sglang_argv(
    model_path: str, *, port: int, host: str = "127.0.0.1", mem_fraction_static: float = 0.5, extra: list[str] = ()
) -> list[str]:
    """``python -m sglang.launch_server`` for RL rollouts: colocated memory (release/resume by tag needs
    --enable-memory-saver), weight sync by tensor, our own sampling seeds."""
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--mem-fraction-static",
        str(mem_fraction_static),
        "--enable-memory-saver",
        "--skip-server-warmup",
        *extra,
    ]


def launch_sglang(
    model_path: str,
    *,
    port: int = 0,
    ledger=None,
    extra: list[str] = (),
    log_path: str = "",
    ready_timeout_s: float = 600.0,
) -> SGLangClient:
    """Start a real SGLang server for ``model_path`` (a HF checkpoint directory) and return a client that owns it."""
    if not sglang_available():
        raise ImportError(
            "real SGLang is not installed (it needs a CUDA build): pip install 'miles[sglang]'; "
            "on CPU use rollout.engine=http, which serves the embedded engine with `miles serve`"
        )
    port = port or free_port()
    proc = ServerProcess(
        sglang_argv(model_path, port=port, extra=list(extra)),
        url=f"http://127.0.0.1:{port}",
        ready_timeout_s=ready_timeout_s,
        log_path=log_path,
    )
    proc.start()
    return SGLangClient(proc.url, flavor="sglang", ledger=ledger, process=proc)
