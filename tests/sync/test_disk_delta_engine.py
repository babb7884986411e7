"""End to end with the real embedded engine: a bf16 decoder trained with AdamW, its weights synced through
disk deltas against the HF checkpoint the engine loaded, engine bit-equal to trainer after every sync."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from miles.model.checkpoint import save_hf
from miles.model.config import ModelConfig
from miles.model.decoder import build_decoder
from miles.protocols.engine import GenerateRequest
from miles.rollout.engine import EmbeddedEngine
from miles.sync.disk_delta.transport import DiskDeltaConfig, DiskDeltaSync
from miles.sync.disk_delta.version import published_versions

TINY = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
    dtype="bfloat16",
)


def _adamw_step(model, optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY.vocab_size, (4, 12), generator=g)
    logits = model(ids[:, :-1]).float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, TINY.vocab_size), ids[:, 1:].reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


@pytest.mark.timeout(60)
def test_embedded_engine_matches_trainer_after_each_disk_delta_sync(tmp_path):
    trainer = build_decoder(TINY, seed=0)
    save_hf(trainer, tmp_path / "ckpt")
    engine = EmbeddedEngine(
        dataclasses.replace(TINY, checkpoint=str(tmp_path / "ckpt")), max_batch_size=2, max_seq_len=32
    )
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    sync = DiskDeltaSync(
        DiskDeltaConfig(root=str(tmp_path / "weights"), baseline=str(tmp_path / "ckpt"), check_weights=True)
    )
    sync.connect([engine])
    for version in (1, 2, 3):
        _adamw_step(trainer, optimizer, seed=version)
        sync.update(trainer.hf_state_dict().items(), version=version)  # check_weights raises on any difference
        engine_w = engine.named_weights()
        assert engine.weight_version == version
        assert all(torch.equal(engine_w[k], v) for k, v in trainer.hf_state_dict().items())
    assert published_versions(tmp_path / "weights")[-1] == 3
    assert sync.metrics()["disk_delta/wire_bytes"] < sync.metrics()["disk_delta/raw_bytes"]
    out = engine.generate([GenerateRequest(rid="0", input_ids=[1, 2, 3])])
    assert out[0].weight_version == 3


@pytest.mark.timeout(60)
def test_embedded_engine_rejects_a_checkpoint_in_another_dtype_before_any_version(tmp_path):
    trainer = build_decoder(TINY, seed=0)
    save_hf(build_decoder(dataclasses.replace(TINY, dtype="float16"), seed=0), tmp_path / "ckpt")  # fp16 on disk
    sync = DiskDeltaSync(DiskDeltaConfig(root=str(tmp_path / "weights"), baseline=str(tmp_path / "ckpt")))
    with pytest.raises(ValueError, match=r"has F16\[64, 32\] \(4096 bytes\), the trainer has BF16\[64, 32\]"):
        sync.update(trainer.hf_state_dict().items(), version=1)
    assert published_versions(tmp_path / "weights") == []
