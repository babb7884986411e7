"""The dashboard on a long run, in real headless Chromium: the Memory tab's step window (last 10 steps by default, the
overview strip, from/to, arrows, span, #memory/A-B), its tooltip per event and the cause of each peak above the
planner; the Metrics tab's filter, smoothing, synced hover readout, unclipped labels and constant series; a folder of
runs with a run picker and an overlay; the rollout table's filter and pages. The 100-step run is shaped like the
quickstart's (the same tags, bytes and checkpoint_every=25); one test trains a real tiny run with a checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from miles.dashboard.server import DashboardServer
from miles.dashboard.snapshot import CHROMIUM, CHROMIUM_ARGS
from miles.dashboard.store import RunDirWriter
from miles.dashboard.synthetic import synthetic_step
from miles.memory.ledger import LedgerEvent, pool_peaks
from miles.recipes import quickstart
from miles.rollout_dump import RolloutDumpWriter

pytestmark = pytest.mark.browser  # headless Chromium against the dashboard

sync_api = pytest.importorskip("playwright.sync_api")
if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
MiB = 1 << 20
WEIGHTS, KV, PARAMS, OPTIMIZER = 3_289_600, 32 * MiB, 3_289_600, 6_579_200  # the quickstart's ledger
NUM_STEPS, CHECKPOINT_EVERY = 100, 25
EDGE_INK = """(c) => { const g = c.getContext('2d').getImageData(0, 0, c.width, c.height).data, w = c.width;
    for (let y = 0; y < c.height; y++) for (const x of [0, w - 1]) if (g[(y * w + x) * 4 + 3] > 0) return true;
    return false; }"""


def quickstart_shaped_run(run_dir: Path, t0: float = 1_700_000_000.0) -> Path:
    """Setup, then NUM_STEPS colocated steps as the quickstart's ledger has them; every CHECKPOINT_EVERY steps the
    trainer's state is onloaded to save a checkpoint while the engine holds its weights and KV cache (the driver saves
    after a step's ledger is drained, so those events open the next step), with a published manifest in between."""
    run = RunDirWriter(run_dir=run_dir)
    run.write_config(json.loads(json.dumps(quickstart().to_dict(), default=str)))
    ev = lambda t, owner, tag, pool, n, d, phase, step: dict(  # noqa: E731
        time=t, owner=owner, tag=tag, pool=pool, bytes=n, direction=d, phase=phase, step=step
    )
    trainer = (("params", PARAMS), ("optimizer", OPTIMIZER))
    events = [ev(t0, "engine/0", "weights", "device", WEIGHTS, "in", "init", -1)]
    events += [ev(t0 + 0.1, "engine/0", "kv_cache", "device", KV, "in", "init", -1)]
    events += [
        ev(t0 + 0.2 + k / 10, "trainer/0", tag, "host", n, "in", "offload_train", -1)
        for k, (tag, n) in enumerate(trainer)
    ]
    held, rows, rng = {}, [], np.random.default_rng(0)
    pool_peaks([LedgerEvent(**{k: v for k, v in e.items() if k != "step"}) for e in events], held)  # setup
    for step in range(NUM_STEPS):
        t = t0 + 10 * (step + 1)
        step_events = []
        if step and step % CHECKPOINT_EVERY == 0:
            for k, (tag, n) in enumerate(trainer):
                step_events += [ev(t + k / 100, "trainer/0", tag, "host", n, "out", "onload_train", step)]
                step_events += [ev(t + k / 100, "trainer/0", tag, "device", n, "in", "onload_train", step)]
            save_checkpoint(run_dir, step, saved_at=t + 0.05)
            for k, (tag, n) in enumerate(trainer):
                step_events += [ev(t + 0.08 + k / 100, "trainer/0", tag, "device", n, "out", "offload_train", step)]
                step_events += [ev(t + 0.08 + k / 100, "trainer/0", tag, "host", n, "in", "offload_train", step)]
            t += 0.2
        step_events += [ev(t + 0.1, "engine/0", "kv_cache", "device", KV, "out", "release_cuda_graph+kv_cache", step)]
        step_events += [ev(t + 0.2, "engine/0", "weights", "device", WEIGHTS, "out", "release_weights", step)]
        for k, (tag, n) in enumerate(trainer):
            step_events += [ev(t + 0.3 + k / 100, "trainer/0", tag, "host", n, "out", "onload_train", step)]
            step_events += [ev(t + 0.3 + k / 100, "trainer/0", tag, "device", n, "in", "onload_train", step)]
        for k, (tag, n) in enumerate(trainer):
            step_events += [ev(t + 2 + k / 100, "trainer/0", tag, "device", n, "out", "offload_train", step)]
            step_events += [ev(t + 2 + k / 100, "trainer/0", tag, "host", n, "in", "offload_train", step)]
        step_events += [ev(t + 2.2, "engine/0", "weights", "device", WEIGHTS, "in", "resume_weights", step)]
        step_events += [ev(t + 2.3, "engine/0", "kv_cache", "device", KV, "in", "resume_cuda_graph+kv_cache", step)]
        events += step_events
        peaks = pool_peaks([LedgerEvent(**{k: v for k, v in e.items() if k != "step"}) for e in step_events], held)
        rows.append(
            {
                "step": step,
                "reward": min(1.0, 0.3 + 0.005 * step + 0.05 * rng.standard_normal()),
                "lr": 0.001,  # constant
                "pg_loss": -0.003776 + 1e-5 * rng.standard_normal(),  # labels as wide as -0.003776
                "train_rollout_kl": 1.11e-14 * rng.random(),
                "engines/live": 1,
                "mem/device_peak": peaks["device"],
                "mem/host_peak": peaks["host"],
            }
        )
    run.append_ledger(events)
    for row in rows:
        run.append_metrics(row)
    return run_dir


