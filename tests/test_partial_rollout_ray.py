"""Partial rollouts on Ray actors (async.partial_rollout): weight updates land in the rollouts that are generating,
between two decode steps, and the bound still holds. Generation is made slower than training by the run's own
settings (one KV row per engine, long answers), so the trainer's syncs reach steps mid-generation."""

import json

import numpy as np
import pytest

from miles.driver import train
from tests.conftest import tiny_run_cfg

pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]

K = 2
SLOW_PARTIAL = [
    f"async.max_staleness={K}",
    "async.partial_rollout=true",
    "handoff.offload_train=none",
    "handoff.offload_rollout=false",
    "trainer.rollout_correction=tis",
    "trainer.warmup_sft_steps=0",
    "model.max_position_embeddings=128",
    "rollout.max_new_tokens=48",
    "rollout.max_batch_size=1",  # the rows one after another: a rollout takes many decode steps
    "num_steps=6",
    "checkpoint_every=0",
    "dump_rollouts=true",
]


def _rows_versions(run_dir, step):
    """Each sample's response tokens' weight versions, from the step's rollout dump."""
    d = run_dir / "rollouts" / f"step_{step:06d}"
    flat = np.fromfile(d / "weight_versions.int32", dtype=np.int32)
    index = json.loads((d / "index.json").read_text())
    rows = []
    for s in index["samples"]:
        v = flat[s["token_start"] : s["token_start"] + s["num_tokens"]]
        rows.append([int(x) for x in v if x >= 0])  # -1: prompt tokens
    return rows


@pytest.mark.parametrize("kv, source", [("keep", "bucket"), ("recompute", "bucket"), ("recompute", "in_place")])
def test_updates_land_inside_generating_rollouts_within_the_staleness_bound(tmp_path, ray_session, kv, source):
    cfg = tiny_run_cfg(tmp_path, *SLOW_PARTIAL, f"async.kv_on_update={kv}", f"sync.source={source}")
    rows = train(cfg, progress=False)
    assert len(rows) == 6  # the run finished
    assert max(r["async/version_span_max"] for r in rows) > 0  # some rollout crossed an update
    retracted = sum(r["async/retractions"] for r in rows)  # rows sent back to be prefilled under the new weights
    assert retracted > 0 if kv == "recompute" else retracted == 0
    for step, r in enumerate(rows):
        assert r["async/staleness_max"] <= K
        assert r["async/version_min"] >= step - K
        for versions in _rows_versions(tmp_path / "run", step):
            assert versions, f"step {step}: a sample without response tokens"
            assert all(a <= b for a, b in zip(versions, versions[1:])), f"step {step}: versions went back"
            assert step - versions[0] <= K and versions[-1] <= step
