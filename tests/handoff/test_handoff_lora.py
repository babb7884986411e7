"""The handoff plan with LoRA, executed for real by the RL loop in one process: the frozen base (trainer and engine)
is placed once, when each side is built, and never released or restored by a plan step, whatever the mode; each
step moves only the adapters, their optimizer state and the KV cache, exactly the bytes the planner predicts."""

from __future__ import annotations

import pytest

from miles.handoff.plan import HandoffPlan
from miles.handoff.planner import plan as predict
from miles.model.lora_config import adapter_numel
from tests.handoff.test_handoff_execution import executed_plan_steps, expected_steps, run, small_cfg

MOVERS = ("offload", "onload", "offload_kv", "onload_kv", "offload_weights", "onload_weights")


@pytest.mark.parametrize(
    "mode, warmup",
    [("cpu", ""), ("gpu", ""), ("cpu", "model.lora.warmup=base")],
    ids=["cpu_order", "peak_on_device_order", "base_warmup"],
)
def test_with_lora_the_base_is_placed_once_and_every_step_moves_only_the_predicted_adapter_bytes(
    tmp_path, mode, warmup
):
    """With model.lora.warmup = base the warm-up trains the base where it lies and the sync writes it into the
    engine's in place: still placed once per side, and no plan step moves it."""
    cfg = small_cfg(
        tmp_path,
        *([warmup, "trainer.warmup_sft_steps=2"] if warmup else []),
        "model.lora.rank=2",
        f"handoff.colocate_memory_peak_device={mode}",
        "handoff.offload_rollout_level=kv_cache,weight",
        "handoff.offload_train=host",
        "handoff.engine_host_mirror=true",
    )
    steps = 3
    co, _ = run(cfg, tmp_path, steps=steps)
    plan = HandoffPlan.from_config(cfg.handoff, warmup=cfg.trainer.warmup_sft_steps > 0)
    assert executed_plan_steps(co) == expected_steps(plan, steps)
    base_events = [e for e in co.events if e.tag == "base"]
    assert {e.owner.split("/")[0] for e in base_events} == {"trainer", "engine"}
    assert all(e.direction == "in" and e.pool == "device" for e in base_events)  # placed, never moved
    assert len(base_events) == 2  # once per side, not once per step
    adapter_bytes = 4 * adapter_numel(cfg.model)  # FP32
    predicted = [s for s in predict(cfg, "cpu", num_steps=steps).steps if s.phase not in ("construct", "train")]
    records = [r for r in co.records if r.phase != "train"]
    assert len(records) == len(predicted)
    moved_params = []
    for rec, pred in zip(records, predicted):
        assert str(rec.step) == pred.step and "base" not in rec.step.tags and "base" not in pred.moved
        if rec.step.verb in MOVERS:
            measured = {}
            for e in rec.events:
                if e.pool == "device" and e.phase != "alloc":
                    measured[e.tag] = measured.get(e.tag, 0) + e.bytes
            assert measured == pred.moved, (rec.step, measured, pred.moved)
            moved_params += [b for t, b in measured.items() if t in ("params", "weights")]
    assert moved_params and set(moved_params) == {adapter_bytes}  # the trainer's and the engine's: the adapters


def test_the_planner_fits_lora_on_one_h200_with_the_engine_where_full_fine_tuning_of_the_same_shape_does_not():
    """Qwen2.5-14B's dimensions in bf16 on the h200_llama3_8b_lora recipe: full fine-tuning needs its weights, grads
    and AdamW state beside the engine's copy (over 131 GiB); LoRA keeps two frozen bases and megabytes of adapters."""
    from miles.config import apply_overrides
    from miles.handoff.planner import plan
    from miles.recipes import h200_llama3_8b_lora

    shape = [
        "model.vocab_size=152064", "model.hidden_size=5120", "model.intermediate_size=13824",
        "model.num_hidden_layers=48", "model.num_attention_heads=40", "model.num_key_value_heads=8",
    ]  # fmt: skip
    lora, full = (apply_overrides(h200_llama3_8b_lora(), [*shape, f"model.lora.rank={r}"]) for r in (32, 0))
    lo, fu = plan(lora, "h200", mode="cpu"), plan(full, "h200", mode="cpu")
    assert lo.fits_device and not fu.fits_device
    assert lo.sync_bytes == 4 * adapter_numel(lora.model) < fu.sync_bytes / 50
    base = lo.sizes.tags[("trainer", "base")].bytes
    assert lo.sizes.tags[("engine", "base")].bytes == base == fu.sizes.tags[("trainer", "params")].bytes
    assert plan(h200_llama3_8b_lora(), "h200", mode="cpu").fits_device  # the 8B recipe itself, as planned


def test_a_base_warm_up_is_planned_as_a_full_fine_tuning_step_and_creates_no_adapter_state():
    """model.lora.warmup = base: the warm-up row holds a full fine-tuning step's working set and the base's AdamW
    moments (made and dropped inside it); the adapters' optimizer state is created by the first RL step."""
    from miles.config import apply_overrides
    from miles.model.size import decoder_storages
    from miles.recipes import quickstart

    def warmup_row(*overrides):
        cfg = apply_overrides(quickstart(), ["handoff.hardware=cpu", *overrides])
        return next(s for s in predict(cfg, "cpu", num_steps=1).steps if s.step == "trainer.warmup()"), cfg

    full, _ = warmup_row()
    adapters, _ = warmup_row("model.lora.rank=4")
    base, cfg = warmup_row("model.lora.rank=4", "model.lora.warmup=base")
    params = sum(decoder_storages(cfg.model)["params"])
    assert base.transient_device == full.transient_device + 2 * params > adapters.transient_device
    assert base.device == adapters.device - 2 * 4 * adapter_numel(cfg.model)  # no adapter AdamW state yet
