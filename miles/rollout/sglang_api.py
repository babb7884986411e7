"""The wire format of SGLang's HTTP API as miles speaks it: the /generate body miles' client sends, the control
bodies the server reads, and miles' own base64 tensor payloads of ``/update_weights_from_tensor``.

The server reads /generate with miles.rollout.generate_call and answers with miles.rollout.sglang_output; the
client reads answers with miles.rollout.sglang_responses. Field names follow SGLang's ``GenerateReqInput``.
"""

from __future__ import annotations

import base64
import io

import torch

from miles.protocols.engine import GenerateRequest
from miles.rollout.engine import ENGINE_TAGS
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
            # SGLang also stops at the model's EOS unless ignore_eos (which turns off every token stop): a request
            # with no stop ids runs to max_new_tokens, as in the embedded engine
            "ignore_eos": not s.stop_token_ids,
        }
        if s.min_new_tokens:
            p["min_new_tokens"] = s.min_new_tokens
        if seed is not None:
            p["sampling_seed"] = seed
        params.append(p)
    return {
        "input_ids": [list(r.input_ids) for r in requests],
        "rid": [r.rid for r in requests],
        "sampling_params": params,
        "return_logprob": True,
    }


# ---- control bodies ------------------------------------------------------------------------------------------
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
