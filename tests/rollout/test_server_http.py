"""`miles serve` over real HTTP: one uvicorn process on a free loopback port for the whole module, driven raw
(httpx) and through the SGLang client."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch

from miles.protocols.engine import EngineError, GenerateRequest, SamplingParams
from miles.rollout.engine import EmbeddedEngine
from miles.rollout.launch import spawn_miles_servers
from miles.rollout.sglang_client import SGLangClient
from miles.sync.flat_bucket import StagingBuffers
from tests.conftest import tiny_run_cfg

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]  # procs: it starts processes or servers


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return tiny_run_cfg(
        tmp_path_factory.mktemp("serve"),
        "rollout.max_batch_size=64",
        "rollout.max_seq_len=48",
        "handoff.engine_host_mirror=true",
    )


@pytest.fixture(scope="module")
def server(cfg):
    (proc,) = spawn_miles_servers(cfg, 1, device="cpu")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    c = SGLangClient(server.url)
    yield c
    c.http.close()


def _reqs(n, max_new_tokens=6, temperature=1.0, prefix="r"):
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    return [GenerateRequest(rid=f"{prefix}{i}", input_ids=[1, 5 + i, 9, 2 + i], sampling=sp) for i in range(n)]


def test_seeded_generate_over_http_matches_the_in_process_engine(cfg, client):
    local = EmbeddedEngine.from_config(cfg, "cpu")
    reqs = _reqs(5)
    want = local.generate(reqs, seed=11)
    got = client.generate(reqs, seed=11)
    assert [o.output_ids for o in got] == [o.output_ids for o in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(
            torch.tensor(g.output_log_probs), torch.tensor(w.output_log_probs), atol=1e-6, rtol=0
        )
        assert (g.rid, g.finish_reason, g.weight_version) == (w.rid, w.finish_reason, 0)


def test_generate_answers_in_sglang_fields(server):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "return_logprob": True}
    one = httpx.post(server.url + "/generate", json=body).json()
    meta = one["meta_info"]
    assert len(one["output_ids"]) == 4 and meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 4
    assert [t for _, t, _ in meta["output_token_logprobs"]] == one["output_ids"]
    assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"])
    ids = one["output_ids"]
    stop = ids[-1]  # greedy: the same tokens again, now stopping at the first occurrence of the last one
    batch = httpx.post(
        server.url + "/generate",
        json={
            **body,
            "input_ids": [[1, 2, 3], [4, 5]],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "stop_token_ids": [stop]},
        },
    ).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert batch[0]["output_ids"] == ids[: ids.index(stop) + 1]


def test_release_and_resume_by_tag_frees_and_restores_the_tagged_bytes(client):
    before = client.memory()["tags"]
    weights = client.named_weights()
    assert before["kv_cache"]["resident_bytes"] > 0 and before["weights"]["resident_bytes"] > 0
    assert client.offload(["kv_cache"]) == before["kv_cache"]["resident_bytes"]  # storages resized to 0 bytes
    mid = client.memory()["tags"]
    assert mid["kv_cache"] == {"resident_bytes": 0, "paused": True}
    assert mid["weights"]["resident_bytes"] == before["weights"]["resident_bytes"]
    assert client.offload(["weights"]) == before["weights"]["resident_bytes"]
    assert client.memory()["tags"]["weights"]["resident_bytes"] == 0
    with pytest.raises(EngineError, match="released"):
        client.generate(_reqs(1))
    assert (
        client.onload(["weights", "kv_cache"])
        == before["weights"]["resident_bytes"] + before["kv_cache"]["resident_bytes"]
    )
    assert client.memory()["tags"] == before
    after = client.named_weights()
    assert all(torch.equal(after[k], v) for k, v in weights.items())  # host mirror: restored bit for bit
    assert client.generate(_reqs(2))[0].finish_reason in ("length", "stop")


def test_weight_update_then_generate_reflects_the_new_weights(cfg, client):
    other = EmbeddedEngine.from_config(cfg.__class__.from_dict({**cfg.to_dict(), "seed": 1}), "cpu")
    original = client.named_weights()
    reqs = _reqs(3, temperature=0)
    before = client.generate(reqs)
    client.update_weights_from_tensor(other.named_weights().items(), version=7)
    got, want = client.generate(reqs), other.generate(reqs)
    assert [o.output_ids for o in got] == [o.output_ids for o in want] != [o.output_ids for o in before]
    assert {o.weight_version for o in got} == {7} and client.weight_version == 7
    staging = StagingBuffers("cpu")  # the colocated path: a shared-memory bucket handle, no bytes in the body
    try:
        client.update_weights_from_bucket(staging.pack(0, list(original.items())), None)
        client.set_weight_version(8)
    finally:
        staging.close()
    assert [o.output_ids for o in client.generate(reqs)] == [o.output_ids for o in before]
    assert client.weight_version == 8 and all(torch.equal(client.named_weights()[k], v) for k, v in original.items())


def _in_background(fn):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", fn()), daemon=True)
    t.start()
    return t, box


def _wait_load(client, running=None, waiting=None, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = client._get("/v1/loads").json()["loads"][0]
        if (running is None or load["num_running_reqs"] == running) and (
            waiting is None or load["num_waiting_reqs"] == waiting
        ):
            return
        time.sleep(0.02)
    raise AssertionError(f"load never reached running={running} waiting={waiting}: {load}")


def test_abort_reaches_in_flight_and_queued_requests(client):
    client.pause_generation("in_place")  # in-flight requests stop between decode steps
    try:
        t1, a = _in_background(lambda: client.generate(_reqs(2, max_new_tokens=30, prefix="long")))
        _wait_load(client, running=2)
        t2, b = _in_background(lambda: client.generate(_reqs(1, prefix="queued")))
        _wait_load(client, waiting=1)
        client.abort(["queued0"])
        t2.join(10)
        assert b["out"][0].finish_reason == "abort" and b["out"][0].output_ids == []
        client.abort(["long0"])
    finally:
        client.continue_generation()
    t1.join(20)
    first, second = a["out"]
    assert first.finish_reason == "abort" and 1 <= len(first.output_ids) < 30
    assert second.finish_reason == "length" and len(second.output_ids) == 30


def test_bad_input_is_a_4xx_with_a_clear_message_and_the_engine_keeps_serving(server, client):
    url = server.url
    cases = [
        (
            httpx.post(url + "/generate", content=b'{"input_ids": [1, 2', headers={"content-type": "application/json"}),
            "malformed JSON",
        ),
        (httpx.post(url + "/generate", json={"input_embeds": [[0.5]]}), "input_embeds is not supported"),
        (httpx.post(url + "/generate", json={"input_ids": [1, 10**9]}), "outside the vocabulary"),
        (
            httpx.post(url + "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": "many"}}),
            "max_new_tokens",
        ),
        (
            httpx.post(url + "/release_memory_occupation", json={"tags": ["kv_cache", "gpu_cache"]}),
            "unknown memory tag",
        ),
        (httpx.post(url + "/abort_request", json={"rid": ["a", "b"]}), "unhashable type: 'list'"),
        (
            httpx.post(url + "/update_weights_from_tensor", json={"serialized_named_tensors": ["not base64!"]}),
            "not base64",
        ),
    ]
    for r, text in cases:
        assert 400 <= r.status_code < 500 and text in r.json()["message"], (r.status_code, r.text)
    name, w = next(iter(client.named_weights().items()))
    with pytest.raises(EngineError, match=r"got torch.float32 \(3, 3\), the engine holds"):
        client.update_weights_from_tensor([(name, torch.zeros(3, 3))], version=99)
    with pytest.raises(EngineError, match="not a parameter"):
        client.update_weights_from_tensor([("model.nope.weight", torch.zeros(1))])
    assert client.weight_version != 99 and torch.equal(client.named_weights()[name], w)  # nothing was written
    assert client.memory()["tags"]["kv_cache"]["paused"] is False
    assert httpx.get(url + "/health_generate").status_code == 200
    assert len(client.generate(_reqs(2))) == 2


def test_two_hundred_concurrent_requests_share_a_few_batches(client):
    start = client._get("/server_info").json()["miles"]["batcher"]["batches"]

    async def fire():
        outs = await asyncio.gather(
            *(client.agenerate(_reqs(1, max_new_tokens=4, prefix=f"c{i}-")) for i in range(200))
        )
        await client.aclose()
        return outs

    outs = asyncio.run(fire())
    assert sorted(o[0].rid for o in outs) == sorted(f"c{i}-0" for i in range(200))
    assert all(len(o[0].output_ids) == 4 for o in outs)
    assert (
        client._get("/server_info").json()["miles"]["batcher"]["batches"] - start < 50
    )  # batched, not one forward pass per request


def test_an_aborted_weight_update_leaves_the_served_weights_and_version_alone(cfg, client):
    from miles.sync.buckets import WeightManifest, fused_group

    original, version = client.named_weights(), client.weight_version
    named = [(k, v + 1.0) for k, v in original.items()]
    staging = StagingBuffers("cpu")
    try:
        client.begin_weight_update(WeightManifest.of(named, fused_group, "shadow"))
        client.update_weights_from_bucket(staging.pack(0, named), None)  # lands in the open update only
        client.abort_weight_update()
        assert client.weight_version == version
        assert all(torch.equal(client.named_weights()[k], v) for k, v in original.items())
        client.begin_weight_update(WeightManifest.of(named, fused_group, "shadow"))
        client.update_weights_from_bucket(staging.pack(0, named), None)
        client.set_weight_version(version + 1)  # commits
        assert all(torch.equal(client.named_weights()[k], v) for k, v in named)
        client.update_weights_from_tensor(original.items(), version)
    finally:
        staging.close()


def test_update_weights_from_distributed_lands_a_broadcast_from_rank_0(client):
    from miles.rollout.launch import free_port
    from miles.sync.buckets import Piece, WeightManifest, fused_group, layout
    from miles.sync.weight_group import broadcast, make_group

    original, version = client.named_weights(), client.weight_version
    named = [(k, v * 0.5) for k, v in original.items()]
    port = free_port()
    t, _ = _in_background(lambda: client.init_weights_update_group("127.0.0.1", port, 1, 2, "serve-test", "gloo"))
    pg = make_group("127.0.0.1", port, 0, 2, "serve-test", "gloo", 60.0)
    t.join(60)
    pieces = [Piece(n, w, 0, w.numel() * w.element_size()) for n, w in named]
    metas, total = layout(pieces)
    flat = torch.zeros(total, dtype=torch.uint8)
    for p, m in zip(pieces, metas):
        flat[m.offset : m.offset + m.nbytes].copy_(p.source_bytes())
    client.begin_weight_update(WeightManifest.of(named, fused_group, "shadow"))  # pieces land in an open update
    t, _ = _in_background(
        lambda: client.update_weights_from_distributed(
            [n for n, _ in named],
            [str(w.dtype).removeprefix("torch.") for _, w in named],
            [list(w.shape) for _, w in named],
            "serve-test",
            version=41,
            load_format="miles_flat",  # the aligned flat bucket built above (SGLang's default is one per tensor)
        )
    )
    broadcast(pg, flat)
    t.join(60)
    assert client.weight_version == 41 and all(torch.equal(client.named_weights()[k], v) for k, v in named)
    client.destroy_weights_update_group("serve-test")
    client.update_weights_from_tensor(original.items(), version)
