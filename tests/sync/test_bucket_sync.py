"""miles.sync.buckets.host_bytes (the bytes of a live tensor for numpy code, without pinning its storage's size) and
the engine calls miles.sync.bucket_sync.BucketSync makes around its buckets."""

import numpy as np
import pytest
import torch

from miles.sync.buckets import host_bytes
from tests.conftest import tiny_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_host_bytes_equal_the_numpy_export_and_leave_the_storage_resizable(dtype):
    t = (torch.randn(7, 5) * 100).to(dtype)
    view = host_bytes(t)
    reference = t.clone().view(torch.uint8).reshape(-1).numpy()  # the export marks only the clone's storage
    assert view.dtype == np.uint8 and np.array_equal(view, reference)
    t.untyped_storage().resize_(0)  # what TaggedMemory does at an offload; after .numpy() this raises
    assert t.untyped_storage().nbytes() == 0


def test_host_bytes_rejects_what_it_cannot_view():
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        host_bytes(torch.randn(4, 4).t())
    assert host_bytes(torch.empty(0)).size == 0


class _Recorded:
    """An embedded engine's weight-update methods, with every call the sync makes recorded; ``two`` adds the
    two-call form (UpdateCalls), otherwise the engine takes the steps one by one."""

    STEPS = (
        "pause_generation",
        "flush_cache",
        "begin_weight_update",
        "set_weight_version",
        "continue_generation",
        "abort_weight_update",
        "update_weights_from_bucket",
    )

    def __init__(self, engine, two: bool):
        self.engine, self.calls = engine, []
        for name in self.STEPS + (("open_weight_update", "commit_weight_update") if two else ()):
            setattr(self, name, self._recording(name, getattr(engine, name)))

    def _recording(self, name, fn):
        def call(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)

        return call


@pytest.mark.parametrize("two", [True, False], ids=["two-calls", "one-by-one"])
def test_a_bucketed_sync_takes_two_engine_calls_around_its_buckets_where_the_engine_offers_them(two):
    from miles.config import SyncConfig
    from miles.model.decoder import build_decoder
    from miles.rollout.engine import EmbeddedEngine
    from miles.sync import SyncError
    from miles.sync.check import check_weights
    from miles.sync.tensor import TensorSync

    cfg = tiny_model(max_position_embeddings=32)
    named = [
        (n, t.detach().clone() + 0.5)
        for n, t in build_decoder(cfg, seed=2).hf_state_dict().items()
        if n != "lm_head.weight" or not cfg.tie_word_embeddings
    ]
    engine = EmbeddedEngine(cfg, max_batch_size=1, max_seq_len=8)
    rec = _Recorded(engine, two)
    sync = TensorSync(SyncConfig(update_weight_buffer_size=1 << 20), "cpu")
    sync.connect([rec])
    sync.update(named, 1)
    check_weights(named, engine.named_weights())
    around = [c for c in rec.calls if c != "update_weights_from_bucket"]
    assert around == (
        ["open_weight_update", "commit_weight_update"]
        if two
        else ["pause_generation", "flush_cache", "begin_weight_update", "set_weight_version", "continue_generation"]
    )
    assert engine.weight_version == 1 and not engine.loop.paused

    rec.calls.clear()
    broken = named[:5] + [(named[5][0], torch.empty_like(named[5][1], device="meta"))] + named[6:]
    with pytest.raises(SyncError, match="keep serving their previous version"):
        sync.update(broken, 2)
    assert rec.calls[-2:] == ["abort_weight_update", "continue_generation"]  # aborted, then generating again
    assert engine.weight_version == 1 and not engine.loop.paused
    check_weights(named, engine.named_weights())  # shadow staging: the served weights are untouched
