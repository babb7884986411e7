"""The dashboard as a workbench, in real headless Chromium: the Memory tab per step (setup collapsed, owner colours,
the budget and the planner's peak, the same peak as the Metrics tab), metric descriptions, empty states, a default
sample, a colour scale that keeps float noise white, and the tab screenshots notebook 09 shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.dashboard.server import DashboardServer
from miles.dashboard.snapshot import CHROMIUM, CHROMIUM_ARGS, screenshot_tabs
from miles.dashboard.store import RunDirWriter
from miles.dashboard.synthetic import synthetic_run, synthetic_step
from miles.handoff.view import run_overlay
from miles.recipes import quickstart
from miles.rollout_dump import RolloutDumpWriter

pytestmark = pytest.mark.browser  # headless Chromium against the dashboard

sync_api = pytest.importorskip("playwright.sync_api")
if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
MiB = 1 << 20


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


def open_page(browser, server, tab: str):
    page = browser.new_page(viewport={"width": 1300, "height": 850})
    page.errors = []
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.goto(f"{server.url}#{tab}")
    page.wait_for_function("document.body.dataset.ready === '1'")
    return page


def event(t, owner, tag, pool, nbytes, direction, phase, step):
    return dict(time=t, owner=owner, tag=tag, pool=pool, bytes=nbytes, direction=direction, phase=phase, step=step)


def driver_peaks(events: list[dict]) -> dict[int, int]:
    """The reference: mem/device_peak as the driver computes it (per step, time order, from the bytes held at its start)."""
    held, peaks = 0, {}
    for e in sorted(events, key=lambda e: e["time"]):
        if e["pool"] != "device":
            continue
        start = peaks.setdefault(e["step"], held)
        held += e["bytes"] if e["direction"] == "in" else -e["bytes"]
        peaks[e["step"]] = max(start, peaks[e["step"]], held)
    return {s: p for s, p in peaks.items() if s >= 0}


@pytest.fixture(scope="module")
def ledger_run(tmp_path_factory):
    """Setup holds engine and trainer together (a larger peak than any RL step), then two RL steps."""
    run_dir = tmp_path_factory.mktemp("dash-mem")
    run = RunDirWriter(run_dir=run_dir)
    run.write_config(json.loads(json.dumps(quickstart().to_dict(), default=str)))
    ev = [
        event(0.0, "engine/0", "weights", "device", 8 * MiB, "in", "init", -1),
        event(0.1, "engine/0", "kv_cache", "device", 6 * MiB, "in", "init", -1),
        event(5.0, "trainer/0", "params", "device", 8 * MiB, "in", "init", -1),
        event(9.0, "trainer/0", "params", "device", 8 * MiB, "out", "offload_train", -1),
        event(9.1, "trainer/0", "params", "host", 8 * MiB, "in", "offload_train", -1),
    ]
    t = 100.0
    for step in (0, 1):
        ev += [
            event(t, "engine/0", "kv_cache", "device", 6 * MiB, "out", "release_kv", step),
            event(t + 0.1, "trainer/0", "params", "device", 8 * MiB, "in", "onload_train", step),
            event(t + 0.2, "trainer/0", "optimizer", "device", (2 + step) * MiB, "in", "train", step),
            event(t + 0.3, "trainer/0", "optimizer", "device", (2 + step) * MiB, "out", "offload_train", step),
            event(t + 0.4, "trainer/0", "params", "device", 8 * MiB, "out", "offload_train", step),
            event(t + 0.5, "engine/0", "kv_cache", "device", 6 * MiB, "in", "resume_kv", step),
        ]
        t += 1
    run.append_ledger(ev)
    for step, peak in driver_peaks(ev).items():
        run.append_metrics({"step": step, "reward": 0.5, "mem/device_peak": peak})
    return run_dir


def test_the_memory_peak_is_the_metrics_peak_and_setup_is_collapsed_until_asked(browser, ledger_run):
    with DashboardServer(ledger_run) as server:
        page = open_page(browser, server, "memory")
        card = page.wait_for_selector(".card[data-pool='device']")
        metrics_peak = max(driver_peaks(json.loads(l) for l in (ledger_run / "ledger.jsonl").open()).values())
        assert int(card.get_attribute("data-peak")) == metrics_peak == 19 * MiB
        facts = page.inner_text(".card[data-pool='device'] .facts")
        assert "peak over RL steps 19.0 MiB" in facts and "setup peak 22.0 MiB" in facts
        shown = int(card.get_attribute("data-events"))
        page.check("#memory-setup")
        card = page.wait_for_selector(".card[data-pool='device']")
        assert int(card.get_attribute("data-events")) == shown + 4  # the four device events of setup
        legend = page.eval_on_selector_all("#memory-legend span", "s => s.map((x) => x.innerText)")
        assert legend == ["engine · weights", "engine · kv_cache", "trainer · params", "trainer · optimizer"]
        assert page.errors == []


def test_the_planners_peak_and_the_budget_come_from_the_runs_config(browser, ledger_run, tmp_path):
    expected = run_overlay(json.loads((ledger_run / "config.json").read_text()))
    with DashboardServer(ledger_run) as server:
        page = open_page(browser, server, "memory")
        page.wait_for_selector(".card[data-pool='device'][data-planned]")
        card = page.query_selector(".card[data-pool='device']")
        assert int(card.get_attribute("data-planned")) == expected["peaks"]["device"]
        assert int(card.get_attribute("data-budget")) == expected["budget"]["device"]
        assert "planner: cpu profile, peak device cpu" in page.inner_text("#memory-plan")
    partial = synthetic_run(tmp_path / "partial", num_steps=1)  # its config.json is not a RunConfig
    with DashboardServer(partial) as server:
        page = open_page(browser, server, "memory")
        page.wait_for_function("document.getElementById('memory-plan').innerText.startsWith('no planner overlay')")
        assert page.query_selector(".card[data-pool='device'][data-planned]") is None


def test_metric_titles_describe_the_metric_on_hover(browser, ledger_run):
    with DashboardServer(ledger_run) as server:
        page = open_page(browser, server, "metrics")
        title = page.get_attribute(".card[data-metric='reward'] .title b", "title")
        assert title.startswith("mean reward")
        assert "ledger" in page.get_attribute(".card[data-metric='mem/device_peak'] .title b", "title")


def test_an_empty_run_directory_says_so_on_every_tab(browser, tmp_path):
    with DashboardServer(tmp_path) as server:
        page = open_page(browser, server, "metrics")
        for tab, empty in (
            ("metrics", "#metrics-empty"),
            ("memory", "#memory-empty"),
            ("rollouts", "#rollouts-empty"),
            ("sample", "#sample-empty"),
        ):
            page.click(f"#tabs button[data-tab='{tab}']")
            page.wait_for_selector(empty, state="visible")
        assert "Rollouts tab" in page.inner_text("#sample-empty")
        assert not page.is_visible("#strip")  # no empty strip box under the message
        assert page.errors == []


def test_the_sample_tab_opens_the_latest_steps_first_sample(browser, tmp_path):
    run_dir = synthetic_run(tmp_path / "run", num_steps=2)
    with DashboardServer(run_dir) as server:
        page = open_page(browser, server, "sample")
        page.wait_for_function("document.getElementById('pane-sample').dataset.state === 'ready'")
        assert page.inner_text("#sample-title").startswith("step 2 · sample 0")
        assert "latest step's first sample" in page.inner_text("#sample-hint")


def test_float_noise_between_train_and_rollout_log_probs_stays_white(browser, tmp_path):
    rows = synthetic_step(1, num_groups=1, group_size=2)
    for i, r in enumerate(rows):  # row 0: train = rollout up to float32 rounding; row 1: a real 0.5-nat gap
        r["train_log_probs"] = [v + (0.5 if i else 1e-7 * (-1) ** k) for k, v in enumerate(r["rollout_log_probs"])]
    RunDirWriter(run_dir=tmp_path).append_metrics({"step": 1, "reward": 0.5})
    RolloutDumpWriter(run_dir=tmp_path).write_step(1, rows)
    with DashboardServer(tmp_path) as server:
        page = open_page(browser, server, "sample/1/0")
        page.wait_for_function("document.getElementById('pane-sample').dataset.state === 'ready'")
        assert page.inner_text("#legend").split() == ["-0.001", "0.001"]  # the floor, not +-1e-7
        levels = page.eval_on_selector_all(".blk span:not(.p)", "s => s.map((x) => x.className)")
        assert levels and all(c.split()[-1] in ("pos0", "neg0") for c in levels if c)
        page.goto(f"{server.url}#sample/1/1")
        page.wait_for_function("document.getElementById('sample-title').innerText.startsWith('step 1 · sample 1')")
        page.wait_for_function("document.getElementById('pane-sample').dataset.state === 'ready'")
        assert page.inner_text("#legend").split() == ["-0.5", "0.5"]  # a real difference sets the scale


def test_every_tab_is_screenshotted_for_the_notebook(ledger_run):
    with DashboardServer(ledger_run) as server:
        paths = screenshot_tabs(server.url, ARTIFACTS / "tabs")
    assert sorted(paths) == ["memory", "metrics", "rollouts", "sample"]
    for p in paths.values():
        assert p.stat().st_size > 5_000 and p.read_bytes()[:4] == b"\x89PNG"
