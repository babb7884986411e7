"""`miles bench dashboard`: how fast the sample view shows a 64k-token strip, in real headless Chromium.

Writes a synthetic run directory (with the same writers the driver uses), serves it, and in one browser
measures side by side: building the strip and reaching its first paint with the block strip (the
dashboard's) and with the naive one-span-per-token build (the reference) -- wall time, and the renderer's
CPU time from a trace, which a machine busy with other work does not inflate -- recolouring both, and how
many requests one sample view makes (strip + chart + conversation: the goal is one).

    python -c "import miles.bench as b, json; print(json.dumps(b.run('dashboard', ['--json']), indent=1))"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from miles.dashboard.store import RolloutDumpWriter, RunDirWriter

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
WORDS = [
    "the",
    "model",
    "reverse",
    "letters",
    "token",
    "answer",
    "so",
    "we",
    "get",
    "step",
    "check",
    "=",
    "+",
    "then",
    "a",
    "b",
    "c",
    "d",
    "e",
    "f",
    "result",
    "is",
    "wait",
    "let",
    "me",
    "think",
    "again",
    "ok",
]
LONG_PROMPT = 2048


def synthetic_sample(
    rng: np.random.Generator,
    *,
    index: int,
    group: int,
    prompt_len: int,
    response_len: int,
    reward: float,
    advantage: float,
    weight_version: int,
) -> dict:
    """A sample shaped like the driver's: tokens, display strings, log-probs that drift, per-token stats."""
    n = prompt_len + response_len
    ids = rng.integers(0, len(WORDS), n)
    newline = rng.random(n) < 0.04
    token_text = [WORDS[i] + ("\n" if nl else " ") for i, nl in zip(ids.tolist(), newline.tolist())]
    rollout = -rng.exponential(0.8, response_len)
    train = rollout + rng.normal(0, 0.05, response_len) * (1 + 4 * (rng.random(response_len) < 0.01))
    mask = np.ones(response_len, dtype=np.int64)
    if response_len > 40:  # a masked span, as a tool output inside an agent turn would be
        mask[response_len // 3 : response_len // 3 + 12] = 0
    return {
        "index": index,
        "group": group,
        "reward": reward,
        "weight_version": weight_version,
        "finish_reason": "length" if response_len > 1000 else "stop",
        "prompt_text": "".join(token_text[:prompt_len]).strip(),
        "response_text": "".join(token_text[prompt_len:]).strip(),
        "tokens": (ids + 100).tolist(),
        "token_text": token_text,
        "prompt_len": prompt_len,
        "loss_mask": mask.tolist(),
        "rollout_log_probs": rollout.tolist(),
        "train_log_probs": train.tolist(),
        "advantages": np.full(response_len, advantage).tolist(),
        "entropy": rng.gamma(2.0, 0.4, response_len).tolist(),
    }


def synthetic_step(
    step: int, *, num_groups: int = 4, group_size: int = 4, long_tokens: int = 0, seed: int = 0
) -> list[dict]:
    rng = np.random.default_rng(seed + step)
    samples = []
    for g in range(num_groups):
        rewards = rng.random(group_size).round(3)
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for k in range(group_size):
            idx = g * group_size + k
            is_long = bool(long_tokens) and idx == 1
            prompt_len = (
                min(LONG_PROMPT, long_tokens // 2) if is_long else 40
            )  # a long prompt: the strip must scroll to the response
            response_len = long_tokens - prompt_len if is_long else int(rng.integers(8, 200))
            samples.append(
                synthetic_sample(
                    rng,
                    index=idx,
                    group=g,
                    prompt_len=prompt_len,
                    response_len=response_len,
                    reward=float(rewards[k]),
                    advantage=float(adv[k]),
                    weight_version=step,
                )
            )
    return samples


def synthetic_run(run_dir: str | Path, *, num_steps: int = 3, long_tokens: int = 0, seed: int = 0) -> Path:
    """A run directory like the driver writes: config, metrics, ledger and rollouts for num_steps steps.
    With long_tokens, sample row 1 of the last step has that many tokens, LONG_PROMPT of them prompt."""
    run_dir = Path(run_dir)
    run = RunDirWriter(run_dir=run_dir)
    run.write_config({"run_dir": str(run_dir), "task": {"name": "reverse"}, "synthetic": True})
    rng = np.random.default_rng(seed)
    t = 1_700_000_000.0
    for step in range(1, num_steps + 1):
        run.append_ledger(_ledger_step(t, step))
        t += 10
        run.append_metrics(
            {
                "step": step,
                "reward": 0.3 + 0.1 * step + 0.05 * rng.random(),
                "loss": 1.0 / step,
                "kl": 0.01 * step,
                "entropy": 1.2 - 0.1 * step,
                "tokens_per_s": 900 + 50 * rng.random(),
                "time/generate": 2.0,
                "time/train": 3.0 + rng.random(),
                "time/sync": 0.4,
                "mem/device_peak": 3.2e9 + 1e8 * step,
                "mem/host_peak": 5.5e9,
            }
        )
        RolloutDumpWriter(run_dir=run_dir).write_step(
            step, synthetic_step(step, long_tokens=long_tokens if step == num_steps else 0, seed=seed)
        )
    return run_dir


def _ledger_step(t: float, step: int) -> list[dict]:
    """Memory events of one colocated step: engine weights/kv in and out, trainer params/optimizer around train."""
    gib = 1 << 30
    moves = [
        ("engine/0", "weights", "device", 2 * gib, "in", "onload_weights"),
        ("engine/0", "kv_cache", "device", 1 * gib, "in", "onload_kv"),
        ("engine/0", "kv_cache", "device", 1 * gib, "out", "offload_rollout"),
        ("engine/0", "weights", "device", 2 * gib, "out", "offload_rollout"),
        ("engine/0", "weights", "host", 2 * gib, "in", "offload_rollout"),
        ("trainer/0", "params", "device", 2 * gib, "in", "onload_train"),
        ("trainer/0", "optimizer", "device", 4 * gib, "in", "onload_train"),
        ("trainer/0", "grads", "device", 2 * gib, "in", "train"),
        ("trainer/0", "grads", "device", 2 * gib, "out", "train"),
        ("trainer/0", "optimizer", "device", 4 * gib, "out", "offload_train"),
        ("trainer/0", "optimizer", "host", 4 * gib, "in", "offload_train"),
        ("trainer/0", "params", "device", 2 * gib, "out", "offload_train"),
        ("engine/0", "weights", "host", 2 * gib, "out", "onload_weights"),
        ("trainer/0", "optimizer", "host", 4 * gib, "out", "onload_train"),
    ]
    return [
        {
            "time": t + 0.6 * i,
            "owner": o,
            "tag": tag,
            "pool": pool,
            "bytes": b,
            "direction": d,
            "phase": ph,
            "step": step,
        }
        for i, (o, tag, pool, b, d, ph) in enumerate(moves)
    ]


STRIP_JS = """async ({mode, url}) => {
  const { TokenStrip, parseSample } = await import('/static/strip.js');
  const data = parseSample(await (await fetch(url)).arrayBuffer());
  const host = document.createElement('div');
  host.className = 'strip';
  host.style.height = '600px';
  document.body.prepend(host);
  const paint = () => new Promise((r) => requestAnimationFrame(() => setTimeout(r, 0)));
  await paint();
  performance.mark('strip-start');
  const t0 = performance.now();
  const strip = new TokenStrip(host, { mode });
  strip.build(data);
  strip.scrollToToken(data.promptLen);
  await paint();
  const first_paint_ms = performance.now() - t0;
  performance.mark('strip-end');
  const t1 = performance.now();
  strip.recolor('entropy');
  await paint();
  const recolor_ms = performance.now() - t1;
  const spans = host.querySelectorAll('span').length;
  host.remove();
  return { first_paint_ms, recolor_ms, spans, tokens: data.n };
}"""


def _cpu_between_marks(trace: bytes) -> dict:
    """CPU time (thread clock) of the renderer's top-level tasks between the strip-start and strip-end marks:
    main thread alone, and all renderer threads (compositor, raster workers). Unlike wall time, a busy
    machine does not inflate it."""
    data = json.loads(trace)
    events = data["traceEvents"] if isinstance(data, dict) else data
    marks = {e["name"]: e for e in events if e.get("name") in ("strip-start", "strip-end")}
    start, end = marks["strip-start"], marks["strip-end"]
    main, total = 0, 0
    for e in events:
        if (
            e.get("ph") == "X"
            and e.get("cat") == "toplevel"
            and e["pid"] == start["pid"]
            and start["ts"] <= e["ts"] <= end["ts"]
        ):
            total += e.get("tdur", 0)
            main += e.get("tdur", 0) if e["tid"] == start["tid"] else 0
    return {"main_cpu_ms": main / 1000, "renderer_cpu_ms": total / 1000}


def _measure_strips(browser, page, url: str, repeats: int) -> dict:
    """Wall time (untraced runs) and CPU time (traced runs), the two modes alternating so both see the same load."""
    runs = {"blocks": [], "naive": []}
    cpu = {"blocks": [], "naive": []}
    for _ in range(repeats):
        for mode in runs:
            runs[mode].append(page.evaluate(STRIP_JS, {"mode": mode, "url": url}))
    for _ in range(repeats):
        for mode in cpu:
            browser.start_tracing(page=page, categories=["toplevel", "blink.user_timing", "__metadata"])
            page.evaluate(STRIP_JS, {"mode": mode, "url": url})
            cpu[mode].append(_cpu_between_marks(browser.stop_tracing()))
    out = {}
    med = lambda xs: round(statistics.median(xs), 1)
    for mode, rs in runs.items():
        out[mode] = {
            "first_paint_ms_median": med(r["first_paint_ms"] for r in rs),
            "first_paint_ms_all": [round(r["first_paint_ms"], 1) for r in rs],
            "main_thread_cpu_ms_median": med(c["main_cpu_ms"] for c in cpu[mode]),
            "renderer_cpu_ms_median": med(c["renderer_cpu_ms"] for c in cpu[mode]),
            "recolor_ms_median": med(r["recolor_ms"] for r in rs),
            "spans_built": rs[0]["spans"],
            "tokens": rs[0]["tokens"],
        }
    for key in ("first_paint_ms_median", "main_thread_cpu_ms_median"):
        out[f"speedup_{key.removesuffix('_median')}"] = round(out["naive"][key] / max(out["blocks"][key], 1e-3), 1)
    return out


def _sample_view(page, base: str, step: int, row: int) -> dict:
    """Open the rollout table, click the long sample, count requests until the strip sits on the response."""
    page.goto(f"{base}#rollouts/{step}")
    page.wait_for_selector(f"#rollout-table tr[data-row='{row}']")
    requests = []

    def count(request):
        requests.append(request.url)

    page.on("request", count)
    t0 = time.perf_counter()
    page.click(f"#rollout-table tr[data-row='{row}']")
    page.wait_for_function(f"document.getElementById('pane-sample').dataset.scrolled === '{step}/{row}'")
    elapsed = time.perf_counter() - t0
    page.remove_listener("request", count)
    return {
        "requests_per_sample_view": len(requests),
        "request_urls": [u.replace(base, "/") for u in requests],
        "click_to_scrolled_ms": round(elapsed * 1000, 1),
    }


def run(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(prog="miles bench dashboard")
    p.add_argument("--tokens", type=int, default=65536, help="tokens in the long sample")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--json", action="store_true", help="accepted for `miles bench dashboard --json`; output is JSON anyway"
    )
    args = p.parse_args(argv)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        raise ImportError(
            "the dashboard benchmark needs playwright and Chromium: pip install 'miles[dev]'; apt install chromium"
        ) from e
    from miles.dashboard.server import DashboardServer

    with tempfile.TemporaryDirectory(prefix="miles-bench-dashboard-") as tmp:
        t0 = time.perf_counter()
        run_dir = synthetic_run(Path(tmp) / "run", num_steps=2, long_tokens=args.tokens)
        write_s = time.perf_counter() - t0
        with DashboardServer(run_dir) as server, sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(server.url)
            page.wait_for_function("document.body.dataset.ready === '1'")
            load_before = os.getloadavg()[0]
            strips = _measure_strips(browser, page, "/api/steps/2/samples/1", args.repeats)
            view = _sample_view(page, server.url, 2, 1)
            browser.close()
    return {
        "tokens": args.tokens,
        "repeats": args.repeats,
        "write_run_dir_s": round(write_s, 2),
        "load_avg_1min": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "strip": strips,
        **view,
        "goal": {"first_paint_ms": 66, "requests_per_sample_view": 1},
    }
