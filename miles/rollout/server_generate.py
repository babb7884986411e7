"""``/generate`` as SGLang answers it (sglang 0.5.10.post1 ``http_server.generate_request``): one object for a
single prompt, a list for a batch, or with ``stream: true`` server-sent events ``data: {json}`` carrying the
cumulative answer so far (``finish_reason`` null until the last; a batch's chunks carry ``index``) and then
``data: [DONE]``; plus ``/health_generate``.

Prompts with ``max_new_tokens > 0`` go to the engine through the batcher; ``max_new_tokens: 0`` prompts are only
scored (miles.rollout.scoring), as are answers that ask for input or top log-probs. ``run_call`` is shared with
the OpenAI routes (miles.rollout.openai_server).
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from miles.protocols.engine import GenerateOutput, GenerateRequest, SamplingParams
from miles.rollout.generate_call import GenerateCall, parse_generate
from miles.rollout.scoring import score
from miles.rollout.serve_http import error, read_body
from miles.rollout.sglang_output import STOP_CHECK_EVERY, OutputWatch, needs_scores, output_json


def add_routes(app: FastAPI, srv) -> None:
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        call = parse_generate(await read_body(request), srv.model)
        srv.check_ready()
        if call.stream:
            return StreamingResponse(stream_call(srv, call), media_type="text/event-stream")
        res = await run_call(srv, call)
        return res if call.is_batch else res[0]

    @app.get("/health_generate")
    async def health_generate():
        """503 unless a generate would run now (miles' /health body says why), else a one-token generate."""
        status = srv.status()
        if status["status"] != "ok":
            return error(503, status["message"])
        req = GenerateRequest(
            rid=f"HEALTH_CHECK_{time.time_ns()}",
            input_ids=[0],
            sampling=SamplingParams(max_new_tokens=1, temperature=0),
        )
        await srv.batcher.submit([req])
        return {"status": "ok"}


async def run_call(srv, call: GenerateCall, on_progress=None) -> list[dict]:
    """Every prompt's answer in order. ``on_progress(index, ids, log_probs)`` (from the engine's thread) makes each
    generated row report its tokens every ``stream_interval`` tokens."""
    started = time.perf_counter()
    watches = {}
    for i, p in enumerate(call.prompts):
        if p.max_new_tokens and (p.options.stop or on_progress is not None):
            report = None if on_progress is None else (lambda ids, lps, i=i: on_progress(i, ids, lps))
            interval = p.options.stream_interval if report else STOP_CHECK_EVERY
            watches[i] = p.request.watch = OutputWatch(p.options.stop, srv.model, interval=interval, on_progress=report)
    gen = [p.request for p in call.prompts if p.max_new_tokens]
    outs = {o.rid: o for o in await srv.batcher.submit(gen, call.seed)} if gen else {}
    wv = srv.engine.weight_version
    outputs = [
        outs.get(p.request.rid) or GenerateOutput(rid=p.request.rid, output_ids=[], output_log_probs=[],
                                                  finish_reason="length", weight_version=wv)
        for p in call.prompts
    ]  # fmt: skip
    scored = [i for i, p in enumerate(call.prompts) if needs_scores(p)]
    scores = {}
    if scored:
        seqs = [list(call.prompts[i].request.input_ids) + outputs[i].output_ids for i in scored]
        temps = [call.prompts[i].options.temperature for i in scored]
        top = max(call.prompts[i].options.top_logprobs_num for i in scored)
        scores = dict(zip(scored, await asyncio.to_thread(score, srv.engine, seqs, temps, top)))
    return [
        output_json(p, o, srv.model, srv.version, watch=watches.get(i), scores=scores.get(i), started=started)
        for i, (p, o) in enumerate(zip(call.prompts, outputs, strict=True))
    ]


async def stream_outputs(srv, call: GenerateCall):
    """``(index, answer so far, finished)`` for each prompt of ``call`` every ``stream_interval`` tokens, then each
    final answer. A consumer that stops early (a client gone) aborts the requests."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    task = asyncio.ensure_future(
        run_call(srv, call, on_progress=lambda i, ids, lps: loop.call_soon_threadsafe(queue.put_nowait, (i, ids, lps)))
    )
    started = time.perf_counter()
    try:
        while not task.done():
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            i, ids, lps = getter.result()
            p = call.prompts[i]
            partial = GenerateOutput(
                rid=p.request.rid, output_ids=ids, output_log_probs=lps, finish_reason="length", weight_version=0
            )
            yield i, output_json(p, partial, srv.model, srv.version, started=started, finished=False), False
        for i, r in enumerate(task.result()):
            yield i, r, True
    finally:
        if not task.done():
            srv.batcher.abort([p.request.rid for p in call.prompts])
            task.cancel()


async def stream_call(srv, call: GenerateCall):
    """The SSE body of a streamed /generate: SGLang's ``data: {json}`` events, then ``data: [DONE]``."""
    try:
        async for i, answer, _ in stream_outputs(srv, call):
            yield _event(answer, i if call.is_batch else None)
    except ValueError as e:  # SGLang streams a bad request's error as an event, then [DONE]
        yield _event({"error": {"message": str(e)}}, None)
    yield b"data: [DONE]\n\n"


def _event(obj: dict, index: int | None) -> bytes:
    if index is not None:
        obj = {**obj, "index": index}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"
