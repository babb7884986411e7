"""Server processes: start ``miles serve`` (or a real SGLang server) as a child process, wait until it answers
/health, stop and restart it. RolloutManager spawns its HTTP engines with these when ``rollout.engine = "http"``;
``launch_sglang`` starts a real SGLang server and returns its client.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor, as_completed

import httpx

from miles.http_guard import API_KEY_ENV, is_loopback
from miles.nodes import node_env
from miles.ports import free_port
from miles.rollout.sglang_client import SGLangClient
from miles.sglang_flags import STANDIN, engine_gpus, parse_port_range, sglang_server_flags

log = logging.getLogger(__name__)
READY_PREFIX = "miles serve: listening on "  # the line a `miles serve` child prints with its URL
_LIVE: "weakref.WeakSet[ServerProcess]" = weakref.WeakSet()


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
        log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 - lives as long as the child
        # a server at a fixed URL (SGLang) reports nothing we read: its stdout goes to the log with its stderr
        stdout = log if (log and self.fixed_url) else subprocess.PIPE
        stderr = subprocess.STDOUT if stdout is log else log
        self.proc = subprocess.Popen(self.argv, stdout=stdout, stderr=stderr, env=self.env, text=True)
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

    def _log_hint(self, lines: int = 20) -> str:
        if not self.log_path:
            return "; its stderr went to this process's stderr"
        try:
            with open(self.log_path, errors="replace") as f:
                tail = f.readlines()[-lines:]
        except OSError:
            tail = []
        return f"; see {self.log_path}" + (", which ends:\n" + "".join(tail).rstrip() if tail else " (empty)")

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
        "miles.cli.serve",
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
    env = ({"OMP_NUM_THREADS": str(cfg.num_threads)} if cfg.num_threads else {}) | node_env()  # samples name it
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


SGLANG_HINT = (
    "real SGLang is not installed (it needs a CUDA build): pip install 'miles[sglang]'; on CPU use "
    "rollout.sglang_launcher=miles-serve (the stand-in) or rollout.engine=http"
)


def sglang_engine_argv(cfg, index: int, port: int, config_path: str = "", host: str = "127.0.0.1") -> list[str]:
    """The command of SGLang engine ``index`` for ``cfg`` (a RunConfig): ``python -m <rollout.sglang_launcher>``
    and SGLang's flags (miles.sglang_flags); the stand-in is ``miles serve`` taking the same flags plus
    the run config it builds its engine from."""
    flags = sglang_server_flags(cfg.rollout, cfg.handoff, cfg.model.checkpoint, port, host)
    if cfg.rollout.sglang_launcher != STANDIN:
        return [sys.executable, "-m", cfg.rollout.sglang_launcher, *flags]
    owner = ["--owner", f"engine/{index}", "--parent-pid", str(os.getpid())]
    return [sys.executable, "-m", "miles.cli.serve", *flags, "--config", config_path, *owner]


def spawn_sglang_servers(cfg, *, device: str = "", log_dir: str = "") -> list[ServerProcess]:
    """One SGLang server per engine (``rollout.engine = "sglang"``), launched together and waited for in
    parallel; if any fails to answer /health, every one is stopped and the error carries its log's tail."""
    r = cfg.rollout
    if r.sglang_launcher != STANDIN and importlib.util.find_spec(r.sglang_launcher.split(".")[0]) is None:
        raise ImportError(SGLANG_HINT if r.sglang_launcher.startswith("sglang") else f"no module {r.sglang_launcher}")
    ports = parse_port_range(r.sglang_ports)[: r.num_engines] or [free_port() for _ in range(r.num_engines)]
    config_path = ""
    if r.sglang_launcher == STANDIN:
        d = cfg.to_dict() | ({"device": device} if device else {})
        fd, config_path = tempfile.mkstemp(prefix="miles-serve-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(d, f)
    log_dir = log_dir or tempfile.mkdtemp(prefix="miles-sglang-logs-")
    env = ({"OMP_NUM_THREADS": str(cfg.num_threads)} if cfg.num_threads else {}) | node_env()  # samples name it
    gpus = (lambda i: {}) if r.sglang_launcher == STANDIN else (lambda i: {"CUDA_VISIBLE_DEVICES": _ids(r, i)})
    procs = [
        ServerProcess(
            sglang_engine_argv(cfg, i, port, config_path),
            url=f"http://127.0.0.1:{port}",
            ready_timeout_s=r.engine_ready_timeout_s,
            env=env | gpus(i),
            log_path=os.path.join(log_dir, f"engine_{i}.log"),
        )
        for i, port in enumerate(ports)
    ]
    try:
        for p in procs:
            p.launch()
        with ThreadPoolExecutor(len(procs)) as pool:
            for fut in as_completed([pool.submit(p.wait_ready) for p in procs]):
                if fut.exception() is not None:
                    for p in procs:  # the other waiters see their process gone and return at once
                        p.stop()
                    raise fut.exception()
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def engine_server(
    cfg, index: int, *, host: str, api_key: str, gpu_index: int = 0, device: str = "", log_dir: str = ""
) -> ServerProcess:
    """Engine ``index``'s server (not yet started) for ``cfg`` (a RunConfig), bound to ``host``: ``miles serve`` for
    rollout.engine = http, the SGLang launcher (or its stand-in) for sglang, on the node-local GPUs of engine
    ``gpu_index`` (miles.sglang_flags.engine_gpus). Bound beyond loopback only with ``api_key``, which the server
    reads from its environment (real SGLang only from its --api-key flag)."""
    if not is_loopback(host) and not api_key:
        raise ValueError(
            f"engine {index} would listen on {host}, reachable from other machines, without an API key: anyone who "
            f"reaches the port could generate and load weights there. Set ${API_KEY_ENV} (the run generates one when "
            "it launches engines on other nodes), or bind 127.0.0.1"
        )
    r = cfg.rollout
    fd, config_path = tempfile.mkstemp(prefix="miles-serve-", suffix=".json")  # on this node: its disk may be its own
    with os.fdopen(fd, "w") as f:
        json.dump(cfg.to_dict() | ({"device": device} if device else {}), f)
    env = ({"OMP_NUM_THREADS": str(cfg.num_threads)} if cfg.num_threads else {}) | node_env()
    env |= {API_KEY_ENV: api_key} if api_key else {}
    log_path = os.path.join(log_dir or tempfile.mkdtemp(prefix="miles-engine-logs-"), f"engine_{index}.log")
    if r.engine == "http":
        argv = miles_serve_argv(config_path, owner=f"engine/{index}", host=host)
        return ServerProcess(argv, env=env, log_path=log_path)
    ports = parse_port_range(r.sglang_ports)
    port = ports[index] if ports else free_port(host)
    argv = sglang_engine_argv(cfg, index, port, config_path, host=host)
    if r.sglang_launcher != STANDIN:
        argv += [] if "--api-key" in argv else ["--api-key", api_key]  # visible in `ps` on that node: SGLang's only way
        env["CUDA_VISIBLE_DEVICES"] = _ids(r, gpu_index)
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    return ServerProcess(argv, url=url, ready_timeout_s=r.engine_ready_timeout_s, env=env, log_path=log_path)


def _ids(rollout, index: int) -> str:
    return ",".join(map(str, engine_gpus(rollout, index)))


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
        raise ImportError(SGLANG_HINT)
    port = port or free_port()
    proc = ServerProcess(
        sglang_argv(model_path, port=port, extra=list(extra)),
        url=f"http://127.0.0.1:{port}",
        ready_timeout_s=ready_timeout_s,
        log_path=log_path,
    )
    proc.start()
    return SGLangClient(proc.url, flavor="sglang", ledger=ledger, process=proc)
