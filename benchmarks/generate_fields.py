"""``miles bench generate_fields``: what SGLang's /generate fields cost on ``miles serve``. Two servers run side by
side on the same config: one from an older tree (``--base``, default c0e5705: the tree the 2026-12-04 conformance
review checked, before detokenized text, EOS stops, stop strings, scoring and streaming) and one from this
checkout. The same concurrent load (single-prompt /generate calls, ``return_logprob``, ``ignore_eos`` so both
generate exactly ``--max-new-tokens``) goes to each in alternating rounds; then this checkout's server is asked
with the new fields on (a text prompt, stop strings that never match, token texts in the log-probs, top log-probs,
streaming, prefill scoring). Reports requests/s and tokens/s per case (median over rounds) and, per round, the
ratio of each case to the old server's plain load measured just before it (their median: ``vs_before_plain``),
which is what survives a shared, noisy machine; likewise the server process's CPU time per request
(``server_cpu_ms_per_request``, ``cpu_vs_before_plain``), which other load on the machine changes less than the
wall time.

    miles bench generate_fields --json                       # 200 requests x 3 rounds, quickstart model
    miles bench generate_fields --base main~5 --num-requests 400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles bench generate_fields")
    p.add_argument("--base", default="c0e5705", help="git ref of the 'before' server")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--recipe", default="quickstart")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--json", action="store_true", help="accepted for the CLI; the result is always JSON")
    return p


def _body(i: int, a, extra: dict | None = None, sampling: dict | None = None) -> dict:
    ids = [(7 * i + j) % 250 + 1 for j in range(a.prompt_len)]
    sp = {"max_new_tokens": a.max_new_tokens, "temperature": 1.0, "ignore_eos": True, **(sampling or {})}
    return {"input_ids": ids, "sampling_params": sp, "return_logprob": True, **(extra or {})}


CASES = {  # name: (extra top-level fields, extra sampling params); bodies a pre-change server also takes first
    "plain": ({}, {}),
    "stop_strings": ({}, {"stop": ["\n\n###", "</answer>"]}),  # checked every 16 tokens, never matching
    "token_texts": ({"return_text_in_logprobs": True}, {}),
    "top_logprobs_5": ({"top_logprobs_num": 5}, {}),  # one scoring forward per request
    "text_prompt": ({"text": "Sort: 3 1 2 ->"}, {}),
    "stream": ({"stream": True}, {}),
    "prefill_scoring": ({"logprob_start_len": 0}, {"max_new_tokens": 0}),
}


def _cpu_s(pid: int) -> float:
    """The server process's CPU seconds so far (user + system, all its threads): what a call costs it, which a
    loaded machine changes far less than the wall time."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def _fire(url: str, bodies: list[dict], pid: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one(body):
            if body.get("stream"):
                async with client.stream("POST", "/generate", json=body) as r:
                    last = None
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            last = line
                    return json.loads(last[6:])
            if "text" in body:
                body = {k: v for k, v in body.items() if k != "input_ids"}
            r = await client.post("/generate", json=body)
            r.raise_for_status()
            return r.json()

        t0, cpu0 = time.perf_counter(), _cpu_s(pid)
        outs = await asyncio.gather(*(one(b) for b in bodies))
        wall, cpu = time.perf_counter() - t0, _cpu_s(pid) - cpu0
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {
        "requests_per_s": len(outs) / wall,
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
        "server_cpu_ms_per_request": 1000 * cpu / len(outs),
    }


def _serve_module(tree: str) -> str:
    """The ``miles serve`` entry point of a tree: miles.cli.serve, or miles.rollout.serve_cli before the move."""
    return (
        "miles.cli.serve"
        if os.path.exists(os.path.join(tree, "miles", "cli", "serve.py"))
        else "miles.rollout.serve_cli"
    )


def _start(tree: str, recipe: str, overrides: list[str]) -> tuple[subprocess.Popen, str]:
    """``miles serve`` from ``tree`` (its own code: PYTHONPATH and cwd), the same recipe and overrides for both."""
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", _serve_module(tree), "--recipe", recipe, "--port", "0"]
    argv += [f"--set={o}" for o in overrides] + ["--parent-pid", str(os.getpid())]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tree)
    for line in proc.stdout:
        if "listening on " in line:
            return proc, line.split("listening on ")[1].strip()
    raise RuntimeError(f"the server from {tree} exited before listening ({' '.join(argv)})")


def run(argv: list[str]) -> dict:
    import logging

    from miles.config import apply_overrides
    from miles.recipes import get_recipe

    logging.getLogger("httpx").setLevel(logging.WARNING)
    a = _parser().parse_args(argv)
    overrides = [*a.set, "num_threads=1", "device=cpu"]
    cfg = apply_overrides(get_recipe(a.recipe), overrides)
    tmp = tempfile.mkdtemp(prefix="miles-fields-")
    base_dir = os.path.join(tmp, "base")
    subprocess.run(
        ["git", "-C", ROOT, "worktree", "add", "--detach", base_dir, a.base], check=True, capture_output=True
    )
    procs = []
    try:
        before, url_before = _start(base_dir, a.recipe, overrides)
        procs.append(before)
        after, url_after = _start(ROOT, a.recipe, overrides)
        procs.append(after)
        n = a.num_requests
        plain = [_body(i, a) for i in range(n)]
        for url, pid in ((url_before, before.pid), (url_after, after.pid)):  # warm both
            asyncio.run(_fire(url, plain[: 4 * cfg.rollout.max_batch_size // 8 or 8], pid))
        rounds: dict[str, list[dict]] = {"before/plain": [], **{f"after/{c}": [] for c in CASES}}
        ratios: dict[str, list[float]] = {k: [] for k in rounds}
        cpu_ratios: dict[str, list[float]] = {k: [] for k in rounds}
        for _ in range(a.rounds):
            for case, (extra, sampling) in CASES.items():  # each case right after its own old-server baseline
                base = asyncio.run(_fire(url_before, plain, before.pid))
                rounds["before/plain"].append(base)
                got = asyncio.run(_fire(url_after, [_body(i, a, extra, sampling) for i in range(n)], after.pid))
                rounds[f"after/{case}"].append(got)
                ratios[f"after/{case}"].append(got["requests_per_s"] / base["requests_per_s"])
                cpu_ratios[f"after/{case}"].append(got["server_cpu_ms_per_request"] / base["server_cpu_ms_per_request"])
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base_dir], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    med = lambda rs, k: round(statistics.median(r[k] for r in rs), 1)  # noqa: E731
    table = {
        k: {
            "requests_per_s": med(v, "requests_per_s"),
            "tokens_per_s": med(v, "tokens_per_s"),
            "server_cpu_ms_per_request": med(v, "server_cpu_ms_per_request"),
        }
        for k, v in rounds.items()
    }
    for k, row in table.items():
        row["vs_before_plain"] = round(statistics.median(ratios[k]), 3) if ratios[k] else 1.0
        row["cpu_vs_before_plain"] = round(statistics.median(cpu_ratios[k]), 3) if cpu_ratios[k] else 1.0
    return {
        "config": {
            "base": a.base,
            "num_requests": n,
            "rounds": a.rounds,
            "max_new_tokens": a.max_new_tokens,
            "prompt_len": a.prompt_len,
            "recipe": a.recipe,
            "max_batch_size": cfg.rollout.max_batch_size,
            "overrides": a.set,
        },
        "cases": table,
        "rounds": {k: [round(r["requests_per_s"], 1) for r in v] for k, v in rounds.items()},
        "paired_ratios": {k: [round(x, 3) for x in v] for k, v in ratios.items() if v},
    }
