"""The dashboard in real headless Chromium: the 64k-token strip, its scrolling, the table, every pane.

Screenshots land in tests/artifacts/dashboard_*.png (gitignored) for a person to look at.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from miles.dashboard.server import DashboardServer
from miles.dashboard.snapshot import CHROMIUM, CHROMIUM_ARGS
from miles.dashboard.store import RunDirWriter
from miles.dashboard.synthetic import LONG_PROMPT, synthetic_step
from miles.rollout_dump import RolloutDumpWriter

pytestmark = pytest.mark.browser  # headless Chromium against the dashboard

sync_api = pytest.importorskip("playwright.sync_api")
if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
LONG = "/api/steps/3/samples/1"


@pytest.fixture(scope="module")
def server(long_run_dir):
    with DashboardServer(long_run_dir) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    p = browser.new_page(viewport={"width": 1400, "height": 900})
    p.errors = []
    p.on("pageerror", lambda e: p.errors.append(str(e)))
    p.on("console", lambda m: p.errors.append(m.text) if m.type == "error" else None)
    p.goto(server.url)
    p.wait_for_function("document.body.dataset.ready === '1'")
    yield p
    assert p.errors == []
    p.close()


def shot(page, name):
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"dashboard_{name}.png"))


def open_table(page, step=3):
    page.goto(page.url.split("#")[0] + f"#rollouts/{step}")
    page.wait_for_selector("#rollout-table tr[data-row='1']")


def open_long_sample(page):
    open_table(page)
    page.click("#rollout-table tr[data-row='1']")


def wait_scrolled(page, key="3/1"):
    page.wait_for_function(f"document.getElementById('pane-sample').dataset.scrolled === '{key}'")
    page.evaluate("() => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)))")


def first_response_token_offset(page) -> float:
    """Where the first response token sits, in px below the strip's top edge (visible: 0 <= y < height)."""
    return page.evaluate(f"""() => {{
        const s = window.miles.strip;
        return s.span({LONG_PROMPT}).getBoundingClientRect().top - s.el.getBoundingClientRect().top; }}""")


def strip_state(page) -> dict:
    return page.evaluate("""() => { const s = window.miles.strip, v = window.miles.visibleTokens();
        return { scrollTop: s.el.scrollTop, top: v && v[0], height: s.el.clientHeight }; }""")


def test_the_64k_token_strip_builds_from_one_request(page):
    open_table(page)
    requests = []
    page.on("request", lambda r: requests.append(r.url.split("/", 3)[3]))
    page.click("#rollout-table tr[data-row='1']")
    wait_scrolled(page)
    assert requests == [LONG.lstrip("/")]
    assert page.get_attribute("#strip", "data-built") == "65536"
    assert page.evaluate("window.miles.data.n") == 65536
    # the per-token chart was drawn from the same payload: its canvas has ink
    assert page.evaluate("""() => { const c = document.getElementById('token-chart');
        return c.getContext('2d').getImageData(0, 0, c.width, c.height).data.some((v, i) => i % 4 === 3 && v > 0); }""")
    assert "65,536 tokens" in page.inner_text("#sample-status")
    shot(page, "sample")


def test_the_strip_scrolls_to_the_first_response_token_when_shown(page):
    open_long_sample(page)
    wait_scrolled(page)
    state = strip_state(page)
    assert state["scrollTop"] > 1000  # 2,048 prompt tokens lie above it
    assert 0 <= first_response_token_offset(page) < 60
    assert LONG_PROMPT - 300 <= state["top"] <= LONG_PROMPT


def test_a_tab_switch_during_a_long_load_still_scrolls_to_the_response_when_shown(page):
    held = []
    page.route(f"**{LONG}", lambda route: held.append(route))
    open_long_sample(page)
    page.wait_for_function("document.getElementById('pane-sample').dataset.state === 'loading'")
    page.click("#tabs button[data-tab='metrics']")
    page.wait_for_function("document.getElementById('pane-sample').hidden")
    assert len(held) == 1
    held[0].continue_()
    page.wait_for_function("document.getElementById('pane-sample').dataset.state === 'ready'")
    page.evaluate("() => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)))")
    # built while hidden: no layout box yet, so the one-shot scroll is still waiting
    assert page.evaluate("document.getElementById('pane-sample').dataset.scrolled") is None
    assert page.evaluate("window.miles.strip.el.scrollTop") == 0
    page.click("#tabs button[data-tab='sample']")
    wait_scrolled(page)
    assert 0 <= first_response_token_offset(page) < 60
    page.unroute(f"**{LONG}")


