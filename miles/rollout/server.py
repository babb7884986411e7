"""``miles serve``: the embedded engine behind the SGLang HTTP endpoints that RL uses, so the SGLang client
(miles.rollout.sglang_client) and the router are exercised over real HTTP on any machine.

    miles serve --recipe quickstart --set rollout.max_batch_size=64 --port 30000
    curl -s localhost:30000/generate -d '{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}'

Endpoints (SGLang names): /generate, /health, /health_generate, /get_model_info, /get_server_info, /get_load,
/get_weight_version, /update_weight_version, /flush_cache, /abort_request, /pause_generation,
/continue_generation, /release_memory_occupation, /resume_memory_occupation, /update_weights_from_tensor,
/update_weights_from_disk, /init_weights_update_group, /update_weights_from_distributed,
/destroy_weights_update_group, /get_weights_by_name. miles additions: GET /miles/memory (resident bytes per
tag), GET /miles/weights (all weights, ``torch.save`` bytes, for check_weights), POST /miles/ledger (drain the
engine's MemoryLedger), POST /miles/begin_weight_update ({"manifest": payload}: open a failure-safe update that
later buckets land in and /update_weight_version commits) and POST /miles/abort_weight_update.

Who may call it (miles.http_guard): the Host header must name loopback or the bound host, a body must be sent
as ``application/json`` (415 otherwise), browsers' cross-site requests are refused, and with ``--api-key`` /
``$MILES_API_KEY`` every endpoint but /health needs ``Authorization: Bearer KEY``. Binding beyond loopback
without a key prints a warning. /flush_cache, /release_memory_occupation and /resume_memory_occupation take GET
as SGLang's do, but without a key a GET needs same-origin evidence (405 otherwise; programs send POST). A
request head must arrive within ``--head-timeout-s`` and one client address may hold
``--max-connections-per-client`` connections (miles.http_connections).

Deliberate differences from SGLang:
- /generate takes ``input_ids`` only (no ``text``; the server holds no tokenizer) and returns ``"text": ""``;
  ``stream`` is refused. Concurrent calls are batched (collected for ``--batch-wait-ms``) and run one batch at a
  time on the engine's single KV cache. Every value is checked per call before it joins a batch (finite,
  non-denormal temperature and top_p, token ids in the vocabulary, lengths within max_seq_len), so one bad call
  gets its 400 and never fails the calls batched with it.
- ``sampling_params.sampling_seed`` must be the same for every prompt of a call; a seeded call runs as a batch of
  its own, so its outputs equal an in-process ``engine.generate(requests, seed=...)``.
- ``weight_version`` is an integer (SGLang: a string, "default" before any update); the client reads both.
- /update_weights_from_tensor: each ``serialized_named_tensors`` entry is ``base64(torch.save(obj))`` (SGLang:
  its MultiprocessingSerializer), decoded with torch's weights_only unpickler. ``obj`` is a list of (name, tensor)
  pairs (bytes travel in the body; works across machines), or, with ``load_format="flattened_bucket"``, a
  miles.sync.flat_bucket.BucketHandle (shared memory on CPU, CUDA IPC on GPU: one machine only). A bucket is
  opened only when it is a miles staging buffer of this user in the shared-memory directory, read-only
  (flat_bucket.check_handle). All tensors are checked (name, shape, dtype) before any is written; a mismatch is a
  400 and nothing changes.
- /update_weights_from_disk: ``model_path`` is a disk-delta directory (miles.sync.disk_delta.transport), not a HF
  checkpoint, and ``weight_version`` is required.
- /init_weights_update_group: joins run on an executor of their own (miles.rollout.group_calls), bounded by
  ``--group-connect-timeout-s``; a second join while one is pending is a 409.
- /release_memory_occupation and /resume_memory_occupation return ``{"bytes": n}``; unknown tags are a 400 (valid:
  weights, kv_cache, cuda_graph). They wait for the running batch; while generation is paused in place they
  answer 409 instead of waiting forever.
- /pause_generation supports mode "abort" and "in_place" ("retract" is a 400). /abort_request reaches queued
  requests at once and running ones at the next decode step (finish_reason ``abort``, tokens so far kept).
- /health answers 200 whenever the process serves HTTP (routers restart engines that fail it), with ``status``
  "ok" only when a generate would run: "memory_released", or "weights_not_synced" after discarded weights were
  resumed and before every tensor was written again (/generate answers 409 meanwhile); a pending group join is
  listed. /health_generate answers 503 unless the status is "ok", else runs a one-token generate.
- Every 4xx body is ``{"success": false, "message": ..., "error": {"message": ..., "code": ...}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import time

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from miles.http_guard import LOOPBACK_HOSTS, HttpGuard
from miles.memory.ledger import process_rss_bytes
from miles.rollout.batcher import GenerateBatcher
from miles.rollout.engine import ENGINE_TAGS, EmbeddedEngine, GenerateRequest, SamplingParams, WeightsNotSynced
from miles.rollout.group_calls import GroupCalls, GroupJoinPending
from miles.rollout.sglang_api import (
    FLATTENED_BUCKET,
    WireError,
    bucket_handle,
    decode_payload,
    named_tensors_of,
    output_json,
    parse_generate,
    parse_group_args,
    parse_tags,
    parse_version,
    weight_manifest,
)
from miles.sync.disk_delta.baseline import MissingTensorError

log = logging.getLogger("miles.serve")


# endpoints that change the engine's state and that SGLang also serves on GET: GET needs same-origin evidence here
STATE_CHANGING_GETS = ("/flush_cache", "/release_memory_occupation", "/resume_memory_occupation")


class Conflict(RuntimeError):
    """The request is valid but the engine's state forbids it now (HTTP 409)."""


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"success": False, "message": message, "error": {"message": message, "code": status}}, status_code=status
    )


