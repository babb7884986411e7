"""The OpenAI-compatible surface, driven by the ``openai`` Python package (what agent frameworks use), and the
chat shape radixark/miles' session server sends.

Spec: sglang 0.5.10.post1 ``srt/entrypoints/openai/protocol.py`` (ModelCard, CompletionResponse,
ChatCompletionResponse, their stream chunks, UsageInfo, LogProbs / ChoiceLogprobs),
``srt/entrypoints/openai/serving_chat.py`` (the first stream chunk names the role, usage chunk with
``stream_options.include_usage``, ``data: [DONE]``), ``http_server.py`` (/v1/models).
Request shapes: radixark/miles ``miles/rollout/session/core.py`` (``prepare_chat_request``:
``logprobs``, ``return_meta_info``, ``no_stop_trim: false``, ``input_ids``; ``extract_completion`` reads
``choices[0].meta_info.output_token_logprobs`` and ``message.content``); slime ``slime/agent/adapters/common.py``
(probes /v1/models).
"""

from __future__ import annotations

import httpx
import pytest

from tests.rollout.conformance.conftest import A

openai = pytest.importorskip("openai", reason="the OpenAI client tests need it: pip install 'miles[dev]'")
pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]  # procs: it starts processes or servers


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_v1_models_lists_the_served_model(servers):
    models = client(servers()).models.list().data
    assert len(models) == 1 and models[0].object == "model" and models[0].max_model_len == 64
    assert client(servers()).models.retrieve(models[0].id).id == models[0].id


@pytest.mark.parametrize("prompt", ["ab", [1, 2, 3]], ids=["text", "token-ids"])
def test_completions_answer_text_usage_and_logprobs(servers, prompt):
    r = client(servers(A)).completions.create(model="m", prompt=prompt, max_tokens=3, logprobs=2, temperature=0)
    c = r.choices[0]
    assert r.object == "text_completion" and c.text == "aaa" and c.finish_reason == "length"
    assert r.usage.completion_tokens == 3 and r.usage.prompt_tokens == (2 if prompt == "ab" else 3)
    assert c.logprobs.tokens == ["a", "a", "a"] and len(c.logprobs.token_logprobs) == 3
    assert all(len(t) <= 2 for t in c.logprobs.top_logprobs)


def test_chat_completions_answer_a_message_logprobs_and_usage(servers):
    r = client(servers(A)).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True, top_logprobs=2
    )
    c = r.choices[0]
    assert r.object == "chat.completion" and c.message.role == "assistant" and c.message.content == "aaaa"
    assert [t.token for t in c.logprobs.content] == ["a"] * 4 and len(c.logprobs.content[0].top_logprobs) == 2
    assert r.usage.completion_tokens == 4 and r.usage.total_tokens == r.usage.prompt_tokens + 4


def test_the_rmiles_session_server_chat_shape_gets_meta_info_and_content(servers):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "input_ids": [1, 2, 3],
        "logprobs": True,
        "return_meta_info": True,
        "no_stop_trim": False,
        "tools": None,
        "chat_template_kwargs": {},
        "max_tokens": 3,
    }
    choice = httpx.post(servers(A).url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    meta = choice["meta_info"]
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == 3
    assert meta["prompt_tokens"] == 3 and choice["message"]["content"] == "aaa"


def test_chat_streaming_sends_the_role_first_then_deltas_a_finish_reason_and_usage(servers):
    stream = client(servers(A)).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "aaaaa"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_completion_streaming_delivers_the_text_in_deltas(servers):
    chunks = list(client(servers(A)).completions.create(model="m", prompt="x", max_tokens=4, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "aaaa" and chunks[-1].choices[0].finish_reason == "length"
