"""The router over three real `miles serve` processes: least-loaded spreading, a killed engine marked dead while
the run goes on, and recovery (restart + weight push + the fleet's memory state)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles.protocols.engine import GenerateRequest, SamplingParams
from miles.rollout.launch import spawn_miles_servers
from miles.rollout.router import NoEngineAlive, Router
from miles.rollout.sglang_client import SGLangClient
from tests.conftest import tiny_run_cfg

pytestmark = [pytest.mark.procs, pytest.mark.timeout(180)]  # procs: it starts processes or servers


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    cfg = tiny_run_cfg(tmp_path_factory.mktemp("router"), "rollout.max_batch_size=32", "rollout.max_seq_len=32")
    procs = spawn_miles_servers(cfg, 3, device="cpu")
    router = Router([SGLangClient(p.url) for p in procs], restart=lambda i: procs[i].restart(), max_failures=2)
    yield router, procs
    router.close()


def _reqs(n, step=0):
    sp = SamplingParams(max_new_tokens=4, temperature=1.0)
    return [GenerateRequest(rid=f"s{step}-{i}", input_ids=[1, 3 + i % 7, 2], sampling=sp) for i in range(n)]


def _served(router):
    return [c._get("/server_info").json()["miles"]["batcher"]["requests"] for c in router.clients]


def test_concurrent_requests_spread_over_every_engine(fleet):
    router, _ = fleet
    before = _served(router)

    async def fire():
        outs = await asyncio.gather(*(router.agenerate(_reqs(1, step=100 + i)) for i in range(30)))
        await router.aclose()
        return outs

    outs = asyncio.run(fire())
    assert len(outs) == 30 and all(len(o[0].output_ids) == 4 for o in outs)
    gained = [a - b for a, b in zip(_served(router), before)]
    assert sum(gained) == 30 and min(gained) >= 5, gained


def _sync(router, step):
    """What a weight sync does through the router: buckets without a version, then the version."""
    named = {k: v + 0.01 for k, v in router.named_weights().items()}
    router.pause_generation("in_place")
    router.update_weights_from_tensor(named.items(), None)
    router.set_weight_version(step + 1)
    router.continue_generation()
    return named


def test_a_killed_engine_is_marked_dead_the_run_goes_on_and_recovery_restores_it(fleet):
    router, procs = fleet
    for step in range(6):
        if step == 2:
            procs[1].kill()  # a crash: no goodbye
        outs = router.generate(_reqs(12, step), seed=step)
        assert [o.rid for o in outs] == [f"s{step}-{i}" for i in range(12)]
        assert all(o.finish_reason == "length" and o.weight_version == step for o in outs)
        if step == 3:  # recovery while the fleet's kv cache is released (as during a train step)
            assert router.alive == [True, False, True]
            router.offload(["kv_cache"])
            router.check_health()
            assert router.alive == [True, True, True]
            assert router.clients[1].memory()["tags"]["kv_cache"]["paused"] is True
            router.onload(["kv_cache"])
        weights = _sync(router, step)
    assert [kind for _, kind, i in router.events if i == 1] == ["dead", "recovered"]
    for c in router.clients:
        got = c.named_weights()
        assert c.weight_version == 6 and all(torch.equal(got[k], v) for k, v in weights.items())
    before = _served(router)
    router.generate(_reqs(12, 99))
    assert all(a > b for a, b in zip(_served(router), before))  # the recovered engine takes traffic again


def test_bad_input_is_not_an_engine_failure(fleet):
    router, _ = fleet
    from miles.protocols.engine import EngineError

    with pytest.raises(EngineError, match="outside the vocabulary"):
        router.generate([GenerateRequest(rid="bad", input_ids=[10**9])])
    assert router.alive == [True, True, True] and router.failures == [0, 0, 0]


def test_no_live_engine_is_a_clear_error():
    router = Router([SGLangClient.__new__(SGLangClient)])
    router.alive = [False]
    with pytest.raises(NoEngineAlive, match="dead: \\[0\\]"):
        router.generate(_reqs(1))