async def _body(request: Request) -> dict:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WireError(f"malformed JSON body: {e}; send a JSON object") from None
    except RecursionError:
        raise WireError("JSON body nested too deeply to parse; send a flat JSON object") from None
    if not isinstance(body, dict):
        raise WireError(f"expected a JSON object, got {type(body).__name__}")
    return body


class EngineServer:
    """The app's state: one engine, its batcher, and the weight-update receivers.

    server = EngineServer(engine, batch_wait_ms=5, api_key=""); app = server.app   # then run app with uvicorn

    Broadcast-group calls go through ``GroupCalls`` (executors of their own, one pending join at most).
    """

    def __init__(
        self,
        engine: EmbeddedEngine,
        *,
        batch_wait_ms: float = 5.0,
        info: dict | None = None,
        api_key: str = "",
        allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS,
        group_connect_timeout_s: float = 30.0,
        max_request_bytes: int = 0,
    ):
        self.engine, self.info = engine, info or {}
        self.batch_wait_s = batch_wait_ms / 1000
        self.batcher: GenerateBatcher | None = None
        self.paused_in_place = False
        self.groups = GroupCalls(engine, connect_timeout_s=group_connect_timeout_s)
        self.app = FastAPI(title="miles serve", lifespan=self._lifespan)
        self.app.add_middleware(
            HttpGuard,
            api_key=api_key,
            allowed_hosts=allowed_hosts,
            max_body_bytes=max_request_bytes,
            state_changing_gets=STATE_CHANGING_GETS,
        )
        self._routes()

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.batcher = GenerateBatcher(self.engine, wait_s=self.batch_wait_s)
        self.batcher.start()
        yield
        await self.batcher.stop()
        self.groups.close()

    def _routes(self) -> None:
        """The HTTP surface, by group: serving, control (versions, pause, memory), weight updates (by request, by
        broadcast group), inspection."""
        app = self.app

        @app.exception_handler(ValueError)  # EngineError, WireError and the sync receiver's checks: bad input
        async def bad_request(_, exc):
            return _error(400, str(exc))

        @app.exception_handler(RequestValidationError)
        async def invalid(_, exc):
            return _error(400, f"invalid request: {exc.errors()}")

        @app.exception_handler(Conflict)
        @app.exception_handler(GroupJoinPending)
        @app.exception_handler(WeightsNotSynced)
        async def conflict(_, exc):
            return _error(409, str(exc))

        @app.exception_handler(MissingTensorError)  # a KeyError: a disk-delta version naming an unknown tensor
        async def missing_tensor(_, exc):
            return _error(400, str(exc.args[0] if exc.args else exc))

        for group in (
            self._serving_routes,
            self._control_routes,
            self._weight_routes,
            self._group_routes,
            self._inspection_routes,
        ):
            group(app, self.engine)

    def _serving_routes(self, app: FastAPI, e: EmbeddedEngine) -> None:
        """SGLang-compatible generation and the read-only status endpoints."""

        @app.api_route("/generate", methods=["POST", "PUT"])
        async def generate(request: Request):
            body = await _body(request)
            reqs, seed, is_batch = parse_generate(body, vocab_size=e.cfg.vocab_size, max_seq_len=e.max_seq_len)
            if not e.weights_synced:
                raise Conflict(e.unsynced_message())
            outs = await self.batcher.submit(reqs, seed)
            res = [output_json(o, len(r.input_ids), bool(body.get("return_logprob"))) for r, o in zip(reqs, outs)]
            return res if is_batch else res[0]

        @app.get("/health")
        async def health():
            """Liveness (200 while the process serves; routers restart engines that fail it) with the truth about
            readiness in the body: status "ok" only when a generate would run now."""
            return self.status()

        @app.get("/health_generate")
        async def health_generate():
            status = self.status()
            if status["status"] != "ok":
                return _error(503, status["message"])
            req = GenerateRequest(
                rid=f"HEALTH_CHECK_{time.time_ns()}",
                input_ids=[0],
                sampling=SamplingParams(max_new_tokens=1, temperature=0),
            )
            await self.batcher.submit([req])
            return {"status": "ok"}

        @app.get("/get_model_info")
        async def model_info():
            return {"model_path": e.cfg.checkpoint, "is_generation": True, "weight_version": e.weight_version}

        @app.get("/get_server_info")
        async def server_info():
            return {
                **self.info,
                "max_batch_size": e.max_batch_size,
                "max_seq_len": e.max_seq_len,
                "device": str(e.device),
                "batch_wait_ms": self.batch_wait_s * 1000,
                "pid": os.getpid(),
            }

        @app.get("/get_load")
        async def load():
            b = self.batcher
            return {
                "num_reqs": b.num_running + b.num_waiting,
                "num_running": b.num_running,
                "num_waiting": b.num_waiting,
                **b.stats,
            }

        @app.get("/get_weight_version")
        async def weight_version():
            return {"weight_version": e.weight_version}

    def status(self) -> dict:
        e = self.engine
        out = {"status": "ok", "weight_version": e.weight_version}
        if e.memory.is_offloaded("weights") or e.memory.is_offloaded("kv_cache"):
            out.update(status="memory_released", message="memory is released; resume_memory_occupation first")
        elif not e.weights_synced:
            out.update(status="weights_not_synced", message=e.unsynced_message())
        if pending := self.groups.pending_status():
            out["pending_group_join"] = pending
        return out

    def _control_routes(self, app: FastAPI, e: EmbeddedEngine) -> None:
        """Weight version, cache, aborts, pause / continue, memory release / resume."""

        @app.post("/update_weight_version")
        async def update_weight_version(request: Request):
            body = await _body(request)
            if body.get("abort_all_requests"):
                self.batcher.abort(None)
            e.set_weight_version(parse_version(body.get("new_version"), "new_version") or 0)
            return {
                "success": True,
                "message": f"weight version is {e.weight_version}",
                "new_version": e.weight_version,
            }

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache():
            e.flush_cache()
            return Response("Cache flushed.\n")

        @app.post("/abort_request")
        async def abort_request(request: Request):
            body = await _body(request)
            if body.get("abort_all"):
                n = self.batcher.abort(None)
            elif isinstance(body.get("rid"), (str, list)):
                rid = body["rid"]
                n = self.batcher.abort([rid] if isinstance(rid, str) else [str(r) for r in rid])
            else:
                raise WireError("/abort_request needs rid (a string or list) or abort_all=true")
            return {"success": True, "num_aborted": n}

        @app.post("/pause_generation")
        async def pause_generation(request: Request):
            mode = (await _body(request)).get("mode", "abort")
            if mode not in ("abort", "in_place"):
                raise WireError(f"pause_generation mode {mode!r} is not supported; use 'abort' or 'in_place'")
            if mode == "abort":
                self.batcher.abort(None)
            e.pause_generation("in_place")
            self.paused_in_place = True
            return {"message": "Generation paused successfully.", "status": "ok"}

        @app.post("/continue_generation")
        async def continue_generation():
            e.continue_generation()
            self.paused_in_place = False
            return {"message": "Generation continued successfully.", "status": "ok"}

        @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
        async def release(request: Request):
            return await self._memory(e.offload, parse_tags(await _body(request)))

        @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
        async def resume(request: Request):
            return await self._memory(e.onload, parse_tags(await _body(request)))

    def _weight_routes(self, app: FastAPI, e: EmbeddedEngine) -> None:
        """Weight updates: tensor buckets, transactions, disk deltas."""

        @app.post("/update_weights_from_tensor")
        async def update_from_tensor(request: Request):
            body = await _body(request)
            entries = body.get("serialized_named_tensors")
            if not isinstance(entries, list) or not entries or not all(isinstance(s, str) for s in entries):
                raise WireError("serialized_named_tensors must be a non-empty list of base64 strings (one per TP rank)")
            version = parse_version(body.get("weight_version"))
            if body.get("load_format") == FLATTENED_BUCKET:  # the engine opens it (and lands it in an open update)
                for s in entries:
                    await asyncio.to_thread(_apply_bucket, e, bucket_handle(decode_payload(s)), version)
                return {
                    "success": True,
                    "message": f"applied {len(entries)} bucket(s); weight version {e.weight_version}",
                }
            named = [p for s in entries for p in named_tensors_of(decode_payload(s), body.get("load_format"))]
            await asyncio.to_thread(e.update_weights_from_tensor, named, version)
            return {"success": True, "message": f"updated {len(named)} tensors; weight version {e.weight_version}"}

        @app.post("/miles/begin_weight_update")
        async def begin_weight_update(request: Request):
            manifest = weight_manifest(decode_payload((await _body(request)).get("manifest", "")))
            await asyncio.to_thread(e.begin_weight_update, manifest)
            return {"success": True, "message": f"update of {len(manifest.specs)} tensors opened"}

        @app.post("/miles/abort_weight_update")
        async def abort_weight_update():
            await asyncio.to_thread(e.abort_weight_update)
            return {"success": True, "message": f"update aborted; weight version stays {e.weight_version}"}

        @app.post("/update_weights_from_disk")
        async def update_from_disk(request: Request):
            body = await _body(request)
            path, version = body.get("model_path"), parse_version(body.get("weight_version"))
            if not isinstance(path, str) or not path:
                raise WireError("/update_weights_from_disk needs model_path (a disk-delta directory)")
            if version is None:
                raise WireError("/update_weights_from_disk needs weight_version: the disk-delta version to load")
            if not os.path.isdir(path) or path.endswith(".safetensors"):
                raise WireError(f"model_path {path!r} is not a disk-delta directory on the server's machine")
            try:
                await asyncio.to_thread(e.update_weights_from_disk, path, version)
            except (TypeError, AttributeError) as err:  # an index.json of the wrong shape (e.g. tensors a list)
                raise WireError(
                    f"version {version} under {path} is malformed ({type(err).__name__}: {err}); "
                    "the engine keeps its weights"
                ) from None
            return {
                "success": True,
                "message": f"loaded {path}; weight version {e.weight_version}",
                "num_paused_requests": 0,
            }

    def _group_routes(self, app: FastAPI, e: EmbeddedEngine) -> None:
        """Weight updates by torch.distributed broadcast: join a group, receive into it, leave it."""

        @app.post("/init_weights_update_group")
        async def init_group(request: Request):
            await self.groups.join(*parse_group_args(await _body(request)))
            return {"success": True, "message": "weights update group initialised"}

        @app.post("/update_weights_from_distributed")
        async def update_from_distributed(request: Request):
            body = await _body(request)
            names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
            if not (
                isinstance(names, list)
                and isinstance(dtypes, list)
                and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)
            ):
                raise WireError(
                    "/update_weights_from_distributed needs names, dtypes and shapes: lists of equal length"
                )
            group = str(body.get("group_name", "weight_update_group"))
            await self.groups.receive(names, dtypes, shapes, group, parse_version(body.get("weight_version")))
            return {"success": True, "message": f"received {len(names)} tensors; weight version {e.weight_version}"}

        @app.post("/destroy_weights_update_group")
        async def destroy_group(request: Request):
            name = (await _body(request)).get("group_name", "weight_update_group")
            await self.groups.leave(str(name))
            return {"success": True, "message": "weights update group destroyed"}

    def _inspection_routes(self, app: FastAPI, e: EmbeddedEngine) -> None:
        """Weights, memory and the ledger, for checks and the dashboard."""

        @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
        async def weights_by_name(request: Request):
            body = await _body(request)
            name, n = body.get("name"), body.get("truncate_size", 100)
            if not isinstance(name, str):
                raise WireError(f"name = {str(name)[:80]} must be a string (one weight name)")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise WireError(f"truncate_size = {n!r} must be a non-negative integer")
            weights = self._weights()
            if name not in weights:
                raise WireError(f"no weight named {name!r}; e.g. {next(iter(weights))!r}")
            return weights[name][:n].float().tolist()

        @app.get("/miles/weights")
        async def all_weights():
            buf = io.BytesIO()
            torch.save({k: v.contiguous() for k, v in self._weights().items()}, buf)
            return Response(buf.getvalue(), media_type="application/octet-stream")

        @app.get("/miles/memory")
        async def memory():
            tags = {
                t: {"resident_bytes": e.memory.resident_bytes(t), "paused": e.memory.is_offloaded(t)}
                for t in ENGINE_TAGS
            }
            return {"tags": tags, "rss_bytes": process_rss_bytes()}

        @app.post("/miles/ledger")
        async def ledger():
            e.ledger.sample_process(getattr(e.memory, "owner", "engine"))
            events, samples = e.ledger.drain()
            return {"events": [_asdict(x) for x in events], "samples": [_asdict(x) for x in samples]}

    async def _memory(self, fn, tags: list[str]) -> dict:
        if self.paused_in_place and self.batcher.in_flight:
            raise Conflict(
                "generation is paused in place with requests in flight; /continue_generation or "
                "/abort_request them before releasing or resuming memory"
            )
        async with self.batcher.idle:
            n = await asyncio.to_thread(fn, tags)
        return {"success": True, "message": f"{fn.__name__} {tags}: {n} bytes", "bytes": n}

    def _weights(self) -> dict[str, torch.Tensor]:
        if self.engine.memory.is_offloaded("weights"):
            raise Conflict('weights are released; /resume_memory_occupation {"tags": ["weights"]} first')
        if not self.engine.weights_synced:  # discarded bytes (often NaN): nothing to read
            raise Conflict(self.engine.unsynced_message())
        return self.engine.named_weights()


def _apply_bucket(engine, handle, version) -> None:
    try:
        engine.update_weights_from_bucket(handle, version)
    except (OSError, RuntimeError) as err:
        raise WireError(
            f"bucket {handle.key} could not be opened ({err}); flattened buckets only work between "
            "processes of one machine"
        ) from None


def _asdict(x) -> dict:
    return {f: getattr(x, f) for f in x.__slots__}


# ---- the command ----------------------------------------------------------------------------------------------
def build_engine(cfg, device: str, owner: str = "engine/0") -> EmbeddedEngine:
    """The engine a RolloutManager would build in-process for ``cfg`` (a RunConfig)."""
    r = cfg.rollout
    return EmbeddedEngine(
        cfg.model,
        max_batch_size=r.max_batch_size,
        max_seq_len=r.max_seq_len,
        device=device,
        seed=cfg.seed,
        owner=owner,
        weights_policy="host" if cfg.handoff.engine_host_mirror else "discard",
        logprob_chunk_size=cfg.trainer.logprob_chunk_size,
    )
