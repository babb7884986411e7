"""The engine behind a session server, as a two-method interface: generate one request, abort requests by id.

Two implementations: ``EmbeddedPolicy`` drives an in-process :class:`EmbeddedEngine` (its KV cache is one
preallocated block, so concurrent calls are batched by one worker thread rather than run side by side), and
``HttpPolicy`` speaks SGLang's ``/generate`` + ``/abort_request`` contract to any server that serves it
(``miles serve``, or SGLang itself).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Protocol

from miles.protocols.engine import EngineError, GenerateRequest, SamplingParams
from miles.rollout.engine import EmbeddedEngine


@dataclass(kw_only=True, slots=True)
class Completion:
    output_ids: list[int]
    output_log_probs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int


class Policy(Protocol):
    def generate(self, rid: str, input_ids: list[int], sampling: SamplingParams) -> Completion: ...

    def abort(self, rids: list[str]) -> None: ...


class EmbeddedPolicy:
    """Batches concurrent ``generate`` calls onto one in-process engine.

    policy = EmbeddedPolicy(engine)                      # starts the worker thread
    out = policy.generate("s1/0", [1, 2, 3], SamplingParams(max_new_tokens=8))   # from any thread
    policy.abort(["s1/0"])                              # the call returns early with finish_reason 'abort'
    policy.close()
    """

    def __init__(self, engine: EmbeddedEngine, *, max_batch: int = 0):
        self.engine = engine
        self.max_batch = max_batch or engine.max_batch_size
        self._queue: queue.Queue = queue.Queue()
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="embedded-policy", daemon=True)
        self._worker.start()

    def generate(self, rid: str, input_ids: list[int], sampling: SamplingParams) -> Completion:
        if self._closed:
            raise EngineError("the policy is closed")
        with self._lock:
            if rid in self._aborted:  # aborted before it reached the engine
                self._aborted.discard(rid)
                return Completion(
                    output_ids=[], output_log_probs=[], finish_reason="abort", weight_version=self.engine.weight_version
                )
        done: queue.Queue = queue.Queue(maxsize=1)
        self._queue.put((GenerateRequest(rid=rid, input_ids=list(input_ids), sampling=sampling), done))
        result = done.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def abort(self, rids: list[str]) -> None:
        with self._lock:
            self._aborted |= set(rids)
        self.engine.abort(list(rids))

    def close(self) -> None:
        """Stop the worker; calls still queued get an EngineError instead of waiting forever."""
        self._closed = True
        self._queue.put(None)
        self._worker.join(timeout=10)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[1].put(EngineError("the policy was closed before this request ran"))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < self.max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
            self._serve(batch)

    def _serve(self, batch) -> None:
        with self._lock:
            live = [(r, d) for r, d in batch if r.rid not in self._aborted]
            for r, d in batch:
                if r.rid in self._aborted:
                    self._aborted.discard(r.rid)
                    d.put(
                        Completion(
                            output_ids=[],
                            output_log_probs=[],
                            finish_reason="abort",
                            weight_version=self.engine.weight_version,
                        )
                    )
        if not live:
            return
        try:
            outs = self.engine.generate([r for r, _ in live])
        except Exception as e:  # bad input fails the whole batch: retry one by one so each caller gets its own answer
            if len(live) > 1:
                for one in live:
                    self._serve([one])
                return
            live[0][1].put(e)
            return
        with self._lock:
            for (r, d), o in zip(live, outs):
                self._aborted.discard(r.rid)
                d.put(
                    Completion(
                        output_ids=o.output_ids,
                        output_log_probs=o.output_log_probs,
                        finish_reason=o.finish_reason,
                        weight_version=o.weight_version,
                    )
                )


class HttpPolicy:
    """SGLang's HTTP contract: POST /generate with input_ids, sampling_params, return_logprob; POST /abort_request.

    policy = HttpPolicy("http://127.0.0.1:30000")
    out = policy.generate("s1/0", [1, 2, 3], SamplingParams(max_new_tokens=8))
    """

    def __init__(self, url: str, *, timeout_s: float = 600.0, api_key: str | None = None):
        import httpx

        from miles.http_guard import bearer_headers

        self.url = url.rstrip("/")
        self._client = httpx.Client(timeout=timeout_s, headers=bearer_headers(api_key))

    def generate(self, rid: str, input_ids: list[int], sampling: SamplingParams) -> Completion:
        body = {
            "rid": rid,
            "input_ids": list(input_ids),
            "return_logprob": True,
            "sampling_params": {
                "max_new_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "stop_token_ids": list(sampling.stop_token_ids),
                "ignore_eos": not sampling.stop_token_ids,  # SGLang stops at EOS unless told otherwise
            },
        }
        r = self._client.post(f"{self.url}/generate", json=body)
        if r.status_code >= 400:
            raise EngineError(f"engine at {self.url} answered {r.status_code}: {r.text[:300]}")
        return parse_generate_response(r.json())

    def abort(self, rids: list[str]) -> None:
        for rid in rids:  # SGLang's AbortReq takes one rid
            self._client.post(f"{self.url}/abort_request", json={"rid": rid})

    def close(self) -> None:
        self._client.close()


def as_version(v) -> int:
    """SGLang's weight_version is a string ("default" before any update); sessions count integers."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def parse_generate_response(d: dict) -> Completion:
    """Read SGLang's /generate answer: ``output_ids`` and ``meta_info.output_token_logprobs`` ([logprob, id, text])."""
    if isinstance(d, list):
        d = d[0]
    meta = d.get("meta_info", {})
    lps = meta.get("output_token_logprobs")
    ids = d.get("output_ids")
    if ids is None and lps is not None:
        ids = [int(t[1]) for t in lps]
    if ids is None:
        raise EngineError(
            f"the engine's /generate answer has neither output_ids nor meta_info.output_token_logprobs: {str(d)[:200]}"
        )
    log_probs = [float(t[0]) for t in lps] if lps is not None else []
    if len(log_probs) != len(ids):
        raise EngineError(
            f"the engine returned {len(ids)} tokens but {len(log_probs)} log-probs; ask with return_logprob=true"
        )
    reason = meta.get("finish_reason") or {}
    reason = reason.get("type", "stop") if isinstance(reason, dict) else str(reason)
    return Completion(
        output_ids=[int(t) for t in ids],
        output_log_probs=log_probs,
        finish_reason=reason,
        weight_version=as_version(meta.get("weight_version")),
    )


def make_engine(
    model_json: str = "", *, seed: int = 0, max_seq_len: int = 0, max_batch_size: int = 16, device: str = "cpu"
) -> EmbeddedEngine:
    """An embedded engine from ModelConfig fields as JSON ("" = the default config)."""
    import json

    from miles.model.config import ModelConfig

    cfg = ModelConfig(**json.loads(model_json)) if model_json else ModelConfig()
    return EmbeddedEngine(cfg, max_batch_size=max_batch_size, max_seq_len=max_seq_len, seed=seed, device=device)


def make_policy(spec: str, engine: EmbeddedEngine | None = None):
    """``"embedded"`` wraps ``engine`` (build it with make_engine); ``"http://..."`` reaches an SGLang-style server."""
    if spec.startswith(("http://", "https://")):
        return HttpPolicy(spec)
    if spec != "embedded" or engine is None:
        raise ValueError(
            f"engine {spec!r} is not known (or no engine was built); use 'embedded' with an engine, or an "
            "SGLang-compatible URL like http://127.0.0.1:30000"
        )
    return EmbeddedPolicy(engine)
