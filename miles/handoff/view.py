"""The planner as a picture: knobs in, the memory timeline of the handoff steps against the budget out.

A reader turns model x hardware x nodes x precision x offload level x peak device and sees where the host and
device peaks land against the node's budget. This file is the pure logic (a config from the knobs, the timeline
as numbers, a matplotlib drawing); ``miles.workbench.PlannerWidget`` only wires ipywidgets to ``view`` and ``draw``,
so everything here is tested without a browser.

    v = view(Knobs(model="deepseek-v4-flash", hardware="gb300", nodes=8, mode="cpu"))
    v.fits, v.host_peak_gib, v.verdict        # False, 992.6, "OVER: host 992.6 GiB/node > 898.0 GiB at ..."
    fig = draw(v)                             # device/GPU and host/node per executed step, budget lines
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from miles.handoff.hardware import GiB, get_profile
from miles.handoff.planner import PlanReport, plan
from miles.model.size import available_hf_configs

HARDWARE = ("gb300", "gb200", "h200", "h100")
PRECISIONS = ("bf16", "fp8", "mxfp8", "nvfp4")
LEVELS = {"kv_cache": ("kv_cache",), "weight": ("weight",), "kv_cache+weight": ("kv_cache", "weight")}
MODES = ("cpu", "gpu")
PHASE_COLOURS = {"construct": "#eeeeee", "init": "#e8e8f4", "rollout_to_train": "#fdf1dc", "train": "#e3f2e1"}
PHASE_COLOURS["train_to_rollout"] = "#dcecf7"
PHASE_NAMES = {"construct": "", "init": "init", "rollout_to_train": "rollout→train", "train": "train"}
PHASE_NAMES["train_to_rollout"] = "train→rollout"


@dataclass(frozen=True, slots=True)
class Knobs:
    """One planner question. ``nodes``: GB300/GB200 trays (4 GPUs each) or HGX nodes (8 GPUs each); one engine
    per ``nodes_per_engine`` nodes, trainer state sharded over every GPU (the shape of the gb300_*_plan recipes)."""

    model: str = "deepseek-v4-flash"
    hardware: str = "gb300"
    nodes: int = 8
    precision: str = "bf16"
    level: str = "kv_cache+weight"
    mode: str = "cpu"
    nodes_per_engine: int = 1  # an engine spans this many nodes (Kimi-K2's bf16 weights do not fit one tray)

    def __post_init__(self):
        choices = {
            "model": available_hf_configs(),
            "hardware": HARDWARE,
            "precision": PRECISIONS,
            "level": tuple(LEVELS),
            "mode": MODES,
        }
        for name, valid in choices.items():
            if getattr(self, name) not in valid:
                raise ValueError(f"planner knob {name} = {getattr(self, name)!r} is not one of {list(valid)}")
        if not 1 <= self.nodes <= 256:
            raise ValueError(f"planner knob nodes = {self.nodes} must be between 1 and 256")
        if self.nodes_per_engine < 1 or self.nodes % self.nodes_per_engine:
            raise ValueError(
                f"planner knob nodes_per_engine = {self.nodes_per_engine} must be >= 1 and divide nodes = {self.nodes}"
            )


def config_for(k: Knobs):
    """The RunConfig the knobs describe: the gb300 planning recipe's shape with these choices applied."""
    from miles.config import RunConfig
    from miles.recipes import gb300_dsv4_flash_plan

    hw = get_profile(k.hardware)
    d = gb300_dsv4_flash_plan().to_dict()
    d["recipe"] = f"{k.model} on {k.nodes} x {k.hardware}"
    d["trainer"].update(world_size=k.nodes * hw.gpus_per_node, precision=k.precision)
    d["rollout"]["num_engines"] = k.nodes // k.nodes_per_engine
    d["handoff"].update(
        plan_model=k.model,
        hardware=k.hardware,
        colocate_memory_peak_device=k.mode,
        offload_rollout_level=LEVELS[k.level],
    )
    return RunConfig.from_dict(d)


