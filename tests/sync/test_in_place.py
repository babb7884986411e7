"""In-place sync in one process (the cross-process cases are in test_sync_transports and test_sync_gpu)."""

from __future__ import annotations

import logging

import pytest
import torch

from miles.config import SyncConfig
from miles.model.decoder import build_decoder
from miles.rollout.engine import EmbeddedEngine
from miles.sync import SyncError
from miles.sync.check import check_weights
from miles.sync.in_place import InPlaceSync
from tests.conftest import in_place_versions, tiny_model

CFG = tiny_model(max_position_embeddings=32)


def test_a_trainer_whose_tensors_move_every_sync_still_syncs_bit_equal_and_is_told_to_use_buckets(caplog):
    named = [
        (n, t.detach().clone())
        for n, t in build_decoder(CFG, seed=1).hf_state_dict().items()
        if n != "lm_head.weight" or not CFG.tie_word_embeddings
    ]
    engine = EmbeddedEngine(CFG, max_batch_size=1, max_seq_len=8)
    sync = InPlaceSync(SyncConfig(source="in_place"), "cpu")
    sync.connect([engine])
    with caplog.at_level(logging.WARNING, logger="miles.sync.in_place"):
        for version in (1, 2, 3):
            named = [(n, t + 0.01) for n, t in named]  # new tensors every step: nothing stays at its address
            sync.update(named, version)
            check_weights(named, engine.named_weights())
    assert sync.exports == 3 and engine.weight_version == 3
    assert sum("use sync.source=bucket" in r.message for r in caplog.records) == 1


def test_a_doorbell_runs_every_update_after_the_first_and_a_failed_ring_keeps_the_previous_version():
    """The first update goes by call and opens the engine's doorbell; later ones ring it (same receiver, same
    checks). A ring the engine cannot serve (its weights released) comes back as a SyncError naming the cause, the
    engine keeps the version it had, and the next update goes by call again."""
    named = [
        (n, t.detach().clone())
        for n, t in build_decoder(CFG, seed=1).hf_state_dict().items()
        if n != "lm_head.weight" or not CFG.tie_word_embeddings
    ]
    engine = EmbeddedEngine(CFG, max_batch_size=1, max_seq_len=8)
    sync = InPlaceSync(SyncConfig(source="in_place", engine_staging="shadow"), "cpu", doorbell=True, timeout_s=30)
    sync.connect([engine])
    try:
        rung = in_place_versions(sync, named, (1, 2, 3), engine.named_weights)
        assert rung == [0, 1, 1] and engine.weight_version == 3 and sync.exports == 1
        engine.offload(["weights"])  # an engine that cannot take the update
        with torch.no_grad():
            for _, t in named:
                t.add_(0.01)
        with pytest.raises(SyncError, match="keep serving their previous version") as err:
            sync.update(named, 4)
        assert "weights" in str(err.value.__cause__)  # the engine's own reason, through the doorbell
        engine.onload(["weights"])  # (their bytes come back with the next sync)
        assert engine.weight_version == 3
        sync.update(named, 5)
        assert sync.metrics()["sync/rung"] == 0  # by call again after a failure
        sync.update(named, 6)
        assert sync.metrics()["sync/rung"] == 1 and engine.weight_version == 6
        check_weights(named, engine.named_weights())
    finally:
        sync.close()
        engine._in_place.close()
