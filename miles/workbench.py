"""The notebook workbench: launch, watch and stop runs from ipywidgets, with a live reward curve.

panel = RunPanel()          # recipe, overrides, Ray address; Start / Stop buttons; live plot
panel                       # display it in a cell
rows = panel.run(wait=True) # or start programmatically (what the CI notebook does)
"""

from __future__ import annotations

import threading

from miles.config import apply_overrides
from miles.recipes import RECIPES, get_recipe


class LivePlot:
    """A matplotlib figure of reward (and loss) per RL step, redrawn in an ipywidgets Output."""

    def __init__(self, output=None, title: str = "reward"):
        import matplotlib.pyplot as plt

        self.output, self.rows = output, []
        self.fig, self.ax = plt.subplots(figsize=(6, 3))
        self.title = title
        plt.close(self.fig)

    def update(self, row: dict) -> None:
        self.rows.append(row)
        ax = self.ax
        ax.clear()
        ax.plot([r["step"] for r in self.rows], [r["reward"] for r in self.rows], "o-", ms=3, label="mean reward")
        ax.set_xlabel("RL step")
        ax.set_ylabel("reward")
        ax.set_ylim(0, 1)
        ax.set_title(self.title)
        ax.grid(alpha=0.3)
        if self.output is not None:
            from IPython.display import display

            with self.output:
                self.output.clear_output(wait=True)
                display(self.fig)


class RunPanel:
    """Recipe + overrides + Ray address in, a run out; runs in a background thread so the notebook stays live."""

    def __init__(self, recipe: str = "quickstart", overrides: str = "", ray_address: str = ""):
        import ipywidgets as w

        self.recipe = w.Dropdown(options=sorted(RECIPES), value=recipe, description="recipe")
        self.overrides = w.Textarea(
            value=overrides,
            description="overrides",
            placeholder="trainer.lr=1e-4\nnum_steps=20",
            layout=w.Layout(width="60%", height="80px"),
        )
        self.address = w.Text(value=ray_address, description="Ray", placeholder="local (empty) or ray://host:10001")
        self.start_btn, self.stop_btn = (
            w.Button(description="Start", button_style="success"),
            w.Button(description="Stop"),
        )
        self.status, self.out = w.HTML("idle"), w.Output()
        self.start_btn.on_click(lambda _: self.run(wait=False))
        self.stop_btn.on_click(lambda _: self.stop())
        self.widget = w.VBox(
            [
                w.HBox([self.recipe, self.address]),
                self.overrides,
                w.HBox([self.start_btn, self.stop_btn, self.status]),
                self.out,
            ]
        )
        self._stop, self._thread, self.rows, self.error = threading.Event(), None, [], None

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def config(self):
        lines = [
            l.strip()
            for l in self.overrides.value.replace(";", "\n").splitlines()
            if l.strip() and not l.startswith("#")
        ]
        if self.address.value.strip():
            lines.append(f"cluster.address={self.address.value.strip()}")
        return apply_overrides(get_recipe(self.recipe.value), lines)

    def run(self, wait: bool = False) -> list[dict]:
        from miles.driver import train

        if self._thread is not None and self._thread.is_alive():
            self.status.value = "already running"
            return self.rows
        cfg = self.config()
        plot = LivePlot(self.out, title=f"{cfg.recipe}: mean reward per RL step")
        self._stop.clear()
        self.status.value = f"running {cfg.recipe} in {cfg.run_dir}"

        def target():
            try:
                self.rows = train(cfg, progress=False, stop=self._stop, on_step=plot.update)
                self.status.value = f"done: {len(self.rows)} steps"
            except Exception as e:  # shown in the panel; the notebook keeps running
                self.error = e
                self.status.value = f"<b>failed</b>: {e}"

        self._thread = threading.Thread(target=target, daemon=True)
        self._thread.start()
        if wait:
            self._thread.join()
            if self.error:
                raise self.error
        self.plot = plot
        return self.rows

    def stop(self) -> None:
        """Ask the run to stop after the current step (a checkpoint is written)."""
        self._stop.set()
        self.status.value = "stopping after this step"


class PlannerWidget:
    """The planner with knobs: model x hardware x nodes x precision x offload level x peak device; every change
    re-plans (milliseconds) and redraws the timeline against the budget (miles.handoff.view holds the logic).

    w = PlannerWidget()          # display it in a cell
    w.model.value = "kimi-k2"    # what a click does; w.view is the current picture's numbers
    """

    def __init__(self, knobs=None):
        import ipywidgets as w

        from miles.handoff import view as pv

        k = knobs or pv.Knobs()
        self.model = w.Dropdown(options=pv.available_hf_configs(), value=k.model, description="model")
        self.hardware = w.Dropdown(options=pv.HARDWARE, value=k.hardware, description="hardware")
        self.nodes = w.IntSlider(value=k.nodes, min=1, max=64, description="trays/nodes")
        self.precision = w.Dropdown(options=pv.PRECISIONS, value=k.precision, description="precision")
        self.level = w.Dropdown(options=list(pv.LEVELS), value=k.level, description="offload level")
        self.per_engine = w.Dropdown(options=[1, 2, 4, 8], value=k.nodes_per_engine, description="nodes/engine")
        self.mode = w.ToggleButtons(options=pv.MODES, value=k.mode, description="peak device")
        self.status, self.out = w.HTML(), w.Output()
        self.knobs = [self.model, self.hardware, self.nodes, self.precision, self.level, self.per_engine, self.mode]
        for knob in self.knobs:
            knob.observe(lambda _: self.redraw(), names="value")
        self.widget = w.VBox([w.HBox(self.knobs[:3]), w.HBox(self.knobs[3:6]), self.mode, self.status, self.out])
        self.fig, self.view, self.error = None, None, None
        self.redraw()

    def current(self):
        from miles.handoff.view import Knobs

        return Knobs(
            model=self.model.value,
            hardware=self.hardware.value,
            nodes=self.nodes.value,
            precision=self.precision.value,
            level=self.level.value,
            mode=self.mode.value,
            nodes_per_engine=self.per_engine.value,
        )

    def redraw(self) -> None:
        """Plan the knobs and redraw; a config the planner rejects shows its message instead of a picture."""
        from IPython.display import display

        from miles.handoff.view import draw, view

        try:  # a knob combination can be invalid mid-change (nodes not a multiple of nodes/engine)
            self.view, self.error = view(self.current()), None
        except ValueError as e:
            self.view, self.error = None, e
            self.status.value = f"<b>not plannable</b>: {e}"
            return
        v = self.view
        colour = "green" if v.fits else "crimson"
        self.status.value = (
            f"<b style='color:{colour}'>{v.verdict}</b> &nbsp; host peak {v.host_peak_gib:.1f} GiB/node, "
            f"device peak {v.device_peak_gib:.1f} GiB/GPU, handoff {v.seconds:.2f} s per RL step"
        )
        self.fig = draw(v, self.fig)
        with self.out:
            self.out.clear_output(wait=True)
            display(self.fig)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)
