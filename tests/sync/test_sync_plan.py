"""Bucket planning, fused groups and the engine-side transaction, in one process (milliseconds)."""

from __future__ import annotations

import logging

import pytest
import torch

from miles.config import SyncConfig
from miles.model.decoder import build_decoder
from miles.rollout.engine import EmbeddedEngine
from miles.sync import SyncError
from miles.sync.buckets import ALIGN, PieceMeta, WeightManifest, aligned, byte_view, fused_group, plan_buckets
from miles.sync.check import WeightMismatch, check_weights, weights_differ
from miles.sync.receiver import ReceiveError
from miles.sync.tensor import TensorSync


def _named(cfg, seed):
    return list(build_decoder(cfg, seed=seed, device="cpu").hf_state_dict().items())


def _covered(buckets) -> dict[str, int]:
    got: dict[str, int] = {}
    for b in buckets:
        for p in b:
            got[p.name] = got.get(p.name, 0) + p.nbytes
    return got


def test_fused_group_maps_trainer_shards_to_the_engine_parameter_they_form():
    assert fused_group("model.layers.3.self_attn.k_proj.weight") == "model.layers.3.self_attn.qkv_proj.weight"
    assert fused_group("model.layers.3.self_attn.v_proj.bias") == "model.layers.3.self_attn.qkv_proj.bias"
    assert fused_group("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.gate_up_proj.weight"
    assert fused_group("model.layers.1.mlp.experts.7.up_proj.weight") == "model.layers.1.mlp.experts.w13"
    assert fused_group("model.layers.1.mlp.experts.2.down_proj.weight") == "model.layers.1.mlp.experts.w2"
    assert fused_group("model.layers.0.self_attn.o_proj.weight") == "model.layers.0.self_attn.o_proj.weight"


def test_buckets_stay_under_the_limit_and_never_split_a_group(tiny_model_cfg):
    named = _named(tiny_model_cfg, 0)
    limit = 20_000
    buckets = list(plan_buckets(named, limit))
    where: dict[str, int] = {}
    for i, b in enumerate(buckets):
        assert sum(aligned(p.nbytes) for p in b) <= limit or len({fused_group(p.name) for p in b}) == 1
        for p in b:
            assert p.start == 0 and p.nbytes == p.tensor.numel() * p.tensor.element_size()
            assert where.setdefault(fused_group(p.name), i) == i
    assert _covered(buckets) == {n: t.numel() * t.element_size() for n, t in named}


def test_experts_of_a_layer_travel_together_even_when_interleaved():
    named = [
        (f"model.layers.0.mlp.experts.{e}.{w}_proj.weight", torch.zeros(8, 8))
        for e in range(4)
        for w in ("gate", "up", "down")
    ]
    buckets = list(plan_buckets(named, 4 * 2 * aligned(256)))
    assert [sorted({fused_group(p.name) for p in b}) for b in buckets] == [
        ["model.layers.0.mlp.experts.w13"],
        ["model.layers.0.mlp.experts.w2"],
    ]


def test_a_group_larger_than_the_bucket_grows_it_with_one_warning(tiny_model_cfg, caplog):
    named = _named(tiny_model_cfg, 0)
    embed = named[0][1].numel() * 4
    with caplog.at_level(logging.WARNING, logger="miles.sync.buckets"):
        buckets = list(plan_buckets(named, 4096))
        list(plan_buckets(named, 4096))
    big = [b for b in buckets if b[0].name == "model.embed_tokens.weight"]
    assert len(big) == 1 and len(big[0]) == 1 and big[0][0].nbytes == embed > 4096
    assert sum("model.embed_tokens.weight" in r.getMessage() for r in caplog.records) <= 1


def test_split_mode_cuts_a_large_group_into_aligned_pieces_that_cover_every_byte(tiny_model_cfg):
    named = _named(tiny_model_cfg, 0)
    buckets = list(plan_buckets(named, 4096, split=True))
    assert all(sum(aligned(p.nbytes) for p in b) <= 4096 for b in buckets)
    assert _covered(buckets) == {n: t.numel() * t.element_size() for n, t in named}
    assert all(p.start % ALIGN == 0 for b in buckets for p in b)
    qkv = [
        i for i, b in enumerate(buckets) for p in b if fused_group(p.name) == "model.layers.0.self_attn.qkv_proj.weight"
    ]
    assert len(set(qkv)) > 1  # this fused parameter really is cut across rounds


def _engine(cfg):
    return EmbeddedEngine(cfg, max_batch_size=2, max_seq_len=16)


def test_direct_staging_applies_a_fused_group_only_when_all_its_shards_arrived(tiny_model_cfg):
    engine = _engine(tiny_model_cfg)
    new = dict(_named(tiny_model_cfg, 7))
    group = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
    ]
    before = {n: engine.named_weights()[n].clone() for n in group}
    engine.begin_weight_update(WeightManifest.of([(n, new[n]) for n in group], fused_group, "direct"))
    r = engine.weight_receiver()
    q = byte_view(new[group[0]])
    r.receive([(PieceMeta(group[0], 0, q.numel()), q), (PieceMeta(group[1], 0, 1024), byte_view(new[group[1]])[:1024])])
    assert weights_differ(before, engine.named_weights()) == []  # nothing written: k and v are incomplete
    r.receive(
        [
            (PieceMeta(group[1], 0, 1024, start=1024), byte_view(new[group[1]])[1024:]),
            (PieceMeta(group[2], 0, 2048), byte_view(new[group[2]])),
        ]
    )
    engine.set_weight_version(5)
    check_weights({n: new[n] for n in group}, engine.named_weights())
    assert engine.weight_version == 5