def save_checkpoint(run_dir: Path, next_step: int, saved_at: float) -> None:
    """A checkpoint directory as the dashboard reads it: the manifest, written at ``saved_at``."""
    d = run_dir / "checkpoints" / f"step_{next_step:06d}"
    d.mkdir(parents=True)
    (d / "state.json").write_text(json.dumps({"next_step": next_step, "files": {}}))
    os.utime(d / "state.json", (saved_at, saved_at))


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    return quickstart_shaped_run(tmp_path_factory.mktemp("long") / "quickstart")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(long_run):
    with DashboardServer(long_run) as s:
        yield s


def open_page(browser, url: str, width: int = 1400):
    page = browser.new_page(viewport={"width": width, "height": 1000})
    page.errors = []
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
    page.goto(url)
    page.wait_for_function("document.body.dataset.ready === '1'")
    return page


def memory_page(browser, server, route="memory"):
    page = open_page(browser, f"{server.url}#{route}")
    page.wait_for_selector(".card[data-pool='device'][data-planned]", timeout=60_000)  # the planner imports slowly
    return page


def window(page) -> str:
    return page.get_attribute("#pane-memory", "data-window")


def device_events_shown(page) -> int:
    return int(page.get_attribute(".card[data-pool='device']", "data-shown"))


def test_the_memory_tab_opens_on_the_last_ten_steps_with_labels_inside_the_charts(browser, server):
    page = memory_page(browser, server)
    assert window(page) == "90-99"
    assert device_events_shown(page) == 10 * 8  # eight device events per step
    canvases = page.query_selector_all("#pane-memory canvas")
    assert len(canvases) == 3 and not any(c.evaluate(EDGE_INK) for c in canvases)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard_memory_long.png"))
    assert page.errors == []


def test_the_step_picker_moves_zooms_and_deep_links_the_memory_window(browser, server):
    page = memory_page(browser, server)
    page.fill("#memory-from", "20")
    page.fill("#memory-to", "29")
    page.press("#memory-to", "Enter")
    page.wait_for_function("document.getElementById('pane-memory').dataset.window === '20-29'")
    assert page.evaluate("location.hash") == "#memory/20-29"
    assert device_events_shown(page) == 10 * 8 + 4  # step 25 also holds the checkpoint's onload and offload
    page.click("#memory-next")
    assert window(page) == "30-39"
    page.click("#memory-prev")
    page.click("#memory-prev")
    assert window(page) == "10-19"
    page.select_option("#memory-span", "25")
    assert window(page) == "10-34"
    page.select_option("#memory-span", "5")
    box = page.query_selector("#memory-overview").bounding_box()
    x_of = (
        page.evaluate("(k) => window.miles.memoryView.overview.X(k)", 0),
        page.evaluate("(k) => window.miles.memoryView.overview.X(k + 1)", 0),
    )
    step_x = lambda s: box["x"] + x_of[0] + (s + 0.5) * (x_of[1] - x_of[0])  # noqa: E731
    page.mouse.move(step_x(40), box["y"] + 15)  # drag over steps 40..44
    page.mouse.down()
    page.mouse.move(step_x(44), box["y"] + 15, steps=4)
    page.mouse.up()
    assert window(page) == "40-44"
    page.mouse.click(step_x(70), box["y"] + 15)  # a click centres the window (5 steps) there
    assert window(page) == "68-72"
    page.select_option("#memory-span", "all")
    assert window(page) == "0-99" and device_events_shown(page) == 100 * 8 + 3 * 4
    page.goto(f"{server.url}#memory/50-54")
    page.wait_for_function("document.getElementById('pane-memory').dataset.window === '50-54'")
    assert page.input_value("#memory-from") == "50" and page.input_value("#memory-to") == "54"
    assert page.input_value("#memory-span") == "5"  # the menu names the window's size, whoever set it
    page.check("#memory-setup")  # setup shown: a window of the same size from the run's start
    assert window(page) == "-1-3"
    page.uncheck("#memory-setup")
    assert window(page) == "0-4"
    assert page.errors == []


