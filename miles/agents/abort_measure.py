"""One agent rollout step over running session servers and a harness, timed: oversampling with abort and flush,
waiting for every episode, or no oversampling (``mode``). ``miles bench agent-abort`` repeats it; notebook 08
runs it live. ``TINY`` is the embedded engine's model for CPU runs.

    with AgentProcesses.start(ports=..., harness_port=..., model_json=json.dumps(TINY), ...) as procs:
        row = measure(procs, args, step=1, mode="abort")   # args: the benchmark's options (argparse.Namespace)
"""

from __future__ import annotations

import argparse

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
