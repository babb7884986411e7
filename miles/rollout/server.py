"""``miles serve``: the embedded engine behind the SGLang HTTP endpoints that RL uses, so the SGLang client
(miles.rollout.sglang) and the router are exercised over real HTTP on any machine.

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

Deliberate differences from SGLang:
- /generate takes ``input_ids`` only (no ``text``; the server holds no tokenizer) and returns ``"text": ""``;
  ``stream`` is refused. Concurrent calls are batched (collected for ``--batch-wait-ms``) and run one batch at a
  time on the engine's single KV cache.
- ``sampling_params.sampling_seed`` must be the same for every prompt of a call; a seeded call runs as a batch of
  its own, so its outputs equal an in-process ``engine.generate(requests, seed=...)``.
- ``weight_version`` is an integer (SGLang: a string, "default" before any update); the client reads both.
- /update_weights_from_tensor: each ``serialized_named_tensors`` entry is ``base64(torch.save(obj))`` (SGLang:
  its MultiprocessingSerializer), decoded with torch's weights_only unpickler. ``obj`` is a list of (name, tensor)
  pairs (bytes travel in the body; works across machines), or, with ``load_format="flattened_bucket"``, a
  miles.sync.flat_bucket.BucketHandle (shared memory on CPU, CUDA IPC on GPU: one machine only). All tensors are
  checked (name, shape, dtype) before any is written; a mismatch is a 400 and nothing changes.
- /update_weights_from_disk: ``model_path`` is a disk-delta directory (miles.sync.disk_delta), not a HF checkpoint.
- /release_memory_occupation and /resume_memory_occupation return ``{"bytes": n}``; unknown tags are a 400 (valid:
  weights, kv_cache, cuda_graph). They wait for the running batch; while generation is paused in place they
  answer 409 instead of waiting forever.
- /pause_generation supports mode "abort" and "in_place" ("retract" is a 400). /abort_request reaches queued
  requests at once and running ones at the next decode step (finish_reason ``abort``, tokens so far kept).
- /health answers 200 whenever the process serves HTTP; /health_generate runs a one-token generate (503 while
  memory is released).
- Every 4xx body is ``{"success": false, "message": ..., "error": {"message": ..., "code": ...}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import logging
import os
import socket
import sys
import threading
import time

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from miles.memory.ledger import process_rss_bytes
from miles.rollout.batcher import GenerateBatcher
from miles.rollout.engine import ENGINE_TAGS, EmbeddedEngine, GenerateRequest, SamplingParams
from miles.rollout.sglang_api import (
    FLATTENED_BUCKET,
    WireError,
    bucket_handle,
    decode_payload,
    named_tensors_of,
    output_json,
    parse_generate,
    weight_manifest,
)

log = logging.getLogger("miles.serve")
READY_PREFIX = "miles serve: listening on "


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
    if not isinstance(body, dict):
        raise WireError(f"expected a JSON object, got {type(body).__name__}")
    return body


def _version(v, field: str = "weight_version") -> int | None:
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        raise WireError(f"{field} = {v!r} must be an integer (miles counts versions)") from None


def _tags(body: dict) -> list[str]:
    tags = body.get("tags")
    if tags is None:
        return list(ENGINE_TAGS)
    if isinstance(tags, str) or not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise WireError(f'tags = {tags!r} must be a list of strings, e.g. ["kv_cache", "weights"]')
    bad = [t for t in tags if t not in ENGINE_TAGS]
    if bad:
        raise WireError(f"unknown memory tag(s) {bad}; valid tags: {list(ENGINE_TAGS)}")
    return tags


class EngineServer:
    """The app's state: one engine, its batcher, and the weight-update receivers.

    server = EngineServer(engine, batch_wait_ms=5); app = server.app   # then run app with uvicorn
    """

    def __init__(self, engine: EmbeddedEngine, *, batch_wait_ms: float = 5.0, info: dict | None = None):
        self.engine, self.info = engine, info or {}
        self.batch_wait_s = batch_wait_ms / 1000
        self.batcher: GenerateBatcher | None = None
        self.paused_in_place = False
        self.app = FastAPI(title="miles serve", lifespan=self._lifespan)
        self._routes()

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.batcher = GenerateBatcher(self.engine, wait_s=self.batch_wait_s)
        self.batcher.start()
        yield
        await self.batcher.stop()

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
        async def conflict(_, exc):
            return _error(409, str(exc))

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
            reqs, seed, is_batch = parse_generate(body)
            outs = await self.batcher.submit(reqs, seed)
            res = [output_json(o, len(r.input_ids), bool(body.get("return_logprob"))) for r, o in zip(reqs, outs)]
            return res if is_batch else res[0]

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.get("/health_generate")
        async def health_generate():
            if e.memory.is_paused("weights") or e.memory.is_paused("kv_cache"):
                return _error(503, "memory is released; resume_memory_occupation before generating")
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

    def _control_routes(self, app: FastAPI, e: EmbeddedEngine) -> None:
        """Weight version, cache, aborts, pause / continue, memory release / resume."""

        @app.post("/update_weight_version")
        async def update_weight_version(request: Request):
            body = await _body(request)
            if body.get("abort_all_requests"):
                self.batcher.abort(None)
            e.set_weight_version(_version(body.get("new_version"), "new_version") or 0)
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
            return await self._memory(e.release_memory, _tags(await _body(request)))

        @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
        async def resume(request: Request):
            return await self._memory(e.resume_memory, _tags(await _body(request)))

    def _weight_routes(self, app: FastAPI, e: EmbeddedEngine) -> None:
        """Weight updates: tensor buckets, transactions, disk deltas."""

        @app.post("/update_weights_from_tensor")
        async def update_from_tensor(request: Request):
            body = await _body(request)
            entries = body.get("serialized_named_tensors")
            if not isinstance(entries, list) or not entries or not all(isinstance(s, str) for s in entries):
                raise WireError("serialized_named_tensors must be a non-empty list of base64 strings (one per TP rank)")
            version = _version(body.get("weight_version"))
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
            path = body.get("model_path")
            if not isinstance(path, str) or not path:
                raise WireError("/update_weights_from_disk needs model_path (a disk-delta directory)")
            if not os.path.isdir(path):
                raise WireError(f"model_path {path!r} is not a directory on the server's machine")
            await asyncio.to_thread(e.update_weights_from_disk, path, _version(body.get("weight_version")))
            return {
                "success": True,
                "message": f"loaded {path}; weight version {e.weight_version}",
                "num_paused_requests": 0,
            }

    def _group_routes(self, app: FastAPI, e: EmbeddedEngine) -> None:
        """Weight updates by torch.distributed broadcast: join a group, receive into it, leave it."""

        @app.post("/init_weights_update_group")
        async def init_group(request: Request):
            body = await _body(request)
            need = ("master_address", "master_port", "rank_offset", "world_size")
            if missing := [k for k in need if k not in body]:
                raise WireError(f"/init_weights_update_group needs {list(need)}; missing {missing}")
            await asyncio.to_thread(
                e.init_weights_update_group,
                str(body["master_address"]),
                int(body["master_port"]),
                int(body["rank_offset"]),
                int(body["world_size"]),
                body.get("group_name", "weight_update_group"),
                body.get("backend") or "gloo",
            )
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
            await asyncio.to_thread(
                e.update_weights_from_distributed,
                names,
                dtypes,
                shapes,
                body.get("group_name", "weight_update_group"),
                _version(body.get("weight_version")),
            )
            return {"success": True, "message": f"received {len(names)} tensors; weight version {e.weight_version}"}

        @app.post("/destroy_weights_update_group")
        async def destroy_group(request: Request):
            await asyncio.to_thread(
                e.destroy_weights_update_group, (await _body(request)).get("group_name", "weight_update_group")
            )
            return {"success": True, "message": "weights update group destroyed"}

    def _inspection_routes(self, app: FastAPI, e: EmbeddedEngine) -> None:
        """Weights, memory and the ledger, for checks and the dashboard."""

        @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
        async def weights_by_name(request: Request):
            body = await _body(request)
            name, n = body.get("name"), body.get("truncate_size", 100)
            weights = self._weights()
            if name not in weights:
                raise WireError(f"no weight named {name!r}; e.g. {next(iter(weights))!r}")
            return weights[name][: int(n)].float().tolist()

        @app.get("/miles/weights")
        async def all_weights():
            buf = io.BytesIO()
            torch.save({k: v.contiguous() for k, v in self._weights().items()}, buf)
            return Response(buf.getvalue(), media_type="application/octet-stream")

        @app.get("/miles/memory")
        async def memory():
            tags = {
                t: {"resident_bytes": e.memory.resident_bytes(t), "paused": e.memory.is_paused(t)} for t in ENGINE_TAGS
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
        if self.engine.memory.is_paused("weights"):
            raise Conflict('weights are released; /resume_memory_occupation {"tags": ["weights"]} first')
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles serve", description="serve the embedded engine over SGLang's HTTP API")
    p.add_argument("--recipe", default="quickstart")
    p.add_argument("--config", default="", help="a RunConfig JSON file (e.g. a run's config.json); overrides --recipe")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed on stdout)")
    p.add_argument("--owner", default="engine/0", help="owner name in the memory ledger")
    p.add_argument(
        "--batch-wait-ms", type=float, default=5.0, help="how long to collect concurrent requests into a batch"
    )
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone (set by spawners)")
    p.add_argument("--log-level", default="warning")
    return p


def load_config(args):
    from miles.config import RunConfig, apply_overrides
    from miles.recipes import get_recipe

    if args.config:
        with open(args.config) as f:
            cfg = RunConfig.from_dict(json.load(f))
    else:
        cfg = get_recipe(args.recipe)
    return apply_overrides(cfg, args.set)


def _watch_parent(pid: int) -> None:
    def watch():
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(0)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = _parser().parse_args(argv)
    cfg = load_config(args)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    engine = build_engine(cfg, device, args.owner)
    server = EngineServer(engine, batch_wait_ms=args.batch_wait_ms, info={"recipe": cfg.recipe, "owner": args.owner})
    if args.parent_pid:
        _watch_parent(args.parent_pid)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(2048)
    print(f"{READY_PREFIX}http://{args.host}:{sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(server.app, log_level=args.log_level, access_log=False, timeout_keep_alive=60, backlog=2048)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
