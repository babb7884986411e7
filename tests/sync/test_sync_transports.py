"""Every transport moves a real model from a TrainActor into a RolloutManager's engine, each in its own Ray actor
process; check_weights is bit-equal; a failure mid-sync leaves the engine on its previous version."""

from __future__ import annotations

import sys

import pytest
import torch

from miles.sync.buckets import fused_group, plan_buckets
from miles.sync.check import check_weights, weights_differ
from tests.conftest import in_place_versions, tiny_model, tiny_run_cfg

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)

BUCKET = 4096  # bytes: smaller than most tensors of the tiny model, so rdt goes in many rounds
TRANSPORTS = ["tensor", "tensor:in_place", "tensor:in_place:doorbell", "broadcast", "rdt", "rdt:in_place"]
# transport[:sync.source[:doorbell]] (the doorbell is CUDA's default; forced on here)


@pytest.fixture(scope="module")
def actors(ray_session, tmp_path_factory):
    import ray
    from ray import cloudpickle

    from miles.rollout.manager import RolloutManager
    from miles.sources import make_sources
    from miles.sync.rdt import actor_options
    from miles.train.actor import TrainActor

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the helpers below run inside the actors
    cfg = tiny_run_cfg(tmp_path_factory.mktemp("sync"), f"sync.update_weight_buffer_size={BUCKET}", "device=cpu")
    trainer = ray.remote(TrainActor).options(num_cpus=0, **actor_options(gpus_per_engine=1)).remote(cfg, 0, 1)
    engine = (
        ray.remote(RolloutManager)
        .options(num_cpus=0, enable_tensor_transport=True, max_concurrency=4)
        .remote(cfg, "cpu", sources=make_sources)
    )
    ray.get([trainer.build.remote(), engine.weight_versions.remote()])  # the model, as the plan's trainer.build
    yield ray, trainer, engine
    ray.get(trainer.__ray_call__.remote(_close_all))
    for a in (trainer, engine):
        ray.kill(a)


# ---- run inside the TrainActor (through __ray_call__) --------------------------------------------------------
def _use(actor, transport: str, engines) -> None:
    """Make ``transport`` the actor's sync (one per transport for the module: an rdt group is created once)."""
    from dataclasses import replace

    from miles.sync import make_sync

    syncs = actor.__dict__.setdefault("_syncs", {})
    if transport not in syncs:
        name, source, bell = (transport.split(":") + ["", ""])[:3]
        cfg = replace(
            actor.cfg,
            sync=replace(
                actor.cfg.sync,
                transport=name,
                source=source or "bucket",
                rdt_transport="gloo" if name == "rdt" else "auto",
            ),
            handoff=replace(actor.cfg.handoff, offload_train="none" if source else actor.cfg.handoff.offload_train),
        )
        syncs[transport] = make_sync(cfg, "cpu", is_source=True)
        if bell:
            syncs[transport].doorbell = True
        syncs[transport].connect(engines)
    actor.sync = syncs[transport]


def _perturb(actor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in actor.backend.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.01)


def _update_with_a_lost_weight(actor, version: int, index: int) -> str:
    """A weight whose storage is gone (a meta tensor) at ``index``: the sync fails after earlier buckets went out."""
    named = list(actor.backend.named_weights())
    named[index] = (named[index][0], torch.empty_like(named[index][1], device="meta"))
    try:
        actor.sync.update(named, version)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return f"{type(e).__name__}: {e}"
    return ""


def _close_all(actor) -> None:
    for s in actor.__dict__.get("_syncs", {}).values():
        s.close()


def _connect_rdt_in_place(actor, engines, timeout_s: float) -> str:
    from miles.config import SyncConfig
    from miles.sync.rdt import RDTSync

    try:
        RDTSync(SyncConfig(transport="rdt"), "cpu", timeout_s=timeout_s).connect(engines)
    except RuntimeError as e:
        return str(e)
    return ""


# ---- tests ------------------------------------------------------------------------------------------------
def test_a_rollout_manager_actor_handle_shows_the_capabilities_of_the_class_and_every_fanned_out_call(actors):
    from miles.protocols import engine as api
    from miles.rollout.manager import RolloutManager

    _, _, engine = actors
    caps = [api.Transactional, api.TwoCallUpdate, api.ReceivesBroadcast, api.ReceivesRDT, api.ReceivesInPlace]
    assert [api.supports(engine, c) for c in caps] == [api.supports(RolloutManager, c) for c in caps] == [True] * 5
    assert not api.supports(engine, api.ReceivesInProcess)  # a handle: its engines' receivers stay in the actor
    assert api.supports(engine, api.Pausable) and api.supports(engine, api.EngineMemory)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_transport_syncs_a_real_model_into_a_real_engine_in_another_process_bit_equal(actors, transport):
    ray, trainer, engine = actors
    version = 10 + TRANSPORTS.index(transport)
    ray.get(trainer.__ray_call__.remote(_use, transport, [engine]))
    before = ray.get(engine.named_weights.remote())
    ray.get(trainer.__ray_call__.remote(_perturb, version))
    metrics = ray.get(trainer.update_weights.remote(version))
    new = ray.get(trainer.named_weights.remote())
    after = ray.get(engine.named_weights.remote())
    check_weights(new, after)
    assert len(weights_differ(new, before)) == len(new)  # every tensor really moved
    assert ray.get(engine.weight_versions.remote()) == [version]
    assert metrics["sync/bytes"] == sum(t.numel() * t.element_size() for t in new.values())