def test_a_manifest_that_does_not_fit_the_engine_is_rejected_before_any_byte_moves(tiny_model_cfg):
    engine = _engine(tiny_model_cfg)
    bad = [("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3)), ("model.not_a_weight", torch.zeros(2))]
    with pytest.raises(ReceiveError, match="rejected before any byte moved.*q_proj"):
        engine.begin_weight_update(WeightManifest.of(bad, fused_group, "shadow"))
    assert not engine.weight_receiver().is_open


def test_tensor_sync_matches_reference_per_tensor_update(tiny_model_cfg):
    new = _named(tiny_model_cfg, 3)
    reference, bucketed = _engine(tiny_model_cfg), _engine(tiny_model_cfg)
    reference.update_weights_from_tensor(new, version=1)
    sync = TensorSync(SyncConfig(update_weight_buffer_size=8192), "cpu")
    sync.connect([bucketed])
    sync.update(new, version=1)
    check_weights(reference.named_weights(), bucketed.named_weights())
    assert sync.metrics()["sync/buckets"] > 2 and bucketed.weight_version == 1
    sync.close()


@pytest.mark.parametrize("staging", ["shadow", "direct"])
def test_a_failure_mid_sync_with_shadow_staging_keeps_the_previous_weights(tiny_model_cfg, staging):
    engine = _engine(tiny_model_cfg)
    old = {k: v.clone() for k, v in engine.named_weights().items()}
    sync = TensorSync(SyncConfig(update_weight_buffer_size=4096, engine_staging=staging), "cpu")
    sync.connect([engine])
    new = _named(tiny_model_cfg, 11)
    # bucket 5 holds a weight whose storage is gone (a meta tensor): packing it fails after buckets 0-4 went out
    new_bad = new[:10] + [(new[10][0], torch.empty_like(new[10][1], device="meta"))] + new[11:]
    with pytest.raises(SyncError, match="keep serving their previous version"):
        sync.update(new_bad, version=4)
    assert engine.weight_version == 0 and not engine.weight_receiver().is_open
    assert not engine.loop.paused  # generation was continued
    if staging == "shadow":
        check_weights(old, engine.named_weights())
    else:
        with pytest.raises(WeightMismatch):  # direct staging trades this guarantee for memory: documented
            check_weights(old, engine.named_weights())
    sync.update(new, version=5)
    check_weights(new, engine.named_weights())
    assert engine.weight_version == 5
    sync.close()
