"""SGLang's ``/generate`` request (``GenerateReqInput`` and ``SamplingParams`` of sglang 0.5.10.post1:
``srt/managers/io_struct.py``, ``srt/sampling/sampling_params.py``) read into miles' engine requests, with every
value checked per call before it joins a batch, so one bad call gets its 400 and never fails the calls batched
with it.

Every sampling key SGLang defines is honoured or refused with a 400 naming it; a refused key may still be sent at
its default value (``"repetition_penalty": 1.0`` is accepted). Honoured: max_new_tokens (0 = score the prompt
only), temperature, top_p, top_k, min_new_tokens, stop (strings), stop_token_ids, ignore_eos, skip_special_tokens,
spaces_between_special_tokens, no_stop_trim, sampling_seed, stream_interval, custom_params (SGLang passes them
to a custom logit processor only, and miles takes none). Refused unless at their defaults: stop_regex, min_p,
frequency/presence/repetition penalties, n, json_schema, regex, ebnf, structural_tag, logit_bias. A key SGLang
does not define is a 400, as SGLang's ``SamplingParams(**params)`` raises TypeError. Top-level keys SGLang
ignores unknown; known ones that need what miles lacks (images, LoRA, hidden states, sessions) are 400s.

    call = parse_generate(body, served_model)       # WireError (a ValueError: HTTP 400) naming the field
    call.prompts[0].request                          # the engine's GenerateRequest
"""

from __future__ import annotations

import math
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any

from miles.protocols.engine import GenerateRequest, SamplingParams
from miles.rollout.sglang_api import WireError

MIN_TEMPERATURE = 1e-6  # below it (but not 0) logits / temperature overflow float32: NaN probabilities
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes
HONOURED = (
    "max_new_tokens temperature top_p top_k min_new_tokens stop stop_token_ids ignore_eos skip_special_tokens "
    "spaces_between_special_tokens no_stop_trim sampling_seed stream_interval custom_params"
).split()
REFUSED = {  # key: its default (accepted); anything else is a 400
    "stop_regex": None,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
}
UNSUPPORTED_TOP_LEVEL = {  # GenerateReqInput fields that need what miles serve lacks: their defaults only
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "token_ids_logprob": None,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "session_params": None,
    "lora_path": None,
    "lora_id": None,
    "custom_logit_processor": None,
    "background": False,
    "return_entropy": False,
}


