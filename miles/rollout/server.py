"""``miles serve``: the embedded engine behind SGLang's HTTP API, answering as sglang 0.5.10.post1 answers (its
``srt/entrypoints/http_server.py`` is the spec), so real RL clients (slime, radixark/miles), OpenAI clients and
miles' own SGLang client (miles.rollout.sglang_client) and router can drive it on any machine.

    miles serve --recipe quickstart --set rollout.max_batch_size=64 --port 30000
    curl -s localhost:30000/generate -d '{"text": "2 + 2 =", "sampling_params": {"max_new_tokens": 4}}'

The routes, by room: /generate (and its SSE stream), /health_generate (miles.rollout.server_generate); /health,
/model_info, /server_info, /get_load, /v1/loads and their older names (miles.rollout.server_info); versions,
cache, aborts, pause / continue, memory (miles.rollout.server_control); weight updates by request, file or
broadcast group and the weight inspection routes (miles.rollout.server_weights); /v1/models, /v1/completions,
/v1/chat/completions (miles.rollout.openai_server). miles additions live under /miles/: GET /miles/memory
(resident bytes per tag), GET /miles/weights (all weights, ``torch.save`` bytes, for check_weights), POST
/miles/ledger (drain the engine's MemoryLedger), POST /miles/begin_weight_update ({"manifest": payload}: a
failure-safe update that later buckets land in and /update_weight_version commits), POST
/miles/abort_weight_update.

Who may call it (miles.http_guard): the Host header must name loopback or the bound host, a body must be sent
as ``application/json`` (415 otherwise), browsers' cross-site requests are refused, and with ``--api-key`` /
``$MILES_API_KEY`` every endpoint but /health needs ``Authorization: Bearer KEY``. Binding beyond loopback
without a key prints a warning. /flush_cache, /release_memory_occupation and /resume_memory_occupation take GET
as SGLang's do, but without a key a browser's GET needs same-origin evidence (405 otherwise; a program's GET, as
slime sends, passes). A request head must arrive within ``--head-timeout-s`` and one client address may hold
``--max-connections-per-client`` connections (miles.http_connections).

Where miles keeps a deliberate difference from SGLang, miles.rollout.server_info.DELIBERATE_DIFFERENCES says which
and why; /server_info lists them and the README repeats them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from miles.http_guard import LOOPBACK_HOSTS, HttpGuard
from miles.protocols.engine import WeightsNotSynced
from miles.rollout import openai_server, server_control, server_generate, server_info, server_weights
from miles.rollout.batcher import GenerateBatcher
from miles.rollout.engine import EmbeddedEngine
from miles.rollout.group_calls import GroupCalls, GroupJoinPending
from miles.rollout.serve_http import Conflict, error, read_body  # noqa: F401 - read_body: re-exported
from miles.rollout.sglang_api import WireError
from miles.sync.disk_delta.baseline import MissingTensorError

log = logging.getLogger("miles.serve")

# endpoints that change the engine's state and that SGLang also serves on GET: a browser's GET needs same-origin evidence
STATE_CHANGING_GETS = ("/flush_cache", "/release_memory_occupation", "/resume_memory_occupation")


class EngineServer:
    """The app's state: one engine, its batcher, the weight version string, the weight-update receivers.

    server = EngineServer(engine, batch_wait_ms=5, api_key=""); app = server.app   # then run app with uvicorn

    Broadcast-group calls go through ``GroupCalls`` (executors of their own, one pending join at most).
    """

    def __init__(
        self,
        engine: EmbeddedEngine,
        *,
        model=None,
        batch_wait_ms: float = 5.0,
        info: dict | None = None,
        api_key: str = "",
        allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS,
        group_connect_timeout_s: float = 30.0,
        max_request_bytes: int = 0,
    ):
        from miles.rollout.served_model import ServedModel

        self.engine, self.info = engine, info or {}
        self.model = model or ServedModel.of(engine.cfg, engine.max_seq_len)
        self.batch_wait_s = batch_wait_ms / 1000
        self.batcher: GenerateBatcher | None = None
        self.paused: str | None = None  # the mode of a pause in force: "abort", "in_place", "retract"
        self.version = "default"  # SGLang's weight_version string; the engine counts integers
        self.groups = GroupCalls(engine, connect_timeout_s=group_connect_timeout_s)
        self.app = FastAPI(title="miles serve", lifespan=self._lifespan)
        self.app.add_middleware(
            HttpGuard,
            api_key=api_key,
            allowed_hosts=allowed_hosts,
            max_body_bytes=max_request_bytes,
            state_changing_gets=STATE_CHANGING_GETS,
        )
        self._handlers(self.app)
        for room in (server_generate, server_info, server_control, server_weights, openai_server):
            room.add_routes(self.app, self)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.batcher = GenerateBatcher(self.engine, wait_s=self.batch_wait_s)
        self.batcher.start()
        yield
        await self.batcher.stop()
        self.groups.close()

    @staticmethod
    def _handlers(app: FastAPI) -> None:
        @app.exception_handler(ValueError)  # EngineError, WireError and the sync receiver's checks: bad input
        async def bad_request(_, exc):
            return error(400, str(exc))

        @app.exception_handler(RequestValidationError)
        async def invalid(_, exc):
            return error(400, f"invalid request: {exc.errors()}")

        @app.exception_handler(Conflict)
        @app.exception_handler(GroupJoinPending)
        @app.exception_handler(WeightsNotSynced)
        async def conflict(_, exc):
            return error(409, str(exc))

        @app.exception_handler(MissingTensorError)  # a KeyError: a disk-delta version naming an unknown tensor
        async def missing_tensor(_, exc):
            return error(400, str(exc.args[0] if exc.args else exc))

    # ---- weight versions: SGLang's strings outside, the engine's integers inside ----------------------------
    def engine_version(self, v) -> int | None:
        """The engine's integer for a version string sent with an update: the integer it spells, else the next
        count (SGLang takes any string, e.g. "step-3"); None when no version was sent. A non-string is a 400."""
        if v is None:
            return None
        if not isinstance(v, str):
            raise WireError(f"weight_version = {v!r} must be a string (SGLang's weight versions are strings)")
        try:
            n = int(v)
        except ValueError:
            return self.engine.weight_version + 1
        if not 0 <= n < 2**63:
            raise WireError(f"weight_version = {v!r} must spell an integer in [0, 2**63) or be a non-numeric string")
        return n

    def check_ready(self) -> None:
        if not self.engine.weights_synced:
            raise Conflict(self.engine.unsynced_message())

    def status(self) -> dict:
        e = self.engine
        out = {"status": "ok", "weight_version": self.version}
        if e.memory.is_offloaded("weights") or e.memory.is_offloaded("kv_cache"):
            out.update(status="memory_released", message="memory is released; resume_memory_occupation first")
        elif not e.weights_synced:
            out.update(status="weights_not_synced", message=e.unsynced_message())
        if pending := self.groups.pending_status():
            out["pending_group_join"] = pending
        return out

    async def with_engine_idle(self, fn, *args):
        """Run ``fn`` (a memory move) when no row holds KV state: between batches, or while a retract pause holds
        the loop. While generation is paused in place with requests in flight it would wait forever: 409."""
        if self.paused == "retract" and self.engine.loop.holds_no_rows:
            return await asyncio.to_thread(fn, *args)
        if self.paused in ("in_place", "abort") and self.batcher.in_flight:
            raise Conflict(
                "generation is paused in place with requests in flight; /continue_generation or "
                "/abort_request them before releasing or resuming memory"
            )
        async with self.batcher.idle:
            return await asyncio.to_thread(fn, *args)
