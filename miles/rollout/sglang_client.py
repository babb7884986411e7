"""The SGLang client: the engine interface (same methods as EmbeddedEngine) over SGLang's HTTP API, so a
RolloutManager holds it in ``self.engines`` unchanged. It talks to ``miles serve`` (flavor "miles", tested here
over real HTTP) or to a real SGLang server (flavor "sglang", started by ``miles.rollout.launch.launch_sglang``).

Real SGLang needs a CUDA build (``pip install 'miles[sglang]'``) and cannot be installed on the CPU machines
this project is tested on; ``launch_sglang`` raises an ImportError with that hint there. Against real SGLang the
client sends weights with SGLang's own MultiprocessingSerializer (CUDA IPC handles of the trainer's tensors, one
machine) and reads the integer from SGLang's string ``weight_version``; ``named_weights`` (full weights, used by
check_weights) and the memory ledger exist only on ``miles serve``.
"""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Iterable

import httpx
import torch

from miles.http_guard import api_key_from, bearer_headers
from miles.rollout.engine import EngineError, GenerateOutput, GenerateRequest
from miles.rollout.sglang_api import FLATTENED_BUCKET, as_version, encode_payload, generate_body, parse_output

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request drowns every other log


class EngineUnavailable(RuntimeError):
    """The engine did not answer (connection refused, timeout, 5xx): a router counts it as a failure."""


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
    ):
        if flavor not in ("miles", "sglang"):
            raise ValueError(f"flavor {flavor!r} must be 'miles' (miles serve) or 'sglang' (a real SGLang server)")
        self.url, self.flavor, self.timeout_s = url.rstrip("/"), flavor, timeout_s
        self.ledger, self.process = ledger, process
        self.api_key = api_key_from(api_key)  # both servers take it as SGLang's --api-key does: a Bearer header
        self.headers = bearer_headers(self.api_key)
        self.http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=self.headers)
        self._aclients: dict[int, httpx.AsyncClient] = {}
        self._opened = None
        self._groups: set[str] = set()  # weight update groups this server joined through this client
        self._pull_ledger()

    def __repr__(self) -> str:
        return f"SGLangClient({self.url!r}, flavor={self.flavor!r})"

    # ---- plumbing -----------------------------------------------------------------------------------------
    def _request(
        self, method: str, path: str, body: dict | None = None, timeout_s: float | None = None
    ) -> httpx.Response:
        try:
            r = self.http.request(method, path, json=body, timeout=timeout_s or self.timeout_s)
        except httpx.HTTPError as e:
            raise EngineUnavailable(f"{self.url}{path}: {type(e).__name__}: {e}") from None
        return _checked(r, self.url + path)

    def _post(self, path: str, body: dict | None = None) -> dict:
        r = self._request("POST", path, body or {})
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else {}

    def _get(self, path: str, timeout_s: float | None = None) -> httpx.Response:
        return self._request("GET", path, timeout_s=timeout_s)

    def _pull_ledger(self) -> None:
        """Move the server's ledger events (memory moves, RSS samples) into ours, so run ledgers see engine bytes."""
        if self.ledger is None or self.flavor != "miles":
            return
        from miles.memory.ledger import LedgerEvent, ProcessSample

        d = self._post("/miles/ledger")
        self.ledger.extend([LedgerEvent(**e) for e in d["events"]], [ProcessSample(**s) for s in d["samples"]])

    # ---- generation ---------------------------------------------------------------------------------------
    def generate(self, requests: list[GenerateRequest], *, seed: int | None = None) -> list[GenerateOutput]:
        if not requests:
            return []
        res = self._post("/generate", generate_body(requests, seed))
        return [parse_output(d) for d in (res if isinstance(res, list) else [res])]

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
        try:
            r = await client.post("/generate", json=generate_body(requests, seed))
        except httpx.HTTPError as e:
            raise EngineUnavailable(f"{self.url}/generate: {type(e).__name__}: {e}") from None
        res = _checked(r, self.url + "/generate").json()
        return [parse_output(d) for d in (res if isinstance(res, list) else [res])]

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        client = self._aclients.pop(id(loop), None)
        if client is not None:
            await client.aclose()

    def abort(self, rids: Iterable[str] | str = "all") -> None:
        self._post("/abort_request", {"abort_all": True} if rids == "all" else {"rid": list(rids)})

    def pause_generation(self, mode: str = "in_place") -> None:
        self._post("/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._post("/continue_generation")

    def flush_cache(self) -> None:
        self._post("/flush_cache")

    # ---- memory -------------------------------------------------------------------------------------------
    def offload(self, tags: Iterable[str]) -> int:
        n = self._post("/release_memory_occupation", {"tags": list(tags)}).get("bytes", 0)
        self._pull_ledger()
        return n

    def onload(self, tags: Iterable[str]) -> int:
        n = self._post("/resume_memory_occupation", {"tags": list(tags)}).get("bytes", 0)
        self._pull_ledger()
        return n

    def memory(self) -> dict:
        """Resident bytes per tag (miles serve only)."""
        return self._get("/miles/memory").json()

    # ---- weights ------------------------------------------------------------------------------------------
    def update_weights_from_tensor(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        named = [(n, t.detach()) for n, t in named_tensors]
        if self.flavor == "sglang":
            payload, fmt = _sglang_serialize(named), None
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
    ) -> None:
        """Receive one flat bucket broadcast by rank 0 of the group; call while rank 0 broadcasts it."""
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": False,
        }
        if version is not None:
            body["weight_version"] = str(version)
        self._post("/update_weights_from_distributed", body)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._groups.discard(group_name)
        self._post("/destroy_weights_update_group", {"group_name": group_name})

    def group_ranks(self) -> int:
        """Ranks this server takes in a weight update group: one per tensor-parallel worker on real SGLang (its
        ``tp_size``), one on ``miles serve`` (a single process)."""
        if self.flavor == "miles":
            return 1
        return int(self._get("/get_server_info").json().get("tp_size", 1))

    def in_weights_group(self, group_name: str) -> bool:
        """Joined through this client (a restarted server gets a new client, which has joined nothing)."""
        return group_name in self._groups

    def set_weight_version(self, version: int) -> None:
        self._post("/update_weight_version", {"new_version": str(version)})

    @property
    def weight_version(self) -> int:
        return as_version(self._get("/get_weight_version").json().get("weight_version"))

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
        return int(self._get("/get_load").json().get("num_reqs", 0))

    def close(self) -> None:
        self.http.close()
        if self.process is not None:
            self.process.stop()


def _checked(r: httpx.Response, where: str) -> httpx.Response:
    if r.status_code < 400:
        return r
    try:
        msg = r.json().get("message") or r.text
    except ValueError:
        msg = r.text
    if r.status_code < 500:
        raise EngineError(f"{where}: HTTP {r.status_code}: {msg}")
    raise EngineUnavailable(f"{where}: HTTP {r.status_code}: {msg[:500]}")


def _sglang_serialize(named: list[tuple[str, torch.Tensor]]) -> str:
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError as e:
        raise ImportError("sending tensors to a real SGLang server needs sglang: pip install 'miles[sglang]'") from e
    return MultiprocessingSerializer.serialize(named, output_str=True)