@dataclass(kw_only=True, slots=True)
class OutputOptions:
    """How one prompt's answer is written (everything that does not change the tokens)."""

    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: only output log-probs (SGLang's default)
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stop: tuple[str, ...] = ()
    stream_interval: int = 1
    temperature: float = 1.0  # the log-prob temperature of a scoring pass (0: 1, as for greedy sampling)


@dataclass(kw_only=True, slots=True)
class Prompt:
    request: GenerateRequest
    options: OutputOptions
    max_new_tokens: int  # 0: the prompt is scored, nothing is generated


@dataclass(kw_only=True, slots=True)
class GenerateCall:
    prompts: list[Prompt] = field(default_factory=list)
    seed: int | None = None
    is_batch: bool = False
    stream: bool = False


def parse_generate(body: Any, model) -> GenerateCall:
    """A GenerateCall from a /generate body; ``model`` is the ServedModel (vocabulary, max_seq_len, tokenizer)."""
    if not isinstance(body, dict):
        raise WireError(f"/generate expects a JSON object, got {type(body).__name__}")
    for key, default in UNSUPPORTED_TOP_LEVEL.items():
        if body.get(key) not in (default, None, [], False):
            raise WireError(
                f"/generate: {key} is not supported by miles serve (send {key}={default!r} or leave it out)"
            )
    for key in ("routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank"):
        if body.get(key) not in (None, 0):
            raise WireError(f"/generate: {key} = {body[key]!r}; miles serve has one data-parallel rank, 0")
    batch, is_batch = _prompts(body, model)
    n = len(batch)
    stream = _flag(body.get("stream", False), "stream")
    rids = _per_request(body.get("rid"), n, "rid") if body.get("rid") is not None else [None] * n
    if any(r is not None and not isinstance(r, str) for r in rids):
        raise WireError(f"rid must be a string (or a list of strings, one per prompt); got {str(body['rid'])[:60]}")
    if len({r for r in rids if r is not None}) < len([r for r in rids if r is not None]):
        raise WireError(f"Duplicate request IDs detected within the request: {rids}")
    sps = _per_request(body.get("sampling_params") or {}, n, "sampling_params")
    logprob = _per_request(body.get("return_logprob") or False, n, "return_logprob")
    start = _per_request(
        -1 if body.get("logprob_start_len") is None else body["logprob_start_len"], n, "logprob_start_len"
    )
    top = _per_request(body.get("top_logprobs_num") or 0, n, "top_logprobs_num")
    text_lp = _flag(body.get("return_text_in_logprobs", False), "return_text_in_logprobs")
    call, seeds = GenerateCall(is_batch=is_batch, stream=stream), set()
    for i, ids in enumerate(batch):
        sampling, seed, opts = _sampling(sps[i], i, model)
        opts.return_logprob = _flag(logprob[i], "return_logprob")
        opts.logprob_start_len = _int(start[i], f"request {i}: logprob_start_len", lo=-1)
        if opts.logprob_start_len > len(ids):
            raise WireError(
                f"logprob_start_len={opts.logprob_start_len} is higher than the number of input tokens "
                f"{len(ids)}. Please use a smaller logprob_start_len."
            )
        opts.top_logprobs_num = _int(top[i], f"request {i}: top_logprobs_num", lo=0, hi=model.vocab_size)
        opts.return_text_in_logprobs = text_lp
        _check_length(ids, sampling.max_new_tokens, i, model.max_seq_len)
        seeds.add(seed)
        rid = rids[i] if rids[i] is not None else uuid.uuid4().hex
        req = GenerateRequest(rid=rid, input_ids=ids, sampling=sampling)
        call.prompts.append(Prompt(request=req, options=opts, max_new_tokens=sampling.max_new_tokens))
    if len(seeds) > 1:
        raise WireError(
            f"sampling_params.sampling_seed differs within one request ({sorted(seeds, key=str)}); use one seed per call"
        )
    call.seed = seeds.pop()
    return call


def _prompts(body: dict, model) -> tuple[list[list[int]], bool]:
    """(one id list per prompt, whether the request was a batch): ``input_ids`` or ``text``, never both."""
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise WireError("Either text, input_ids or input_embeds should be provided (exactly one of text, input_ids).")
    if has_text:
        text = body["text"]
        texts = text if isinstance(text, list) else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise WireError(f"text must be a string or a non-empty list of strings, got {str(text)[:60]}")
        batch = [model.encode(t) for t in texts]
        if any(not ids for ids in batch):
            raise WireError("a text prompt tokenized to no tokens; send at least one character")
        return batch, isinstance(text, list)
    ids = body["input_ids"]
    if not isinstance(ids, list) or not ids:
        raise WireError("input_ids cannot be empty.")
    is_batch = isinstance(ids[0], list)
    batch = ids if is_batch else [ids]
    for i, one in enumerate(batch):
        if not isinstance(one, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in one):
            raise WireError(f"input_ids[{i}] must be a list of integers, got {str(one)[:60]}")
        if not one:
            raise WireError(f"input_ids[{i}] is empty; send at least one token")
        _check_ids(one, f"input_ids[{i}]", model.vocab_size)
    return batch, is_batch


def _per_request(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise WireError(f"{name} has {len(value)} entries for {n} prompts; send one per prompt or a single value")
        return value
    return [value] * n


def _sampling(sp, i: int, model) -> tuple[SamplingParams, int | None, OutputOptions]:
    if not isinstance(sp, dict):
        raise WireError(f"sampling_params[{i}] must be an object, got {type(sp).__name__}")
    where = f"request {i}: sampling_params"
    unknown = sorted(set(sp) - set(HONOURED) - set(REFUSED))
    if unknown:
        raise WireError(f"{where}: unexpected keyword argument(s) {unknown}; SGLang's SamplingParams has no such key")
    for key, default in REFUSED.items():
        if sp.get(key, default) != default:
            raise WireError(f"{where}.{key} = {str(sp[key])[:60]} is not supported by miles serve (only {default!r})")
    get = lambda k, d: d if sp.get(k) is None else sp[k]  # noqa: E731 - SGLang treats null as the default
    max_new = _int(get("max_new_tokens", 128), f"{where}.max_new_tokens", lo=0)
    temperature = _number(get("temperature", 1.0), f"{where}.temperature")
    top_p = _number(get("top_p", 1.0), f"{where}.top_p")
    if temperature != 0 and not MIN_TEMPERATURE <= temperature:
        raise WireError(f"{where}.temperature = {temperature!r} must be 0 (greedy) or >= {MIN_TEMPERATURE}")
    if not (0 < top_p <= 1 and top_p >= sys.float_info.min):  # a denormal top_p is not a probability mass
        raise WireError(f"{where}.top_p = {top_p!r} must be in (0, 1] (and not denormal)")
    top_k = _int(get("top_k", -1), f"{where}.top_k", lo=-1)
    if top_k == 0:
        raise WireError(f"{where}.top_k = 0: top_k must be -1 (disable) or at least 1")
    min_new = _int(get("min_new_tokens", 0), f"{where}.min_new_tokens", lo=0, hi=max_new)
    ignore_eos = _flag(get("ignore_eos", False), f"{where}.ignore_eos")
    stop_ids = get("stop_token_ids", [])
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise WireError(f"{where}.stop_token_ids = {str(stop_ids)[:60]} must be a list of integers")
    _check_ids(stop_ids, f"{where}.stop_token_ids", model.vocab_size)
    # SGLang: ignore_eos turns off every token stop (stop_token_ids too); otherwise the model's EOS always stops
    stops = () if ignore_eos else tuple(dict.fromkeys([*stop_ids, *model.eos_ids]))
    seed = get("sampling_seed", None)
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not SEED_RANGE[0] <= seed < SEED_RANGE[1]
    ):
        raise WireError(f"{where}.sampling_seed = {seed!r} must be a 64-bit integer")
    if not isinstance(get("custom_params", {}), dict):
        raise WireError(f"{where}.custom_params must be an object")
    sampling = SamplingParams(
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),  # the engine counts 0 as no cut
        stop_token_ids=stops,
        min_new_tokens=min_new,
    )
    opts = OutputOptions(
        skip_special_tokens=_flag(get("skip_special_tokens", True), f"{where}.skip_special_tokens"),
        spaces_between_special_tokens=_flag(
            get("spaces_between_special_tokens", True), f"{where}.spaces_between_special_tokens"
        ),
        no_stop_trim=_flag(get("no_stop_trim", False), f"{where}.no_stop_trim"),
        stop=_stop_strings(get("stop", []), where),
        stream_interval=_int(get("stream_interval", 1), f"{where}.stream_interval", lo=1),
        temperature=temperature or 1.0,
    )
    return sampling, seed, opts


