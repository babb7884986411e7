"""``POST /generate`` as sglang 0.5.10.post1 answers it, for the request shapes slime and radixark/miles send.

Spec: ``srt/managers/io_struct.py`` (GenerateReqInput), ``srt/sampling/sampling_params.py`` (SamplingParams:
its keys, ``top_k`` -1 = all, ``TypeError`` on an unknown key), ``srt/managers/tokenizer_manager.py``
(``_handle_batch_output``: meta_info; ``add_logprob_to_meta_info``: ``[logprob, id, None]`` triples),
``srt/managers/schedule_batch.py`` (``FINISH_MATCHED_TOKEN/_STR``, ``FINISH_LENGTH(length=max_new_tokens)``;
``_check_token_based_finish``: the model's EOS stops unless ``ignore_eos``, which also turns off stop_token_ids),
``srt/managers/detokenizer_manager.py`` (``text``: the stop token / stop string trimmed unless no_stop_trim),
``scheduler_output_processor_mixin.py`` (input log-probs: ``[None] + ...`` from ``logprob_start_len``),
``sampling/penaltylib/min_new_tokens.py`` (stop tokens masked until min_new_tokens), ``http_server.py``
(``stream``: ``data: {json}`` events with cumulative output, then ``data: [DONE]``).
Request shapes: slime ``slime/rollout/sglang_rollout.py`` (``GenerateState.sampling_params``, ``generate``),
``slime/rollout/sglang_streaming_rollout.py``, ``slime/rollout/on_policy_distillation.py``; radixark/miles
``miles/rollout/generate_utils/prefill_logprobs.py``.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.rollout.conformance.conftest import EOS, A

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]  # procs: it starts processes or servers

SLIME_SAMPLING = {  # slime's GenerateState.sampling_params with its defaults (stop_token_ids None: EOS stops)
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "max_new_tokens": 6,
    "stop": None,
    "stop_token_ids": None,
    "skip_special_tokens": True,
    "no_stop_trim": True,
    "spaces_between_special_tokens": False,
}


def gen(server, **body):
    return httpx.post(server.url + "/generate", json=body, timeout=60)


def test_slimes_single_request_answers_sglangs_fields(servers):
    r = gen(servers(), input_ids=[1, 2, 3], sampling_params=SLIME_SAMPLING, return_logprob=True, rid="s-0")
    assert r.status_code == 200
    d = r.json()
    meta = d["meta_info"]
    assert set(d) == {"text", "output_ids", "meta_info"} and isinstance(d["text"], str)
    assert meta["id"] == "s-0" and meta["prompt_tokens"] == 3 and meta["cached_tokens"] == 0
    assert meta["completion_tokens"] == len(d["output_ids"]) == meta["output_token_logprobs_length"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == d["output_ids"]
    assert all(isinstance(lp, float) and lp <= 0 and text is None for lp, _, text in meta["output_token_logprobs"])
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["input_token_logprobs"] == []
    for key in ("weight_version", "total_retractions", "reasoning_tokens", "e2e_latency"):
        assert key in meta


def test_weight_version_in_meta_info_is_a_string(servers):
    meta = gen(servers(), input_ids=[1], sampling_params={"max_new_tokens": 1}).json()["meta_info"]
    assert meta["weight_version"] == "default"  # ServerArgs.weight_version's default


def test_text_is_the_decoded_output(servers):
    d = gen(servers(A), input_ids=[1, 2], sampling_params={"max_new_tokens": 4}).json()
    assert d["output_ids"] == [A] * 4 and d["text"] == "aaaa"


def test_a_batch_with_a_rid_list_answers_a_list_in_order(servers):
    d = gen(servers(), input_ids=[[1, 2], [3, 4, 5]], rid=["b-0", "b-1"], sampling_params={"max_new_tokens": 2}).json()
    assert isinstance(d, list) and [x["meta_info"]["id"] for x in d] == ["b-0", "b-1"]
    assert [x["meta_info"]["prompt_tokens"] for x in d] == [2, 3]


def test_without_return_logprob_there_are_no_logprobs(servers):
    meta = gen(servers(), input_ids=[1], sampling_params={"max_new_tokens": 2}).json()["meta_info"]
    assert "output_token_logprobs" not in meta and "input_token_logprobs" not in meta


def test_a_length_finish_names_max_new_tokens(servers):
    meta = gen(servers(A), input_ids=[1], sampling_params={"max_new_tokens": 5}).json()["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}


def test_the_same_sampling_seed_gives_the_same_tokens(servers):
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 6, "sampling_seed": 11, "ignore_eos": True}}
    assert gen(servers(), **body).json()["output_ids"] == gen(servers(), **body).json()["output_ids"]


def test_top_k_1_at_temperature_1_is_greedy(servers):
    greedy = gen(
        servers(), input_ids=[5, 6], sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    )
    for seed in (1, 2, 3):
        sp = {"max_new_tokens": 6, "temperature": 1.0, "top_k": 1, "sampling_seed": seed, "ignore_eos": True}
        assert gen(servers(), input_ids=[5, 6], sampling_params=sp).json()["output_ids"] == greedy.json()["output_ids"]


def test_an_unknown_sampling_key_is_a_400_naming_it(servers):
    r = gen(servers(), input_ids=[1], sampling_params={"max_new_tokens": 1, "temprature": 0.5})
    assert r.status_code == 400 and "temprature" in r.json()["error"]["message"]


def test_min_new_tokens_holds_back_a_stop_token(servers):
    d = gen(
        servers(A), input_ids=[1], sampling_params={"max_new_tokens": 6, "stop_token_ids": [A], "min_new_tokens": 3}
    )
    assert len(d.json()["output_ids"]) >= 3  # the only token the model emits is suppressed for 3 tokens


@pytest.mark.parametrize("start", [3, 0])
def test_prefill_scoring_answers_input_token_logprobs_from_logprob_start_len(servers, start):
    ids = [4, 9, 2, 7, 7, 1]
    d = gen(servers(), input_ids=ids, sampling_params={"max_new_tokens": 0, "temperature": 0},
            return_logprob=True, logprob_start_len=start).json()  # fmt: skip
    lps = d["meta_info"]["input_token_logprobs"]
    assert d["output_ids"] == [] and d["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert [t for _, t, _ in lps] == ids[start:] and lps[0][0] is None
    assert all(isinstance(lp, float) and lp <= 0 for lp, _, _ in lps[1:])


def test_a_batch_of_prefill_scores_shares_one_sampling_params(servers):
    """radixark/miles ``_build_batch_prefill_scoring_payload``: input_ids a list of lists, one sampling_params."""
    body = {"input_ids": [[1, 2, 3], [4, 5, 6, 7]], "return_logprob": True, "logprob_start_len": 1,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0, "skip_special_tokens": False}}  # fmt: skip
    d = gen(servers(), **body).json()
    assert [len(x["meta_info"]["input_token_logprobs"]) for x in d] == [2, 3]


def test_top_logprobs_num_answers_output_and_input_top_logprobs(servers):
    d = gen(servers(), input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 3}, return_logprob=True,
            top_logprobs_num=2, logprob_start_len=1).json()["meta_info"]  # fmt: skip
    assert len(d["output_top_logprobs"]) == 3 and all(len(x) == 2 for x in d["output_top_logprobs"])
    assert d["input_top_logprobs"][0] is None and len(d["input_top_logprobs"]) == 2
    lp, tok, text = d["output_top_logprobs"][0][0]
    assert isinstance(lp, float) and isinstance(tok, int) and text is None


def test_slimes_streaming_request_gets_cumulative_events_then_done(servers):
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5}, "return_logprob": True, "stream": True}
    with httpx.stream("POST", servers(A).url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 2 and all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    lens = [len(c["meta_info"]["output_token_logprobs"]) for c in chunks]
    assert lens == sorted(lens) and lens[-1] == 5 and chunks[-1]["text"] == "aaaaa"  # cumulative, not deltas


def test_a_text_prompt_goes_through_the_models_tokenizer(servers):
    d = gen(servers(A), text="hi there", sampling_params={"max_new_tokens": 2}).json()
    assert d["meta_info"]["prompt_tokens"] == len("hi there".encode()) and d["text"] == "aa"


def test_a_stop_token_is_matched_kept_in_output_ids_and_trimmed_from_text(servers):
    d = gen(servers(A), input_ids=[1], sampling_params={"max_new_tokens": 4, "stop_token_ids": [A]},
            return_logprob=True).json()  # fmt: skip
    assert d["meta_info"]["finish_reason"] == {"type": "stop", "matched": A}
    assert d["output_ids"] == [A] and len(d["meta_info"]["output_token_logprobs"]) == 1 and d["text"] == ""


def test_a_stop_string_stops_with_the_string_matched(servers):
    d = gen(servers(A), input_ids=[1], sampling_params={"max_new_tokens": 4, "stop": ["a"]}).json()
    assert d["output_ids"] == [A] and d["meta_info"]["finish_reason"] == {"type": "stop", "matched": "a"}
    assert d["text"] == ""  # trimmed; with no_stop_trim it stays
    kept = gen(servers(A), input_ids=[1], sampling_params={"max_new_tokens": 4, "stop": "a", "no_stop_trim": True})
    assert kept.json()["text"] == "a"


def test_the_models_eos_stops_generation_by_default(servers):
    d = gen(servers(EOS), input_ids=[1], sampling_params={"max_new_tokens": 6}).json()
    assert d["output_ids"] == [EOS] and d["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}


def test_ignore_eos_generates_past_the_eos(servers):
    d = gen(servers(EOS), input_ids=[1], sampling_params={"max_new_tokens": 6, "ignore_eos": True}).json()
    assert d["output_ids"] == [EOS] * 6 and d["meta_info"]["finish_reason"]["type"] == "length"
