"""The planner widget's logic, without a browser: knobs -> config -> timeline numbers -> figure, and the widget's
redraw on a knob change (ipywidgets objects work without a front end)."""

import matplotlib
import pytest

matplotlib.use("Agg")

from miles.handoff.hardware import GiB  # noqa: E402
from miles.handoff.planner import plan  # noqa: E402
from miles.handoff.view import HARDWARE, LEVELS, PRECISIONS, Knobs, config_for, draw, phase_spans, view  # noqa: E402


def test_view_of_the_dsv4_recipe_equals_the_planners_peaks_in_both_orders():
    from miles.recipes import gb300_dsv4_flash_plan

    for mode in ("cpu", "gpu"):
        v = view(Knobs(model="deepseek-v4-flash", hardware="gb300", nodes=8, mode=mode))
        rep = plan(gb300_dsv4_flash_plan(), "gb300", mode=mode, num_steps=1)
        assert v.host_peak_gib == pytest.approx(rep.host_peak / GiB)
        assert v.device_peak_gib == pytest.approx(rep.device_peak / GiB)
        assert v.fits == (mode == "gpu")
    cpu = view(Knobs(mode="cpu"))
    assert cpu.verdict.startswith("OVER: host 992.6 GiB/node > 898.0 GiB at trainer.offload")
    assert cpu.labels[cpu.host_peak_step] == "trainer.offload"


def test_an_engine_over_more_nodes_lowers_the_device_peak_and_more_nodes_the_trainer_backup_per_node():
    one, two = view(Knobs(model="kimi-k2", nodes=32)), view(Knobs(model="kimi-k2", nodes=32, nodes_per_engine=2))
    assert two.device_peak_gib < one.device_peak_gib
    small, large = (
        view(Knobs(model="kimi-k2", nodes=16, mode="gpu")),
        view(Knobs(model="kimi-k2", nodes=64, mode="gpu")),
    )
    assert large.host_gib[-1] == pytest.approx(small.host_gib[-1] / 4, rel=0.01)  # after the step: the backup only


def test_every_hardware_precision_and_level_gives_one_entry_per_executed_step():
    for hw in HARDWARE:
        for precision in PRECISIONS:
            for level in LEVELS:
                v = view(Knobs(model="qwen3-8b", hardware=hw, nodes=1, precision=precision, level=level, mode="gpu"))
                n = len(v.report.steps)
                assert len(v.labels) == len(v.phases) == len(v.device_gib) == len(v.host_gib) == n
                assert v.seconds >= 0


def test_the_knobs_reach_the_config():
    cfg = config_for(Knobs(model="glm-4.5", hardware="h200", nodes=2, precision="fp8", level="kv_cache", mode="gpu"))
    assert cfg.trainer.world_size == 16 and cfg.rollout.num_engines == 2 and cfg.trainer.precision == "fp8"
    assert cfg.handoff.offload_rollout_level == ("kv_cache",) and cfg.handoff.colocate_memory_peak_device == "gpu"
    assert cfg.handoff.plan_model == "glm-4.5"


def test_a_bad_knob_names_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"hardware = 'tpu' is not one of \['gb300'"):
        Knobs(hardware="tpu")
    with pytest.raises(ValueError, match="nodes = 0"):
        Knobs(nodes=0)
    with pytest.raises(ValueError, match="nodes_per_engine = 3 must be >= 1 and divide nodes = 8"):
        Knobs(nodes_per_engine=3)


def test_phase_spans_cover_every_step_once():
    assert phase_spans(["init", "init", "train", "init"]) == [("init", 0, 2), ("train", 2, 3), ("init", 3, 4)]


def test_the_drawing_shows_the_planned_bytes_and_both_budget_lines():
    v = view(Knobs(mode="cpu"))
    fig = draw(v)
    dev, host = fig.axes
    assert list(dev.lines[0].get_ydata()) == pytest.approx(v.device_gib)
    assert list(host.lines[0].get_ydata()) == pytest.approx(v.host_gib)
    assert host.lines[1].get_ydata()[0] == pytest.approx(898.0)
    assert "OVER" in fig._suptitle.get_text()


def test_the_widget_replans_when_a_knob_moves():
    pytest.importorskip("ipywidgets")
    from miles.workbench import PlannerWidget

    w = PlannerWidget()
    assert not w.view.fits and "OVER" in w.status.value
    w.mode.value = "gpu"
    assert w.view.knobs.mode == "gpu" and w.view.fits and "fits" in w.status.value
    w.nodes.value = 7  # not a multiple of nodes/engine = 2 below: the status says so, nothing is drawn
    w.per_engine.value = 2
    assert w.view is None and "nodes_per_engine = 2" in w.status.value
    w.nodes.value = 8
    w.model.value = "qwen3-8b"
    assert w.view.knobs.model == "qwen3-8b"
    assert list(w.fig.axes[1].lines[0].get_ydata()) == pytest.approx(w.view.host_gib)
