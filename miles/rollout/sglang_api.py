"""The wire format of SGLang's HTTP API as miles speaks it: JSON bodies <-> GenerateRequest / GenerateOutput,
and the base64 tensor payloads of ``/update_weights_from_tensor``.

The server (miles.rollout.server) and the client (miles.rollout.sglang) both use these functions, so the two
sides cannot drift apart. Field names follow SGLang's ``GenerateReqInput`` and its ``meta_info`` output.
"""

from __future__ import annotations

import base64
import io
import uuid
from typing import Any

import torch

from miles.rollout.engine import GenerateOutput, GenerateRequest, SamplingParams
from miles.sync.flat_bucket import BucketHandle, TensorMeta

FLATTENED_BUCKET = "flattened_bucket"  # load_format of a serialized BucketHandle (shared memory / CUDA IPC)


class WireError(ValueError):
    """A request body that does not follow the API; the message names the field and the fix."""


# ---- /generate ----------------------------------------------------------------------------------------------
def generate_body(requests: list[GenerateRequest], seed: int | None = None) -> dict:
    """One batched /generate body for ``requests`` (the batch form: input_ids is a list of lists)."""
    params = []
    for r in requests:
        s = r.sampling
        p = {
            "max_new_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "stop_token_ids": list(s.stop_token_ids),
        }
        if seed is not None:
            p["sampling_seed"] = seed
        params.append(p)
    return {
        "input_ids": [list(r.input_ids) for r in requests],
        "rid": [r.rid for r in requests],
        "sampling_params": params,
        "return_logprob": True,
    }


def parse_generate(body: Any) -> tuple[list[GenerateRequest], int | None, bool]:
    """(requests, seed, is_batch) from a /generate body; raises WireError with the field at fault."""
    if not isinstance(body, dict):
        raise WireError(f"/generate expects a JSON object, got {type(body).__name__}")
    if body.get("stream"):
        raise WireError("stream=true is not supported by miles serve; send stream=false and read the whole response")
    if "input_ids" not in body:
        hint = " (miles serve takes token ids; tokenize on the client)" if "text" in body else ""
        raise WireError(f"/generate needs input_ids{hint}")
    ids = body["input_ids"]
    is_batch = isinstance(ids, list) and len(ids) > 0 and all(isinstance(x, list) for x in ids)
    batch = ids if is_batch else [ids]
    n = len(batch)
    rids = _per_request(body.get("rid"), n, "rid") if body.get("rid") is not None else [None] * n
    sps = _per_request(body.get("sampling_params") or {}, n, "sampling_params")
    requests, seeds = [], set()
    for i, (one, rid, sp) in enumerate(zip(batch, rids, sps)):
        if not isinstance(one, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in one):
            raise WireError(f"input_ids[{i}] must be a list of integers, got {str(one)[:60]}")
        sampling, seed = _sampling(sp, i)
        seeds.add(seed)
        requests.append(
            GenerateRequest(rid=str(rid) if rid is not None else uuid.uuid4().hex, input_ids=one, sampling=sampling)
        )
    if len(seeds) > 1:
        raise WireError(
            f"sampling_params.sampling_seed differs within one request ({sorted(seeds, key=str)}); use one seed per call"
        )
    return requests, seeds.pop(), is_batch