def test_rdt_sends_a_set_larger_than_its_bucket_in_rounds_and_a_split_fused_parameter_arrives_whole(actors):
    ray, trainer, engine = actors
    ray.get(trainer.__ray_call__.remote(_use, "rdt", [engine]))
    ray.get(trainer.__ray_call__.remote(_perturb, 99))
    metrics = ray.get(trainer.update_weights.remote(20))
    new = ray.get(trainer.named_weights.remote())
    rounds = list(plan_buckets(new.items(), BUCKET, split=True))
    total = sum(t.numel() * t.element_size() for t in new.values())
    assert metrics["sync/buckets"] == len(rounds) >= total // BUCKET
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    members = {p.name for r in rounds for p in r if fused_group(p.name) == qkv}
    assert len({i for i, r in enumerate(rounds) for p in r if p.name in members}) > 1  # cut across rounds
    check_weights({n: new[n] for n in members}, ray.get(engine.named_weights.remote()))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_transport_failure_mid_sync_leaves_the_engine_serving_its_previous_version(actors, transport):
    ray, trainer, engine = actors
    ray.get(trainer.__ray_call__.remote(_use, transport, [engine]))
    ray.get(trainer.update_weights.remote(30))
    served = ray.get(engine.named_weights.remote())
    ray.get(trainer.__ray_call__.remote(_perturb, 31))
    err = ray.get(trainer.__ray_call__.remote(_update_with_a_lost_weight, 31, 20))
    assert "SyncError" in err and "keep serving their previous version" in err
    assert ray.get(engine.weight_versions.remote()) == [30]
    check_weights(served, ray.get(engine.named_weights.remote()))
    batches, _ = ray.get(engine.generate.remote(0))  # generation was continued
    assert batches
    ray.get(trainer.update_weights.remote(32))  # and the next sync goes through
    check_weights(ray.get(trainer.named_weights.remote()), ray.get(engine.named_weights.remote()))


def _move_a_storage(actor) -> None:
    """What a trainer that reallocates a weight does: the same parameter, its bytes somewhere new."""
    p = next(actor.backend.model.parameters())
    p.data = p.data.clone()


def test_in_place_opens_handles_once_and_again_only_after_a_trainer_storage_moves(actors):
    ray, trainer, engine = actors
    ray.get(trainer.__ray_call__.remote(_use, "tensor:in_place", [engine]))
    exports = []
    for version, move in [(40, False), (41, False), (42, True), (43, False)]:
        if move:
            ray.get(trainer.__ray_call__.remote(_move_a_storage))
        ray.get(trainer.__ray_call__.remote(_perturb, version))
        exports.append(ray.get(trainer.update_weights.remote(version))["sync/exports"])
        check_weights(ray.get(trainer.named_weights.remote()), ray.get(engine.named_weights.remote()))
    assert [e - exports[0] for e in exports] == [0, 0, 1, 1]
    assert ray.get(engine.weight_versions.remote()) == [43]


def test_an_engine_asked_for_handles_it_never_opened_refuses_instead_of_reading_stale_memory():
    from miles.sync.buckets import WeightManifest
    from miles.sync.in_place import OpenedWeights, SharedWeights
    from miles.sync.receiver import ReceiveError

    with pytest.raises(ReceiveError, match="the trainer must send the handles again"):
        OpenedWeights().get(SharedWeights("abc", WeightManifest(()), None))


@pytest.mark.parametrize(
    "options",
    [dict(enable_tensor_transport=True, max_concurrency=1), dict(enable_tensor_transport=False, max_concurrency=1)],
    ids=["one-slot", "plain"],
)
def test_rdt_on_a_trainer_actor_ray_would_starve_fails_fast_instead_of_hanging(actors, options):
    ray, _, engine = actors

    class Bare:
        def ready(self):
            return True

    bare = ray.remote(Bare).options(num_cpus=0, **options).remote()
    err = ray.get(bare.__ray_call__.remote(_connect_rdt_in_place, [engine], 2.0))
    ray.kill(bare)
    assert "max_concurrency >= 1 + gpus_per_engine" in err


def test_a_doorbell_rung_in_another_process_syncs_bit_equal_and_a_dead_engine_fails_the_sync_instead_of_hanging(
    ray_session,
):
    """This process is the trainer; an embedded engine in a Ray actor opens its doorbell at the first (called)
    update and is rung for the rest. Killing the engine process turns the next update into a SyncError at once."""
    import time

    from miles.config import SyncConfig
    from miles.model.decoder import build_decoder
    from miles.rollout.engine import EmbeddedEngine
    from miles.sync import SyncError
    from miles.sync.in_place import InPlaceSync

    ray = ray_session
    cfg = tiny_model(max_position_embeddings=32)
    named = [
        (n, t.detach().clone())
        for n, t in build_decoder(cfg, seed=5).hf_state_dict().items()
        if n != "lm_head.weight" or not cfg.tie_word_embeddings
    ]
    engine = ray.remote(EmbeddedEngine).options(num_cpus=0).remote(cfg, max_batch_size=1, max_seq_len=8)
    sync = InPlaceSync(SyncConfig(source="in_place", engine_staging="direct"), "cpu", doorbell=True, timeout_s=60)
    sync.connect([engine])
    try:
        rung = in_place_versions(sync, named, (1, 2, 3), lambda: ray.get(engine.named_weights.remote()))
        assert rung == [0, 1, 1]
        assert ray.get(engine.__ray_call__.remote(lambda e: e.weight_version)) == 3
        ray.kill(engine)
        time.sleep(0.5)
        t0 = time.perf_counter()
        with pytest.raises(SyncError, match="did the engine process die"):
            sync.update(named, 4)
        assert time.perf_counter() - t0 < 10
    finally:
        sync.close()
