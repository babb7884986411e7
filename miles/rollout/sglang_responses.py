"""What an SGLang server answers, read and checked before any of it reaches a sample.

``SGLangClient`` talks to servers miles does not control (``rollout.engine_urls``: an older SGLang, a proxy, a
server of another model). A response that does not fit the requests it answers (fewer outputs, ids outside the
vocabulary or not integers, a log-prob per token missing, NaN log-probs, a body that is not JSON) is refused
here with ``EngineResponseError`` naming the server and the fault, instead of becoming a sample with an empty or
wrong response. The shapes are SGLang 0.5.10's (``srt/managers/tokenizer_manager.py``: a list for a batch, one
object for a single prompt; ``meta_info.output_token_logprobs`` as ``[logprob, token_id, text]`` triples).
"""

from __future__ import annotations

import json
import math
from typing import Any

from miles.protocols.engine import GenerateOutput, GenerateRequest


class EngineUnavailable(RuntimeError):
    """The engine did not answer (connection refused, timeout, 5xx): a router counts it as a failure."""


class EngineResponseError(EngineUnavailable):
    """The engine answered something that is not a valid response to the request (a broken or foreign server)."""


def decode_json(raw: bytes, content_type: str, where: str) -> Any:
    """The JSON value of a body (``None`` for SGLang's ``null`` and for an empty body)."""
    if not raw.strip():
        return None
    if "json" not in content_type:
        raise EngineResponseError(f"{where}: expected JSON, got {content_type or 'no content-type'}: {_head(raw)}")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EngineResponseError(f"{where}: the body is not valid JSON ({e}): {_head(raw)}") from None


def _head(raw: bytes) -> str:
    return repr(raw[:120].decode("utf-8", errors="replace"))


def parse_outputs(res: Any, requests: list[GenerateRequest], where: str, vocab_size: int = 0) -> list[GenerateOutput]:
    """One checked GenerateOutput per request, in request order."""
    items = res if isinstance(res, list) else [res]
    if len(items) != len(requests):
        raise EngineResponseError(
            f"{where}: {len(items)} output(s) for {len(requests)} request(s); the server dropped or invented some"
        )
    outs = [parse_output(d, f"{where} output {i}", vocab_size) for i, d in enumerate(items)]
    for i, (r, o) in enumerate(zip(requests, outs, strict=True)):
        if o.rid and o.rid != r.rid:
            raise EngineResponseError(f"{where}: output {i} answers rid {o.rid!r}, the request was {r.rid!r}")
    return outs


def parse_output(d: Any, where: str = "response", vocab_size: int = 0) -> GenerateOutput:
    """A GenerateOutput from one response object (miles serve or real SGLang), every field checked."""
    if not isinstance(d, dict) or not isinstance(d.get("meta_info"), dict):
        raise EngineResponseError(f"{where}: not a /generate output (no meta_info object): {str(d)[:120]}")
    meta = d["meta_info"]
    reason = meta.get("finish_reason") or {"type": "abort"}
    kind = reason.get("type", "abort") if isinstance(reason, dict) else str(reason)
    triples = meta.get("output_token_logprobs") or []
    if not isinstance(triples, list) or not all(isinstance(x, (list, tuple)) and len(x) >= 2 for x in triples):
        raise EngineResponseError(f"{where}: output_token_logprobs is not a list of [logprob, id, ...]")
    ids = d.get("output_ids")
    if ids is None:
        ids = [x[1] for x in triples]
    if not isinstance(ids, list):
        raise EngineResponseError(f"{where}: output_ids is {type(ids).__name__}, not a list")
    _check_ids(ids, where, vocab_size)
    lps = [x[0] for x in triples]
    if triples and len(lps) != len(ids):
        raise EngineResponseError(f"{where}: {len(ids)} output ids but {len(lps)} log-probs")
    if triples and [x[1] for x in triples] != ids:
        raise EngineResponseError(f"{where}: output_token_logprobs name other tokens than output_ids")
    bad = [x for x in lps if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x > 1e-3]
    if bad:
        raise EngineResponseError(f"{where}: log-probs must be finite numbers <= 0; got {bad[:3]}")
    return GenerateOutput(
        rid=str(meta.get("id", "")),
        output_ids=list(ids),
        output_log_probs=[float(x) for x in lps],
        finish_reason=kind if kind in ("stop", "length") else "abort",
        weight_version=as_version(meta.get("weight_version")),
    )


def _check_ids(ids: list, where: str, vocab_size: int) -> None:
    hi = vocab_size or 2**63
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < hi]
    if bad:
        space = f"[0, {vocab_size})" if vocab_size else "[0, 2**63)"
        raise EngineResponseError(f"{where}: output ids {bad[:3]} are not token ids in {space}")


def as_version(v) -> int:
    """SGLang reports weight_version as a string ('default' before any update); miles counts integers."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0
