"""`miles dashboard RUN_DIR`: a local web server over a run directory (or a folder of runs), live while runs write.

JSON endpoints read a run directory through :class:`RunDirReader` (which refuses every path outside it); every
endpoint takes ``?run=NAME`` to pick one run of a folder of runs (:class:`RunCatalog`), the newest by default;
one binary endpoint streams a sample's whole token range for the token strip and its per-token chart; the
front end in ``static/`` is plain HTML/JS/CSS with no build step and nothing fetched from the internet.
Binds 127.0.0.1 unless told otherwise: the run directory may hold prompts and model outputs.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from miles.dashboard.runs import NotARunDir, RunCatalog
from miles.dashboard.store import NotInRunDir, RunDirReader
from miles.http_guard import LOOPBACK_HOSTS, HttpGuard, exposure_warning
from miles.http_guard import allowed_hosts as guard_hosts

STATIC = Path(__file__).parent / "static"
LOOPBACK = LOOPBACK_HOSTS
MAX_JSONL_BYTES = 4 << 20
# bounded so that no value a client sends can overflow a seek or a file name: out of range is a 422
Offset = Annotated[int, Query(ge=0, le=1 << 60)]
MaxBytes = Annotated[int, Query(ge=1, le=64 << 20)]
Step = Annotated[int, PathParam(ge=0, le=10**9)]
Row = Annotated[int, PathParam(ge=0, le=1 << 31)]
RunName = Annotated[str | None, Query(max_length=255)]


def _run_reader(request: Request, run: RunName = None) -> RunDirReader:
    """The reader of the run a request names (?run=NAME), or of the run the page opens with."""
    return request.app.state.catalog.reader(run)


Reader = Annotated[RunDirReader, Depends(_run_reader)]


def create_app(
    run_dir: str | os.PathLike, *, follow: bool = False, allowed_hosts: tuple[str, ...] = LOOPBACK
) -> FastAPI:
    """The dashboard app for a run directory or a folder of them; ``follow`` tells the page to poll for new data.

    Requests must name one of ``allowed_hosts`` in their Host header (loopback by default): a web page
    elsewhere cannot reach a local dashboard through a DNS name that it re-points at 127.0.0.1. Browsers'
    cross-site requests and bodies not sent as application/json are refused too (miles.http_guard).
    """
    catalog = RunCatalog(run_dir)
    app = FastAPI(title="miles dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(HttpGuard, allowed_hosts=tuple(allowed_hosts), max_body_bytes=1 << 20)  # it reads; no uploads
    app.state.catalog = catalog

    @app.exception_handler(NotInRunDir)
    async def not_found(_request, exc: NotInRunDir):
        return JSONResponse({"detail": f"not found in the run directory: {exc}"}, status_code=404)

    @app.get("/")
    def index():
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/api/info")
    def info(reader: Reader, run: RunName = None):
        return {"run_dir": str(reader.root), "name": run or catalog.default(), "follow": follow}

    @app.get("/api/runs")
    def runs():
        """The runs this dashboard serves (one, or the run directories of a folder) and the one it opens with."""
        return {
            "root": str(catalog.root),
            "folder": not catalog.single,
            "default": catalog.default(),
            "runs": catalog.listing(),
        }

    @app.get("/api/config")
    def config(reader: Reader):
        return reader.config()

    @app.get("/api/plan")
    def planned(reader: Reader):
        from miles.handoff.view import run_overlay

        return run_overlay(reader.config())

    @app.get("/api/checkpoints")
    def checkpoints(reader: Reader):
        return {"checkpoints": reader.checkpoints()}

    @app.get("/api/metrics")
    def metrics(reader: Reader, offset: Offset = 0, max_bytes: MaxBytes = MAX_JSONL_BYTES):
        return _jsonl(reader, "metrics.jsonl", offset, max_bytes)

    @app.get("/api/ledger")
    def ledger(reader: Reader, offset: Offset = 0, max_bytes: MaxBytes = MAX_JSONL_BYTES):
        return _jsonl(reader, "ledger.jsonl", offset, max_bytes)

    @app.get("/api/steps")
    def steps(reader: Reader):
        return {"steps": reader.steps()}

    @app.get("/api/steps/{step}/samples")
    def samples(reader: Reader, step: Step):
        index = reader.step_index(step)
        return {"step": step, "samples": index["samples"]}

    @app.get("/api/steps/{step}/samples/{row}")
    def sample(reader: Reader, step: Step, row: Row):
        """The whole token range of one sample plus its metadata and texts, streamed (see sample_chunks)."""
        size, chunks = reader.sample_chunks(step, row)
        headers = {"Content-Length": str(size), "Cache-Control": "no-cache"}
        return StreamingResponse(chunks, media_type="application/octet-stream", headers=headers)

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def _jsonl(reader: RunDirReader, name: str, offset: int, max_bytes: int) -> dict:
    try:
        rows, next_offset = reader.read_jsonl(name, offset, max_bytes)
    except (ValueError, OSError) as e:  # mid-line: a JSONDecodeError; past what the filesystem can seek: EINVAL
        raise HTTPException(
            400, f"offset = {offset} is not the start of a line of {name} ({type(e).__name__}); use 0 or a next_offset"
        ) from None
    return {"rows": rows, "next_offset": next_offset}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="miles dashboard", description="Serve a run directory as a local web dashboard.")
    p.add_argument(
        "run_dir",
        help="the run directory the driver writes (config.json, metrics.jsonl, rollouts/), or a folder of them: "
        "the page then has a run picker",
    )
    p.add_argument("--follow", action="store_true", help="poll for new steps, metrics and memory events (live run)")
    p.add_argument("--port", type=int, default=8642, help="port to listen on (0 = any free port)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind; the default keeps it on this machine")
    p.add_argument(
        "--allowed-hosts",
        default="",
        help="extra names the Host header may carry, comma-separated ('*' = any); loopback and --host always pass",
    )
    return p.parse_args(argv)


def _allowed_hosts(host: str, extra: str = "") -> tuple[str, ...]:
    # loopback and the bound host (IPv6 included); a wildcard bind (0.0.0.0) accepts any name reaching it
    return guard_hosts(host, extra)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 picks a free one (read it back with sock.getsockname()[1])."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(
            f"cannot listen on {host}:{port} ({e.strerror}); pick another --port, or 0 for any free one"
        ) from e
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(app: FastAPI):
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))


class DashboardServer:
    """The dashboard served from a background thread, for notebooks, tests and benchmarks.

    with DashboardServer(run_dir) as server:     # 127.0.0.1, a free port
        httpx.get(server.url + "api/steps")
    # or: server = DashboardServer(run_dir).start(); ...; server.stop()
    """

    def __init__(self, run_dir: str | os.PathLike, *, follow: bool = False, host: str = "127.0.0.1", port: int = 0):
        self.app = create_app(run_dir, follow=follow, allowed_hosts=_allowed_hosts(host))
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{self.port}/"
        self._server = _uvicorn_server(self.app)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout_s: float = 10.0) -> "DashboardServer":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the dashboard server on {self.url} did not start within {timeout_s} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> "DashboardServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if not Path(args.run_dir).is_dir():
        print(
            f"miles dashboard: {args.run_dir} is not a directory; pass a run_dir written by `miles train`",
            file=sys.stderr,
        )
        return 2
    try:
        app = create_app(args.run_dir, follow=args.follow, allowed_hosts=_allowed_hosts(args.host, args.allowed_hosts))
    except NotARunDir as e:
        print(f"miles dashboard: {e}", file=sys.stderr)
        return 2
    if exposure_warning("miles dashboard", args.host, ""):
        print(f"miles dashboard: serving on {args.host}: anyone who can reach it can read this run", file=sys.stderr)
    sock = bind(args.host, args.port)
    port = sock.getsockname()[1]
    catalog = app.state.catalog
    what = args.run_dir if catalog.single else f"{args.run_dir}: runs {', '.join(catalog.names())}"
    print(f"miles dashboard: http://{args.host}:{port}/  ({what}{', following' if args.follow else ''})", flush=True)
    try:
        _uvicorn_server(app).run(sockets=[sock])
    finally:
        sock.close()
    return 0
