"""Shared fixtures: a tiny model config, a session-wide local Ray, a GPU skip marker."""

from __future__ import annotations

import os

import pytest
import torch

from miles.config import apply_overrides
from miles.model.config import ModelConfig
from miles.recipes import quickstart


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny_model_cfg() -> ModelConfig:
    return ModelConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


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
