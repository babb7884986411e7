"""Health, info, load, version, cache, abort, pause and memory endpoints as sglang 0.5.10.post1 answers them.

Spec: ``srt/entrypoints/http_server.py`` (/model_info, /server_info and their deprecated names, /get_load,
/update_weight_version aborting every request unless ``abort_all_requests: false``, /flush_cache's text,
/abort_request's empty 200, /pause_generation's modes and message, the memory endpoints' ``null`` body),
``srt/entrypoints/v1_loads.py`` (/v1/loads), ``srt/managers/io_struct.py`` (GetLoadReqOutput,
UpdateWeightVersionReqInput, PauseGenerationReqInput, AbortReq), ``srt/managers/scheduler.py`` (an abort's rid
matches as a prefix; a queued request aborted answers ``Abort in waiting queue``).
Request shapes: slime ``backends/sglang_utils/sglang_engine.py`` (health headers, flush, pause/continue,
release/resume), ``backends/sglang_utils/server_control.py`` (abort_all, /v1/loads?include=core), radixark/miles
``backends/sglang_utils/sglang_engine.py`` (/model_info first, pause mode retract, update_weight_version).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.rollout.conformance.conftest import A

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]  # procs: it starts processes or servers
SLIME_HEALTH_HEADERS = {"Content-Type": "application/json; charset=utf-8", "Authorization": "Bearer None"}
REQUESTS_UA = "python-requests/2.32.3"  # what slime's requests.get sends


def post(server, path, body=None, **kw):
    return httpx.post(server.url + path, json={} if body is None else body, timeout=60, **kw)


def get(server, path, **kw):
    return httpx.get(server.url + path, timeout=30, **kw)


def in_background(fn):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", fn()), daemon=True)
    t.start()
    return t, box


def wait_queued(server, n, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if get(server, "/get_load").json()[0]["num_reqs"] >= n:
            return
        time.sleep(0.01)
    raise AssertionError(f"{n} requests never reached the server")


def long_request(server, rid):
    body = {"input_ids": [1, 2], "rid": rid, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    return lambda: post(server, "/generate", body)


def test_health_generate_with_slimes_headers_and_health_answer_200(servers):
    s = servers()
    assert get(s, "/health_generate", headers=SLIME_HEALTH_HEADERS).status_code == 200
    assert get(s, "/health").status_code == 200


def test_flush_cache_by_get_and_post_answers_sglangs_text(servers):
    """slime: ``requests.get(url + "/flush_cache")`` bare (flush_cache) and with its health headers (startup)."""
    s = servers()
    bare = get(s, "/flush_cache", headers={"User-Agent": REQUESTS_UA})
    startup = get(s, "/flush_cache", headers={**SLIME_HEALTH_HEADERS, "User-Agent": REQUESTS_UA})
    for r in (bare, startup, post(s, "/flush_cache")):
        assert r.status_code == 200 and r.text.startswith("Cache flushed."), r.text


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
def test_model_info_has_sglangs_fields_and_a_string_weight_version(servers, path):
    d = get(servers(), path).json()
    for key in ("model_path", "tokenizer_path", "is_generation", "preferred_sampling_params", "model_type"):
        assert key in d
    assert d["is_generation"] is True and d["weight_version"] == "default"


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_server_info_has_the_server_args_clients_read(servers, path):
    d = get(servers(), path).json()
    assert d["tp_size"] == 1 and d["dp_size"] == 1 and isinstance(d["model_path"], str)
    assert isinstance(d["version"], str) and isinstance(d["internal_states"], list)


def test_get_weight_version_is_kept_for_slime(servers):
    """Deliberate difference: SGLang 0.5.10 answers 404 here ('use /model_info'); slime still reads it."""
    assert get(servers(), "/get_weight_version").json() == {"weight_version": "default"}


def test_v1_loads_include_core_has_the_per_rank_loads_slime_polls(servers):
    d = get(servers(), "/v1/loads", params={"include": "core"}).json()
    assert d["dp_rank_count"] == 1 and set(d) >= {"timestamp", "version", "loads", "aggregate"}
    row = d["loads"][0]
    for key in ("dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs", "max_running_requests"):
        assert key in row
    assert "memory" not in row and d["aggregate"]["total_reqs"] == row["num_total_reqs"]


def test_get_load_is_one_entry_per_dp_rank(servers):
    d = get(servers(), "/get_load").json()
    assert isinstance(d, list) and len(d) == 1
    assert set(d[0]) >= {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "ts_tic"}


def test_pause_and_continue_answer_sglangs_messages(servers):
    s = servers()
    assert post(s, "/pause_generation").json() == {"message": "Generation paused successfully.", "status": "ok"}
    assert post(s, "/continue_generation").json() == {"message": "Generation continued successfully.", "status": "ok"}
    assert post(s, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_slimes_update_sequence_pause_flush_continue_then_generate(servers):
    s = servers()
    assert post(s, "/pause_generation").status_code == 200
    assert get(s, "/flush_cache", headers={"User-Agent": REQUESTS_UA}).status_code == 200
    assert post(s, "/continue_generation").status_code == 200
    assert post(s, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}).status_code == 200


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_pause_in_place_or_retract_holds_requests_that_finish_after_continue(servers, mode):
    s = servers()
    assert post(s, "/pause_generation", {"mode": "in_place"}).status_code == 200  # the request is held from its start
    t, box = in_background(long_request(s, f"held-{mode}"))
    wait_queued(s, 1)
    assert post(s, "/pause_generation", {"mode": mode}).status_code == 200  # rmiles' default mode is retract
    time.sleep(0.1)
    assert t.is_alive()
    assert post(s, "/continue_generation").status_code == 200
    t.join(30)
    meta = box["r"].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 40
    assert meta["total_retractions"] == (1 if mode == "retract" else 0)


def test_abort_all_and_abort_by_rid_end_queued_requests_with_abort(servers):
    s = servers()
    post(s, "/pause_generation", {"mode": "in_place"})
    try:
        t1, one = in_background(long_request(s, "q-first"))
        t2, two = in_background(long_request(s, "q-second"))
        wait_queued(s, 2)
        r = post(s, "/abort_request", {"rid": "q-first"})
        assert r.status_code == 200 and r.content == b""  # SGLang: Response(status_code=200)
        t1.join(20)
        assert not t1.is_alive() and t2.is_alive()  # answered at once, its batchmate still held by the pause
        assert post(s, "/abort_request", {"abort_all": True}).status_code == 200
        t2.join(20)
    finally:
        post(s, "/continue_generation")
    for box in (one, two):
        assert box["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_update_weight_version_with_rmiles_shape_echoes_the_string(servers):
    s = servers()
    r = post(s, "/update_weight_version", {"new_version": "5", "abort_all_requests": False})
    assert r.json() == {"success": True, "message": "Weight version updated to 5", "new_version": "5"}
    assert get(s, "/model_info").json()["weight_version"] == "5"


def test_update_weight_version_aborts_in_flight_requests_by_default(servers):
    s = servers()
    post(s, "/pause_generation", {"mode": "in_place"})
    try:
        t, box = in_background(long_request(s, "v-held"))
        wait_queued(s, 1)
        assert post(s, "/update_weight_version", {"new_version": "6"}).status_code == 200
        t.join(20)
    finally:
        post(s, "/continue_generation")
    assert box["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_a_non_integer_weight_version_is_taken_and_reported(servers):
    s = servers()
    assert post(s, "/update_weight_version", {"new_version": "step-3", "abort_all_requests": False}).status_code == 200
    meta = post(s, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]
    assert meta["weight_version"] == "step-3"


def test_release_and_resume_answer_null_and_follow_the_tags(servers):
    s = servers(A)
    r = post(s, "/release_memory_occupation", {})
    assert r.status_code == 200 and r.json() is None
    assert post(s, "/resume_memory_occupation", {"tags": ["weights"]}).json() is None
    assert post(s, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}).json() is None
    assert post(s, "/release_memory_occupation", {"tags": None}).json() is None
    assert post(s, "/resume_memory_occupation", {"tags": None}).json() is None


def test_destroying_an_unknown_group_is_sglangs_400_and_the_server_keeps_serving(servers):
    s = servers()
    r = post(s, "/destroy_weights_update_group", {"group_name": "never-joined"})
    assert r.status_code == 400 and r.json()["message"] == "The group to be destroyed does not exist."
    assert post(s, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}).status_code == 200