def _per_request(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise WireError(f"{name} has {len(value)} entries for {n} prompts; send one per prompt or a single value")
        return value
    return [value] * n


_SAMPLING_FIELDS = {"max_new_tokens": int, "temperature": float, "top_p": float}


def _sampling(sp, i: int) -> tuple[SamplingParams, int | None]:
    if not isinstance(sp, dict):
        raise WireError(f"sampling_params[{i}] must be an object, got {type(sp).__name__}")
    kw = {}
    for name, tp in _SAMPLING_FIELDS.items():
        if sp.get(name) is None:
            continue
        v = sp[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (tp is int and not float(v).is_integer()):
            raise WireError(f"sampling_params.{name} = {v!r} must be {'an integer' if tp is int else 'a number'}")
        kw[name] = tp(v)
    if kw.get("max_new_tokens", 1) < 0 or kw.get("temperature", 1.0) < 0 or not 0 < kw.get("top_p", 1.0) <= 1:
        raise WireError(f"sampling_params {sp}: need max_new_tokens >= 0, temperature >= 0, 0 < top_p <= 1")
    stop = sp.get("stop_token_ids") or ()
    if not isinstance(stop, (list, tuple)) or not all(isinstance(t, int) for t in stop):
        raise WireError(f"sampling_params.stop_token_ids = {stop!r} must be a list of integers")
    seed = sp.get("sampling_seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise WireError(f"sampling_params.sampling_seed = {seed!r} must be an integer")
    return SamplingParams(**kw, stop_token_ids=tuple(stop)), seed


def output_json(o: GenerateOutput, prompt_len: int, return_logprob: bool) -> dict:
    """SGLang's response for one request: output_ids plus meta_info (finish_reason as an object)."""
    if o.finish_reason == "stop":
        reason = {"type": "stop", "matched": o.output_ids[-1] if o.output_ids else None}
    elif o.finish_reason == "length":
        reason = {"type": "length", "length": len(o.output_ids)}
    else:
        reason = {"type": "abort", "message": "aborted by /abort_request or pause_generation(mode='abort')"}
    meta = {
        "id": o.rid,
        "finish_reason": reason,
        "prompt_tokens": prompt_len,
        "completion_tokens": len(o.output_ids),
        "cached_tokens": 0,
        "weight_version": o.weight_version,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(o.output_log_probs, o.output_ids)]
    return {"text": "", "output_ids": o.output_ids, "meta_info": meta}


def parse_output(d: dict) -> GenerateOutput:
    """A GenerateOutput from one response object (miles serve or real SGLang)."""
    meta = d["meta_info"]
    reason = meta.get("finish_reason") or {"type": "abort"}
    kind = reason.get("type", "abort") if isinstance(reason, dict) else str(reason)
    lps = meta.get("output_token_logprobs") or []
    ids = d.get("output_ids")
    if ids is None:
        ids = [t for _, t, *_ in lps]
    return GenerateOutput(
        rid=str(meta.get("id", "")),
        output_ids=list(ids),
        output_log_probs=[float(x[0]) for x in lps],
        finish_reason=kind if kind in ("stop", "length") else "abort",
        weight_version=as_version(meta.get("weight_version")),
    )


def as_version(v) -> int:
    """SGLang reports weight_version as a string ('default' before any update); miles counts integers."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


# ---- tensor payloads ----------------------------------------------------------------------------------------
def encode_payload(obj) -> str:
    """base64 of ``torch.save(obj)``: a list of (name, tensor) pairs, a BucketHandle or a WeightManifest."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_payload(s: str):
    """Inverse of encode_payload, through torch's weights_only unpickler: only tensors, plain containers and
    bucket handles can be built, never arbitrary objects from the network."""
    try:
        raw = base64.b64decode(s, validate=True)
    except (ValueError, TypeError) as e:
        raise WireError(f"serialized_named_tensors entry is not base64 ({e}); send base64(torch.save(obj))") from None
    from miles.sync.base import WeightManifest, WeightSpec

    allowed = [BucketHandle, TensorMeta, WeightManifest, WeightSpec, torch.Tensor, torch.UntypedStorage, torch.device]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(io.BytesIO(raw), weights_only=True, map_location=None)
    except Exception as e:  # noqa: BLE001 - the unpickler raises many kinds; all mean "bad payload"
        raise WireError(f"serialized_named_tensors entry could not be decoded: {str(e)[:300]}") from None


def bucket_handle(obj) -> BucketHandle:
    if not isinstance(obj, BucketHandle):
        raise WireError(f"load_format={FLATTENED_BUCKET!r} needs a serialized BucketHandle, got {type(obj).__name__}")
    return obj


def weight_manifest(obj):
    from miles.sync.base import WeightManifest

    if not isinstance(obj, WeightManifest):
        raise WireError(f"manifest must be a serialized miles.sync.base.WeightManifest, got {type(obj).__name__}")
    return obj


def named_tensors_of(obj, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a decoded ``load_format = null`` payload."""
    if load_format not in (None, "direct"):
        raise WireError(
            f"load_format = {load_format!r} is not supported; use null (named tensors) or {FLATTENED_BUCKET!r}"
        )
    if isinstance(obj, dict):
        obj = list(obj.items())
    if not isinstance(obj, list) or not all(
        isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
        for p in obj
    ):
        raise WireError("serialized_named_tensors must decode to a list of (name, tensor) pairs")
    return [(n, t) for n, t in obj]
