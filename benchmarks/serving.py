"""``miles bench serving``: N concurrent single-prompt /generate calls through the router over E `miles serve`
processes, side by side with the same load on one engine directly. Reports completed / lost requests, throughput
and p50 / p99 latency, and how many engine batches served them.

    miles bench serving --json                                  # 200 requests, 2 engines, quickstart model
    miles bench serving --num-requests 1000 --num-engines 4 --set rollout.max_batch_size=256
"""

from __future__ import annotations

import argparse
import asyncio
import time

from miles.protocols.engine import GenerateRequest, SamplingParams


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles bench serving")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--num-engines", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--batch-wait-ms", type=float, default=5.0)
    p.add_argument("--recipe", default="quickstart")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--device", default="", help="cpu | cuda (default: the recipe's)")
    p.add_argument("--json", action="store_true", help="accepted for the CLI; the result is always JSON")
    return p


def _requests(n: int, prompt_len: int, max_new_tokens: int, vocab: int, tag: str) -> list[GenerateRequest]:
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)
    return [
        GenerateRequest(
            rid=f"{tag}-{i}", input_ids=[(7 * i + j) % (vocab - 1) + 1 for j in range(prompt_len)], sampling=sp
        )
        for i in range(n)
    ]


async def _fire(target, reqs: list[GenerateRequest]) -> dict:
    """All requests at once, one call each; returns latencies and how many came back complete."""
    lat: list[float] = []
    errors: list[str] = []

    async def one(r):
        t0 = time.perf_counter()
        try:
            out = await target.agenerate([r])
            if out[0].rid == r.rid and out[0].finish_reason != "abort":
                lat.append(time.perf_counter() - t0)
                return len(out[0].output_ids)
            errors.append(f"{r.rid}: {out[0].finish_reason}")
        except Exception as e:  # noqa: BLE001 - a lost request is a result here, not a crash
            errors.append(f"{r.rid}: {e}")
        return 0

    t0 = time.perf_counter()
    tokens = await asyncio.gather(*(one(r) for r in reqs))
    wall = time.perf_counter() - t0
    await target.aclose()
    lat.sort()
    pct = lambda q: round(1000 * lat[min(len(lat) - 1, int(q * len(lat)))], 1) if lat else None
    return {
        "completed": len(lat),
        "lost": len(reqs) - len(lat),
        "errors": errors[:5],
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(lat) / wall, 1),
        "tokens_per_s": round(sum(tokens) / wall, 1),
        "latency_ms": {"p50": pct(0.50), "p99": pct(0.99), "max": round(1000 * lat[-1], 1) if lat else None},
    }


def _batches(clients) -> list[int]:
    return [c._get("/server_info").json()["miles"]["batcher"]["batches"] for c in clients]


def run(argv: list[str]) -> dict:
    from miles.config import apply_overrides
    from miles.recipes import get_recipe
    from miles.rollout.launch import spawn_miles_servers
    from miles.rollout.router import Router
    from miles.rollout.sglang_client import SGLangClient

    a = _parser().parse_args(argv)
    cfg = apply_overrides(get_recipe(a.recipe), a.set)
    t0 = time.perf_counter()
    procs = spawn_miles_servers(cfg, a.num_engines, device=a.device, batch_wait_ms=a.batch_wait_ms)
    boot_s = time.perf_counter() - t0
    clients = [SGLangClient(p.url) for p in procs]
    router = Router(clients)
    try:
        vocab = cfg.model.vocab_size
        mk = lambda tag: _requests(a.num_requests, a.prompt_len, a.max_new_tokens, vocab, tag)
        asyncio.run(_fire(router, _requests(4 * a.num_engines, a.prompt_len, a.max_new_tokens, vocab, "warmup")))
        b0 = _batches(clients)
        routed = asyncio.run(_fire(router, mk("routed")))
        b1 = _batches(clients)
        single = asyncio.run(_fire(clients[0], mk("single")))
        b2 = _batches(clients)
    finally:
        router.close()
        for p in procs:
            p.stop()
    routed["engine_batches"] = [y - x for x, y in zip(b0, b1)]
    single["engine_batches"] = b2[0] - b1[0]
    return {
        "config": {
            "num_requests": a.num_requests,
            "num_engines": a.num_engines,
            "max_new_tokens": a.max_new_tokens,
            "prompt_len": a.prompt_len,
            "batch_wait_ms": a.batch_wait_ms,
            "recipe": a.recipe,
            "max_batch_size": cfg.rollout.max_batch_size,
            "overrides": a.set,
        },
        "boot_s": round(boot_s, 1),
        "router": routed,
        "one_engine_direct": single,
        "speedup_router_vs_one": round(routed["requests_per_s"] / single["requests_per_s"], 2)
        if single["requests_per_s"]
        else None,
    }