def test_each_peak_above_the_planner_is_named_with_the_checkpoint_saved_while_it_stood(browser, server):
    page = memory_page(browser, server)
    planned = int(page.get_attribute(".card[data-pool='device']", "data-planned"))
    assert planned == WEIGHTS + KV  # the quickstart's planner: the engine's weights and KV cache
    peaks = page.inner_text(".card[data-pool='device'] .peaks")
    assert "steps 25, 50, 75 · 44.5 MiB, 9.4 MiB over the planner" in peaks
    assert "checkpoints step_000025, step_000050, step_000075 saved" in peaks
    assert (
        "trainer params + optimizer (9.4 MiB) moved in by onload_train while engine kv_cache + weights (35.1 MiB)"
        in peaks
    )
    assert page.is_hidden(".card[data-pool='host'] .peaks")  # the host never rises above its line
    page.click(".card[data-pool='device'] .peaks a[data-step='50']")  # a step link centres the window on it
    assert window(page) == "46-55"
    assert page.errors == []


def test_a_peak_whose_checkpoint_was_not_saved_while_it_stood_is_named_by_its_phase(browser, tmp_path):
    run = quickstart_shaped_run(tmp_path / "run")
    stamp = (run / "checkpoints" / "step_000050" / "state.json").stat().st_mtime + 5  # saved after the bytes left
    os.utime(run / "checkpoints" / "step_000050" / "state.json", (stamp, stamp))
    with DashboardServer(run) as s:
        page = memory_page(browser, s)
        peaks = page.inner_text(".card[data-pool='device'] .peaks")
        assert "steps 25, 75 · 44.5 MiB" in peaks and "checkpoints step_000025, step_000075 saved" in peaks
        assert "step 50 · 44.5 MiB, 9.4 MiB over the planner · onload_train: trainer params + optimizer" in peaks
        assert page.errors == []


def test_hovering_the_memory_chart_shows_the_event_the_bytes_held_and_the_peaks_cause(browser, server):
    page = memory_page(browser, server, "memory/20-29")
    at = page.evaluate("""() => { const v = window.miles.memoryView, c = v.charts.device;
        const q = v.pools.find((p) => p.pool === 'device').peaks.find((q) => q.step === 25);
        const r = document.querySelector(".card[data-pool='device'] canvas").getBoundingClientRect();
        return { x: r.left + (c.X(q.index) + c.X(q.index + 1)) / 2, y: r.top + 120 }; }""")
    page.mouse.move(at["x"], at["y"])
    page.wait_for_selector("#tooltip:not([hidden])")
    tip = page.inner_text("#tooltip")
    assert tip.startswith("step 25 · event 2 of 12 · onload_train")
    assert "trainer/0 optimizer +6.3 MiB" in tip and "held 44.5 MiB   planner 35.1 MiB (+9.4 MiB)" in tip
    assert "▲ step 25 peaks at 44.5 MiB: checkpoint step_000025 saved" in tip
    assert page.is_visible(".card[data-pool='device'] .cursor")
    page.mouse.move(5, 5)
    assert page.is_hidden("#tooltip")
    assert page.errors == []


