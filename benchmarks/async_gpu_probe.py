"""The H200 sync-vs-async comparison (benchmarks/gpu_async.sh) as one JSON: per arm the held-out mean@4 curve
against wall-clock, the seconds to +25 points over the first eval, the final mean@4, tokens/s, and for the async
arm the planner's predicted staleness and step time (miles plan --measured) against the measured ones.

    python benchmarks/async_gpu_probe.py OUT     # writes benchmarks/results/async-smollm2-long.gpu.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

KEY = "eval/all/mean@4"


def arm(metrics: Path) -> dict:
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    evals = [r for r in rows if r.get("phase") == "eval" and KEY in r]
    rl = [r for r in rows if "phase" not in r]
    curve = [(r["step"], round(r["time/since_start"], 1), round(r[KEY], 4)) for r in evals]
    to_25 = next((t for _, t, m in curve if curve and m >= curve[0][2] + 0.25), None)
    out = {
        "curve_step_s_mean4": curve,
        "first_mean4": curve[0][2] if curve else None,
        "final_mean4": curve[-1][2] if curve else None,
        "seconds_to_plus_25_points": to_25,
        "rl_steps": len(rl),
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rl) if rl else None,
        "step_s_median": statistics.median(r["time/step"] for r in rl) if rl else None,
    }
    if rl and "async/staleness_mean" in rl[0]:
        out["staleness_mean_measured"] = statistics.fmean(r["async/staleness_mean"] for r in rl)
        out["version_span_max_measured"] = max(r["async/version_span_max"] for r in rl)
    return out


def main(out_dir: str) -> dict:
    out = Path(out_dir)
    result = {name.stem.split(".")[0]: arm(name) for name in sorted(out.glob("*.metrics.jsonl"))}
    for plan in out.glob("*.plan.json"):
        name = plan.name.split(".")[0]
        if name in result:
            result[name]["predicted"] = json.loads(plan.read_text()).get("async")
    path = Path(__file__).parent / "results" / "async-smollm2-long.gpu.json"
    path.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1]), indent=1))
