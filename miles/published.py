"""Published vs reproduced: the upstream PR's figure next to ours, in one box at the top of a notebook.

Each notebook that reproduces a PR of the production framework (github.com/radixark/miles) names it, gives the
PR's figure, ours (measured here at small scale, on the H200 where a stored result exists, or modelled at full
scale by the planner or the traffic model), their ratio, and a side-by-side plot of the claims that have both
figures. A figure the PR does not state is ``None`` and shows as "not stated" in the table, and its claim is left
out of the plot (a bar chart of ours beside an empty bar says nothing the table does not); a box none of whose
claims has a published figure is the header and the table only. A figure we cannot measure here says why in
``note``.

    box(2781, "host peak at the handoff", [Claim("DSv4-Flash host peak, cpu order", "GiB/tray", 898, 992.6,
        "modelled: planner, 8 x GB300", note="published figure is the cgroup it overflows")])
"""

from __future__ import annotations

import html
import textwrap
from dataclasses import dataclass

REPO = "https://github.com/radixark/miles/pull"
PRS = {
    2692: "disk-delta: tensor layouts that differ from the canonical checkpoint rejected",
    2739: "optimizer state offloaded to NVMe",
    2748: "agent abort flushes every session-server instance",
    2764: "policy log-probs in model precision (logits memory)",
    2781: "colocate memory peak device: the handoff's host peak on GB300",
    2794: "dashboard token strip: one scroll box for a 64k-token sample",
    2142: "quantized weight workspaces dropped before offload",
    1313: "RDT weight sync (Ray Direct Transport) vs NCCL broadcast",
}


@dataclass(frozen=True, slots=True)
class Claim:
    """One figure: what it measures, its unit, the PR's value (None: not stated), ours, where ours comes from."""

    quantity: str
    unit: str
    published: float | None
    ours: float | None
    source: str  # "measured here (CPU, toy size)" / "H200, benchmarks/results/x.json" / "modelled: planner"
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.published in (None, 0) or self.ours is None:
            return None
        return self.ours / self.published


def table(claims: list[Claim]):
    """The claims as a DataFrame: published and ours with units, ours / published, the source and a note."""
    import pandas as pd

    fmt = lambda x, unit: "not stated" if x is None else f"{x:,.4g} {unit}"
    return pd.DataFrame(
        {
            "quantity": [c.quantity for c in claims],
            "published": [fmt(c.published, c.unit) for c in claims],
            "ours": [fmt(c.ours, c.unit) if c.ours is not None else "not measured here" for c in claims],
            "ours / published": ["" if c.ratio is None else f"{c.ratio:.2f}" for c in claims],
            "ours from": [c.source for c in claims],
            "note": [c.note for c in claims],
        }
    )


def plot(claims: list[Claim], title: str = ""):
    """One small panel per claim with both figures: published and ours as two bars, labelled with the values.
    None when no claim has both (the table then says everything)."""
    import matplotlib.pyplot as plt

    shown = [c for c in claims if c.ours is not None and c.published is not None]
    if not shown:
        return None
    fig, axes = plt.subplots(1, len(shown), figsize=(2.8 * len(shown) + 0.6, 3.0), squeeze=False)
    for ax, c in zip(axes[0], shown):
        bars = ax.bar([0, 1], [c.published, c.ours], color=["0.6", "C0"], width=0.6)
        for bar, v in zip(bars, (c.published, c.ours)):
            ax.text(
                bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{v:,.3g}", ha="center", va="bottom", fontsize=7
            )
        ax.set_xticks([0, 1], ["published", "ours"], fontsize=8)
        ax.set_ylabel(c.unit, fontsize=8)
        ax.set_ylim(0, max(c.published, c.ours) * 1.25 or 1)
        ax.set_title(textwrap.fill(c.quantity, 34), fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    plt.close(fig)
    return fig


def header(pr: int, summary: str) -> str:
    """The box's first lines as HTML: the PR link, what it changed, and the one-sentence answer."""
    return (
        f"<div style='border:2px solid #4a7ab0;border-radius:6px;padding:6px 10px;margin:4px 0'>"
        f"<b>Published vs reproduced</b>: <a href='{REPO}/{pr}'>radixark/miles#{pr}</a> ({html.escape(PRS[pr])})"
        f"<br>{html.escape(summary)}</div>"
    )


def box(pr: int, summary: str, claims: list[Claim], title: str = ""):
    """Display the box: the header, the table and, where a claim has both figures, the side-by-side plot (what a
    notebook's first cell shows)."""
    from IPython.display import HTML, display

    if pr not in PRS:
        raise ValueError(f"PR #{pr} is not one this workbench reproduces; known: {sorted(PRS)}")
    display(HTML(header(pr, summary)))
    display(HTML(table(claims).to_html(index=False)))  # the HTML writer does not cut long cells at 50 characters
    fig = plot(claims, title)
    if fig is not None:
        display(fig)


def stored(name: str) -> dict | None:
    """A stored result ``benchmarks/results/<name>`` (the repository found from the working directory upward),
    or None where this checkout has none (a notebook then says so instead of failing)."""
    import json
    from pathlib import Path

    for root in [Path.cwd(), *Path.cwd().parents]:
        path = root / "benchmarks" / "results" / name
        if (root / "pyproject.toml").exists() and path.is_file():
            return json.loads(path.read_text())
    return None
