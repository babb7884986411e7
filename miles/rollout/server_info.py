"""The read-only endpoints, shaped as sglang 0.5.10.post1's (``srt/entrypoints/http_server.py``, ``v1_loads.py``,
``srt/managers/io_struct.py``): /health, /model_info (and /get_model_info), /server_info (and /get_server_info),
/get_load (one ``GetLoadReqOutput`` per data-parallel rank), /v1/loads, and /get_weight_version, which SGLang 0.5.10
answers with a 404 and miles keeps (see DELIBERATE_DIFFERENCES).
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone

from fastapi import FastAPI

from miles.rollout.sglang_api import WireError
from miles.sync.weight_group import FORMATS as BROADCAST_FORMATS  # what /update_weights_from_distributed takes

SGLANG_VERSION = "0.5.10.post1"  # the SGLang HTTP API this server answers as (/server_info "version")

DELIBERATE_DIFFERENCES = (
    "/get_weight_version and /weight_version answer {weight_version} (SGLang 0.5.10: 404, 'use /model_info'): "
    "slime still reads them",
    "/health answers 200 with a JSON body saying whether a generate would run (status ok, memory_released, "
    "weights_not_synced, a pending group join); SGLang's is empty. /health_generate is 503 unless ok",
    "/flush_cache always succeeds: the engine keeps no prefix cache between calls (SGLang answers 400 while "
    "requests run)",
    "memory tags are weights, kv_cache, cuda_graph; another tag is a 400 naming them",
    "sampling keys without an implementation here (stop_regex, min_p, frequency/presence/repetition penalties, "
    "n, json_schema, regex, ebnf, structural_tag, logit_bias) are a 400 unless at their defaults; so are images, "
    "LoRA, hidden states, sessions and token_ids_logprob",
    "sampling_seed must be the same for every prompt of a call: a seeded call runs as a batch of its own, so it "
    "equals an in-process engine.generate(requests, seed=...)",
    "output_top_logprobs and input log-probs come from one extra scoring forward over the finished sequence; a "
    "stream carries them in its last chunk only",
    "concurrent calls are batched (--batch-wait-ms) on one KV cache and each is answered when its own requests "
    "finish, but a call that arrives while a batch runs waits for it and joins the next batch (SGLang admits it at "
    "its next step): one engine call per batch keeps its prefill batched; an in-place pause holds rows between "
    "decode steps, a retract pause returns them to the queue (prefilled again on continue)",
    "weight payloads: SGLang's MultiprocessingSerializer pickles are read by a restricted unpickler that admits "
    "only tensors rebuilt from same-host shared memory or CUDA IPC (miles.rollout.sglang_payloads), since a pickle "
    "can run any code; miles' own torch.save payloads and flat-bucket handles are also taken",
    "/update_weights_from_disk takes a HF checkpoint directory or a miles disk-delta directory (what miles' "
    "disk-delta sync writes)",
    "/init_weights_update_group joins are answered within --group-connect-timeout-s and one may be pending (409), "
    "so a trainer that never forms its group costs seconds, not the 300 s collective timeout",
    "4xx bodies carry success/message beside SGLang's error.message (miles' own clients read message)",
    "the HTTP guard (miles.http_guard) refuses what a web page could send: a foreign Host header, a cross-site "
    "request, a body not declared application/json, and a browser's GET of /flush_cache or the memory endpoints "
    "without a key or same-origin evidence (an <img> on any page would release the weights); programs' GETs, as "
    "slime sends, pass",
    "the OpenAI routes run no tool-call or reasoning parser: message.content is the generated text, tool_calls "
    "and reasoning_content are null (the tools still reach the chat template)",
)


def add_routes(app: FastAPI, srv) -> None:
    e = srv.engine

    @app.get("/health")
    async def health():
        """Liveness (200 while the process serves; routers restart engines that fail it) with the truth about
        readiness in the body: status "ok" only when a generate would run now."""
        return srv.status()

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        m = srv.model
        return {
            "model_path": m.name,
            "tokenizer_path": m.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": srv.version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": m.model_type,
            "architectures": m.architectures,
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        b = srv.batcher
        return {
            "model_path": srv.model.name,
            "tokenizer_path": srv.model.tokenizer_path,
            "served_model_name": srv.model.name,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "ep_size": 1,
            "context_length": srv.model.max_seq_len,
            "max_running_requests": e.max_batch_size,
            "device": str(e.device),
            "skip_tokenizer_init": False,
            "enable_memory_saver": True,
            "weight_version": srv.version,
            "internal_states": [{"num_running_reqs": b.num_running, "num_waiting_reqs": b.num_waiting}],
            "version": SGLANG_VERSION,
            "miles": {
                **srv.info,
                "max_batch_size": e.max_batch_size,
                "max_seq_len": e.max_seq_len,
                "batch_wait_ms": srv.batch_wait_s * 1000,
                "batcher": dict(b.stats),
                "pid": os.getpid(),
                "weight_broadcast_formats": list(BROADCAST_FORMATS),
                "deliberate_differences": list(DELIBERATE_DIFFERENCES),
            },
        }

    @app.get("/get_load")
    async def get_load():
        b = srv.batcher
        return [
            {
                "rid": None,
                "http_worker_ipc": None,
                "dp_rank": 0,
                "num_reqs": b.num_running + b.num_waiting,
                "num_waiting_reqs": b.num_waiting,
                "num_tokens": b.num_tokens,
                "ts_tic": time.time(),
            }
        ]

    @app.get("/v1/loads")
    async def loads(dp_rank: int | None = None, include: str | None = None, format: str | None = None):
        sections = {s.strip() for s in include.split(",")} if include else {"all"}
        bad = sections - {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
        if bad or format not in (None, "json"):
            raise WireError(f"/v1/loads: include {sorted(bad)} / format {format!r} not known; e.g. include=core")
        rows = [] if dp_rank not in (None, 0) else [_load(srv, sections)]
        return {
            "timestamp": datetime.now(timezone.utc).isoformat(),
            "version": SGLANG_VERSION,
            "dp_rank_count": len(rows),
            "loads": rows,
            "aggregate": _aggregate(rows),
        }

    @app.get("/get_weight_version")
    @app.get("/weight_version")
    async def weight_version():
        return {"weight_version": srv.version}


def _load(srv, sections: set[str]) -> dict:
    b, e = srv.batcher, srv.engine
    capacity = e.max_batch_size * e.max_seq_len
    d = {
        "dp_rank": 0,
        "num_running_reqs": b.num_running,
        "num_waiting_reqs": b.num_waiting,
        "num_used_tokens": b.num_tokens,
        "max_total_num_tokens": capacity,
        "token_usage": round(b.num_tokens / capacity, 4) if capacity else 0.0,
        "gen_throughput": 0.0,
        "cache_hit_rate": 0.0,
        "utilization": round(b.num_running / e.max_batch_size, 4),
        "max_running_requests": e.max_batch_size,
    }
    if sections & {"memory", "all"}:
        gb = lambda t: e.memory.resident_bytes(t) / 2**30  # noqa: E731
        d["memory"] = {
            "weight_gb": gb("weights"),
            "kv_cache_gb": gb("kv_cache"),
            "graph_gb": gb("cuda_graph"),
            "token_capacity": capacity,
        }
    d["num_total_reqs"] = d["num_running_reqs"] + d["num_waiting_reqs"]
    return d


def _aggregate(rows: list[dict]) -> dict:
    n = len(rows) or 1
    return {
        "total_running_reqs": sum(r["num_running_reqs"] for r in rows),
        "total_waiting_reqs": sum(r["num_waiting_reqs"] for r in rows),
        "total_reqs": sum(r["num_total_reqs"] for r in rows),
        "avg_token_usage": round(sum(r["token_usage"] for r in rows) / n, 4),
        "avg_throughput": round(sum(r["gen_throughput"] for r in rows) / n, 2),
        "avg_utilization": round(sum(r["utilization"] for r in rows) / n, 4),
    }
