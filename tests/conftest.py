"""Shared fixtures (a tiny model config, a session-wide local Ray) and the test tiers, cheapest first:

- ``unit``: pure logic in one process (seconds in all);
- ``procs``: several processes or servers: real Ray, gloo groups, child processes, HTTP servers;
- ``browser``: headless Chromium against the dashboard;
- ``notebook``: the notebooks, run top to bottom by nbval;
- ``gpu``: needs a CUDA device (skipped without one).

Within ``procs``, ``cluster`` marks the tests that start a Ray cluster of several nodes on this machine (minutes;
the file says ``pytestmark = [pytest.mark.procs, pytest.mark.cluster]``).

Every collected item gets exactly one of them, from its kind, its file's mark (a file that starts processes or
servers says so: ``pytestmark = pytest.mark.procs``; ``browser`` likewise) or its fixtures (``ray_session``), so that
for example ``python -m pytest -m unit`` runs the fast tier and ``-m "not notebook"`` leaves the notebooks out.
"""

from __future__ import annotations

import os

import pytest
import torch

from miles.config import apply_overrides
from miles.model.config import ModelConfig
from miles.recipes import quickstart


def tier(item) -> str:
    """A test's tier by its kind, its file's mark (``pytestmark = pytest.mark.procs`` or ``browser``) or its fixtures
    (``ray_session`` makes a test ``procs``); unit otherwise."""
    if str(item.path).endswith(".ipynb"):
        return "notebook"
    if item.get_closest_marker("gpu"):  # the mark, not a keyword (a parameter id "gpu" is one too)
        return "gpu"
    if item.get_closest_marker("browser"):
        return "browser"
    if item.get_closest_marker("procs") or "ray_session" in getattr(item, "fixturenames", ()):
        return "procs"
    return "unit"


@pytest.hookimpl(tryfirst=True)  # before -m deselects by mark
def pytest_collection_modifyitems(config, items):
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        t = tier(item)
        item.add_marker(getattr(pytest.mark, t))
        if t == "gpu" and skip is not None:
            item.add_marker(skip)


def tiny_model(**fields) -> ModelConfig:
    """The tests' tiny decoder (2 layers, width 32, 4 heads over 2 KV heads); ``fields`` change any of it."""
    return ModelConfig(
        **{
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
            **fields,
        }
    )


@pytest.fixture
def tiny_model_cfg() -> ModelConfig:
    return tiny_model()


def tiny_run_cfg(tmp_path, *overrides):
    """The quickstart recipe shrunk to a few seconds per step, writing into ``tmp_path``."""
    base = [
        "model.hidden_size=32",
        "model.intermediate_size=64",
        "model.num_hidden_layers=2",
        "rollout.num_prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=6",
        "trainer.warmup_sft_steps=1",
        "num_steps=2",
        "num_threads=1",
        f"run_dir={tmp_path / 'run'}",
    ]
    return apply_overrides(quickstart(), base + list(overrides))


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from miles.cluster import start_ray

    if not ray.is_initialized():
        start_ray(num_cpus=max(2, os.cpu_count() or 1), threads=1)
    yield ray
    ray.shutdown()


def in_place_versions(sync, named, versions, engine_weights) -> list[int]:
    """Move every trainer tensor, sync it as each of ``versions`` and check the engine bit-equal after each;
    returns how many engines were rung (not called) per sync (miles.sync.in_place's ``sync/rung``)."""
    from miles.sync.check import check_weights

    rung = []
    for version in versions:
        with torch.no_grad():
            for _, t in named:
                t.add_(0.01)
        sync.update(named, version)
        rung.append(sync.metrics()["sync/rung"])
        check_weights(named, engine_weights())
    return rung
