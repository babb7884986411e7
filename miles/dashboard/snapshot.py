"""Screenshots of the dashboard's tabs in headless Chromium, so a stored notebook (and a person reading a test's
artifacts) shows the page without a live server: the browser tests and notebook 09 take them the same way.

    with DashboardServer(run_dir) as server:
        paths = screenshot_tabs(server.url, Path("shots"))   # {"metrics": shots/metrics.png, ...}
"""

from __future__ import annotations

import shutil
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"  # Debian's package; playwright drives it
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
TABS = ("metrics", "memory", "rollouts", "sample")


def screenshot_tabs(url: str, out: Path, tabs=TABS, width: int = 1200, height: int = 760) -> dict[str, Path]:
    """One PNG per tab (the page opened at ``#tab``, after it says it is ready); runs in a worker thread because
    Playwright's sync API refuses a thread that already runs an event loop (a notebook kernel's)."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(1).submit(_shoot, url, Path(out), tabs, width, height).result()


def _shoot(url: str, out: Path, tabs, width: int, height: int) -> dict[str, Path]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        raise ImportError("dashboard screenshots need playwright: pip install 'miles[dev]'") from e
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": width, "height": height})
        for tab in tabs:
            page.goto(f"{url.rstrip('/')}/#{tab}")
            page.wait_for_function("document.body.dataset.ready === '1'")
            if tab == "sample":  # the default sample loads after the page is ready
                page.wait_for_function(
                    "['ready', 'empty', 'error'].includes(document.getElementById('pane-sample').dataset.state)"
                )
            page.wait_for_timeout(300)  # the canvases draw on the next animation frame
            paths[tab] = out / f"{tab}.png"
            page.screenshot(path=str(paths[tab]))
        browser.close()
    return paths
