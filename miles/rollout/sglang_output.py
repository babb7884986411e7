"""SGLang's ``/generate`` answer for one prompt, written as sglang 0.5.10.post1 writes it, and the watch that
ends a row at a stop string and feeds a stream.

Sources: ``srt/managers/tokenizer_manager.py`` (``_handle_batch_output``: meta_info's keys and their order,
``add_logprob_to_meta_info``: ``[logprob, token_id, text-or-None]`` triples), ``srt/managers/schedule_batch.py``
(``FINISH_*.to_json``; stop strings matched on the decoded tail of the last ``len(tokens(stop)) + 1`` tokens),
``srt/managers/detokenizer_manager.py`` (``trim_matched_stop``: a matched stop token is left out of ``text`` and
a matched stop string cut from it unless ``no_stop_trim``; ``output_ids`` keep every token) and
``srt/managers/scheduler_output_processor_mixin.py`` (input log-probs: the first is None, the token ids are the
prompt's from ``logprob_start_len``).

    watch = OutputWatch(options.stop, served_model, interval=16)     # a RowWatch for the engine request
    body = output_json(prompt, engine_output, served_model, "7", watch=watch, scores=scores, started=t0)
"""

from __future__ import annotations

import time

from miles.protocols.engine import GenerateOutput
from miles.rollout.generate_call import Prompt
from miles.rollout.scoring import Scores

STOP_CHECK_EVERY = 16  # tokens between stop-string checks when nothing streams (as the decode loop's flag reads)


class OutputWatch:
    """The RowWatch of one prompt: its stop strings, checked at every token position as SGLang does, and the
    progress of a streamed row (``on_progress(ids, log_probs)`` from the engine's thread)."""

    def __init__(self, stops: tuple[str, ...], model, *, interval: int = STOP_CHECK_EVERY, on_progress=None):
        self.stops, self.model, self.interval, self.on_progress = stops, model, interval, on_progress
        self.window = max((len(model.encode_plain(s)) for s in stops), default=0) + 1
        self.matched: str | None = None
        self.checked = 0  # token positions already checked

    def seen(self, ids: list[int], log_probs: list[float]) -> int | None:
        for k in range(self.checked + 1, len(ids) + 1) if self.stops else ():
            tail = self.model.decode(ids[max(0, k - self.window) : k], skip_special_tokens=False)
            for s in self.stops:
                if s in tail:
                    self.matched, self.checked = s, k
                    return k
        self.checked = len(ids)
        if self.on_progress is not None:
            self.on_progress(list(ids), list(log_probs))
        return None


def finish_json(out: GenerateOutput, prompt: Prompt, watch: OutputWatch | None) -> dict:
    """``meta_info.finish_reason``: FINISH_MATCHED_TOKEN / _STR, FINISH_LENGTH, FINISH_ABORT as SGLang writes them."""
    if out.finish_reason == "stop":
        matched = watch.matched if watch is not None and watch.matched is not None else out.output_ids[-1]
        return {"type": "stop", "matched": matched}
    if out.finish_reason == "length":
        return {"type": "length", "length": prompt.max_new_tokens}
    if not out.output_ids:  # aborted before it ran: SGLang's tokenizer manager answers for the waiting queue
        return {"type": "abort", "message": "Abort in waiting queue"}
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def output_text(ids: list[int], finish: dict | None, prompt: Prompt, model, *, partial: bool = False) -> str:
    opts = prompt.options
    matched = (finish or {}).get("matched")
    if not opts.no_stop_trim and isinstance(matched, int) and not isinstance(matched, bool) and ids:
        ids = ids[:-1]  # the stop token itself is not part of the text
    text = model.decode(
        ids,
        skip_special_tokens=opts.skip_special_tokens,
        spaces_between_special_tokens=opts.spaces_between_special_tokens,
    )
    if not opts.no_stop_trim and isinstance(matched, str) and (pos := text.find(matched)) != -1:
        text = text[:pos]
    return text.rstrip("\ufffd") if partial else text  # a stream holds back a character still being completed


def output_json(
    prompt: Prompt,
    out: GenerateOutput,
    model,
    version: str,
    *,
    watch: OutputWatch | None = None,
    scores: Scores | None = None,
    started: float = 0.0,
    finished: bool = True,
) -> dict:
    """One prompt's answer; ``finished=False`` for a stream's intermediate chunk (``finish_reason`` null)."""
    opts, ids = prompt.options, out.output_ids
    finish = finish_json(out, prompt, watch) if finished else None
    meta = {
        "id": out.rid,
        "finish_reason": finish,
        "prompt_tokens": len(prompt.request.input_ids),
        "weight_version": version,
        "total_retractions": out.retractions,
    }
    if opts.return_logprob:
        meta.update(_logprobs(prompt, out, model, scores))
    meta.update(reasoning_tokens=0, completion_tokens=len(ids), cached_tokens=0)
    if finished:
        meta["e2e_latency"] = time.perf_counter() - started if started else 0.0
        meta["response_sent_to_client_ts"] = time.time()
    return {"text": output_text(ids, finish, prompt, model, partial=not finished), "output_ids": ids, "meta_info": meta}


def _logprobs(prompt: Prompt, out: GenerateOutput, model, scores: Scores | None) -> dict:
    opts, prompt_ids = prompt.options, prompt.request.input_ids
    L = len(prompt_ids)
    texts = model.token_texts if opts.return_text_in_logprobs else (lambda ids: [None] * len(ids))
    start = L if opts.logprob_start_len == -1 else opts.logprob_start_len
    in_ids = prompt_ids[start:]
    in_lps = [None] + [scores.token_lps[j - 1] for j in range(start + 1, L)] if in_ids else []
    out_ids = out.output_ids
    d = {
        "input_token_logprobs": [list(x) for x in zip(in_lps, in_ids, texts(in_ids))],
        "output_token_logprobs": [list(x) for x in zip(out.output_log_probs, out_ids, texts(out_ids))],
        "output_token_logprobs_length": len(out_ids),
    }
    if opts.top_logprobs_num > 0:
        top = scores.top if scores is not None else []
        d["input_top_logprobs"] = [None] + [_top(top[j - 1], texts) for j in range(start + 1, L)] if in_ids else []
        d["output_top_logprobs"] = [
            _top(top[L - 1 + k], texts) if L - 1 + k < len(top) else [] for k in range(len(out_ids))
        ]
    return d


def _top(pairs: list[tuple[float, int]], texts) -> list[list]:
    return [[lp, i, t] for (lp, i), t in zip(pairs, texts([i for _, i in pairs]))]


def needs_scores(prompt: Prompt) -> bool:
    """Whether the answer needs a scoring forward (input log-probs from logprob_start_len, or top log-probs)."""
    o = prompt.options
    L = len(prompt.request.input_ids)
    return o.return_logprob and (0 <= o.logprob_start_len < L - 1 or o.top_logprobs_num > 0)
