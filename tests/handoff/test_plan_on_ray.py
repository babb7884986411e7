"""The planner's prediction against a real run: train() on Ray actors (the production executor, miles.cluster)
moves and holds exactly the bytes miles.handoff.planner replays for the same config, step by step, warm-up included."""

import json
from collections import defaultdict

import pytest

from miles.driver import train
from miles.handoff.planner import plan as predict
from tests.conftest import tiny_run_cfg


def _device_held(ledger_path) -> tuple[dict[int, int], dict[int, int]]:
    """Bytes on the device after the events of each step (init is step -1), and the most held during it."""
    held, after, peak = 0, {}, {}
    for line in open(ledger_path):
        e = json.loads(line)
        if e["pool"] == "device":
            held += e["bytes"] if e["direction"] == "in" else -e["bytes"]
        after[e["step"]] = held  # events are in order: the last one of a step leaves what the step holds
        peak[e["step"]] = max(peak.get(e["step"], 0), held)
    return after, peak


@pytest.mark.parametrize("mode", ["gpu"], ids=["peak-on-device"])  # the init with the most moves
def test_a_ray_run_moves_and_holds_the_bytes_the_planner_predicts(tmp_path, ray_session, mode):
    cfg = tiny_run_cfg(
        tmp_path,
        f"handoff.colocate_memory_peak_device={mode}",
        "handoff.offload_rollout_level=kv_cache,weight",
        "handoff.engine_host_mirror=true",
        "handoff.hardware=cpu",
        "trainer.warmup_sft_steps=1",  # the plan's trainer.warmup step: it creates the optimizer state in init
        "num_steps=2",
        "checkpoint_every=0",
    )
    rows = train(cfg, progress=False)
    predicted = predict(cfg, "cpu", num_steps=2).steps
    assert any(p.step == "trainer.warmup()" for p in predicted)

    # bytes held on the device after init and after each RL step (the engine and the trainer rank share it)
    held, peak = _device_held(tmp_path / "run" / "ledger.jsonl")
    init = [p for p in predicted if p.phase in ("construct", "init")]
    per_step = [p for p in predicted if p.phase not in ("construct", "init")]
    n = len(per_step) // 2
    assert held[-1] == init[-1].device > 0
    # start-up in the plan's order: engines built, their KV released, then the trainer (a trainer built first,
    # or warmed up beside a resident KV cache, holds more than the planner priced)
    assert peak[-1] == max(p.device for p in init)
    assert [held[0], held[1]] == [per_step[n - 1].device, per_step[-1].device]

    # bytes each plan step moved, as the executor reported them, against the replay's per-step moves
    for step, row in enumerate(rows):
        want: dict[str, int] = defaultdict(int)
        for p in per_step[step * n : (step + 1) * n]:
            if p.phase != "train":
                want[p.step.split("(")[0]] += sum(p.moved.values())
        got = {k.removeprefix("moved/"): v for k, v in row.items() if k.startswith("moved/")}
        assert got == {k: v for k, v in want.items() if k in got} and sum(got.values()) == sum(want.values()) > 0
