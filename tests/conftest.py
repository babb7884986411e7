"""Shared fixtures (a tiny model config, a session-wide local Ray) and the test tiers, cheapest first:

- ``unit``: pure logic in one process (seconds in all);
- ``procs``: several processes or servers: real Ray, gloo groups, child processes, HTTP servers;
- ``browser``: headless Chromium against the dashboard;
- ``notebook``: the notebooks, run top to bottom by nbval;
- ``gpu``: needs a CUDA device (skipped without one).

Within ``procs``, ``cluster`` marks the tests that start a Ray cluster of several nodes on this machine (minutes).

Every collected item gets exactly one of them, from its file (PROCS, BROWSER) or its kind, so that for example
``python -m pytest -m unit`` runs the fast tier and ``-m "not notebook"`` leaves the notebooks out.
"""

from __future__ import annotations

import os

import pytest
import torch

from miles.config import apply_overrides
from miles.model.config import ModelConfig
from miles.recipes import quickstart

PROCS = {  # test files that start Ray, child processes, process groups or HTTP servers
    "agents/test_agent_abort.py",
    "agents/test_agent_guard.py",
    "agents/test_agent_harness.py",
    "agents/test_agent_http_engine.py",
    "agents/test_agent_recipe.py",
    "agents/test_agent_session.py",
    "data/test_dataset_run.py",
    "data/test_dataset_source.py",  # its math verifier's sympy checks start reward workers
    "dashboard/test_dashboard_api.py",
    "dashboard/test_dashboard_guard.py",
    "envs/test_env_http_engine.py",
    "envs/test_env_source.py",
    "envs/test_python_tool.py",
    "model/test_smollm2.py",
    "model/test_train_a_checkpoint.py",
    "optim/test_optim_offload_disk.py",
    "reward/test_pool.py",
    "reward/test_reward_run.py",
    "reward/test_verifier_cases.py",
    "rollout/test_router_failover.py",
    "rollout/conformance/test_conformance_broadcast.py",
    "rollout/conformance/test_conformance_client.py",
    "rollout/conformance/test_conformance_control.py",
    "rollout/conformance/test_conformance_generate.py",
    "rollout/conformance/test_conformance_openai.py",
    "rollout/conformance/test_conformance_weights.py",
    "rollout/test_serve_connections.py",
    "rollout/test_server_bucket_files.py",
    "rollout/test_server_guard.py",
    "rollout/test_server_http.py",
    "rollout/test_server_requests.py",
    "rollout/test_sglang_client_driver.py",
    "rollout/test_sglang_client_manager.py",
    "rollout/test_sglang_client_responses.py",
    "rollout/test_sglang_engine.py",
    "rollout/test_sglang_engine_loop.py",
    "sync/test_disk_delta_multirank.py",
    "sync/test_sync_transports.py",
    "sync/test_weight_group.py",
    "test_cli.py",
    "test_cluster_nodes.py",
    "test_cluster_start.py",
    "test_driver.py",
    "test_ray_errors.py",
    "test_threads.py",
    "test_watchdog.py",
    "train/test_fsdp2.py",
}
CLUSTER = {"test_cluster_nodes.py"}  # a Ray cluster of two nodes (tests/ray_nodes.py): also marked `cluster`
BROWSER = {
    "dashboard/test_dashboard_browser.py",
    "dashboard/test_dashboard_long_run.py",
    "dashboard/test_dashboard_turns.py",
    "dashboard/test_dashboard_workbench.py",
}
TESTS = os.path.dirname(os.path.abspath(__file__))


def tier(item) -> str:
    path = str(item.path)
    if path.endswith(".ipynb"):
        return "notebook"
    if "gpu" in item.keywords:
        return "gpu"
    rel = os.path.relpath(path, TESTS).replace(os.sep, "/")
    if rel in BROWSER:
        return "browser"
    return "procs" if rel in PROCS or "ray_session" in getattr(item, "fixturenames", ()) else "unit"


@pytest.hookimpl(tryfirst=True)  # before -m deselects by mark
def pytest_collection_modifyitems(config, items):
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        t = tier(item)
        item.add_marker(getattr(pytest.mark, t))
        if os.path.relpath(str(item.path), TESTS).replace(os.sep, "/") in CLUSTER:
            item.add_marker(pytest.mark.cluster)
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
