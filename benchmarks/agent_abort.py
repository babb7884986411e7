"""``miles bench agent-abort``: rollout wall time with oversampling + abort vs waiting for every episode.

Real processes: N session-server instances on a port range (embedded engine) and one harness. Episodes run
SWE-style tasks whose test has a long tail (a fraction of tests sleep ``--slow-s``). Each repeat rolls out the
same step (same tasks, same slow ones) three ways, side by side:

- ``abort``: start ceil(oversample * groups) groups, keep the first ``groups`` complete ones, flush every instance;
- ``wait``: the same oversampled groups with the flush disabled: the step waits for every episode;
- ``no_oversample``: exactly ``groups`` groups, waiting for all of them (the tail lands inside the kept groups).

The goal: abort wall time within 20 % of ``collect`` (the time until the needed groups are complete). One step in
one mode is ``measure``, which notebook 08 runs live (the checkout on sys.path: ``miles.cli.bench.benchmarks()``);
``TINY`` is the embedded engine's model for CPU runs.

    miles bench agent-abort --json
    miles bench agent-abort --json --instances 4 --groups 8 --slow-s 20 --device cuda \
        --model-json '{"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
                       "num_key_value_heads": 4, "max_position_embeddings": 2048}' --max-seq-len 2048
"""

from __future__ import annotations

import argparse
import json
import statistics

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}


def measure(procs, args: argparse.Namespace, *, step: int, mode: str) -> dict:
    """One rollout step in one mode over running processes; returns its timings and flush results."""
    from miles.agents.rollout import AgentRollout, flush_rows
    from miles.config import AgentConfig

    ports = procs.ports
    cfg = AgentConfig(
        session_ports=f"{ports[0]}-{ports[-1]}",
        oversample_factor=1.0 if mode == "no_oversample" else args.oversample,
        abort_partial="drop",
        max_turns=args.max_turns,
        max_tokens_per_turn=args.max_tokens,
        slow_test_fraction=args.slow_fraction,
        slow_test_s=args.slow_s,
        flush_timeout_s=5.0,
        flush_retries=1,
        episode_timeout_s=args.slow_s * 3 + 60,
        test_timeout_s=args.slow_s * 2 + 30,
    )
    rollout = AgentRollout(
        cfg,
        harness_url=procs.harness_url,
        token=procs.token,
        num_groups=args.groups,
        group_size=args.group_size,
        seed=1,
        flush=mode == "abort",
    )
    try:
        out = rollout.collect(step)
    finally:
        rollout.close()
    m = out.metrics
    return {
        "mode": mode,
        "step": step,
        "wall_s": m["time/agent_rollout"],
        "collect_s": m["time/agent_collect"],
        "after_collect_s": m["time/agent_flush"],
        "episodes_started": m["agent/groups_started"] * args.group_size,
        "episodes_cancelled": m.get("agent/episodes_cancelled", 0) + m.get("agent/episodes_aborted", 0),
        "flush_ok": m.get("flush/ok", 0),
        "flush_failed": m.get("flush/failed", 0),
        "kept_slow_tests": sum(r.get("slow_s", 0) > 0 for g in out.groups for r in g),
        "flush": flush_rows(out.flush),
        "episodes": out.episodes,
        "transcript": out.groups[0][0].get("transcript", []) if out.groups else [],
    }


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="miles bench agent-abort")
    p.add_argument("--json", action="store_true", help="print JSON (the default output anyway)")
    p.add_argument("--instances", type=int, default=2, help="session-server processes (one port each)")
    p.add_argument("--groups", type=int, default=4, help="groups needed per step")
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--oversample", type=float, default=2.0)
    p.add_argument("--slow-fraction", type=float, default=0.25, help="share of episodes whose test is slow")
    p.add_argument("--slow-s", type=float, default=20.0, help="how long a slow test sleeps")
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model-json", default=json.dumps(TINY), help="ModelConfig fields for the embedded engine")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--device", default="cpu", help="the session servers' engine device (cuda on a GPU node)")
    return p.parse_args(argv)


def summarize(rows: list[dict]) -> dict:
    med = lambda mode, key: statistics.median(r[key] for r in rows if r["mode"] == mode)
    abort, collect, wait = med("abort", "wall_s"), med("abort", "collect_s"), med("wait", "wall_s")
    out = {
        "abort_wall_s": abort,
        "abort_collect_s": collect,
        "abort_after_collect_s": med("abort", "after_collect_s"),
        "wait_wall_s": wait,
        "abort_over_collect": abort / collect,
        "wait_over_abort": wait / abort,
        "abort_over_collect_per_step": [r["wall_s"] / r["collect_s"] for r in rows if r["mode"] == "abort"],
        "goal_abort_within_20pct_of_collect": abort <= 1.2 * collect,
    }
    if any(r["mode"] == "no_oversample" for r in rows):
        out["no_oversample_wall_s"] = med("no_oversample", "wall_s")
    return out


def run(argv: list[str]) -> dict:
    import logging

    from miles.agents.launcher import AgentProcesses, free_port_range

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise
    args = _parse(argv)
    base = free_port_range(args.instances + 1)
    rows = []
    with AgentProcesses.start(
        ports=[base + i for i in range(args.instances)],
        harness_port=base + args.instances,
        model_json=args.model_json,
        max_seq_len=args.max_seq_len,
        timeout_s=300,
        device=args.device,
    ) as procs:
        measure(procs, args, step=10_000, mode="abort")  # warm-up: first-call costs in every process
        for rep in range(args.repeats):
            for mode in ("abort", "wait", "no_oversample"):
                rows.append(measure(procs, args, step=rep, mode=mode))
    last_abort = [r for r in rows if r["mode"] == "abort"][-1]
    return {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "summary": summarize(rows),
        "rows": [{k: v for k, v in r.items() if k not in ("flush", "episodes", "transcript")} for r in rows],
        "flush": last_abort["flush"],
        "notes": "wall_s = rollout step wall time; collect_s = until the needed groups are complete; wait = the "
        "same oversampled groups with the flush disabled (every episode runs to its end)",
    }
