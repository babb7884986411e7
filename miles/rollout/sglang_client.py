"""The SGLang client: the engine interface (same methods as EmbeddedEngine) over SGLang's HTTP API, so a
RolloutManager holds it in ``self.engines`` unchanged. It talks to ``miles serve`` (flavor "miles", tested here
over real HTTP) or to a real SGLang server (flavor "sglang", started by ``miles.rollout.launch.launch_sglang``).

Real SGLang needs a CUDA build (``pip install 'miles[sglang]'``) and cannot be installed on the CPU machines
this project is tested on; ``launch_sglang`` raises an ImportError with that hint there. Against real SGLang the
client sends weights in SGLang's MultiprocessingSerializer format (miles.rollout.sglang_payloads: CUDA IPC or
shared-memory handles of the trainer's tensors, one machine) and reads the integer from SGLang's string
``weight_version``; ``named_weights`` (full weights, used by check_weights) and the memory ledger exist only on
``miles serve``.

What it expects of SGLang 0.5.10's answers (``srt/entrypoints/http_server.py``): ``null`` bodies from the memory
endpoints and an empty one from /abort_request, the weight version under /model_info (/get_weight_version is a
404 there), /get_load as a list with one entry per data-parallel rank, one /abort_request per rid (``rid`` is a
string), ``abort_all_requests: false`` sent with /update_weight_version (its default aborts every request).
Every /generate answer is checked (miles.rollout.sglang_responses) and every body is read up to a bound.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterable

import httpx
import torch

from miles.http_guard import api_key_from, bearer_headers
from miles.protocols.engine import EngineError, GenerateOutput, GenerateRequest
from miles.rollout.sglang_api import FLATTENED_BUCKET, encode_payload, generate_body
from miles.rollout.sglang_responses import (  # noqa: F401 - EngineUnavailable re-exported for the router
    EngineResponseError,
    EngineUnavailable,
    as_version,
    decode_json,
    parse_outputs,
)
from miles.stall.heartbeat import beat

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request drowns every other log

MAX_BODY_BYTES = 64 * 2**20  # a control answer or a /generate answer's fixed part; /generate adds per token
BYTES_PER_TOKEN = 512  # an output_token_logprobs triple plus its id and its text, with room to spare


class SGLangClient:
    """client = SGLangClient("http://127.0.0.1:30000", ledger=manager_ledger)
    outs = client.generate(requests, seed=7)                  # one batched POST /generate
    client.offload(["kv_cache", "weights"]); client.onload(["weights"])
    client.update_weights_from_bucket(handle, None); client.set_weight_version(3)
    client.named_weights(); client.close()                   # close() also stops an owned server process
    """

    def __init__(
        self,
        url: str,
        *,
        flavor: str = "miles",
        timeout_s: float = 600.0,
        ledger=None,
        process=None,
        api_key: str | None = None,
        vocab_size: int = 0,
    ):
        if flavor not in ("miles", "sglang"):
            raise ValueError(f"flavor {flavor!r} must be 'miles' (miles serve) or 'sglang' (a real SGLang server)")
        self.url, self.flavor, self.timeout_s = url.rstrip("/"), flavor, timeout_s
        self.vocab_size = vocab_size  # output ids are checked against it (0: only that they are ids)
        self.ledger, self.process = ledger, process
        self.api_key = api_key_from(api_key)  # both servers take it as SGLang's --api-key does: a Bearer header
        self.headers = bearer_headers(self.api_key)
        self.http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=self.headers)
        self._aclients: dict[int, httpx.AsyncClient] = {}
        self._opened = None
        self._groups: set[str] = set()  # weight update groups this server joined through this client
        self._formats: tuple[str, ...] | None = None  # broadcast formats the server takes (asked once)
        if ledger is not None:
            self._pull_ledger()  # what the server recorded while it started

    def __repr__(self) -> str:
        return f"SGLangClient({self.url!r}, flavor={self.flavor!r})"

    # ---- plumbing -----------------------------------------------------------------------------------------
    def _request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        timeout_s: float | None = None,
        max_bytes: int = MAX_BODY_BYTES,
    ) -> tuple[httpx.Response, bytes]:
        """The response and its body, read up to ``max_bytes`` (a larger body is an EngineResponseError)."""
        try:
            with self.http.stream(method, path, json=body, timeout=timeout_s or self.timeout_s) as r:
                raw = _read_bounded(r.iter_bytes(), max_bytes, self.url + path)
        except httpx.HTTPError as e:
            raise EngineUnavailable(f"{self.url}{path}: {type(e).__name__}: {e}") from None
        return _checked(r, raw, self.url + path), raw

    def _post(self, path: str, body: dict | None = None, max_bytes: int = MAX_BODY_BYTES, json_only: bool = False):
        """The JSON value answered (``{}`` for SGLang's ``null`` and empty bodies, and for plain text unless
        ``json_only``)."""
        r, raw = self._request("POST", path, body or {}, max_bytes=max_bytes)
        if not json_only and not r.headers.get("content-type", "").startswith("application/json"):
            return {}
        value = decode_json(raw, r.headers["content-type"], self.url + path)
        return {} if value is None else value

    def _get_json(self, path: str, timeout_s: float | None = None):
        r, raw = self._request("GET", path, timeout_s=timeout_s)
        return decode_json(raw, r.headers.get("content-type", ""), self.url + path)

    def _get_first(self, path: str, older: str):
        """GET ``path``; on a 404 (a server older than SGLang 0.5.10) GET ``older`` instead."""
        try:
            return self._get_json(path)
        except EngineError as e:
            if "HTTP 404" not in str(e):
                raise
        return self._get_json(older)

    def _get(self, path: str, timeout_s: float | None = None) -> httpx.Response:
        try:
            r = self.http.get(path, timeout=timeout_s or self.timeout_s)
        except httpx.HTTPError as e:
            raise EngineUnavailable(f"{self.url}{path}: {type(e).__name__}: {e}") from None
        return _checked(r, r.content, self.url + path)

    def _pull_ledger(self) -> list:
        """Move the server's ledger events (memory moves, RSS samples) into ours, so run ledgers see engine bytes;
        returns the events (without a ledger of ours they are drained and only counted)."""
        if self.flavor != "miles":
            return []
        from miles.memory.ledger import LedgerEvent, ProcessSample

        d = self._post("/miles/ledger")
        events = [LedgerEvent(**e) for e in d["events"]]
        if self.ledger is not None:
            self.ledger.extend(events, [ProcessSample(**s) for s in d["samples"]])
        return events

    # ---- generation ---------------------------------------------------------------------------------------
    def generate(self, requests: list[GenerateRequest], *, seed: int | None = None) -> list[GenerateOutput]:
        if not requests:
            return []
        res = self._post("/generate", generate_body(requests, seed), _generate_bytes(requests), json_only=True)
        beat()  # a finished call is progress for the stall watchdog (miles.stall.heartbeat)
        return parse_outputs(res, requests, self.url + "/generate", self.vocab_size)

    async def agenerate(self, requests: list[GenerateRequest], *, seed: int | None = None) -> list[GenerateOutput]:
        """generate without blocking the caller's event loop (one httpx.AsyncClient per loop)."""
        if not requests:
            return []
        loop = asyncio.get_running_loop()
        client = self._aclients.get(id(loop))
        if client is None:
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
            client = self._aclients[id(loop)] = httpx.AsyncClient(
                base_url=self.url, timeout=self.timeout_s, limits=limits, headers=self.headers
            )
        where = self.url + "/generate"
        try:
            async with client.stream("POST", "/generate", json=generate_body(requests, seed)) as r:
                raw, cap = bytearray(), _generate_bytes(requests)
                async for chunk in r.aiter_bytes():
                    raw += chunk
                    if len(raw) > cap:
                        raise EngineResponseError(f"{where}: the body exceeds {cap} bytes; refusing to read on")
        except httpx.HTTPError as e:
            raise EngineUnavailable(f"{where}: {type(e).__name__}: {e}") from None
        _checked(r, bytes(raw), where)
        res = decode_json(bytes(raw), r.headers.get("content-type", ""), where)
        beat()
        return parse_outputs(res, requests, where, self.vocab_size)

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        client = self._aclients.pop(id(loop), None)
        if client is not None:
            await client.aclose()

    def abort(self, rids: Iterable[str] | str = "all") -> None:
        """SGLang's AbortReq takes one rid (a string): one call per rid."""
        if rids == "all":
            self._post("/abort_request", {"abort_all": True})
            return
        for rid in [rids] if isinstance(rids, str) else list(rids):
            self._post("/abort_request", {"rid": str(rid)})

    def pause_generation(self, mode: str = "in_place") -> None:
        self._post("/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._post("/continue_generation")

    def flush_cache(self) -> None:
        self._post("/flush_cache")

    # ---- memory -------------------------------------------------------------------------------------------
    def offload(self, tags: Iterable[str]) -> int:
        """Bytes the server freed on its device, read from its ledger (SGLang answers ``null``: 0 there)."""
        self._post("/release_memory_occupation", {"tags": list(tags)})
        return _device_bytes(self._pull_ledger(), "out")

    def onload(self, tags: Iterable[str]) -> int:
        self._post("/resume_memory_occupation", {"tags": list(tags)})
        return _device_bytes(self._pull_ledger(), "in")

    def memory(self) -> dict:
        """Resident bytes per tag (miles serve only)."""
        return self._get("/miles/memory").json()

    # ---- weights ------------------------------------------------------------------------------------------
    def update_weights_from_tensor(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        named = [(n, t.detach()) for n, t in named_tensors]
        if self.flavor == "sglang":
            from miles.rollout.sglang_payloads import serialize

            # a CPU tensor is shared by moving its storage into shared memory: share a copy, never the caller's
            named = [(n, t.clone() if t.device.type == "cpu" else t) for n, t in named]
            payload, fmt = serialize(named), None  # ``named`` stays alive until the server has answered
        else:
            payload, fmt = encode_payload([(n, t.cpu()) for n, t in named]), None
        self._update_tensor(payload, fmt, version)

    def update_weights_from_bucket(self, handle, version: int | None = None) -> None:
        """Send a flat-bucket handle (miles.sync.flat_bucket); the server opens the same shared memory / IPC buffer."""
        if self.flavor == "sglang":  # SGLang has no use for our handle: open it here and send its tensors by IPC
            if self._opened is None:
                from miles.sync.flat_bucket import OpenedBuffers

                self._opened = OpenedBuffers()
            self.update_weights_from_tensor(self._opened.tensors(handle), version)
            return
        self._update_tensor(encode_payload(handle), FLATTENED_BUCKET, version)

    def begin_weight_update(self, manifest) -> None:
        """Open a failure-safe update (miles.sync.buckets.WeightManifest); buckets land in it, set_weight_version commits.
        Real SGLang has no such transaction: there buckets are applied as they come."""
        if self.flavor == "miles":
            self._post("/miles/begin_weight_update", {"manifest": encode_payload(manifest)})

    def abort_weight_update(self) -> None:
        if self.flavor == "miles":
            self._post("/miles/abort_weight_update")

    def _update_tensor(self, payload: str, load_format: str | None, version: int | None) -> None:
        body = {"serialized_named_tensors": [payload], "load_format": load_format, "flush_cache": False}
        if version is not None:
            body["weight_version"] = str(version)
        self._post("/update_weights_from_tensor", body)

    def update_weights_from_disk(self, path: str, version: int | None = None) -> None:
        body = {"model_path": path, "load_format": None}
        if version is not None:
            body["weight_version"] = str(version)
        self._post("/update_weights_from_disk", body)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> None:
        """Join a private torch.distributed group as ranks ``rank_offset`` .. ``rank_offset + group_ranks() - 1`` (a
        real SGLang server's tensor-parallel workers each take one); blocks until every rank has joined."""
        self._post(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )
        self._groups.add(group_name)

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        version: int | None = None,
        load_format: str | None = None,
    ) -> None:
        """Receive one call's broadcasts from rank 0 of the group (``load_format``: one of broadcast_formats();
        None = one broadcast per tensor); call while rank 0 broadcasts."""
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": False,
            "load_format": None if load_format == "per_tensor" else load_format,
        }
        if version is not None:
            body["weight_version"] = str(version)
        self._post("/update_weights_from_distributed", body)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """Leave the group; a server that is not in it (restarted, or never joined) is already where we want it."""
        self._groups.discard(group_name)
        try:
            self._post("/destroy_weights_update_group", {"group_name": group_name})
        except EngineError as e:
            if "does not exist" not in str(e):
                raise

    def group_ranks(self) -> int:
        """Ranks this server takes in a weight update group: one per tensor-parallel worker on real SGLang (its
        ``tp_size``), one on ``miles serve`` (a single process)."""
        if self.flavor == "miles":
            return 1
        info = self._get_first("/server_info", "/get_server_info")
        return int(info.get("tp_size", 1)) if isinstance(info, dict) else 1

    def broadcast_formats(self) -> tuple[str, ...]:
        """What /update_weights_from_distributed takes here, fastest first: miles serve lists its formats in
        /server_info; SGLang lists none, and one broadcast per tensor is what every version of it receives."""
        if self._formats is None:
            info = self._get_first("/server_info", "/get_server_info")
            miles = info.get("miles") if isinstance(info, dict) else None
            self._formats = tuple((miles or {}).get("weight_broadcast_formats") or ("per_tensor",))
        return self._formats

    def in_weights_group(self, group_name: str) -> bool:
        """Joined through this client (a restarted server gets a new client, which has joined nothing)."""
        return group_name in self._groups

    def set_weight_version(self, version: int) -> None:
        """``abort_all_requests`` defaults to true in SGLang: sent as false, so in-flight requests finish."""
        self._post("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})

    @property
    def weight_version(self) -> int:
        """From /model_info (SGLang 0.5.10's canonical endpoint), else /get_weight_version (older servers)."""
        info = self._get_first("/model_info", "/get_weight_version")
        if not isinstance(info, dict) or "weight_version" not in info:
            raise EngineResponseError(f"{self.url}: no weight_version in {str(info)[:120]}")
        return as_version(info["weight_version"])

    def named_weights(self) -> dict[str, torch.Tensor]:
        if self.flavor == "sglang":
            raise NotImplementedError(
                "real SGLang returns only truncated tensors (/get_weights_by_name); check_weights needs miles serve"
            )
        return torch.load(io.BytesIO(self._get("/miles/weights").content), weights_only=True)

    # ---- health -------------------------------------------------------------------------------------------
    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            return self.http.get("/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def load(self) -> int:
        """Requests in the server: /get_load is one entry per data-parallel rank (older servers: one object)."""
        ranks = self._get_json("/get_load")
        ranks = ranks if isinstance(ranks, list) else [ranks]
        try:
            return sum(int(r.get("num_reqs", 0)) for r in ranks)
        except (AttributeError, TypeError, ValueError):
            raise EngineResponseError(f"{self.url}/get_load: not a list of loads: {str(ranks)[:120]}") from None

    def close(self) -> None:
        self.http.close()
        if self.process is not None:
            self.process.stop()


def _checked(r: httpx.Response, raw: bytes, where: str) -> httpx.Response:
    if r.status_code < 400:
        return r
    text = raw[:2000].decode("utf-8", errors="replace")
    try:
        body = json.loads(raw)
        msg = body.get("message") or (body.get("error") or {}).get("message") or text
    except (ValueError, AttributeError):
        msg = text
    if r.status_code < 500:
        raise EngineError(f"{where}: HTTP {r.status_code}: {msg}")
    raise EngineUnavailable(f"{where}: HTTP {r.status_code}: {msg[:500]}")


def _read_bounded(chunks, max_bytes: int, where: str) -> bytes:
    raw = bytearray()
    for chunk in chunks:
        raw += chunk
        if len(raw) > max_bytes:
            raise EngineResponseError(f"{where}: the body exceeds {max_bytes} bytes; refusing to read on")
    return bytes(raw)


def _generate_bytes(requests: list[GenerateRequest]) -> int:
    """The most a /generate answer to ``requests`` may take: a fixed part and a bound per token."""
    tokens = sum(len(r.input_ids) + r.sampling.max_new_tokens for r in requests)
    return MAX_BODY_BYTES + BYTES_PER_TOKEN * tokens


def _device_bytes(events, direction: str) -> int:
    return sum(e.bytes for e in events if e.pool == "device" and e.direction == direction)