def test_the_metrics_filter_smoothing_and_hover_readout(browser, server):
    page = open_page(browser, f"{server.url}#metrics")
    total = len(page.query_selector_all(".card[data-metric]"))
    page.fill("#metrics-filter", "^mem/")
    assert page.eval_on_selector_all(".card[data-metric]", "cs => cs.map((c) => c.dataset.metric)") == [
        "mem/device_peak",
        "mem/host_peak",
    ]
    assert page.inner_text("#metrics-count") == f"2 of {total} metrics"
    page.fill("#metrics-filter", "mem/(")  # not a regular expression: matched as text
    assert page.query_selector_all(".card[data-metric]") == []
    page.fill("#metrics-filter", "reward|lr")
    page.eval_on_selector("#metrics-smoothing", "(el) => { el.value = '0.9'; el.dispatchEvent(new Event('input')); }")
    box = page.query_selector(".card[data-metric='reward'] canvas").bounding_box()
    step_px = page.evaluate("() => window.miles.metricsView.cards.find((c) => c.s.key === 'reward').chart.X(50)")
    page.mouse.move(box["x"] + step_px, box["y"] + box["height"] / 2)
    page.wait_for_selector("#tooltip:not([hidden])")
    tip = page.inner_text("#tooltip").splitlines()
    assert tip[0] == "reward · step 50" and "smoothed" in tip[1]
    # every visible chart reads out the same step
    titles = page.eval_on_selector_all(".card[data-metric] .title span", "s => s.map((x) => x.innerText)")
    assert titles[0].startswith("step 50: ") and titles[1] == "step 50: 0.001"
    page.mouse.move(5, 5)
    assert page.inner_text(".card[data-metric='lr'] .title span") == "0.001 · constant"
    assert page.errors == []


def test_the_smoothing_matches_tensorboards_debiased_ema(browser, server):
    ys = [0.3, 0.5, float("nan"), 0.2, 0.9, 0.85, 0.1]
    got = open_page(browser, server.url).evaluate(
        "async (ys) => (await import('/static/charts.js')).smooth(ys.map((y) => y ?? NaN), 0.6).map((v) => isNaN(v) ? null : v)",
        [None if y != y else y for y in ys],
    )
    last, n, want = 0.0, 0, []
    for y in ys:  # TensorBoard's smoothing (tensorboard/plugins/scalar), written out
        if y != y:
            want.append(None)
            continue
        last, n = last * 0.6 + 0.4 * y, n + 1
        want.append(last / (1 - 0.6**n))
    assert got == pytest.approx(want)


def test_metric_labels_stay_inside_their_charts_and_a_constant_sits_mid_chart(browser, server):
    page = open_page(browser, f"{server.url}#metrics", width=1000)
    canvases = page.query_selector_all(".card[data-metric] canvas")
    assert canvases and not [c.get_attribute("data-y-labels") for c in canvases if c.evaluate(EDGE_INK)]
    labels = lambda key: json.loads(page.get_attribute(f".card[data-metric='{key}'] canvas", "data-y-labels"))  # noqa: E731
    assert labels("lr") == ["0.0000", "0.0005", "0.0010", "0.0015", "0.0020"]  # 0.001 between 0 and 0.002
    assert labels("engines/live") == ["0.0", "0.5", "1.0", "1.5", "2.0"]
    assert len(set(labels("pg_loss"))) == len(labels("pg_loss"))  # tick labels never round to the same text
    assert page.errors == []


def test_a_folder_of_runs_has_a_run_picker_and_overlays_a_second_run(browser, long_run, tmp_path):
    other = RunDirWriter(run_dir=tmp_path / "baseline")
    other.write_config({"run_dir": str(tmp_path / "baseline")})
    for step in range(0, 100, 10):
        other.append_metrics({"step": step, "reward": 0.2})
    os.symlink(long_run, tmp_path / "quickstart")
    with DashboardServer(tmp_path) as s:
        page = open_page(browser, f"{s.url}#metrics")
        assert page.is_visible("#run-select") and page.is_hidden("#run-name")
        assert page.eval_on_selector_all("#run-select option", "os => os.map((o) => o.value)") == [
            "baseline",
            "quickstart",
        ]
        start = page.input_value("#run-select")
        page.select_option("#run-select", "quickstart" if start == "baseline" else "baseline")
        page.wait_for_function("document.body.dataset.ready === '1' && location.search.startsWith('?run=')")
        page.goto(f"{s.url}?run=quickstart#metrics")
        page.wait_for_function("document.body.dataset.ready === '1'")
        assert page.input_value("#run-select") == "quickstart"
        page.select_option("#metrics-overlay", "baseline")
        page.wait_for_selector("#metrics-legend .run-b")
        page.fill("#metrics-filter", "^reward$")
        box = page.query_selector(".card[data-metric='reward'] canvas").bounding_box()
        px = page.evaluate("() => window.miles.metricsView.cards[0].chart.X(40)")
        page.mouse.move(box["x"] + px, box["y"] + box["height"] / 2)
        tip = page.inner_text("#tooltip").splitlines()
        assert tip[0] == "reward · step 40" and tip[1].startswith("quickstart: ") and tip[2].startswith("baseline: 0.2")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard_metrics_overlay.png"))
        assert page.errors == []