def test_recolouring_and_tab_switches_keep_the_scroll_position_and_the_spans(page):
    open_long_sample(page)
    wait_scrolled(page)
    page.evaluate("window.miles.strip.scrollToToken(30000)")
    page.evaluate("() => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)))")
    page.evaluate("window.__span = window.miles.strip.span(30010); window.__bg = window.__span.className")
    before = strip_state(page)
    assert 29500 < before["top"] <= 30000
    for stat in ("entropy", "advantages", "none", "diff"):
        page.select_option("#color-by", stat)
        assert strip_state(page) == before, stat
    page.select_option("#color-by", "entropy")
    assert page.evaluate("window.miles.strip.span(30010) === window.__span")  # repainted, not rebuilt
    assert page.evaluate("window.__span.className !== window.__bg")
    shot(page, "sample_entropy")
    for tab in ("metrics", "memory", "rollouts"):
        page.click(f"#tabs button[data-tab='{tab}']")
        page.click("#tabs button[data-tab='sample']")
        page.evaluate("() => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)))")
        assert strip_state(page) == before, tab
    assert page.evaluate("window.miles.strip.span(30010) === window.__span")


def test_hovering_a_token_shows_every_stat(page):
    open_long_sample(page)
    wait_scrolled(page)
    box = page.evaluate(f"""() => {{ const r = window.miles.strip.span({LONG_PROMPT + 3}).getBoundingClientRect();
        return {{ x: r.left + r.width / 2, y: r.top + r.height / 2 }}; }}""")
    page.mouse.move(box["x"], box["y"])
    page.wait_for_selector("#tooltip:not([hidden])")
    tip = page.inner_text("#tooltip")
    assert f"token {LONG_PROMPT + 3} (response #3)" in tip
    for label in ("loss mask", "rollout logp", "train logp", "train−rollout", "advantage", "entropy"):
        assert label in tip
    shot(page, "sample_hover")


def column(page, nth: int) -> list[str]:
    return page.eval_on_selector_all(
        f"#rollout-table tbody tr td:nth-child({nth})", "tds => tds.map((t) => t.innerText.trim())"
    )


def test_the_rollout_table_sorts_by_reward_length_and_group(page):
    page.goto(page.url.split("#")[0] + "#rollouts/3")
    page.wait_for_selector("#rollout-table tr[data-row='15']")
    page.click("th[data-key='reward']")
    rewards = [float(x) for x in column(page, 3)]
    assert rewards == sorted(rewards) and len(rewards) == 16
    page.click("th[data-key='reward']")
    assert [float(x) for x in column(page, 3)] == sorted(rewards, reverse=True)
    page.click("th[data-key='num_tokens']")
    lengths = [int(x) for x in column(page, 4)]
    assert lengths == sorted(lengths) and lengths[-1] == 65536
    page.click("th[data-key='group']")
    page.click("th[data-key='group']")
    groups = [int(x) for x in column(page, 2)]
    assert groups == sorted(groups, reverse=True)
    assert page.get_attribute("th[data-key='group']", "data-dir") == "desc"
    page.click("th[data-key='reward']")
    shot(page, "rollouts")


def test_block_strip_matches_the_naive_reference(page):
    """Every token's text, class and colour in the block strip (all blocks materialised) equal the naive build's."""
    result = page.evaluate(f"""async () => {{
        const {{ TokenStrip, parseSample }} = await import('/static/strip.js');
        const data = parseSample(await (await fetch('{LONG}')).arrayBuffer());
        const mk = (mode) => {{ const el = document.createElement('div'); el.className = 'strip';
            document.body.append(el); const s = new TokenStrip(el, {{ mode }}); s.build(data); return s; }};
        const fast = mk('blocks'), naive = mk('naive');
        fast.blocks.forEach((_, b) => fast.materialise(b));
        const diffs = [];
        for (const stat of ['diff', 'entropy']) {{
            fast.recolor(stat); naive.recolor(stat);
            for (let i = 0; i < data.n; i++) {{
                const a = fast.span(i), b = naive.span(i);
                if (a.textContent !== b.textContent || a.className !== b.className
                    ) diffs.push([stat, i]);
            }}
        }}
        const text = Array.from(fast.el.querySelectorAll('span'), (s) => s.textContent).join('');
        fast.el.remove(); naive.el.remove();
        return {{ diffs: diffs.slice(0, 5), same_text: text === data.text, n: data.n }};
    }}""")
    assert result == {"diffs": [], "same_text": True, "n": 65536}


def test_every_pane_renders(page):
    for tab, selector in (
        ("metrics", ".card[data-metric='reward'] canvas"),
        ("memory", ".card[data-pool='device'] canvas"),
    ):
        page.click(f"#tabs button[data-tab='{tab}']")
        page.wait_for_selector(selector)
        shot(page, tab)
    assert page.eval_on_selector_all("#memory-legend span", "s => s.map((x) => x.innerText)") == [
        "engine · weights",
        "engine · kv_cache",
        "trainer · params",
        "trainer · optimizer",
        "trainer · grads",
    ]
    assert "peak over RL steps 8.0 GiB" in page.inner_text(".card[data-pool='device'] .title")


