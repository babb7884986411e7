"""CUDA: staging buckets stay exportable under expandable segments (the bench covers transports between GPU actors)."""

from __future__ import annotations

import pytest
import torch

from miles.sync.flat_bucket import alloc_exportable

pytestmark = pytest.mark.gpu


def test_a_staging_bucket_is_exportable_even_with_expandable_segments_on(monkeypatch):
    from torch.multiprocessing.reductions import reduce_tensor

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    try:
        bucket = alloc_exportable(64 << 20, torch.device("cuda"))
        reduce_tensor(bucket)  # cudaIpcGetMemHandle fails on memory from an expandable (VMM) segment
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")


def _engine_bytes_allocated(engine) -> int:
    return torch.cuda.memory_allocated()


def _engine_weights_on_host(engine) -> dict:
    return {n: t.cpu() for n, t in engine.named_weights().items()}


def test_in_place_sync_reads_the_trainer_weights_through_ipc_opened_once_bit_equal_and_allocates_nothing(ray_session):
    """The trainer (this process) and an engine actor share the GPU: the engine maps the trainer's tensors once and
    copies them into its weights on every sync; a direct update allocates no device memory in the engine."""
    import sys

    from ray import cloudpickle

    from miles.config import SyncConfig
    from miles.model.config import ModelConfig
    from miles.model.decoder import build_decoder
    from miles.rollout.engine import EmbeddedEngine
    from miles.sync.check import check_weights
    from miles.sync.in_place import InPlaceSync

    ray = ray_session
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg = ModelConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        dtype="bfloat16",
        max_position_embeddings=64,
    )
    named = [(n, t.detach().contiguous()) for n, t in build_decoder(cfg, seed=3, device="cuda").hf_state_dict().items()]
    engine = (
        ray.remote(EmbeddedEngine)
        .options(num_gpus=0.5, num_cpus=0)
        .remote(cfg, max_batch_size=1, max_seq_len=8, device="cuda", seed=0)
    )
    sync = InPlaceSync(SyncConfig(source="in_place", engine_staging="direct"), "cuda")
    sync.connect([engine])
    before = ray.get(engine.__ray_call__.remote(_engine_bytes_allocated))
    for version in (1, 2, 3):
        with torch.no_grad():
            for _, t in named:
                t.add_(torch.randn_like(t), alpha=1e-2)
        sync.update(named, version)
        check_weights({n: t.cpu() for n, t in named}, ray.get(engine.__ray_call__.remote(_engine_weights_on_host)))
    assert sync.metrics()["sync/exports"] == 1
    assert ray.get(engine.__ray_call__.remote(_engine_bytes_allocated)) == before
    ray.kill(engine)
