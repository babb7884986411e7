"""WeightReceiver: the batched whole-tensor path lands exactly what the per-piece path lands."""

from __future__ import annotations

import pytest
import torch

from miles.sync.buckets import PieceMeta, WeightManifest, byte_view, fused_group
from miles.sync.receiver import ReceiveError, WeightReceiver

NAMES = [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.norm.weight",
]


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 16), (4, 16), (4, 16), (16, 24), (16,)]
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in zip(NAMES, shapes)}


def _receiver(weights: dict[str, torch.Tensor]) -> WeightReceiver:
    return WeightReceiver(lambda name: weights[name])


@pytest.mark.parametrize("staging", ["direct", "shadow"])
def test_receive_whole_lands_the_same_bytes_as_per_piece_receive(staging):
    new = _weights(1)
    manifest = WeightManifest.of(list(new.items()), fused_group, staging)
    fast, naive = _weights(0), _weights(0)
    r = _receiver(fast)
    r.begin(manifest)
    r.receive_whole(list(new.items()))
    assert r.commit()
    r = _receiver(naive)
    r.begin(manifest)
    r.receive([(PieceMeta(n, 0, t.numel() * t.element_size()), byte_view(t)) for n, t in new.items()])
    assert r.commit()
    for n in NAMES:
        assert torch.equal(fast[n], new[n]) and torch.equal(naive[n], new[n])


def test_receive_whole_with_part_of_a_direct_update_waits_for_the_rest_of_a_fused_group():
    new, held = _weights(1), _weights(0)
    before = {n: t.clone() for n, t in held.items()}
    r = _receiver(held)
    r.begin(WeightManifest.of(list(new.items()), fused_group, "direct"))
    r.receive_whole([(n, new[n]) for n in NAMES[:2]])  # q and k: the qkv group still lacks v
    assert torch.equal(held[NAMES[0]], before[NAMES[0]])
    r.receive_whole([(n, new[n]) for n in NAMES[2:]])
    assert r.commit() and all(torch.equal(held[n], new[n]) for n in NAMES)


def test_receive_whole_refuses_a_tensor_of_the_wrong_size_before_writing_anything():
    new, held = _weights(1), _weights(0)
    before = {n: t.clone() for n, t in held.items()}
    r = _receiver(held)
    r.begin(WeightManifest.of(list(new.items()), fused_group, "direct"))
    bad = list(new.items())
    bad[-1] = (NAMES[-1], torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(ReceiveError, match="16 bytes for a tensor of 32 bytes"):
        r.receive_whole(bad)
    r.abort()
    assert all(torch.equal(held[n], before[n]) for n in NAMES)
