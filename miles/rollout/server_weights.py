"""Weight updates and weight inspection, in SGLang 0.5.10.post1's request shapes (``io_struct``:
``UpdateWeightsFromTensorReqInput``, ``UpdateWeightFromDiskReqInput``, ``InitWeightsUpdateGroupReqInput``,
``UpdateWeightsFromDistributedReqInput``), answered ``{"success": true, "message": ...}``; a version sent with an
update (a string) becomes the served ``weight_version`` once the update has landed. miles' own additions live
under /miles/.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response

from miles.memory.ledger import process_rss_bytes
from miles.rollout import sglang_payloads
from miles.rollout.engine import ENGINE_TAGS, is_hf_checkpoint
from miles.rollout.serve_http import Conflict, read_body
from miles.rollout.server_info import BROADCAST_FORMATS
from miles.rollout.sglang_api import (
    FLATTENED_BUCKET,
    WireError,
    bucket_handle,
    decode_payload,
    named_tensors_of,
    parse_group_args,
    weight_manifest,
)


def add_routes(app: FastAPI, srv) -> None:
    _tensor_routes(app, srv)
    _group_routes(app, srv)
    _inspection_routes(app, srv)


def _tensor_routes(app: FastAPI, srv) -> None:
    e = srv.engine

    @app.post("/update_weights_from_tensor")
    async def update_from_tensor(request: Request):
        """SGLang's MultiprocessingSerializer payloads (pairs, or slime's flattened bucket; read by a restricted
        unpickler, entry 0 as SGLang's tensor-parallel rank 0 reads), or miles' own torch.save payloads (pairs,
        or flat-bucket handles: every entry)."""
        body = await read_body(request)
        entries, fmt = body.get("serialized_named_tensors"), body.get("load_format")
        if not isinstance(entries, list) or not entries or not all(isinstance(s, str) for s in entries):
            raise WireError("serialized_named_tensors must be a non-empty list of base64 strings (one per TP rank)")
        v = body.get("weight_version")
        version = srv.engine_version(v)
        if _flag(body.get("abort_all_requests", False)):
            srv.batcher.abort(None)
        raw = [_b64(s) for s in entries]
        if sglang_payloads.is_pickle(raw[0]):
            named = sglang_payloads.named_tensors(sglang_payloads.deserialize(raw[0]), fmt)
            await asyncio.to_thread(e.update_weights_from_tensor, named, version)
            message = f"updated {len(named)} tensors"
        elif fmt == FLATTENED_BUCKET:  # miles' bucket handle: the engine opens it (and lands it in an open update)
            for s in entries:
                await asyncio.to_thread(_apply_bucket, e, bucket_handle(decode_payload(s)), version)
            message = f"applied {len(entries)} bucket(s)"
        else:
            named = [p for s in entries for p in named_tensors_of(decode_payload(s), fmt)]
            await asyncio.to_thread(e.update_weights_from_tensor, named, version)
            message = f"updated {len(named)} tensors"
        srv.version = srv.version if v is None else v
        return {"success": True, "message": f"{message}; weight version {srv.version}"}

    @app.post("/miles/begin_weight_update")
    async def begin_weight_update(request: Request):
        manifest = weight_manifest(decode_payload((await read_body(request)).get("manifest", "")))
        await asyncio.to_thread(e.begin_weight_update, manifest)
        return {"success": True, "message": f"update of {len(manifest.specs)} tensors opened"}

    @app.post("/miles/abort_weight_update")
    async def abort_weight_update():
        await asyncio.to_thread(e.abort_weight_update)
        return {"success": True, "message": f"update aborted; weight version stays {srv.version}"}

    @app.post("/update_weights_from_disk")
    async def update_from_disk(request: Request):
        """A HF checkpoint directory (SGLang's use: the whole model, weight_version optional) or a miles disk-delta
        directory (weight_version: the delta version to load)."""
        body = await read_body(request)
        path, v = body.get("model_path"), body.get("weight_version")
        version = srv.engine_version(v)
        if not isinstance(path, str) or not path:
            raise WireError("/update_weights_from_disk needs model_path (a HF checkpoint or disk-delta directory)")
        if not os.path.isdir(path):
            raise WireError(f"model_path {path!r} is not a directory on the server's machine")
        hf = is_hf_checkpoint(path)
        if not hf and path.endswith(".safetensors"):
            raise WireError(f"model_path {path!r} is neither a HF checkpoint (config.json) nor a disk-delta directory")
        if version is None and not hf:
            raise WireError("/update_weights_from_disk of a disk-delta directory needs weight_version (its version)")
        if _flag(body.get("abort_all_requests", False)):
            srv.batcher.abort(None)
        try:
            await asyncio.to_thread(e.update_weights_from_disk, path, version)
        except (TypeError, AttributeError, KeyError) as err:  # an index.json of the wrong shape (e.g. tensors a list)
            raise WireError(
                f"{path} is malformed ({type(err).__name__}: {err}); the engine keeps its weights"
            ) from None
        srv.version = srv.version if v is None else v
        return {"success": True, "message": f"Succeeded to update model weights from {path}.", "num_paused_requests": 0}


def _group_routes(app: FastAPI, srv) -> None:
    """Weight updates by torch.distributed broadcast: join a group, receive into it, leave it."""

    @app.post("/init_weights_update_group")
    async def init_group(request: Request):
        await srv.groups.join(*parse_group_args(await read_body(request)))
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(request: Request):
        body = await read_body(request)
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (
            isinstance(names, list)
            and isinstance(dtypes, list)
            and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)
        ):
            raise WireError("/update_weights_from_distributed needs names, dtypes and shapes: lists of equal length")
        group, v, fmt = (
            str(body.get("group_name", "weight_update_group")),
            body.get("weight_version"),
            body.get("load_format"),
        )
        if fmt not in (None, *BROADCAST_FORMATS):
            raise WireError(
                f"load_format = {fmt!r}; /update_weights_from_distributed takes null, {list(BROADCAST_FORMATS)}"
            )
        await srv.groups.receive(names, dtypes, shapes, group, srv.engine_version(v), fmt)
        srv.version = srv.version if v is None else v
        return {"success": True, "message": "Succeeded to update parameter online."}

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request):
        name = str((await read_body(request)).get("group_name", "weight_update_group"))
        if not srv.engine.in_weights_group(name):  # SGLang's model runner answers so (HTTP 400)
            raise WireError("The group to be destroyed does not exist.")
        await srv.groups.leave(name)
        return {"success": True, "message": "Succeeded to destroy custom process group."}


def _inspection_routes(app: FastAPI, srv) -> None:
    """Weights, memory and the ledger, for checks and the dashboard."""
    e = srv.engine

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def weights_by_name(request: Request):
        body = await read_body(request)
        name, n = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str):
            raise WireError(f"name = {str(name)[:80]} must be a string (one weight name)")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise WireError(f"truncate_size = {n!r} must be a non-negative integer")
        weights = _weights(srv)
        if name not in weights:
            raise WireError(f"no weight named {name!r}; e.g. {next(iter(weights))!r}")
        return weights[name][:n].float().tolist()

    @app.get("/miles/weights")
    async def all_weights():
        buf = io.BytesIO()
        torch.save({k: v.contiguous() for k, v in _weights(srv).items()}, buf)
        return Response(buf.getvalue(), media_type="application/octet-stream")

    @app.get("/miles/memory")
    async def memory():
        tags = {
            t: {"resident_bytes": e.memory.resident_bytes(t), "paused": e.memory.is_offloaded(t)} for t in ENGINE_TAGS
        }
        return {"tags": tags, "rss_bytes": process_rss_bytes()}

    @app.post("/miles/ledger")
    async def ledger():
        e.ledger.sample_process(getattr(e.memory, "owner", "engine"))
        events, samples = e.ledger.drain()
        return {"events": [_asdict(x) for x in events], "samples": [_asdict(x) for x in samples]}


def _weights(srv) -> dict[str, torch.Tensor]:
    e = srv.engine
    if e.memory.is_offloaded("weights"):
        raise Conflict('weights are released; /resume_memory_occupation {"tags": ["weights"]} first')
    if not e.weights_synced:  # discarded bytes (often NaN): nothing to read
        raise Conflict(e.unsynced_message())
    return e.named_weights()


def _apply_bucket(engine, handle, version) -> None:
    try:
        engine.update_weights_from_bucket(handle, version)
    except (OSError, RuntimeError) as err:
        raise WireError(
            f"bucket {handle.key} could not be opened ({err}); flattened buckets only work between "
            "processes of one machine"
        ) from None


def _b64(s: str) -> bytes:
    try:
        return base64.b64decode(s, validate=True)
    except (ValueError, TypeError) as e:
        raise WireError(f"serialized_named_tensors entry is not base64 ({e})") from None


def _flag(v) -> bool:
    if not isinstance(v, bool):
        raise WireError(f"abort_all_requests = {v!r} must be true or false")
    return v


def _asdict(x) -> dict:
    return {f: getattr(x, f) for f in x.__slots__}
