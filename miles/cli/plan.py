"""``miles plan``: the handoff plan of a recipe on a hardware profile, with every step's predicted device and host
bytes against the budget, before anything launches (miles.handoff.planner computes; this prints).

The arguments and the config are checked before the planner's heavy imports (torch, for the meta-device model).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING

from miles.config_args import ArgParser, add_config_args, config_from_args, print_config
from miles.handoff.hardware import PROFILES, GiB

if TYPE_CHECKING:
    from miles.handoff.planner import PlanReport

HARDWARE = [*sorted(PROFILES), "cpu", "auto"]
EXIT_DOES_NOT_FIT = 3
MAX_STEPS = 100  # the steady state repeats from the second RL step; a long replay only costs time
HOST_ALLOCATORS = {
    "arena": "one page-rounded pinned arena per tag, freed at resume (what miles does)",
    "arena_kept": "the same arenas kept mapped for the run (host_arena.keep_pinned)",
    "caching": "torch's pinned caching allocator (power-of-two blocks)",
}
EXAMPLES = """\
examples:
  miles plan --recipe gb300_kimi_k2_plan --hardware gb300          both orders of a 1T MoE on 32 GB300 trays
  miles plan --recipe gb300_kimi_k2_plan --hardware h200 --mode auto  what 'auto' would pick, and why
  miles plan --set trainer.world_size=8 handoff.offload_train=disk --json
  miles plan --set handoff.plan_model=path/to/config.json          size any HF config (dense, MoE, MLA)
  miles plan --model path/to/hf_dir                                the embedded decoder built from that checkpoint

exit status: 0 when a planned order fits, 3 when none does, 2 for bad input."""


def _steps(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_STEPS:
        raise argparse.ArgumentTypeError(f"--steps {text} must be in 0..{MAX_STEPS}")
    return n


def parser() -> ArgParser:
    p = ArgParser(
        prog="miles plan",
        description="Predict the device and host peaks of every step of a recipe's handoff plan on a hardware "
        "profile, before launching.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p)
    p.add_argument(
        "--hardware",
        default=None,
        metavar="NAME",
        help=f"the hardware profile: {', '.join(HARDWARE)} (cpu: this machine; auto: the local GPU's, else cpu; "
        "default: the recipe's handoff.hardware)",
    )
    p.add_argument(
        "--mode",
        default="both",
        choices=["cpu", "gpu", "auto", "both"],
        help="which handoff order to plan (handoff.colocate_memory_peak_device): cpu (each side offloads before the "
        "other onloads), gpu (the other side onloads first), auto (what a run would pick), both (default: cpu and "
        "gpu side by side)",
    )
    p.add_argument(
        "--host-allocator",
        default="arena",
        choices=list(HOST_ALLOCATORS),
        help="how host backups are priced: " + "; ".join(f"{k}: {v}" for k, v in HOST_ALLOCATORS.items()),
    )
    p.add_argument("--steps", type=_steps, default=2, help=f"RL steps to replay after init (0..{MAX_STEPS}; default 2)")
    p.add_argument("--json", action="store_true", help="print the plans as JSON (every step's bytes) instead of tables")
    p.add_argument(
        "--measured",
        default=None,
        metavar="METRICS_JSONL",
        help="a run's metrics.jsonl (a synchronous run of the recipe): its rollout, train and sync seconds predict "
        "the async step time (async.max_staleness > 0; miles.async_plan)",
    )
    return p


def async_prediction(cfg, measured: str | None, hw_name: str):
    """The async run's staleness (and its step time from measured rates), or None for a synchronous run."""
    import os

    from miles.async_plan import measured_rates, predict

    k = cfg.async_.max_staleness
    if not k:
        return None
    rates = measured_rates(measured) if measured else {"rollout_s": 0.0, "train_s": 0.0, "sync_s": 0.0}
    cores = (os.cpu_count() or 1) if hw_name == "cpu" else 0  # one machine's cores shared by both sides
    return predict(**rates, max_staleness=k, num_steps=cfg.num_steps, shared_cores=cores)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    cfg = config_from_args(args, plan=True)
    if args.print_config:
        return print_config(cfg, args, "miles plan")
    from miles.handoff.hardware import get_profile
    from miles.handoff.planner import choose_mode, plan

    hw = get_profile(args.hardware or cfg.handoff.hardware)
    modes = ["cpu", "gpu"] if args.mode == "both" else [args.mode]
    if "gpu" in modes and not cfg.handoff.can_peak_on_device and args.mode == "both":
        modes.remove("gpu")
    reports = [plan(cfg, hw, mode=m, num_steps=args.steps, host_allocator=args.host_allocator) for m in modes]
    try:
        auto = dict(zip(("mode", "reason"), choose_mode(cfg, hw)))
    except ValueError as e:
        auto = {"mode": None, "reason": str(e)}
    stale = async_prediction(cfg, args.measured, hw.name)
    fits = [r.mode for r in reports if r.fits_device and r.fits_host]
    code = 0 if fits else EXIT_DOES_NOT_FIT
    if args.json:
        out = {
            "recipe": cfg.recipe,
            "hardware": hw.name,
            "auto": auto,
            "plans": {r.mode: report_dict(r) for r in reports},
        }
        if stale is not None:
            out["async"] = {k: v for k, v in asdict(stale).items() if k != "staleness"}
        print(json.dumps(out, indent=1))
        return code
    print("\n\n".join(report_table(r) for r in reports))
    print(f"\n{_auto_line(reports, auto)}\n{hw.note}")
    if stale is not None:
        from miles.async_plan import describe

        print(describe(stale, cfg.async_.max_staleness))
    planned = ", ".join(f"{r.mode} {'fits' if r.mode in fits else 'does NOT fit'}" for r in reports)
    print(f"on {hw.name}: {planned} (exit {code})")  # the last line agrees with the exit status
    return code


