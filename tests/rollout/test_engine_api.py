"""The declared engine surface (miles.protocols.engine): which engine has which capability, and supports() as the one
check a transport makes at connect."""

import logging

import pytest

from miles.protocols import engine as api
from miles.rollout.engine import EmbeddedEngine
from miles.rollout.manager import RolloutManager
from miles.rollout.router import Router
from miles.rollout.sglang_client import SGLangClient
from miles.sync.tensor import TensorSync

CAPABILITIES = [
    api.Transactional,
    api.TwoCallUpdate,
    api.ReceivesBroadcast,
    api.ReceivesRDT,
    api.ReceivesInPlace,
    api.ReceivesInProcess,
]


@pytest.mark.parametrize("engine_cls", [EmbeddedEngine, SGLangClient, Router])
def test_every_engine_class_has_every_method_of_the_engine_protocol(engine_cls):
    assert api.supports(engine_cls, api.Engine)


def test_the_capabilities_of_each_engine_class_are_the_ones_its_transports_rely_on():
    has = {
        cls.__name__: {c.__name__ for c in CAPABILITIES if api.supports(cls, c)}
        for cls in (EmbeddedEngine, SGLangClient, Router, RolloutManager)
    }
    assert has["EmbeddedEngine"] == {c.__name__ for c in CAPABILITIES}
    assert has["SGLangClient"] == {"Transactional", "ReceivesBroadcast"}
    assert has["Router"] == {"Transactional", "ReceivesBroadcast"}  # every live server joins one group
    assert has["RolloutManager"] == has["EmbeddedEngine"] - {"ReceivesInProcess"}


def test_supports_agrees_with_isinstance_on_in_process_objects():
    class OnlyBegin:
        def begin_weight_update(self, manifest): ...

    class Both(OnlyBegin):
        def abort_weight_update(self): ...

    for obj in (OnlyBegin(), Both()):
        assert api.supports(obj, api.Transactional) == isinstance(obj, api.Transactional)
    assert not api.supports(OnlyBegin(), api.Transactional) and api.supports(Both(), api.Transactional)


def test_a_bucket_sync_warns_once_at_connect_about_an_engine_that_is_not_transactional(caplog, tmp_path):
    class Plain:  # can take buckets, but cannot roll a failed update back
        def update_weights_from_bucket(self, handle, version=None): ...

    from miles.config import SyncConfig

    sync = TensorSync(SyncConfig(), "cpu")
    with caplog.at_level(logging.WARNING):
        sync.connect([Plain()])
    assert "has no begin_weight_update" in caplog.text and sync._transactional == [False]


def test_the_rollout_manager_makes_each_engine_call_on_every_engine_in_order():
    calls = []

    class Recorder:
        def __init__(self, i):
            self.i = i

        def __getattr__(self, name):
            return lambda *a: calls.append((self.i, name, *a))

    manager = RolloutManager.__new__(RolloutManager)  # these calls need only .engines
    manager.engines = [Recorder(0), Recorder(1)]
    manager.pause_generation("retract")
    manager.flush_cache()
    manager.begin_weight_update("manifest")
    manager.update_weights_from_bucket("handle")
    manager.update_weights_from_disk("/w", 4)
    manager.set_weight_version(5)
    manager.abort_weight_update()
    manager.continue_generation()
    assert calls == [
        (0, "pause_generation", "retract"),
        (1, "pause_generation", "retract"),
        (0, "flush_cache"),
        (1, "flush_cache"),
        (0, "begin_weight_update", "manifest"),
        (1, "begin_weight_update", "manifest"),
        (0, "update_weights_from_bucket", "handle", None),
        (1, "update_weights_from_bucket", "handle", None),
        (0, "update_weights_from_disk", "/w", 4),
        (1, "update_weights_from_disk", "/w", 4),
        (0, "set_weight_version", 5),
        (1, "set_weight_version", 5),
        (0, "abort_weight_update"),
        (1, "abort_weight_update"),
        (0, "continue_generation"),
        (1, "continue_generation"),
    ]


@pytest.mark.parametrize("engine_cls", [EmbeddedEngine, SGLangClient, Router, RolloutManager])
def test_what_a_handoff_plan_moves_on_the_rollout_side_every_engine_and_the_manager_offer(engine_cls):
    assert api.supports(engine_cls, api.EngineMemory)


def test_both_trainer_groups_and_both_backends_offer_the_declared_trainer_surface():
    from miles.colocated import LocalTrainer
    from miles.protocols.trainer import TrainerBackend, TrainerGroup
    from miles.train.actor import TrainGroup
    from miles.train.torch_backend import TorchBackend

    assert api.supports(TrainGroup, TrainerGroup) and api.supports(LocalTrainer, TrainerGroup)
    assert api.supports(TorchBackend, TrainerBackend)  # MegatronBackend is a TorchBackend (GPU only to import)
    assert not api.supports(TorchBackend, TrainerGroup)  # a rank is not a group: its results are not per rank
