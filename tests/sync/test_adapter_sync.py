"""LoRA: every transport moves only the adapters, from a TrainActor into a RolloutManager's engine in another Ray
actor process. The bytes a sync reports are the adapters' bytes, the engine's adapters equal the trainer's bit for
bit, and its base (built from the same config, never sent) equals the trainer's frozen base throughout."""

from __future__ import annotations

import sys

import pytest
import torch

from miles.sync.check import check_weights, weights_differ
from tests.conftest import tiny_run_cfg

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)

# disk-delta first: rdt over gloo makes a Ray collective group, which initialises torch.distributed's default group
# in the trainer process, and disk-delta would then gather over that world (a run uses one transport)
TRANSPORTS = ["disk-delta", "tensor", "tensor:in_place", "broadcast", "rdt", "rdt:in_place"]


@pytest.fixture(scope="module")
def actors(ray_session, tmp_path_factory):
    import ray
    from ray import cloudpickle

    from miles.rollout.manager import RolloutManager
    from miles.sources import make_sources
    from miles.sync.rdt import actor_options
    from miles.train.actor import TrainActor

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the helpers below run inside the actors
    cfg = tiny_run_cfg(
        tmp_path_factory.mktemp("adapter-sync"),
        "model.lora.rank=2",
        "sync.update_weight_buffer_size=2048",  # several buckets (rounds) even for the small adapters
        "device=cpu",
    )
    trainer = ray.remote(TrainActor).options(num_cpus=0, **actor_options(gpus_per_engine=1)).remote(cfg, 0, 1)
    engine = (
        ray.remote(RolloutManager)
        .options(num_cpus=0, enable_tensor_transport=True, max_concurrency=4)
        .remote(cfg, "cpu", sources=make_sources)
    )
    ray.get([trainer.build.remote(), engine.weight_versions.remote()])
    yield ray, trainer, engine
    ray.get(trainer.__ray_call__.remote(_close_all))
    for a in (trainer, engine):
        ray.kill(a)


# ---- run inside the TrainActor (through __ray_call__) --------------------------------------------------------
def _use(actor, transport: str, engines) -> None:
    from dataclasses import replace

    from miles.sync import make_sync

    syncs = actor.__dict__.setdefault("_syncs", {})
    if transport not in syncs:
        name, source = (transport.split(":") + [""])[:2]
        cfg = replace(
            actor.cfg,
            sync=replace(
                actor.cfg.sync,
                transport=name,
                source=source or "bucket",
                rdt_transport="gloo" if name == "rdt" else "auto",
            ),
            handoff=replace(
                actor.cfg.handoff,
                offload_train="none" if source else actor.cfg.handoff.offload_train,
                engine_host_mirror=name == "disk-delta",  # deltas need the released adapters back (a few KiB here)
            ),
        )
        syncs[transport] = make_sync(cfg, "cpu", is_source=True)
        syncs[transport].connect(engines)
    actor.sync = syncs[transport]


def _perturb_adapters(actor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in actor.backend.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.01)


def _base(actor) -> dict:
    from miles.model.lora import is_adapter

    return {n: t.clone() for n, t in actor.backend.model.hf_state_dict().items() if not is_adapter(n)}


def _close_all(actor) -> None:
    for s in actor.__dict__.get("_syncs", {}).values():
        getattr(s, "close", lambda: None)()  # disk-delta holds nothing to close


# ---- tests ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_transport_moves_only_the_adapters_and_the_engine_base_stays_the_trainers(actors, transport):
    ray, trainer, engine = actors
    version = 10 + TRANSPORTS.index(transport)
    ray.get(trainer.__ray_call__.remote(_use, transport, [engine]))
    if transport == "disk-delta":  # its first update writes the adapters' baseline, which the engine loads whole
        ray.get(trainer.update_weights.remote(version))
        version += 100
    before = ray.get(engine.named_weights.remote())
    ray.get(trainer.__ray_call__.remote(_perturb_adapters, version))
    metrics = ray.get(trainer.update_weights.remote(version))
    sent = ray.get(trainer.named_weights.remote())  # what the trainer syncs: its adapters
    after = ray.get(engine.named_weights.remote())
    assert sent and all(".lora_A." in n or ".lora_B." in n for n in sent)
    check_weights(sent, after)
    assert len(weights_differ(sent, before)) == len(sent)  # every adapter really moved
    base = ray.get(trainer.__ray_call__.remote(_base))
    check_weights(base, after)  # the base was never sent, and the engine's is the trainer's
    assert set(after) == set(base) | set(sent)
    adapter_bytes = sum(t.numel() * t.element_size() for t in sent.values())
    moved = metrics["disk_delta/raw_bytes"] if transport == "disk-delta" else metrics["sync/bytes"]
    assert moved == adapter_bytes < sum(t.numel() * t.element_size() for t in base.values()) / 10
    assert ray.get(engine.weight_versions.remote()) == [version]
