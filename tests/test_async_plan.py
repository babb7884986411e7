"""The async prediction (miles.async_plan): staleness per step as the loop produces it, and the step-time model by
hand-computed values."""

import pytest

from miles.async_plan import predict, staleness_per_step
from tests.test_rollout_window import RESIDENT, run_loop, small_cfg

pytestmark = pytest.mark.unit


def test_the_predicted_staleness_is_what_the_loop_measures(tmp_path):
    cfg = small_cfg(tmp_path, "async.max_staleness=2", *RESIDENT)
    rows, _ = run_loop(cfg)
    p = predict(1.0, 1.0, 0.1, max_staleness=2, num_steps=cfg.num_steps)
    assert p.staleness == [r["async/staleness_max"] for r in rows] == [r["async/staleness_mean"] for r in rows]
    assert p.staleness_mean == sum(r["async/staleness_mean"] for r in rows) / len(rows) == pytest.approx(1.4)
    assert p.staleness_p95 == 2


def test_staleness_zero_predicts_the_synchronous_step():
    p = predict(2.0, 3.0, 0.5, max_staleness=0, num_steps=10)
    assert p.step_s == p.sync_step_s == 5.5 and p.speedup == 1.0 and p.staleness_mean == 0 == p.staleness_p95


def test_staleness_overlaps_the_rollout_with_the_train_step():
    p = predict(2.0, 3.0, 0.5, max_staleness=1, num_steps=10)
    assert p.step_s == 3.5 and p.speedup == pytest.approx(5.5 / 3.5)
    assert p.staleness == [0] + [1] * 9 and p.staleness_mean == 0.9 and p.staleness_p95 == 1


def test_two_sides_on_one_shared_core_gain_nothing_and_on_two_cores_overlap():
    assert predict(2.0, 3.0, 0.5, max_staleness=2, num_steps=10, shared_cores=1).step_s == 5.5
    assert predict(2.0, 3.0, 0.5, max_staleness=2, num_steps=10, shared_cores=2).step_s == 3.5
    assert predict(3.0, 3.0, 0.0, max_staleness=2, num_steps=10, shared_cores=1).speedup == 1.0


def test_a_resumed_run_counts_staleness_from_its_first_step():
    assert staleness_per_step(2, num_steps=8, first_step=5) == [0, 1, 2]


def test_negative_seconds_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="pass measured seconds"):
        predict(-1.0, 1.0, 0.0, max_staleness=1, num_steps=5)


def test_miles_plan_predicts_the_async_step_from_a_measured_run(tmp_path, capsys):
    import json
    import os

    from miles.cli.plan import main

    metrics = tmp_path / "metrics.jsonl"
    row = {"time/rollout": 2.0, "train_time": 3.0, "sync/seconds": 0.5}
    metrics.write_text("".join(json.dumps({"step": t, **row}) + "\n" for t in range(3)) + '{"phase": "eval"}\n')
    sets = ["async.max_staleness=2", "num_steps=10", *RESIDENT]
    main(["--recipe", "quickstart", "--hardware", "cpu", "--set", *sets, "--measured", str(metrics), "--json"])
    out = json.loads(capsys.readouterr().out)["async"]
    cores = os.cpu_count() or 1
    assert out["sync_step_s"] == 5.5 and out["step_s"] == max(3.0, 5.0 / cores) + 0.5
    assert out["staleness_mean"] == pytest.approx(1.7) and out["staleness_p95"] == 2
