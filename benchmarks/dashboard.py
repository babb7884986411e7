"""`miles bench dashboard`: how fast the sample view shows a 64k-token strip, in real headless Chromium.

Writes a synthetic run directory (with the same writers the driver uses), serves it, and in one browser
measures side by side: building the strip and reaching its first paint with the block strip (the
dashboard's) and with the naive one-span-per-token build (the reference) -- wall time, and the renderer's
CPU time from a trace, which a machine busy with other work does not inflate -- recolouring both, and how
many requests one sample view makes (strip + chart + conversation: the goal is one).

    miles bench dashboard --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from miles.dashboard.synthetic import synthetic_run

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
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