def _auto_line(reports, auto: dict) -> str:
    """What handoff.colocate_memory_peak_device = 'auto' picks, marked as such when that order is not planned."""
    if auto["mode"] is None:
        return f"auto -> none: {auto['reason']}"
    if auto["mode"] in [r.mode for r in reports]:
        return f"auto -> {auto['mode']}: {auto['reason']}"
    return f"auto -> {auto['mode']} (not the order planned above; see --mode {auto['mode']}): {auto['reason']}"


# ---- the report, printed ------------------------------------------------------------------------------------
def report_dict(report: PlanReport) -> dict:
    """The report as JSON (``miles plan --json``)."""
    per = lambda owner: {t: s.bytes for (o, t), s in report.sizes.tags.items() if o == owner}
    return {
        "recipe": report.recipe,
        "mode": report.mode,
        "reason": report.reason,
        "hardware": report.hardware.as_dict(),
        "gpus": report.gpus,
        "nodes": report.nodes,
        "ranks_per_node": report.ranks_per_node,
        "host_allocator": report.host_allocator,
        "model": report.sizes.model,
        "sizes_per_gpu": {
            "trainer": per("trainer"),
            "engine": per("engine"),
            "train_transient": report.sizes.train_transient,
        },
        "steps": [asdict(s) for s in report.steps],
        "peaks": {"device_per_gpu": report.device_peak, "host_per_node": report.host_peak},
        "handoff_seconds_per_step": report.handoff_seconds,
        "sync_bytes_per_gpu": report.sync_bytes,
        "budget": {"device_per_gpu": report.device_budget, "host_per_node": report.host_budget},
        "fits": {"device": report.fits_device, "host": report.fits_host},
        "over_budget_steps": [f"{s.phase}: {s.step} ({', '.join(s.over)})" for s in report.steps if s.over],
    }


def report_table(report: PlanReport) -> str:
    """The report as the table ``miles plan`` prints: every step's bytes moved, seconds, device and host held."""
    hw = report.hardware
    lines = [
        f"{report.recipe}: colocate_memory_peak_device = {report.mode}"
        + (f" ({report.reason})" if report.reason else ""),
        f"  {report.gpus} GPUs on {report.nodes} x {hw.name} ({report.ranks_per_node} ranks/node); "
        f"host budget {_fmt(hw.host_bytes)}/node, device {_fmt(hw.hbm_bytes)}/GPU; host arenas: {report.host_allocator}",
        f"  {'phase':<17} {'step':<58} {'moved/GPU':>10} {'seconds':>8} {'device/GPU':>12} {'host/node':>11}",
    ]
    for s in report.steps:
        flag = " <-- over " + "+".join(s.over) if s.over else ""
        dev = _fmt(s.device + s.transient_device) + ("*" if s.transient_device else " ")
        lines.append(
            f"  {s.phase:<17} {s.step:<58} {_fmt(sum(s.moved.values())):>10} {s.seconds:>8.3f} {dev:>12} "
            f"{_fmt(s.host_node):>11}{flag}"
        )
    at = lambda peak: next(f"{s.phase}: {s.step}" for s in report.steps if peak(s) == max(map(peak, report.steps)))
    lines.append(
        f"  peaks: device {_fmt(report.device_peak)}/GPU at {at(lambda s: s.device + s.transient_device)} (budget "
        f"{_fmt(report.device_budget)}), host {_fmt(report.host_peak)}/node at {at(lambda s: s.host_node)} (budget "
        f"{_fmt(report.host_budget)}) -> {'fits' if report.fits_device and report.fits_host else 'DOES NOT FIT'}"
    )
    if any(s.transient_device for s in report.steps):
        lines.append("  * includes the step's working set on top of what it holds (the train step's, the sync bucket)")
    lines.append(f"  predicted handoff time: {report.handoff_seconds:.3f} s per RL step (moved bytes over the link)")
    what = "the LoRA adapters; the base is never sent" if ("engine", "base") in report.sizes.tags else "every weight"
    if report.sizes.warmup_transient is not None:  # model.lora.warmup = base
        base = _fmt(report.sizes.tags[("engine", "base")].bytes)
        what = f"the LoRA adapters; the base the warm-up trained, {base}, once, at the first sync"
    lines.append(f"  weight sync: {_fmt(report.sync_bytes)} per GPU per RL step ({what})")
    return "\n".join(lines)


def _fmt(n: float) -> str:
    """Binary units throughout (the budgets are GiB too)."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"
