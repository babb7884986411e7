"""Plans executed for real by the RL loop in one process (miles.driver.train_in_process: RolloutManager +
TorchBackend sharing a ledger) against the plan and the planner's prediction: same steps, same tags, same bytes."""

from __future__ import annotations

import itertools

import pytest

from miles.colocated import Colocated
from miles.config import apply_overrides
from miles.driver import train_in_process
from miles.handoff.plan import HandoffPlan, engine_level_tags
from miles.handoff.planner import plan as predict
from miles.recipes import quickstart

LEVELS = ["", "kv_cache", "weight", "kv_cache,weight"]
COMBOS = [
    (m, lvl, t)
    for m, lvl, t in itertools.product(["cpu", "gpu"], LEVELS, ["host", "disk", "none"])
    if not (m == "gpu" and t == "none")
]


def small_cfg(tmp_path, *overrides):
    base = [
        "model.hidden_size=32",
        "model.intermediate_size=64",
        "model.num_hidden_layers=2",
        "rollout.num_prompts_per_step=2",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=4",
        "rollout.max_batch_size=8",
        "rollout.max_seq_len=32",
        "trainer.warmup_sft_steps=0",
        "trainer.num_minibatches=1",
        "num_threads=1",
        f"run_dir={tmp_path / 'run'}",
        "handoff.hardware=cpu",
    ]
    return apply_overrides(quickstart(), base + list(overrides))


def run(cfg, tmp_path, steps=1):
    """The RL loop (miles.driver.train) for ``steps`` steps in this process; the Colocated it ran on, and the plan."""
    co = train_in_process(apply_overrides(cfg, [f"num_steps={steps}"]), disk_dir=str(tmp_path / "offload"))
    return co, HandoffPlan.from_config(cfg.handoff)


def executed_plan_steps(co):
    return [r.step for r in co.records if r.phase != "train"]


def expected_steps(plan, steps):
    return list(plan.init) + (list(plan.rollout_to_train) + list(plan.train_to_rollout)) * steps


@pytest.mark.parametrize("mode,level,offload_train", COMBOS)
def test_every_mode_level_and_offload_train_executes_the_plan_and_moves_the_predicted_bytes(
    tmp_path, mode, level, offload_train
):
    cfg = small_cfg(
        tmp_path,
        f"handoff.colocate_memory_peak_device={mode}",
        f"handoff.offload_rollout_level={level}",
        f"handoff.offload_train={offload_train}",
        "handoff.engine_host_mirror=true",
    )
    co, plan = run(cfg, tmp_path)
    assert executed_plan_steps(co) == expected_steps(plan, 1)
    predicted = [s for s in predict(cfg, "cpu", num_steps=1).steps if s.phase not in ("construct", "train")]
    movers = ("offload", "onload", "offload_kv", "onload_kv", "offload_weights", "onload_weights")
    for rec, pred in zip([r for r in co.records if r.phase != "train"], predicted):
        assert str(rec.step) == pred.step
        if rec.step.verb in movers:
            measured = {}
            for e in rec.events:
                if e.pool == "device" and e.phase != "alloc":  # "alloc": state created since the last move, not a move
                    measured[e.tag] = measured.get(e.tag, 0) + e.bytes
            assert measured == pred.moved, (rec.step, measured, pred.moved)
            assert set(measured) <= set(rec.step.tags)  # nothing moves that the plan did not name
        assert rec.held_device == pred.device, rec.step


def test_gpu_mode_never_holds_engine_mirror_and_trainer_backup_on_host_together(tmp_path):
    def overlap(mode):
        cfg = small_cfg(
            tmp_path / mode, f"handoff.colocate_memory_peak_device={mode}", "handoff.engine_host_mirror=true"
        )
        co, _ = run(cfg, tmp_path / mode, steps=2)
        held, both = {}, 0
        for e in co.events:
            if e.pool == "host":
                side = e.owner.split("/")[0]
                held[side] = held.get(side, 0) + e.signed()
                both = max(both, min(held.get("engine", 0), held.get("trainer", 0)))
        return both

    assert overlap("gpu") == 0
    assert overlap("cpu") > 0  # the cpu order does hold both: the test can see an overlap when there is one


def test_cpu_mode_without_weight_level_onload_weights_moves_zero_bytes(tmp_path):
    cfg = small_cfg(
        tmp_path,
        "handoff.colocate_memory_peak_device=cpu",
        "handoff.offload_rollout_level=kv_cache",
        "handoff.engine_host_mirror=true",
    )
    co, plan = run(cfg, tmp_path, steps=2)
    calls = [r for r in co.records if r.step.verb in ("onload_weights", "offload_weights")]
    assert len(calls) == 2 * 3  # init + every step, kept in the plan as guarded steps
    assert all(r.moved == 0 and not r.events and r.step.tags == () for r in calls)


def test_a_second_sleep_or_wake_is_a_no_op_on_both_sides(tmp_path):
    co = Colocated(small_cfg(tmp_path))
    backend, manager = co.build_trainer(), co.manager
    co.ledger.drain()
    assert backend.offload() > 0 and backend.offload() == 0
    assert backend.onload() > 0 and backend.onload() == 0
    kv, w = (engine_level_tags(co.cfg.handoff, v) for v in ("offload_kv", "offload_weights"))
    assert manager.offload(kv) > 0 and manager.offload(kv) == 0
    assert manager.offload(w) > 0 and manager.offload(w) == 0
    assert manager.onload(w) > 0 and manager.onload(w) == 0
    assert manager.onload(kv) > 0 and manager.onload(kv) == 0
    events, _ = co.ledger.drain()
    assert len([e for e in events if e.owner.startswith("trainer") and e.pool == "device"]) == 2  # one out, one in


def test_plan_validation_names_the_fix(tmp_path):
    cfg = small_cfg(tmp_path)
    with pytest.raises(ValueError, match="needs offload_train and offload_rollout; set handoff.offload_train=host"):
        HandoffPlan.from_config(apply_overrides(cfg, ["handoff.offload_rollout=false"]).handoff, mode="gpu")
    with pytest.raises(ValueError, match=r"unknown level\(s\) \['weights'\]; valid levels: \['kv_cache', 'weight'\]"):
        apply_overrides(cfg, ["handoff.offload_rollout_level=weights"])
    with pytest.raises(ValueError, match="resolved by miles.handoff.planner.choose_mode"):
        HandoffPlan.from_config(cfg.handoff, mode="auto")