def test_follow_mode_shows_new_steps_and_metrics_live(browser, tmp_path):
    run = RunDirWriter(run_dir=tmp_path)
    run.append_metrics({"step": 1, "reward": 0.1})
    RolloutDumpWriter(run_dir=tmp_path).write_step(1, synthetic_step(1, num_groups=1, group_size=2))
    with DashboardServer(tmp_path, follow=True) as server:
        p = browser.new_page()
        p.goto(server.url + "#rollouts")
        p.wait_for_selector("#rollout-table tr[data-row='1']")
        assert p.inner_text("#live") == "● live"
        run.append_metrics({"step": 2, "reward": 0.7})
        RolloutDumpWriter(run_dir=tmp_path).write_step(2, synthetic_step(2, num_groups=2, group_size=2))
        # 30 s: the follow poll is quick, but a loaded 2-core CI box is slow to repaint (10 s timed out once)
        p.wait_for_selector("#step-select option[value='2']", state="attached", timeout=30_000)
        p.wait_for_selector("#rollout-table tr[data-row='3']", timeout=30_000)  # the table follows the newest step
        p.click("#tabs button[data-tab='metrics']")
        # null-safe: the card is drawn after the tab opens, and a predicate that throws ends the wait at once
        p.wait_for_function(
            "document.querySelector(\".card[data-metric='reward'] .title span\")?.innerText === '0.7'", timeout=30_000
        )
        p.close()
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_deep_link_the_next_button_and_a_missing_sample_all_stay_in_the_sample_view(page):
    page.goto(page.url.split("#")[0] + "#sample/3/0")
    wait_scrolled(page, "3/0")
    page.click("#next-sample")
    wait_scrolled(page, "3/1")
    assert page.evaluate("location.hash") == "#sample/3/1"
    page.keyboard.press("[")
    wait_scrolled(page, "3/0")
    page.goto(page.url.split("#")[0] + "#sample/3/99")
    page.wait_for_function("document.getElementById('pane-sample').dataset.state === 'error'")
    assert "row 99 does not exist" in page.inner_text("#sample-status")
    assert all("404" in e for e in page.errors)  # the browser logs the failed fetch; nothing else went wrong
    page.errors.clear()


def test_reward_timeouts_and_errors_show_on_the_metrics_tab_with_their_meaning(browser, tmp_path):
    run = RunDirWriter(run_dir=tmp_path)
    for step, (timeouts, errors) in enumerate([(0, 1), (3, 0)]):
        run.append_metrics({"step": step, "reward": 0.5, "reward/timeouts": timeouts, "reward/errors": errors})
    with DashboardServer(tmp_path) as server:
        p = browser.new_page()
        p.goto(server.url + "#metrics")
        p.wait_for_selector(".card[data-metric='reward/timeouts'] canvas")
        assert p.inner_text(".card[data-metric='reward/timeouts'] .title span") == "3"
        title = p.get_attribute(".card[data-metric='reward/errors'] .title b", "title")
        assert "raised or returned a non-finite number" in title
        assert "REWARD" in p.eval_on_selector_all("#metrics-groups h2", "hs => hs.map((h) => h.innerText)")  # its group
        p.close()


def test_the_strip_colours_tokens_by_weight_version_older_lighter(page):
    """Step 3's long sample crossed an update halfway through its response (versions 2 then 3): coloured by weight
    version, the first half's tokens are a lighter shade than the second half's, and the tooltip names the version."""
    open_long_sample(page)
    wait_scrolled(page)
    page.select_option("#color-by", "weight_versions")
    classes = page.evaluate(f"""() => {{ const s = window.miles.strip, d = window.miles.data;
        const half = {LONG_PROMPT} + Math.floor((d.n - {LONG_PROMPT}) / 2);
        return [s.span({LONG_PROMPT}).className, s.span(half - 1).className, s.span(half).className,
                s.span(d.n - 1).className, s.span({LONG_PROMPT} - 1).className]; }}""")
    level = lambda c: int(next(x for x in c.split() if x.startswith("seq"))[3:])  # noqa: E731
    assert level(classes[0]) == level(classes[1]) < level(classes[2]) == level(classes[3])
    assert not any(x.startswith("seq") for x in classes[4].split())  # a prompt token: not sampled, no version
    assert page.inner_text("#legend").startswith("v2") and "v3" in page.inner_text("#legend")
    shot(page, "sample_weight_versions")
