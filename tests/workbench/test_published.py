"""The published-vs-reproduced box: ratios, "not stated" where the PR gives no figure, and an unknown PR refused."""

import matplotlib
import pytest

matplotlib.use("Agg")

from miles.published import Claim, header, plot, table  # noqa: E402


def test_the_table_gives_the_ratio_and_says_not_stated_where_the_pr_has_no_figure():
    t = table([Claim("host peak", "GiB", 898, 992.6, "planner"), Claim("moved", "B", None, 463104, "measured here")])
    assert list(t["ours / published"]) == ["1.11", ""]
    assert t["published"][1] == "not stated"
    assert t["ours"][0] == "992.6 GiB"


def test_a_figure_we_cannot_measure_says_so():
    t = table([Claim("NCCL broadcast", "ms", None, None, "", note="needs two GPUs")])
    assert t["ours"][0] == "not measured here" and t["note"][0] == "needs two GPUs"


def test_the_plot_has_one_panel_per_claim_with_both_figures():
    fig = plot([Claim("a", "GiB", 1, 2, ""), Claim("b", "ms", None, 3, ""), Claim("c", "s", None, None, "")])
    assert len(fig.axes) == 1
    assert [p.get_height() for p in fig.axes[0].patches] == [1, 2]


def test_a_box_without_any_published_figure_draws_no_chart_of_empty_bars(monkeypatch):
    import IPython.display

    from miles.published import box

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(type(obj).__name__))
    box(2692, "x", [Claim("a", "", None, 9, ""), Claim("b", "ms", None, 3, "")])
    assert plot([Claim("a", "", None, 9, "")]) is None
    assert shown == ["HTML", "HTML"]  # the header and the table


def test_the_header_links_the_pr_and_an_unknown_pr_is_refused():
    assert "https://github.com/radixark/miles/pull/2781" in header(2781, "x")
    from miles.published import box

    with pytest.raises(ValueError, match="PR #1 is not one"):
        box(1, "x", [])
