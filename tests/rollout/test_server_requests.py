"""`miles serve` under bad requests (review 2026-12-03, defects 5, 6, 16, 17): a poisoned /generate fails
alone, group joins to a dead address neither hang generation nor pile up, an engine with discarded weights says
so instead of serving NaNs, and bad values are a 4xx naming the field."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import socket
import threading
import time

import httpx
import pytest
import torch

from miles.rollout.launch import free_port
from miles.sync.disk_delta.transport import DiskDeltaConfig, DiskDeltaSync, save_baseline

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]  # procs: it starts processes or servers

GOOD = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
POISONS = {  # raw JSON: NaN and huge integers as a client can send them
    "temperature": b'{"input_ids":[5],"sampling_params":{"max_new_tokens":4,"temperature":NaN}}',
    "temperature ": b'{"input_ids":[5],"sampling_params":{"max_new_tokens":4,"temperature":1e-320}}',
    "temperature  ": b'{"input_ids":[5],"sampling_params":{"max_new_tokens":4,"temperature":Infinity}}',
    "top_p": b'{"input_ids":[5],"sampling_params":{"max_new_tokens":4,"top_p":1e-320}}',
    "stop_token_ids": b'{"input_ids":[5],"sampling_params":{"stop_token_ids":[1000000000000000000000000000000]}}',
    "max_new_tokens": b'{"input_ids":[5],"sampling_params":{"max_new_tokens":-1}}',
    "sampling_seed": b'{"input_ids":[5],"sampling_params":{"sampling_seed":100000000000000000000000}}',
    "input_ids[0]": b'{"input_ids":[9223372036854775808]}',
}


def test_one_poisoned_generate_call_gets_a_400_naming_the_field_and_the_calls_batched_with_it_succeed(serve):
    s = serve(batch_wait_ms=50)  # wide enough that the 13 concurrent calls share a batch

    async def round_with(poison: bytes):
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
            good = [c.post("/generate", json=GOOD) for _ in range(12)]
            bad = c.post("/generate", content=poison, headers={"Content-Type": "application/json"})
            return await asyncio.gather(bad, *good)

    for field, poison in POISONS.items():
        bad, *good = asyncio.run(round_with(poison))
        assert bad.status_code == 400 and field.strip() in bad.json()["message"], (field, bad.status_code, bad.text)
        assert [r.status_code for r in good] == [200] * 12, (field, {r.status_code for r in good}, good[0].text)


def test_a_group_join_to_a_dead_address_neither_blocks_generate_nor_lets_more_joins_queue(serve):
    s = serve(group_connect_timeout_s=4)
    dead = free_port()  # nothing listens there
    body = {"master_address": "127.0.0.1", "master_port": dead, "rank_offset": 1, "world_size": 2}
    answers: list = []

    def join(i):
        answers.append(
            httpx.post(s.url + "/init_weights_update_group", json={**body, "group_name": f"g{i}"}, timeout=60)
        )

    threads = [threading.Thread(target=join, args=(i,)) for i in range(8)]  # the review's eight
    for t in threads:
        t.start()
        time.sleep(0.05)
    deadline = time.monotonic() + 20
    while len(answers) < 7 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(r.status_code for r in answers[:7]) == [409] * 7, [(r.status_code, r.text) for r in answers]
    assert "still pending" in answers[0].json()["message"]
    health = httpx.get(s.url + "/health", timeout=5)
    assert health.status_code == 200 and health.json()["pending_group_join"]["address"] == f"127.0.0.1:{dead}"
    t0 = time.monotonic()
    assert httpx.post(s.url + "/generate", json=GOOD, timeout=30).status_code == 200
    assert time.monotonic() - t0 < 10  # not behind the join
    for t in threads:
        t.join(60)
    first = answers[-1]
    assert first.status_code == 400 and f"127.0.0.1:{dead} within 4 s" in first.json()["message"], first.text
    assert "pending_group_join" not in httpx.get(s.url + "/health").json()


def test_a_group_join_is_answered_within_its_stated_bound_even_from_an_address_that_never_answers(serve):
    s = serve(group_connect_timeout_s=3)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts and never speaks: torch's store client waits forever
    ports = {"dead": free_port(), "silent": silent.getsockname()[1]}
    try:
        for kind, port in ports.items():
            body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
            t0 = time.monotonic()
            r = httpx.post(s.url + "/init_weights_update_group", json={**body, "group_name": kind}, timeout=60)
            took = time.monotonic() - t0
            assert r.status_code == 400 and f"127.0.0.1:{port} within 3 s" in r.json()["message"], (kind, r.text)
            assert took < 3 * 1.5, f"{kind}: answered after {took:.1f} s; the bound is 3 s"  # was 2.5x, or never
            assert "pending_group_join" not in httpx.get(s.url + "/health").json()  # the next join is taken
    finally:
        silent.close()
    assert httpx.post(s.url + "/generate", json=GOOD, timeout=30).status_code == 200


def _weights(url: str) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(httpx.get(url + "/miles/weights").content), weights_only=True)


def test_an_engine_whose_discarded_weights_were_resumed_refuses_generate_with_409_until_every_tensor_is_synced(serve):
    from miles.rollout.sglang_client import SGLangClient

    s = serve()  # quickstart: weights_policy "discard"
    client = SGLangClient(s.url)
    original = _weights(s.url)
    client.offload(["weights"])
    client.onload(["weights"])
    r = httpx.post(s.url + "/generate", json=GOOD)
    assert r.status_code == 409 and "sync the weights" in r.json()["message"], r.text
    health = httpx.get(s.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "weights_not_synced"
    assert httpx.get(s.url + "/health_generate").status_code == 503
    assert httpx.post(s.url + "/get_weights_by_name", json={"name": "model.norm.weight"}).status_code == 409
    names = list(original)
    client.update_weights_from_tensor([(names[0], original[names[0]])])  # one tensor is not a sync
    assert httpx.post(s.url + "/generate", json=GOOD).status_code == 409
    client.update_weights_from_tensor([(n, original[n]) for n in names[1:]], version=1)
    assert httpx.post(s.url + "/generate", json=GOOD).status_code == 200
    assert httpx.get(s.url + "/health").json()["status"] == "ok"


def test_bad_values_are_a_4xx_naming_the_field_and_leave_the_weights_alone(serve, tmp_path):
    s = serve()
    before = _weights(s.url)
    root = tmp_path / "delta"
    root.mkdir()
    save_baseline(before, root / "baseline.safetensors")
    sync = DiskDeltaSync(DiskDeltaConfig(root=str(root), baseline=str(root / "baseline.safetensors"), keep_versions=0))
    sync.connect([])
    sync.update([(k, v + 1 if k == "model.norm.weight" else v) for k, v in before.items()], version=1)
    shutil.copytree(root, tmp_path / "delta_list")
    shutil.copytree(root, tmp_path / "delta_shards")
    index = root / "v00000001" / "index.json"
    ix = json.loads(index.read_text())
    ix["tensors"] = {"evil.weight": next(iter(ix["tensors"].values()))}
    index.write_text(json.dumps(ix))
    listed = tmp_path / "delta_list" / "v00000001" / "index.json"
    listed.write_text(json.dumps({**json.loads(listed.read_text()), "tensors": [1, 2]}))
    sharded = tmp_path / "delta_shards" / "v00000001" / "index.json"
    sharded.write_text(json.dumps({**json.loads(sharded.read_text()), "shards": ["a", "b"]}))
    os.makedirs(tmp_path / "x.safetensors")
    post = lambda path, body: httpx.post(s.url + path, json=body)  # noqa: E731
    cases = [
        (post("/get_weights_by_name", {"name": ["model.norm.weight"]}), "name"),
        (post("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": -1}), "truncate_size"),
        (post("/update_weights_from_disk", {"model_path": str(tmp_path)}), "weight_version"),
        (
            post("/update_weights_from_disk", {"model_path": str(tmp_path / "x.safetensors"), "weight_version": "1"}),
            "model_path",
        ),
        (post("/update_weights_from_disk", {"model_path": str(root), "weight_version": "1"}), "evil.weight"),
        (
            post("/update_weights_from_disk", {"model_path": str(tmp_path / "delta_list"), "weight_version": "1"}),
            "malformed",
        ),
        (
            post("/update_weights_from_disk", {"model_path": str(tmp_path / "delta_shards"), "weight_version": "1"}),
            "malformed",
        ),
        (post("/update_weight_version", {"new_version": -7}), "new_version"),  # a string in SGLang
        (post("/update_weight_version", {"new_version": 10**30}), "new_version"),
        (
            post(
                "/init_weights_update_group",
                {**dict.fromkeys(("master_address", "master_port"), 1), "rank_offset": 0, "world_size": 2},
            ),
            "rank_offset",
        ),
    ]
    for r, field in cases:
        assert r.status_code == 400 and field in r.json()["message"], (field, r.status_code, r.text)
    after = _weights(s.url)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert httpx.get(s.url + "/get_weight_version").json()["weight_version"] == "default"