def test_the_rollout_table_pages_and_filters_and_a_prompt_token_has_no_difference(browser, tmp_path):
    samples = synthetic_step(1, num_groups=64, group_size=4)  # 256 samples
    for i, s in enumerate(samples):
        s["reward"] = 0.0 if i % 10 == 0 else 0.5 + s["reward"] / 2
    for s in samples:  # the driver stores 0 as the rollout log-prob of prompt tokens
        s["rollout_log_probs"] = [0.0] * s["prompt_len"] + list(s["rollout_log_probs"])
        s["train_log_probs"] = [-7.0] * s["prompt_len"] + list(s["train_log_probs"])
    RolloutDumpWriter(run_dir=tmp_path).write_step(1, samples)
    with DashboardServer(tmp_path) as s:
        page = open_page(browser, f"{s.url}#rollouts/1")
        page.wait_for_selector("#rollout-table tr[data-row='49']")
        assert len(page.query_selector_all("#rollout-table tbody tr")) == 50
        assert page.inner_text("#table-info") == "rows 1–50 of 256"
        page.click("#table-next")
        assert page.inner_text("#table-info") == "rows 51–100 of 256"
        page.fill("#table-filter", "reward = 0")
        rewards = page.eval_on_selector_all("#rollout-table tbody td:nth-child(3)", "ts => ts.map((t) => t.innerText)")
        assert rewards == ["0"] * 26 and page.inner_text("#table-info") == "rows 1–26 of 26 (26 of 256 match)"
        page.fill("#table-filter", "rewrd = 0")
        assert "bad" in page.get_attribute("#table-filter", "class") and "no column rewrd" in page.get_attribute(
            "#table-filter", "title"
        )
        page.goto(f"{s.url}#sample/1/0")
        page.wait_for_function("document.getElementById('pane-sample').dataset.state === 'ready'")
        page.evaluate("window.miles.strip.scrollToToken(0)")
        r = page.evaluate(
            "() => { const b = window.miles.strip.span(2).getBoundingClientRect(); return [b.left + 2, b.top + 4]; }"
        )
        page.mouse.move(*r)
        page.wait_for_selector("#tooltip:not([hidden])")
        tip = page.inner_text("#tooltip")
        assert "(prompt)" in tip and "rollout logp   – (prompt token: not sampled)" in tip
        assert "train−rollout  –" in tip and "train logp     -7.0000" in tip
        assert page.errors == []


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, ray_session):
    """A real run: the quickstart shrunk (tests.conftest.tiny_run_cfg), 4 RL steps, a checkpoint after step 1."""
    from miles.driver import train
    from tests.conftest import tiny_run_cfg

    cfg = tiny_run_cfg(
        tmp_path_factory.mktemp("tiny"), "num_steps=4", "checkpoint_every=2", "trainer.warmup_sft_steps=0"
    )
    train(cfg, progress=False)
    return Path(cfg.run_dir)


@pytest.mark.slow
def test_a_real_runs_peaks_above_the_planner_are_its_checkpoint_saves(browser, tiny_run):
    metrics = [json.loads(line) for line in (tiny_run / "metrics.jsonl").open()]
    with DashboardServer(tiny_run) as s:
        page = memory_page(browser, s)
        planned = int(page.get_attribute(".card[data-pool='device']", "data-planned"))
        above = [r["step"] for r in metrics if "step" in r and r.get("mem/device_peak", 0) > planned]
        assert above == [2]  # the step that opened with the checkpoint save (checkpoint_every=2)
        peaks = page.inner_text(".card[data-pool='device'] .peaks")
        assert peaks.startswith("▲ step 2 · ") and "checkpoint step_000002 saved: trainer params + " in peaks
        assert "moved in by onload_train while engine " in peaks
        assert page.errors == []
