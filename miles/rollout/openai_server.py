"""The OpenAI-compatible surface of ``miles serve``: /v1/models, /v1/completions and /v1/chat/completions, in the
shapes of sglang 0.5.10.post1's ``srt/entrypoints/openai/protocol.py`` (what the ``openai`` package reads), so
agent frameworks and session servers can drive the embedded engine.

Each request becomes a /generate call (miles.rollout.generate_call) and runs through the same batcher, so its
sampling keys are honoured or refused exactly as there. Chat prompts go through the model's chat template (the
tokenizer's own for a Hugging Face checkpoint). Streaming sends ``chat.completion.chunk`` / ``text_completion``
events and ``data: [DONE]``; ``stream_options.include_usage`` adds a usage chunk. Two fields of the sglang-miles
fork that radixark/miles' session server sends are taken on chat: ``input_ids`` (the prompt, instead of rendering
``messages``) and ``return_meta_info`` (each choice then carries the /generate ``meta_info``). No tool-call or
reasoning parser runs: ``message.content`` is the generated text and ``tool_calls`` is null.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from miles.rollout.generate_call import parse_generate
from miles.rollout.serve_http import read_body
from miles.rollout.server_generate import run_call, stream_outputs
from miles.rollout.sglang_api import WireError

PASSED_THROUGH = (  # request fields that are /generate sampling keys under the same name
    "temperature top_p top_k stop stop_token_ids no_stop_trim ignore_eos skip_special_tokens min_p "
    "frequency_penalty presence_penalty repetition_penalty regex ebnf json_schema stop_regex logit_bias n "
    "custom_params"
).split()


def add_routes(app: FastAPI, srv) -> None:
    def card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": srv.model.max_seq_len,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card(srv.model.name)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != srv.model.name:
            return JSONResponse(
                {
                    "error": {
                        "message": f"The model '{model}' does not exist",
                        "type": "invalid_request_error",
                        "param": "model",
                        "code": "model_not_found",
                    }
                },
                status_code=404,
            )
        return card(model)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await read_body(request)
        body = _completion_body(req, srv)
        return await _respond(srv, req, body, _Completion(req, srv, echo=_prompt_text(req, srv)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await read_body(request)
        body = _chat_body(req, srv)
        return await _respond(srv, req, body, _Chat(req))


async def _respond(srv, req: dict, body: dict, shape):
    call = parse_generate(body, srv.model)
    srv.check_ready()
    if req.get("stream"):
        call.stream = True
        return StreamingResponse(_stream(srv, call, shape, req), media_type="text/event-stream")
    answers = await run_call(srv, call)
    return shape.response(answers)


# ---- request translation ---------------------------------------------------------------------------------------
def _sampling(req: dict, max_new: int | None, srv) -> dict:
    sp = {k: req[k] for k in PASSED_THROUGH if req.get(k) is not None}
    if req.get("seed") is not None:
        sp["sampling_seed"] = req["seed"]
    if req.get("min_tokens"):
        sp["min_new_tokens"] = req["min_tokens"]
    if max_new is not None:
        sp["max_new_tokens"] = max_new
    return sp


def _refuse(req: dict, **defaults) -> None:
    for key, default in defaults.items():
        if req.get(key) not in (None, default):
            raise WireError(f"{key} = {str(req[key])[:60]} is not supported by miles serve (only {default!r})")


def _completion_body(req: dict, srv) -> dict:
    _refuse(req, suffix=None, best_of=1, return_hidden_states=False, lora_path=None, response_format=None)
    prompt = req.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)):
        key = "text"
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (int, list)) for p in prompt):
        key = "input_ids"
    else:
        raise WireError(
            f"prompt must be a string, a list of strings, token ids or lists of token ids; got {str(prompt)[:60]}"
        )
    k = req.get("logprobs")
    body = {
        key: prompt,
        "sampling_params": _sampling(req, req.get("max_tokens", 16), srv),
        "return_logprob": k is not None,
        "top_logprobs_num": k or 0,
        "return_text_in_logprobs": True,
    }
    if req.get("echo") and k is not None:
        body["logprob_start_len"] = 0
    return body


def _chat_body(req: dict, srv) -> dict:
    _refuse(req, continue_final_message=False, return_hidden_states=False, lora_path=None, response_format=None)
    ids = req.get("input_ids")
    if ids is None:
        messages = req.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise WireError("messages must be a non-empty list of {role, content} objects")
        kwargs = req.get("chat_template_kwargs") or {}
        ids = srv.model.chat_ids([_message(m) for m in messages], tools=req.get("tools"), **kwargs)
    max_new = req.get("max_completion_tokens") or req.get("max_tokens")
    if max_new is None:
        max_new = max(1, srv.model.max_seq_len - len(ids))  # SGLang: up to the context length
    return {
        "input_ids": ids,
        "sampling_params": _sampling(req, max_new, srv),
        "return_logprob": bool(req.get("logprobs")),
        "top_logprobs_num": req.get("top_logprobs") or 0,
        "return_text_in_logprobs": True,
    }


def _message(m: dict) -> dict:
    """A message for the chat template: text parts of a content list joined; images refused."""
    content = m.get("content")
    if isinstance(content, list):
        if any(isinstance(p, dict) and p.get("type") not in ("text", None) for p in content):
            raise WireError("only text message parts are supported by miles serve (no images or audio)")
        content = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return {**m, "content": "" if content is None else content}


def _prompt_text(req: dict, srv) -> list[str] | None:
    if not req.get("echo"):
        return None
    prompt = req["prompt"]
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    lists = prompt if isinstance(prompt[0], list) else [prompt]
    return [srv.model.decode(p) for p in lists]


# ---- response shapes -------------------------------------------------------------------------------------------
def _usage(answers: list[dict]) -> dict:
    prompt = sum(a["meta_info"]["prompt_tokens"] for a in answers)
    completion = sum(a["meta_info"]["completion_tokens"] for a in answers)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
    }


def _finish(a: dict) -> tuple[str | None, object]:
    f = a["meta_info"]["finish_reason"]
    return (f["type"], f.get("matched")) if f else (None, None)


class _Completion:
    prefix = "cmpl-"
    object = "text_completion"

    def __init__(self, req: dict, srv, echo: list[str] | None):
        self.model, self.echo, self.want_lp = req.get("model", srv.model.name), echo, req.get("logprobs") is not None
        self.id = self.prefix + uuid.uuid4().hex

    def choice(self, i: int, a: dict, text: str, finished: bool) -> dict:
        reason, matched = _finish(a) if finished else (None, None)
        return {
            "index": i,
            "text": text,
            "logprobs": self._logprobs(a) if self.want_lp else None,
            "finish_reason": reason,
            "matched_stop": matched,
        }

    def _logprobs(self, a: dict) -> dict:
        m = a["meta_info"]
        triples = (m.get("input_token_logprobs") or [] if self.echo else []) + m.get("output_token_logprobs", [])
        tops = (m.get("input_top_logprobs") or [] if self.echo else []) + (m.get("output_top_logprobs") or [])
        return {
            "text_offset": [-1] * len(triples),
            "token_logprobs": [lp for lp, _, _ in triples],
            "tokens": [t for _, _, t in triples],
            "top_logprobs": [None if x is None else {t[2]: t[0] for t in x} for x in tops],
        }

    def text(self, i: int, a: dict) -> str:
        return (self.echo[i] if self.echo else "") + a["text"]

    def response(self, answers: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": self.object,
            "created": int(time.time()),
            "model": self.model,
            "choices": [self.choice(i, a, self.text(i, a), True) for i, a in enumerate(answers)],
            "usage": _usage(answers),
            "metadata": None,
        }

    def chunk(self, i: int, a: dict, delta: str, finished: bool, first: bool) -> dict:
        return {
            "id": self.id,
            "object": self.object,
            "created": int(time.time()),
            "model": self.model,
            "choices": [self.choice(i, a, (self.echo[i] if self.echo and first else "") + delta, finished)],
            "usage": None,
        }


class _Chat(_Completion):
    prefix = "chatcmpl-"
    object = "chat.completion"

    def __init__(self, req: dict):
        self.model, self.echo, self.want_lp = req.get("model", ""), None, bool(req.get("logprobs"))
        self.meta = bool(req.get("return_meta_info"))
        self.id = self.prefix + uuid.uuid4().hex

    def choice(self, i: int, a: dict, text: str, finished: bool, delta: bool = False) -> dict:
        reason, matched = _finish(a) if finished else (None, None)
        role = None if delta else "assistant"  # a stream names the role in its first chunk only
        msg = {"role": role, "content": text, "reasoning_content": None, "tool_calls": None}
        c = {
            "index": i,
            "delta" if delta else "message": msg,
            "logprobs": self._chat_logprobs(a) if self.want_lp else None,
            "finish_reason": reason,
            "matched_stop": matched,
        }
        if self.meta and not delta:
            c["meta_info"] = a["meta_info"]
        return c

    @staticmethod
    def _chat_logprobs(a: dict) -> dict:
        m = a["meta_info"]
        tops = m.get("output_top_logprobs") or [[] for _ in m.get("output_token_logprobs", [])]
        return {
            "content": [
                {
                    "token": t,
                    "bytes": list(t.encode()),
                    "logprob": lp,
                    "top_logprobs": [{"token": x[2], "bytes": list(x[2].encode()), "logprob": x[0]} for x in top or []],
                }
                for (lp, _, t), top in zip(m.get("output_token_logprobs", []), tops)
            ]
        }

    def text(self, i: int, a: dict) -> str:
        return a["text"]

    def chunk(self, i: int, a: dict, delta: str, finished: bool, first: bool) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.model,
            "choices": [self.choice(i, a, delta, finished, delta=True)],
            "usage": None,
        }


async def _stream(srv, call, shape, req: dict):
    """OpenAI's server-sent events: deltas of each choice's text, its finish reason last, an optional usage chunk,
    then ``data: [DONE]``."""
    sent: dict[int, str] = {}
    tokens: dict[int, int] = {}  # output tokens already covered by a chunk's logprobs
    finals = {}
    try:
        if isinstance(shape, _Chat):  # the first chunk names the role, as SGLang (and OpenAI) send it
            for i in range(len(call.prompts)):
                first = {"role": "assistant", "content": ""}
                c = shape.chunk(i, {"meta_info": {"finish_reason": None}}, "", False, True)
                c["choices"][0]["delta"] = first
                yield _event(c)
        async for i, answer, finished in stream_outputs(srv, call):
            text = answer["text"]
            delta = text[len(sent.get(i, "")) :]
            if delta or finished:
                yield _event(shape.chunk(i, _new_tokens(answer, tokens.get(i, 0)), delta, finished, i not in sent))
                tokens[i] = answer["meta_info"]["completion_tokens"]
            sent[i] = text
            if finished:
                finals[i] = answer
        if (req.get("stream_options") or {}).get("include_usage"):
            usage = _usage([finals[i] for i in sorted(finals)])
            yield _event({"id": shape.id, "object": shape.chunk(0, finals[0], "", False, False)["object"],
                          "created": int(time.time()), "model": shape.model, "choices": [], "usage": usage})  # fmt: skip
    except ValueError as e:
        yield _event({"error": {"message": str(e), "type": "BadRequestError", "param": None, "code": 400}})
    yield b"data: [DONE]\n\n"


def _new_tokens(answer: dict, start: int) -> dict:
    """The answer with its output log-probs cut to the tokens after ``start`` (a chunk covers its own tokens)."""
    m = dict(answer["meta_info"])
    for key in ("output_token_logprobs", "output_top_logprobs"):
        if m.get(key) is not None:
            m[key] = m[key][start:]
    return {**answer, "meta_info": m}


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"
