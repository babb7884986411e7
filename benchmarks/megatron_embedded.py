"""Issue 23 (build 5): the Megatron trainer with the embedded engine on one GPU, under the handoff plan the torch
trainer runs (the recipe's ``handoff`` section decides it, not the backend), a few RL steps in one process
(miles.colocated.Colocated: the plan executor of a Ray run, without Ray's start-up). Per step: reward and the time
split (generate / rollout->train handoff / train / train->rollout handoff with the weight sync); at the end the
ledger's device peak (bytes the tagged tensors of both sides held at once) and the allocator's peak against the
planner's prediction for the same config, and whether the held bytes equal the prediction after every plan step.

    python benchmarks/megatron_embedded.py --backend megatron --steps 3 --out OUT/megatron_embedded.json
    python benchmarks/megatron_embedded.py --backend torch --steps 3 --dry-run     # config and plan only (CPU)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from miles.config import RunConfig, apply_overrides
from miles.recipes import h200_100m

# h200_100m shrunk to a few seconds per RL step: fewer prompts, short completions, no SFT warm-up
SHRINK = [
    "rollout.num_prompts_per_step=16",
    "rollout.n_samples_per_prompt=8",
    "rollout.max_new_tokens=16",
    "rollout.max_batch_size=128",
    "trainer.warmup_sft_steps=0",
    "checkpoint_every=0",
    "dump_rollouts=false",
    "run_dir=/tmp/miles-megatron-embedded",
]


def bench_config(backend: str, steps: int, device: str, extra: list[str]) -> RunConfig:
    return apply_overrides(
        h200_100m(), [*SHRINK, f"trainer.backend={backend}", f"num_steps={steps}", f"device={device}", *extra]
    )


def ledger_device_peak(events) -> int:
    """The most bytes the ledger's device pool held at once (every owner), replaying its events in order."""
    held = peak = 0
    for e in events:
        if e.pool == "device":
            held += e.signed()
            peak = max(peak, held)
    return peak


def run(cfg: RunConfig, steps: int) -> dict:
    from miles.colocated import Colocated
    from miles.handoff.plan import HandoffPlan
    from miles.handoff.planner import plan as predict

    cuda = cfg.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    co = Colocated(cfg, device=cfg.device)
    plan = HandoffPlan.from_config(cfg.handoff)
    co.execute(plan.init, version=0, phase="init")
    setup_s, rows = time.perf_counter() - t0, []
    for i in range(steps):
        t = [time.perf_counter()]
        batches, metrics = co.manager.generate(i)
        t.append(time.perf_counter())
        co.execute(plan.rollout_to_train, phase="rollout_to_train")
        t.append(time.perf_counter())
        train = co.train(batches, step=i)
        t.append(time.perf_counter())
        co.execute(plan.train_to_rollout, version=i + 1, phase="train_to_rollout")
        t.append(time.perf_counter())
        split = dict(zip(("generate_s", "to_train_s", "train_s", "to_rollout_s"), (b - a for a, b in zip(t, t[1:]))))
        row = {"step": i, "reward": metrics["reward"], "loss": train.get("loss"), **split, "step_s": t[-1] - t[0]}
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    rep = predict(cfg, None, num_steps=steps)
    executed = [r for r in co.records if r.phase != "train"]
    predicted = [s for s in rep.steps if s.phase not in ("construct", "train")]
    allocator = (
        max([r.device_allocated for r in co.records] + [torch.cuda.max_memory_allocated()]) - base if cuda else 0
    )
    return {
        "backend": cfg.trainer.backend,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "parameters": cfg.model.num_parameters,
        "plan_mode": plan.mode,
        "offload_train": cfg.handoff.offload_train,
        "setup_s": setup_s,
        "steps": rows,
        "ledger_device_peak": ledger_device_peak(co.events),
        "predicted_device_peak": rep.device_peak,
        "predicted_held_peak": max(s.device for s in rep.steps),
        "allocator_device_peak": allocator,
        "held_bytes_equal_prediction_every_step": len(executed) == len(predicted)
        and all(r.held_device == p.device for r, p in zip(executed, predicted)),
        "held_mismatches": [
            {"step": str(r.step), "held": r.held_device, "predicted": p.device}
            for r, p in zip(executed, predicted)
            if r.held_device != p.device
        ][:8],
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["megatron", "torch"], default="megatron")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="", help="write the result JSON here")
    p.add_argument("--set", action="append", default=[], help="extra a.b=value overrides")
    p.add_argument("--dry-run", action="store_true", help="build and plan the config only (no model, no GPU)")
    a = p.parse_args(argv)
    cfg = bench_config(a.backend, a.steps, a.device, a.set)
    if a.dry_run:
        from miles.handoff.planner import plan as predict

        rep = predict(cfg, "h200", num_steps=a.steps)
        out = {"backend": cfg.trainer.backend, "mode": rep.mode, "predicted_device_peak": rep.device_peak}
    else:
        out = run(cfg, a.steps)
    print(json.dumps({k: v for k, v in out.items() if k != "steps"}, indent=1), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
