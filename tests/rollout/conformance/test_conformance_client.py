"""miles' ``SGLangClient(flavor="sglang")`` against SGLang 0.5.10.post1's answers: the stand-in server here answers
what ``srt/entrypoints/http_server.py`` answers (null bodies from the memory endpoints, an empty 200 from
/abort_request, /get_load a per-rank list, string weight versions, a 400 for an unknown sampling key), so the
client's calls meet real shapes. Where miles serve deliberately keeps an endpoint SGLang 0.5.10 removed
(/get_weight_version), the 404 SGLang gives is played by an httpx.MockTransport transcribed from that source.

Spec of what the client must send: ``srt/managers/io_struct.py`` (AbortReq.rid is one string;
UpdateWeightVersionReqInput.abort_all_requests defaults to True), ``srt/sampling/sampling_params.py`` (the keys).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from miles.protocols.engine import GenerateRequest, SamplingParams
from miles.rollout.sglang_client import SGLangClient
from miles.rollout.sglang_responses import parse_output
from tests.rollout.conformance.conftest import A

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]  # procs: it starts processes or servers

SGLANG_SAMPLING_KEYS = set(  # sglang 0.5.10.post1 SamplingParams.__init__
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty presence_penalty "
    "repetition_penalty min_new_tokens n json_schema regex ebnf structural_tag ignore_eos skip_special_tokens "
    "spaces_between_special_tokens no_stop_trim custom_params stream_interval logit_bias sampling_seed".split()
)


def sg(server) -> SGLangClient:
    return SGLangClient(server.url, flavor="sglang", vocab_size=264)


def req(rid, n=3, **sp):
    return GenerateRequest(rid=rid, input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=n, **sp))


def test_the_client_reads_length_stop_and_stop_string_finishes_from_real_answers(servers):
    c = sg(servers(A))
    assert c.generate([req("len", 3)])[0].finish_reason == "length"
    out = c.generate([req("stop", 5, stop_token_ids=(A,))])[0]
    assert out.finish_reason == "stop" and out.output_ids == [A]
    d = httpx.post(
        servers(A).url + "/generate", json={"input_ids": [1], "sampling_params": {"stop": "a", "max_new_tokens": 4}}
    ).json()
    assert parse_output(d).finish_reason == "stop"


def test_an_abort_answer_with_status_code_and_err_type_reads_as_abort(servers):
    s = servers()
    c = sg(s)
    c.pause_generation("in_place")
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("o", c.generate([req("ab", 40)])), daemon=True)
    t.start()
    while httpx.get(s.url + "/get_load").json()[0]["num_reqs"] < 1:
        time.sleep(0.01)
    c.abort("all")
    t.join(20)
    c.continue_generation()
    assert box["o"][0].finish_reason == "abort"


def test_weight_version_reads_model_info_and_the_default_string_as_0(servers):
    assert sg(servers()).weight_version == 0


def test_weight_version_reads_model_info_before_the_404_of_get_weight_version():
    asked = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        if request.url.path == "/get_weight_version":
            return httpx.Response(404, json={"object": "error", "message": "deprecated. Please use '/model_info'"})
        return httpx.Response(200, json={"model_path": "m", "weight_version": "12"})

    c = SGLangClient("http://127.0.0.1:1", flavor="sglang")
    c.http = httpx.Client(base_url=c.url, transport=httpx.MockTransport(answer))
    assert c.weight_version == 12 and asked == ["/model_info"]


def test_the_generate_body_is_a_valid_generate_req_input_with_top_k(servers):
    from miles.rollout.sglang_api import generate_body

    body = generate_body([req("a", top_k=5), req("b")], seed=3)
    assert all(set(p) <= SGLANG_SAMPLING_KEYS for p in body["sampling_params"])
    assert [p["top_k"] for p in body["sampling_params"]] == [5, -1]
    assert len(sg(servers()).generate([req("k", top_k=5)])[0].output_ids) == 3  # the stand-in took every key


def test_offload_and_onload_survive_sglangs_null_bodies(servers):
    c = sg(servers(A))
    assert c.offload(["kv_cache"]) == 0 and c.onload(["kv_cache"]) == 0


def test_load_sums_the_per_rank_list(servers):
    assert sg(servers()).load() == 0


def test_abort_by_rids_sends_one_request_per_rid(servers):
    s = servers()
    c = sg(s)
    c.pause_generation("in_place")
    box = {}
    reqs = [req("r-1", 40), req("r-2", 40), req("r-3", 40)]
    t = threading.Thread(target=lambda: box.setdefault("o", c.generate(reqs)), daemon=True)
    t.start()
    while httpx.get(s.url + "/get_load").json()[0]["num_reqs"] < 3:
        time.sleep(0.01)
    c.abort(["r-1", "r-3"])
    c.continue_generation()
    t.join(20)
    assert [o.finish_reason for o in box["o"]] == ["abort", "length", "abort"]


def test_set_weight_version_leaves_in_flight_requests_alone(servers):
    s = servers()
    c = sg(s)
    c.pause_generation("in_place")
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("o", c.generate([req("keep", 20)])), daemon=True)
    t.start()
    while httpx.get(s.url + "/get_load").json()[0]["num_reqs"] < 1:
        time.sleep(0.01)
    c.set_weight_version(4)
    c.continue_generation()
    t.join(20)
    assert box["o"][0].finish_reason == "length" and c.weight_version == 4


def test_pause_continue_flush_group_ranks_and_health(servers):
    c = sg(servers())
    c.pause_generation("retract")
    c.flush_cache()
    c.continue_generation()
    assert c.group_ranks() == 1 and c.healthy()


def test_update_weights_from_tensor_sends_sglangs_payload_and_a_string_version(servers):
    """The body SGLang's UpdateWeightsFromTensorReqInput takes: serialized_named_tensors (MultiprocessingSerializer
    strings), load_format null, flush_cache, weight_version a string."""
    s = servers("client-weights")
    c = sg(s)
    engine = s.server.engine
    name = "model.norm.weight"
    new = engine.named_weights()[name] + 1.5
    c.update_weights_from_tensor([(name, new)], version=5)
    assert torch.equal(engine.named_weights()[name], new) and c.weight_version == 5
    assert httpx.get(s.url + "/model_info").json()["weight_version"] == "5"
