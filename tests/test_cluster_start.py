"""A run that cannot get its devices is refused (at once, or after a bounded wait naming what is missing),
instead of waiting forever for a placement group."""

import time

import pytest
import torch

from miles.config import apply_overrides
from miles.recipes import quickstart

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu_is_refused_before_ray_starts():
    import ray

    from miles.cluster import Cluster

    if ray.is_initialized():
        pytest.skip("a Ray session of another test is running; this test checks that none is started")
    cfg = apply_overrides(quickstart(), ["device=cuda"])
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="device = 'cuda' needs 1 CUDA device.* this machine has 0 .* use device=cpu"):
        Cluster(cfg)
    assert time.perf_counter() - t0 < 5 and not ray.is_initialized()


def test_a_placement_group_that_cannot_be_placed_times_out_naming_the_missing_resource(ray_session):
    from ray.util.placement_group import placement_group, placement_group_table

    from miles.cluster import wait_for_placement_group

    bundles = [{"CPU": 1, "GPU": 1}] * 2
    pg = placement_group(bundles, strategy="PACK")
    with pytest.raises(RuntimeError, match=r"within 1 s: it needs GPU 2 \(the cluster has 0\); lower trainer"):
        wait_for_placement_group(pg, bundles, 1.0)
    deadline = time.monotonic() + 30
    while placement_group_table(pg)["state"] != "REMOVED" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert placement_group_table(pg)["state"] == "REMOVED"  # nothing left pending in the cluster


def _worker_imports() -> dict:
    import importlib
    import os

    out = {"omp": os.environ.get("OMP_NUM_THREADS")}
    try:
        importlib.import_module("rfc3987_syntax")
        out["rfc3987_syntax"] = "imported"
    except ImportError as e:
        out["rfc3987_syntax"] = str(e)
    import jsonschema  # what Ray imports in each process: still works, without the IRI format check

    out["jsonschema"] = jsonschema.__name__
    return out


def test_the_processes_of_a_local_ray_skip_the_slow_optional_import_and_get_the_drivers_environment(ray_session):
    """miles/ray_path hides rfc3987_syntax (slow to import: miles bench startup) from a Ray started here; the threads
    setting reaches the workers through the environment, not a runtime_env."""
    got = ray_session.get(ray_session.remote(_worker_imports).remote())
    assert "hidden from the Ray processes miles starts" in got["rfc3987_syntax"], got
    assert got["jsonschema"] == "jsonschema" and got["omp"] == "1", got
