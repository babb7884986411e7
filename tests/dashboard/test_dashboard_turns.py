"""A multi-turn tool-use sample in the dashboard (real headless Chromium): the turn list, and in the token strip the
turn starts, the tool calls the model wrote and the tool results, drawn without touching the stat colours or the
loss-mask fading, kept through a recolour. The sample is a real 4-turn calculator episode (SmolLM2's template)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from miles.dashboard.server import DashboardServer
from miles.dashboard.snapshot import CHROMIUM, CHROMIUM_ARGS
from miles.rollout_dump import RolloutDumpWriter

pytestmark = pytest.mark.browser  # headless Chromium against the dashboard

sync_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("transformers")
if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}", allow_module_level=True)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "envs"))

from family_tokenizers import family_tokenizer  # noqa: E402
from test_env_tokens import play  # noqa: E402

from miles.envs.renderer import Renderer  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("turns")
    tok = family_tokenizer("smollm2", root / "tok")
    ep = play(Renderer(tok))
    s = ep.to_sample()
    row = {
        "index": 0, "group": 0, "reward": s.reward, "tokens": s.tokens, "token_text": tok.token_text(s.tokens),
        "prompt_len": len(s.prompt_ids), "prompt_text": s.prompt, "response_text": s.response_text,
        "loss_mask": s.metadata["loss_mask"], "rollout_log_probs": s.rollout_log_probs, "spans": s.metadata["spans"],
        "num_tool_calls": s.metadata["num_tool_calls"],
    }  # fmt: skip
    RolloutDumpWriter(root / "run").write_step(0, [row])
    return root / "run", s


def test_the_strip_marks_turns_tool_calls_and_results_and_keeps_them_through_a_recolour(run):
    run_dir, sample = run
    spans = sample.metadata["spans"]
    with DashboardServer(run_dir) as server, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server.url + "#sample/0/0")
        page.wait_for_function("document.getElementById('pane-sample').dataset.scrolled === '0/0'")
        buttons = page.eval_on_selector_all("#turns button", "bs => bs.map(b => [b.className, b.textContent])")
        assert [c for c, _ in buttons] == ["model", "env"] * 3 + ["model"]
        assert all("call calculate" in t for c, t in buttons[:6:2]) and "1 result" in buttons[1][1]

        def classes():
            return page.evaluate("""() => { const s = window.miles.strip; const out = [];
                for (let i = 0; i < s.data.n; i++) out.push(s.span(i).className); return out; }""")

        before = classes()
        for s in spans:
            want = {"tool_call": "tc", "tool_result": "tr"}.get(s["kind"])
            if want:
                assert all(want in before[i].split() for i in range(s["start"], s["end"])), s
            if s["kind"] in ("model", "env"):
                assert "ts" in before[s["start"]].split(), s
        p, mask = len(sample.prompt_ids), sample.metadata["loss_mask"]
        assert all(
            ("m" in before[p + i].split()) == (not m) for i, m in enumerate(mask)
        )  # env tokens fade, sampled do not
        page.select_option("#color-by", "rollout_log_probs")
        after = classes()
        assert [set(c.split()) & {"ts", "tc", "tr", "m"} for c in after] == [
            set(c.split()) & {"ts", "tc", "tr", "m"} for c in before
        ]
        assert after != before  # the colours changed, the marks did not
        env = next(s for s in spans if s["kind"] == "env")
        page.click("#turns button.env")
        top = page.evaluate(
            f"() => window.miles.strip.span({env['start']}).getBoundingClientRect().top - window.miles.strip.el.getBoundingClientRect().top"
        )
        assert 0 <= top < 200
        tip = page.evaluate(f"() => window.miles.tokenStats({env['start']})")
        assert "env turn 0" in tip
        browser.close()
        assert errors == []
