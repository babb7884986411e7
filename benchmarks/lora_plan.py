"""``miles bench lora-plan``: what fits on one GPU with the embedded engine colocated, LoRA against full fine-tuning,
as ``miles plan`` predicts it before launch (no GPU needed: the planner's arithmetic, miles.handoff.planner).

For each model shape (Llama-3-8B, Qwen2.5-14B and Qwen2.5-32B dimensions, bf16) and each of full fine-tuning and
LoRA ranks, on the ``h200_llama3_8b_lora`` recipe's rollout and trainer settings: the device peak per GPU in the
order a run would pick (auto: cpu, else gpu where it fits), the budget, the headroom, whether it fits, the trainer's
trained bytes and the bytes one weight sync sends.

    miles bench lora-plan --json
    miles bench lora-plan --hardware h100 --ranks 0,1,32,128
"""

from __future__ import annotations

import argparse

GiB = 1 << 30
SHAPES = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
    "qwen2.5-14b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, rope_theta=1000000.0),
    "qwen2.5-32b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, rope_theta=1000000.0),
}  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles bench lora-plan")
    p.add_argument("--hardware", default="h200")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--ranks", default="0,1,32", help="0 = full fine-tuning")
    p.add_argument("--set", nargs="*", default=[], help="extra overrides on the recipe (section.field=value)")
    p.add_argument("--json", action="store_true", help="accepted for the CLI; the result is always JSON")
    return p


def config(shape: str, rank: int, extra: list[str] = ()):
    from miles.config import apply_overrides
    from miles.recipes import h200_llama3_8b_lora

    sets = [f"model.{k}={v}" for k, v in SHAPES[shape].items()] + [f"model.lora.rank={rank}", *extra]
    return apply_overrides(h200_llama3_8b_lora(), sets)


def one(shape: str, rank: int, hardware: str, extra: list[str] = ()) -> dict:
    """The plan of one shape at one rank: the first order that fits (cpu, then gpu), else cpu's."""
    from miles.handoff.planner import plan

    cfg = config(shape, rank, extra)
    reports = [plan(cfg, hardware, mode="cpu")]
    if not (reports[0].fits_device and reports[0].fits_host) and cfg.handoff.can_peak_on_device:
        reports.append(plan(cfg, hardware, mode="gpu"))
    r = next((r for r in reports if r.fits_device and r.fits_host), reports[0])
    trainer = {t: s.bytes for (o, t), s in r.sizes.tags.items() if o == "trainer"}
    return {
        "shape": shape,
        "rank": rank,
        "what": f"LoRA rank {rank}" if rank else "full fine-tuning",
        "parameters": r.sizes.model["parameters"],
        "mode": r.mode,
        "device_peak_gib": round(r.device_peak / GiB, 1),
        "budget_gib": round(r.device_budget / GiB, 1),
        "headroom_gib": round((r.device_budget - r.device_peak) / GiB, 1),
        "fits": r.fits_device and r.fits_host,
        "trained_gib": round((trainer.get("params", 0) + trainer.get("optimizer", 0)) / GiB, 2),
        "sync_bytes_per_step": r.sync_bytes,
    }


def run(argv: list[str]) -> dict:
    a = _parser().parse_args(argv)
    rows = [one(shape, int(rank), a.hardware, a.set) for shape in a.shapes.split(",") for rank in a.ranks.split(",")]
    return {"hardware": a.hardware, "recipe": "h200_llama3_8b_lora", "overrides": a.set, "rows": rows}


def table(rows: list[dict]) -> str:
    """The rows as a fixed-width table (the notebook and the report print it)."""
    head = f"{'shape':<12} {'training':<17} {'device peak':>11} {'budget':>7} {'headroom':>9} {'fits':>5} {'sync/step':>11}"
    lines = [head]
    for r in rows:
        sync = r["sync_bytes_per_step"]
        sync_s = f"{sync / GiB:.2f} GiB" if sync >= GiB else f"{sync / (1 << 20):.1f} MiB"
        lines.append(
            f"{r['shape']:<12} {r['what']:<17} {r['device_peak_gib']:>8.1f} GiB {r['budget_gib']:>7.1f} "
            f"{r['headroom_gib']:>9.1f} {'yes' if r['fits'] else 'NO':>5} {sync_s:>11}"
        )
    return "\n".join(lines)