@dataclass(frozen=True, slots=True)
class View:
    """The numbers one picture shows, in GiB (device per GPU, host per node), one entry per executed step."""

    knobs: Knobs
    report: PlanReport
    labels: list[str]  # "engine.offload_weights": the verb, without the tag list
    phases: list[str]
    device_gib: list[float]  # held + the step's working set
    host_gib: list[float]  # host RAM per node as the OS sees it
    device_budget_gib: float
    host_budget_gib: float

    @property
    def device_peak_gib(self) -> float:
        return max(self.device_gib)

    @property
    def host_peak_gib(self) -> float:
        return max(self.host_gib)

    @property
    def host_peak_step(self) -> int:
        return self.host_gib.index(self.host_peak_gib)

    @property
    def device_peak_step(self) -> int:
        return self.device_gib.index(self.device_peak_gib)

    @property
    def fits(self) -> bool:
        return self.report.fits_device and self.report.fits_host

    @property
    def seconds(self) -> float:
        """One steady RL step's handoff time: the moved bytes over the host<->device link."""
        return self.report.handoff_seconds

    @property
    def verdict(self) -> str:
        over = []
        if not self.report.fits_host:
            over.append(
                f"host {self.host_peak_gib:.1f} GiB/node > {self.host_budget_gib:.1f} GiB at "
                f"{self.labels[self.host_peak_step]}"
            )
        if not self.report.fits_device:
            over.append(
                f"device {self.device_peak_gib:.1f} GiB/GPU > {self.device_budget_gib:.1f} GiB at "
                f"{self.labels[self.device_peak_step]}"
            )
        return "OVER: " + "; ".join(over) if over else "fits"

    def summary(self) -> dict:
        """One row for a table: peaks, budgets, verdict and the predicted handoff seconds."""
        k = self.knobs
        return {
            "model": k.model,
            "hardware": f"{k.nodes} x {k.hardware}",
            "engines": k.nodes // k.nodes_per_engine,
            "GPUs": self.report.gpus,
            "precision": k.precision,
            "level": k.level,
            "peak device": k.mode,
            "host peak GiB/node": round(self.host_peak_gib, 1),
            "host budget GiB": round(self.host_budget_gib, 1),
            "device peak GiB/GPU": round(self.device_peak_gib, 1),
            "device budget GiB": round(self.device_budget_gib, 1),
            "handoff s/step": round(self.seconds, 2),
            "verdict": "fits" if self.fits else "OVER",
        }


def view(k: Knobs, num_steps: int = 1) -> View:
    """Plan the knobs' config (init, then ``num_steps`` RL steps) and keep what the picture needs."""
    rep = plan(config_for(k), k.hardware, mode=k.mode, num_steps=num_steps)
    return View(
        knobs=k,
        report=rep,
        labels=[s.step.split("(")[0] for s in rep.steps],
        phases=[s.phase for s in rep.steps],
        device_gib=[(s.device + s.transient_device) / GiB for s in rep.steps],
        host_gib=[s.host_node / GiB for s in rep.steps],
        device_budget_gib=rep.device_budget / GiB,
        host_budget_gib=rep.host_budget / GiB,
    )


def phase_spans(phases: list[str]) -> list[tuple[str, int, int]]:
    """Runs of equal phase as (phase, first index, last index + 1): the shaded bands behind the timeline."""
    spans: list[tuple[str, int, int]] = []
    for i, p in enumerate(phases):
        if spans and spans[-1][0] == p:
            spans[-1] = (p, spans[-1][1], i + 1)
        else:
            spans.append((p, i, i + 1))
    return spans


