"""``miles bench partial-rollout``: in-flight weight updates (``async.partial_rollout``) with the rows' KV cache kept
and recomputed (``async.kv_on_update = keep | recompute``), side by side on the same recipe, seed and settings.

Each arm is one `miles train` run on Ray (partial rollouts need the rollout actor beside the trainer), the arms
alternating ``--rounds`` times. Per arm: the median RL step time, tokens/s, how many steps crossed an update
(version span > 0) and the fraction of samples that did, the rows retracted (recompute), the load average before
and after (the machine may be shared), and two train/inference log-prob mismatches. The run's own
(``train_rollout_logprob_abs_diff``) averages every token, staleness included (the trainer scores at version ``t``
what the engine sampled under ``t - k .. t``). ``crossing_mismatch`` takes only the tokens sampled after an update
at the trainer's own version, where the arms differ only in how the engine computed them: on the old weights' KV
(keep) or on KV recomputed under the new weights (recompute).

    miles bench partial-rollout --steps 12 --set rollout.max_new_tokens=24 rollout.max_batch_size=4
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
from pathlib import Path

import numpy as np

ARMS = ("keep", "recompute")
PARTIAL = ("async.partial_rollout=true", "dump_rollouts=true")  # the dumps: per-token versions and log-probs


def crossing_mismatch(run_dir: Path) -> dict:
    """|train - engine| log-prob of the tokens sampled after an update at the trainer's own version: in step ``t``'s
    rollout, the tokens of version ``t`` in samples that started under an older one. The trainer of step ``t`` holds
    version ``t``, so these tokens differ from it only by how the engine computed them: on the KV of the older
    weights (keep) or on KV recomputed under version ``t`` (recompute). From the rollout dumps."""
    diffs = []
    for d in sorted((run_dir / "rollouts").glob("step_*")):
        step = int(d.name.split("_")[1])
        col = {n: np.fromfile(d / f"{n}.{t}", dtype=t) for n, t in (("weight_versions", "int32"),
               ("train_log_probs", "float32"), ("rollout_log_probs", "float32"))}  # fmt: skip
        for s in json.loads((d / "index.json").read_text())["samples"]:
            sl = slice(s["token_start"], s["token_start"] + s["num_tokens"])
            v, tr, ro = col["weight_versions"][sl], col["train_log_probs"][sl], col["rollout_log_probs"][sl]
            known = v >= 0
            if not known.any() or v[known].min() >= step:
                continue  # no update crossed this sample
            pick = (v == step) & np.isfinite(tr) & np.isfinite(ro)
            diffs += np.abs(tr[pick] - ro[pick]).tolist()
    if not diffs:
        return {"crossing_tokens": 0}
    return {
        "crossing_tokens": len(diffs),
        "crossing_logprob_abs_diff_mean": round(float(np.mean(diffs)), 6),
        "crossing_logprob_abs_diff_max": round(float(np.max(diffs)), 6),
    }


def arm_summary(arm: dict) -> dict:
    rl = arm["rows"]
    spans = [r["async/version_span_max"] for r in rl]

    def med(key):
        return round(statistics.median(r[key] for r in rl), 4) if key in rl[0] else None

    return {
        "median_step_s": med("time/step"),
        "median_rollout_s": med("time/rollout"),
        "median_tokens_per_s": med("tokens_per_s"),
        "steps_crossing_an_update": sum(s > 0 for s in spans),
        "partial_frac_mean": round(statistics.fmean(r["async/partial_frac"] for r in rl), 4),
        "version_span_max_per_step": spans,
        "staleness_max": max(r["async/staleness_max"] for r in rl),
        "retractions": sum(r.get("async/retractions", 0) for r in rl),
        "logprob_abs_diff_mean": med("train_rollout_logprob_abs_diff"),
        "logprob_max_abs_diff_max": max((r.get("train_rollout_logprob_max_abs_diff", 0.0) for r in rl), default=None),
        "rewards": [round(r["reward"], 4) for r in rl],
    } | {k: arm[k] for k in ("wall_s", "load_before", "load_after")}


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="miles bench partial-rollout")
    ap.add_argument("--recipe", default="quickstart_async")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=1, help="keep, recompute, keep, recompute ... this many times")
    ap.add_argument("--set", nargs="*", default=[], help="overrides for every arm (section.field=value)")
    ap.add_argument("--timeout", type=int, default=3600)
    args = ap.parse_args(argv)
    base = importlib.import_module("benchmarks.async")  # its run_arm: one `miles train` in a fresh run directory
    common = [*base.ASYNC_FREE, *PARTIAL, f"num_steps={args.steps}", *args.set]
    out: dict = {"recipe": args.recipe, "seed": args.seed, "overrides": common, "mode": "ray", "rounds": []}
    for _ in range(args.rounds):
        entry = {}
        for kv in ARMS:
            arm = base.run_arm(args.recipe, args.seed, [*common, f"async.kv_on_update={kv}"], None, True, args.timeout)
            entry[kv] = arm_summary(arm) | crossing_mismatch(Path(arm["run_dir"]))
            base.shutil.rmtree(arm["run_dir"], ignore_errors=True)
        entry["recompute_over_keep_step_time"] = round(
            entry["recompute"]["median_step_s"] / entry["keep"]["median_step_s"], 3
        )
        out["rounds"].append(entry)
    return out
