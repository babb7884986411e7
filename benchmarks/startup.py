"""``miles bench startup``: how long a local Ray and the quickstart's cluster take to start, each in a fresh process.

Side by side, alternating, ``--repeats`` times: ``import ray`` + ``ray.init`` with the processes' PYTHONPATH as
miles sets it (miles/ray_path first, hiding jsonschema's optional rfc3987_syntax) and without that folder; then
``Cluster(quickstart)`` up (Ray, the engines, the trainer's actors, the sync connected) and closed. Medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

RAY_INIT = """
import json, logging, os, sys, time
os.environ["RAY_enable_metrics_collection"] = "0"
t0 = time.perf_counter()
import ray
t1 = time.perf_counter()
ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
t2 = time.perf_counter()
ray.shutdown()
print(json.dumps({"import_s": t1 - t0, "init_s": t2 - t1}))
"""

CLUSTER = """
import json, time
t0 = time.perf_counter()
from miles.cluster import Cluster
from miles.config import apply_overrides
from miles.recipes import quickstart
t1 = time.perf_counter()
c = Cluster(apply_overrides(quickstart(), ["run_dir=/tmp/miles-bench-startup"]))
t2 = time.perf_counter()
c.close()
print(json.dumps({"import_s": t1 - t0, "cluster_up_s": t2 - t1, "close_s": time.perf_counter() - t2}))
"""


def _child(code: str, pythonpath: str) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise RuntimeError(f"startup child failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(argv: list[str]) -> dict:
    from miles.cluster import RAY_PATH

    ap = argparse.ArgumentParser(prog="miles bench startup")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    base = os.environ.get("PYTHONPATH", "")
    sides = {"ray_path": os.pathsep.join(filter(None, [str(RAY_PATH), base])), "plain": base}
    samples = {name: [] for name in sides}
    cluster = []
    for _ in range(args.repeats):
        for name, path in sides.items():
            samples[name].append(_child(RAY_INIT, path))
        cluster.append(_child(CLUSTER, base))

    def med(rows, key):
        return statistics.median(r[key] for r in rows)

    result = {
        "repeats": args.repeats,
        "ray_init": {
            name: {"import_s": med(rows, "import_s"), "init_s": med(rows, "init_s"), "runs": rows}
            for name, rows in samples.items()
        },
        "cluster": {"cluster_up_s": med(cluster, "cluster_up_s"), "close_s": med(cluster, "close_s"), "runs": cluster},
    }
    r = result["ray_init"]
    print(
        f"ray.init: {r['plain']['init_s']:.2f} s plain, {r['ray_path']['init_s']:.2f} s with miles/ray_path "
        f"(import ray {r['plain']['import_s']:.2f} / {r['ray_path']['import_s']:.2f} s); quickstart cluster up "
        f"{result['cluster']['cluster_up_s']:.2f} s, closed in {result['cluster']['close_s']:.2f} s",
        file=sys.stderr,
    )
    return result