def shade_phases(ax, phases: list[str], top: float) -> None:
    """The phases behind a step timeline: a band per run of equal phase, its name at the top of the band."""
    for phase, a, b in phase_spans(phases):
        ax.axvspan(a - 0.5, b - 0.5, color=PHASE_COLOURS[phase], zorder=0)
        ax.text((a + b - 1) / 2, top * 0.97, PHASE_NAMES[phase], ha="center", va="top", fontsize=7, color="0.35")


def label_steps(ax, labels: list[str], fontsize: float = 7.5) -> None:
    """One tick per step, its name slanted at 45 degrees and ending under its tick (readable at 16 steps)."""
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", rotation_mode="anchor", fontsize=fontsize)


def draw(v: View, fig=None):
    """Two panels over the executed steps: device GiB per GPU and host GiB per node, each with its budget line,
    the phases shaded, the peak step marked; the title carries the verdict and the predicted handoff seconds."""
    import matplotlib.pyplot as plt

    if fig is None:
        fig = plt.figure(figsize=(13, 4.8))
        plt.close(fig)
    fig.clear()
    axes = fig.subplots(1, 2, sharex=True)
    x = range(len(v.labels))
    panels = [
        (axes[0], v.device_gib, v.device_budget_gib, v.device_peak_step, "device GiB per GPU", "HBM budget"),
        (axes[1], v.host_gib, v.host_budget_gib, v.host_peak_step, "host GiB per node", "host budget (cgroup)"),
    ]
    for ax, ys, budget, peak, ylabel, budget_label in panels:
        top = max(max(ys), budget) * 1.25
        shade_phases(ax, v.phases, top)
        colour = "C3" if ys[peak] > budget else "C0"
        ax.plot(x, ys, drawstyle="steps-mid", color=colour, lw=2, label="planned")
        ax.axhline(budget, ls="--", c="k", lw=1, label=f"{budget_label} {budget:.0f} GiB")
        ax.plot([peak], [ys[peak]], "o", color=colour)
        ax.annotate(
            f"peak {ys[peak]:.1f}\n{v.labels[peak]}",
            (peak, ys[peak]),
            textcoords="offset points",
            xytext=(4, 6),
            fontsize=7,
        )
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, top)
        label_steps(ax, v.labels)
        ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0, 1), ncol=2, frameon=False)  # above the data
    k = v.knobs
    fig.suptitle(
        f"{k.model} on {k.nodes} x {k.hardware} ({v.report.gpus} GPUs), {k.precision}, level {k.level}, "
        f"peak device {k.mode}: {v.verdict} | handoff {v.seconds:.2f} s per RL step",
        fontsize=9,
        color="C3" if not v.fits else "k",
    )
    fig.tight_layout()
    return fig


def with_knob(k: Knobs, **changes) -> Knobs:
    """The knobs with some changed (validated again)."""
    return replace(k, **changes)


def run_overlay(config: dict) -> dict:
    """What the dashboard's Memory tab draws over a run: the planner's per-pool peak over the RL steps (held bytes,
    the ledger's count) and the hardware's budgets, for the run's own config.json; or why there is none."""
    from miles.config import RunConfig

    if not {"model", "rollout", "trainer", "handoff"} <= set(config):
        return {"available": False, "reason": "config.json is not a full RunConfig (the one `miles train` writes)"}
    try:
        cfg = RunConfig.from_dict(config)
        mode = cfg.handoff.colocate_memory_peak_device
        rep = plan(cfg, cfg.handoff.hardware, mode=None if mode == "auto" else mode, num_steps=2)
    except (ValueError, TypeError, KeyError) as e:  # a partial or foreign config.json: the tab draws no overlay
        return {"available": False, "reason": str(e).split("\n")[0][:200]}
    rl = [s for s in rep.steps if s.phase in ("rollout_to_train", "train", "train_to_rollout")]
    return {
        "available": True,
        "hardware": rep.hardware.name,
        "mode": rep.mode,
        "peaks": {"device": max(s.device for s in rl), "host": max(s.host for s in rl)},
        "budget": {"device": rep.device_budget, "host": rep.host_budget},
    }
