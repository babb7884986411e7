"""``miles bench real-model``: a real model learns under a wall-clock budget; the held-out eval curve as JSON.

Runs a recipe (default ``smollm2_math``) with ``--set`` overrides, stops it after ``--minutes`` of training (the
stopped run is evaluated once more), and reports every eval row (step, seconds since the start, mean@k, pass@j,
greedy pass@1 per dataset and overall), the RL rows' reward and throughput, and the gain of each eval figure from
the first eval (the measured start) to the last, and the reward calls that timed out or failed (miles.reward).

    miles bench real-model --minutes 7 --set eval.every=5
    miles bench real-model --recipe smollm2_tools --minutes 8                                  # tool use
    miles bench real-model --recipe smollm2_tools --minutes 8 --set 'env.args={"tools": false}'  # its baseline
"""

from __future__ import annotations

import argparse
import json
import threading
import time


def run(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(prog="miles bench real-model")
    p.add_argument("--recipe", default="smollm2_math")
    p.add_argument("--minutes", type=float, default=7.0, help="training wall-clock budget (evals included)")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="a.b=value")
    a = p.parse_args(argv)
    from miles.config import apply_overrides
    from miles.driver import train
    from miles.recipes import get_recipe

    cfg = apply_overrides(get_recipe(a.recipe), ["resume=false", "overwrite=true", *a.overrides])
    stop = threading.Event()
    timer = threading.Timer(a.minutes * 60, stop.set)
    t0 = time.perf_counter()
    timer.start()
    try:
        rows = train(cfg, progress=False, stop=stop)
    finally:
        timer.cancel()
    wall = time.perf_counter() - t0
    metrics = [json.loads(line) for line in open(f"{cfg.run_dir}/metrics.jsonl")]
    evals = [r for r in metrics if r.get("phase") == "eval"]
    return {
        "recipe": a.recipe,
        "overrides": a.overrides,
        "budget_s": a.minutes * 60,
        "wall_s": wall,
        "train_s": sum(r["time/step"] for r in rows),
        "eval_s": sum(r["time/eval"] for r in evals),
        "num_steps": len(rows),
        "samples_per_step": cfg.rollout.num_prompts_per_step * cfg.rollout.n_samples_per_prompt,
        "tokens_per_s": sum(r["total_tokens"] for r in rows) / max(sum(r["time/step"] for r in rows), 1e-9),
        "rollout_tokens_per_s": sum(r["rollout_tokens"] for r in rows)
        / max(sum(r["time/generate"] for r in rows), 1e-9),
        "reward_timeouts": sum(r.get("reward/timeouts", 0) for r in rows),  # each scored data.reward_on_error
        "reward_errors": sum(r.get("reward/errors", 0) for r in rows),
        "eval_reward_timeouts": sum(r.get("eval/reward_timeouts", 0) for r in evals),
        "time_reward_s": sum(r.get("time/reward", 0) for r in rows),
        "eval_k": cfg.eval.k,
        "eval": evals,
        "gain": _gain(evals),
        "train": [{k: r[k] for k in TRAIN_KEYS if k in r} for r in rows],
    }


# per RL step: reward, lengths, speed, and for environment runs (recipe smollm2_tools) tool calls per episode, turns,
# pass rate, errors and token drift
TRAIN_KEYS = (
    "step", "reward", "response_len", "tokens_per_s", "time/step", "env/tool_calls", "env/turns", "env/pass_rate",
    "env/malformed_tool_calls", "env/episodes_failed", "env/drift_episodes", "env/episode_tokens",
)  # fmt: skip


def _gain(evals: list[dict]) -> dict:
    """Each eval figure's change from the first eval to the last (absolute)."""
    if len(evals) < 2:
        return {}
    first, last = evals[0], evals[-1]
    return {k: last[k] - first[k] for k in first if k.startswith("eval/") and "num_problems" not in k and k in last}
