"""The control endpoints as sglang 0.5.10.post1 answers them (``srt/entrypoints/http_server.py``,
``srt/managers/io_struct.py``): /update_weight_version (``abort_all_requests`` defaults to true), /flush_cache
(its text), /abort_request (``rid`` one string, matched as a prefix as SGLang's scheduler does; an empty 200),
/pause_generation (``abort``, ``retract``, ``in_place``) and /continue_generation, and the memory endpoints
(200 with a ``null`` body).
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from miles.rollout.serve_http import Conflict, read_body
from miles.rollout.sglang_api import WireError, parse_tags

FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
PAUSE_MODES = ("abort", "retract", "in_place")
RETRACT_WAIT_S = 30.0  # how long /pause_generation {"mode": "retract"} waits for the running rows to go back


def add_routes(app: FastAPI, srv) -> None:
    e = srv.engine

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await read_body(request)
        v = body.get("new_version")
        if not isinstance(v, str):
            raise WireError(f"new_version = {v!r} must be a string (UpdateWeightVersionReqInput.new_version: str)")
        if _flag(body.get("abort_all_requests", True), "abort_all_requests"):
            srv.batcher.abort(None)
        n = srv.engine_version(v)
        await asyncio.to_thread(e.set_weight_version, n)  # commits an update opened by /miles/begin_weight_update
        srv.version = v
        return {"success": True, "message": f"Weight version updated to {v}", "new_version": v}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        e.flush_cache()
        return Response(FLUSHED)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await read_body(request)
        rid = body.get("rid", "")
        if _flag(body.get("abort_all", False), "abort_all"):
            srv.batcher.abort(None)
        elif isinstance(rid, str):
            if rid:  # SGLang's scheduler aborts every request whose rid starts with it
                srv.batcher.abort([r for r in srv.batcher.rids() if r.startswith(rid)])
        else:  # what SGLang answers (rid_to_state lookup of a list)
            raise WireError(f"unhashable type: '{type(rid).__name__}'; send one rid (a string) per /abort_request")
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        mode = (await read_body(request)).get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise WireError(f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
        if mode == "abort":
            srv.batcher.abort(None)
        e.pause_generation("retract" if mode == "retract" else "in_place")
        srv.paused = mode
        if mode == "retract":  # answer once the running rows are back in the queue (their KV may then go)
            deadline = time.monotonic() + RETRACT_WAIT_S
            while not e.loop.holds_no_rows and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation():
        released = [t for t in ("weights", "kv_cache") if e.memory.is_offloaded(t)]
        if srv.paused == "retract" and srv.batcher.in_flight and released:
            raise Conflict(
                f"requests are waiting to be prefilled again but the engine's {released} are released; "
                f"/resume_memory_occupation first"
            )
        e.continue_generation()
        srv.paused = None
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release(request: Request):
        await srv.with_engine_idle(e.offload, parse_tags(await read_body(request)))
        return JSONResponse(None)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume(request: Request):
        await srv.with_engine_idle(e.onload, parse_tags(await read_body(request)))
        return JSONResponse(None)


def _flag(v, name: str) -> bool:
    if not isinstance(v, bool):
        raise WireError(f"{name} = {v!r} must be true or false")
    return v
