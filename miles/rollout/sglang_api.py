"""The wire format of SGLang's HTTP API as miles speaks it: JSON bodies <-> GenerateRequest / GenerateOutput,
and the base64 tensor payloads of ``/update_weights_from_tensor``.

The server (miles.rollout.server) and the client (miles.rollout.sglang_client) both use these functions, so the two
sides cannot drift apart. Field names follow SGLang's ``GenerateReqInput`` and its ``meta_info`` output.
"""

from __future__ import annotations

import base64
import io
import math
import sys
import uuid
from typing import Any

import torch

from miles.rollout.engine import ENGINE_TAGS, GenerateOutput, GenerateRequest, SamplingParams
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
            "top_k": s.top_k or -1,  # SGLang: -1 = the whole vocabulary (0 is a 400 there)
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


def parse_generate(
    body: Any, *, vocab_size: int = 0, max_seq_len: int = 0
) -> tuple[list[GenerateRequest], int | None, bool]:
    """(requests, seed, is_batch) from a /generate body; raises WireError with the field at fault. Every value is
    checked here, per call, so that no request can fail the engine batch it would share with others; with the
    engine's ``vocab_size`` and ``max_seq_len`` token ids and lengths are checked too."""
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
        if not one:
            raise WireError(f"input_ids[{i}] is empty; send at least one token")
        _check_ids(one, f"input_ids[{i}]", vocab_size)
        sampling, seed = _sampling(sp, i, vocab_size)
        if max_seq_len and len(one) + sampling.max_new_tokens > max_seq_len:
            raise WireError(
                f"request {i}: prompt {len(one)} + sampling_params.max_new_tokens {sampling.max_new_tokens} exceeds "
                f"the engine's max_seq_len {max_seq_len}; shorten it or raise rollout.max_seq_len"
            )
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
MIN_TEMPERATURE = 1e-6  # below it (but not 0) logits / temperature overflow float32: NaN probabilities
MAX_TOKEN_ID = 2**63  # token ids travel as int64
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes


def _sampling(sp, i: int, vocab_size: int = 0) -> tuple[SamplingParams, int | None]:
    if not isinstance(sp, dict):
        raise WireError(f"sampling_params[{i}] must be an object, got {type(sp).__name__}")
    kw = {}
    for name, tp in _SAMPLING_FIELDS.items():
        if sp.get(name) is None:
            continue
        v = sp[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise WireError(f"request {i}: sampling_params.{name} = {v!r} must be a finite number")
        if tp is int and not float(v).is_integer():
            raise WireError(f"request {i}: sampling_params.{name} = {v!r} must be an integer")
        kw[name] = tp(v)
    _check_ranges(kw, i)
    kw["top_k"] = _top_k(sp.get("top_k"), i)
    stop = sp.get("stop_token_ids") or ()
    if not isinstance(stop, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop):
        raise WireError(f"request {i}: sampling_params.stop_token_ids = {str(stop)[:60]} must be a list of integers")
    _check_ids(stop, f"request {i}: sampling_params.stop_token_ids", vocab_size)
    seed = sp.get("sampling_seed")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed < SEED_RANGE[1]
    ):
        raise WireError(f"request {i}: sampling_params.sampling_seed = {seed!r} must be a 64-bit integer")
    return SamplingParams(**kw, stop_token_ids=tuple(stop)), seed


def _top_k(k, i: int) -> int:
    """SGLang's top_k: -1 (or absent) = the whole vocabulary, else at least 1; miles' engine counts 0 as no cut."""
    if k is None or k == -1:
        return 0
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise WireError(f"request {i}: sampling_params.top_k = {k!r} must be -1 (disable) or an integer >= 1")
    return k


def _check_ranges(kw: dict, i: int) -> None:
    n, temp, top_p = kw.get("max_new_tokens", 1), kw.get("temperature", 1.0), kw.get("top_p", 1.0)
    if n < 0:
        raise WireError(f"request {i}: sampling_params.max_new_tokens = {n} must be >= 0")
    if temp != 0 and not MIN_TEMPERATURE <= temp:
        raise WireError(
            f"request {i}: sampling_params.temperature = {temp!r} must be 0 (greedy) or >= {MIN_TEMPERATURE}"
        )
    if not (0 < top_p <= 1 and top_p >= sys.float_info.min):  # a denormal top_p is not a probability mass
        raise WireError(f"request {i}: sampling_params.top_p = {top_p!r} must be in (0, 1] (and not denormal)")


def _check_ids(ids, field: str, vocab_size: int) -> None:
    hi = vocab_size or MAX_TOKEN_ID
    bad = [t for t in ids if not 0 <= t < hi]
    if bad:
        where = f"the vocabulary [0, {vocab_size})" if vocab_size else "[0, 2**63)"
        raise WireError(f"{field}: token ids {', '.join(str(t)[:24] for t in bad[:5])} are outside {where}")


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


# ---- control bodies ------------------------------------------------------------------------------------------
def parse_version(v, field: str = "weight_version") -> int | None:
    """An integer weight version from a body field (SGLang sends strings); None when absent."""
    if v is None:
        return None
    try:
        n = int(v)
    except (TypeError, ValueError, OverflowError):
        raise WireError(f"{field} = {v!r} must be an integer (miles counts versions)") from None
    if isinstance(v, bool) or not 0 <= n < 2**63:
        raise WireError(f"{field} = {v!r} must be an integer in [0, 2**63)")
    return n


def parse_tags(body: dict) -> list[str]:
    """The memory tags of a release / resume body (all engine tags when absent)."""
    tags = body.get("tags")
    if tags is None:
        return list(ENGINE_TAGS)
    if isinstance(tags, str) or not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise WireError(f'tags = {tags!r} must be a list of strings, e.g. ["kv_cache", "weights"]')
    bad = [t for t in tags if t not in ENGINE_TAGS]
    if bad:
        raise WireError(f"unknown memory tag(s) {bad}; valid tags: {list(ENGINE_TAGS)}")
    return tags


def parse_group_args(body: dict) -> tuple:
    """(master_address, master_port, rank_offset, world_size, group_name, backend) of an
    /init_weights_update_group body, each checked."""
    need = ("master_address", "master_port", "rank_offset", "world_size")
    if missing := [k for k in need if k not in body]:
        raise WireError(f"/init_weights_update_group needs {list(need)}; missing {missing}")
    try:
        port, rank, world = (int(body[k]) for k in need[1:])
    except (TypeError, ValueError):
        raise WireError(f"master_port, rank_offset and world_size must be integers; got {body}") from None
    if not (0 < port < 65536 and 0 < rank < world):  # rank 0 is the sender, which hosts the rendezvous
        raise WireError(f"need 0 < master_port < 65536 and 1 <= rank_offset < world_size; got {port}, {rank}, {world}")
    name, backend = body.get("group_name", "weight_update_group"), body.get("backend") or "gloo"
    if not isinstance(name, str) or backend not in ("gloo", "nccl"):
        raise WireError(f"group_name must be a string and backend 'gloo' or 'nccl'; got {name!r}, {backend!r}")
    return str(body["master_address"]), port, rank, world, name, backend


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
    from miles.sync.buckets import WeightManifest, WeightSpec

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
    from miles.sync.buckets import WeightManifest

    if not isinstance(obj, WeightManifest):
        raise WireError(f"manifest must be a serialized miles.sync.buckets.WeightManifest, got {type(obj).__name__}")
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