def _stop_strings(stop, where: str) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise WireError(f"{where}.stop = {str(stop)[:60]} must be a string or a list of strings")
    return tuple(s for s in stops if s)


def _check_length(ids: list[int], max_new: int, i: int, max_seq_len: int) -> None:
    if max_seq_len and len(ids) + max_new > max_seq_len:
        raise WireError(
            f"request {i}: prompt {len(ids)} + sampling_params.max_new_tokens {max_new} exceeds the engine's "
            f"max_seq_len {max_seq_len}; shorten it or raise rollout.max_seq_len"
        )


def _check_ids(ids, field_name: str, vocab_size: int) -> None:
    hi = vocab_size or 2**63
    bad = [t for t in ids if not 0 <= t < hi]
    if bad:
        where = f"the vocabulary [0, {vocab_size})" if vocab_size else "[0, 2**63)"
        raise WireError(f"{field_name}: token ids {', '.join(str(t)[:24] for t in bad[:5])} are outside {where}")


def _number(v, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise WireError(f"{name} = {v!r} must be a finite number")
    return float(v)


def _int(v, name: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not float(v).is_integer():
        raise WireError(f"{name} = {v!r} must be an integer")
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise WireError(f"{name} = {v} must be in [{lo}, {hi if hi is not None else 'inf'}]")
    return v


def _flag(v, name: str) -> bool:
    if not isinstance(v, bool):
        raise WireError(f"{name} = {v!r} must be true or false")
    return v
