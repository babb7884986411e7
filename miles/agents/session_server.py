"""A session server: OpenAI-style chat completions whose sessions keep the exact tokens the policy produced.

An agent talks chat messages; RL needs tokens. Re-tokenizing a transcript can produce different ids than the
policy sampled (merges across a turn boundary, normalised whitespace), and then the trained log-probs are not
the sampled ones. Here each session keeps the token ids it sent to the engine and the ids + log-probs the
engine returned, and only ever appends: a new request must repeat the session's history, and only the new
messages are templated (token-in, token-out). One server process is one *instance* with an instance id; a
flush aborts every session of that instance at once.

Only the run that started it may drive it: every request but /health needs the run token (miles.agents.run_token),
and the HTTP guard refuses foreign Host headers, cross-site requests and non-JSON bodies (miles.http_guard).
Otherwise any local process could read transcripts, fill the session cap, or flush a live rollout's steps.

    MILES_AGENT_TOKEN=... python -m miles.agents.session_server --port 8100 --engine embedded --model-json '{...}'
    POST /sessions -> {"session_id"}                 POST /sessions/{sid}/v1/chat/completions (OpenAI body)
    GET /sessions/{sid} -> tokens, log-probs, mask   DELETE /sessions/{sid}
    POST /flush -> aborts every session here         GET /health
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch  # imported before a port range forks its instances (one import for all of them)
import uvicorn
from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse

from miles.agents.policy import Policy
from miles.agents.run_token import KEY_HINT, server_token
from miles.agents.tool_calls import parse_tool_calls
from miles.http_connections import guarded_protocol
from miles.http_guard import HttpGuard, allowed_hosts
from miles.protocols.engine import EngineError, SamplingParams


@dataclass(slots=True)
class Session:
    sid: str
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)  # 0.0 where loss_mask is 0
    loss_mask: list[int] = field(default_factory=list)  # 1: sampled by the policy; 0: template, user, tool text
    messages: list[dict] = field(default_factory=list)  # the history as this session recorded it
    weight_versions: list[int] = field(default_factory=list)  # per turn
    finish_reasons: list[str] = field(default_factory=list)
    inflight: str = ""  # request id on the engine while a turn generates
    aborted: bool = False
    metadata: dict = field(default_factory=dict)

    def record(self) -> dict:
        first = self.loss_mask.index(1) if 1 in self.loss_mask else len(self.loss_mask)
        return {
            "session_id": self.sid,
            "token_ids": self.token_ids,
            "log_probs": self.log_probs,
            "loss_mask": self.loss_mask,
            "prompt_len": first,
            "messages": self.messages,
            "weight_versions": self.weight_versions,
            "finish_reasons": self.finish_reasons,
            "num_turns": len(self.finish_reasons),
            "aborted": self.aborted,
            "metadata": self.metadata,
        }


class SessionError(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


class SessionServer:
    """The sessions of one instance over one policy. Thread-safe; the FastAPI app calls it from a thread pool.

    server = SessionServer(policy, tokenizer, instance_id="agent-8100")
    sid = server.open()
    reply = server.chat(sid, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16})
    server.get(sid)["token_ids"]      # exactly what the engine saw and produced
    server.flush()                    # aborts every session of this instance
    """

    def __init__(self, policy: Policy, tokenizer, *, instance_id: str, max_sessions: int = 4096):
        self.policy, self.tok, self.instance_id = policy, tokenizer, instance_id
        self.max_sessions = max_sessions
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self.num_flushes = 0
        self.flushed: set[str] = set()  # ids of sessions a flush dropped, so a late call hears why (bounded)
        self.fences: dict[
            str, int
        ] = {}  # rollout id -> last flushed step: its opens for that step or earlier are refused

    def open(self, metadata: dict | None = None) -> str:
        rollout, step = (metadata or {}).get("rollout"), (metadata or {}).get("step")
        with self._lock:
            fence = self.fences.get(rollout, -1) if isinstance(rollout, str) else -1
            if isinstance(step, int) and 0 <= step <= fence:
                raise SessionError(
                    409,
                    "session_aborted",
                    f"a session for step {step} of rollout {rollout} was asked for "
                    f"after a flush of instance {self.instance_id} ended that step (flushed up to step {fence})",
                )
            if len(self.sessions) >= self.max_sessions:
                raise SessionError(
                    429,
                    "too_many_sessions",
                    f"instance {self.instance_id} holds {len(self.sessions)} sessions "
                    f"(max {self.max_sessions}); delete finished ones with DELETE /sessions/<id>",
                )
            sid = f"{self.instance_id}-{uuid.uuid4().hex[:12]}"
            self.sessions[sid] = Session(sid=sid, metadata=dict(metadata or {}))
            return sid

    def _session(self, sid: str) -> Session:
        s = self.sessions.get(sid)
        if s is None and sid in self.flushed:
            raise SessionError(
                409, "session_aborted", f"session {sid!r} was aborted by a flush of instance {self.instance_id}"
            )
        if s is None:
            raise SessionError(
                404,
                "unknown_session",
                f"session {sid!r} is not open on instance {self.instance_id} "
                f"({len(self.sessions)} open); create one with POST /sessions",
            )
        if s.aborted:
            raise SessionError(
                409, "session_aborted", f"session {sid!r} was aborted by a flush of instance {self.instance_id}"
            )
        return s

    def get(self, sid: str) -> dict:
        with self._lock:
            s = self.sessions.get(sid)
            if s is None:
                raise SessionError(
                    404, "unknown_session", f"session {sid!r} is not open on instance {self.instance_id}"
                )
            return s.record()

    def close(self, sid: str) -> dict:
        with self._lock:
            s = self.sessions.pop(sid, None)
        if s is None:
            raise SessionError(404, "unknown_session", f"session {sid!r} is not open on instance {self.instance_id}")
        return s.record()

    # ---- one turn -------------------------------------------------------------------------------------------
    def chat(self, sid: str, body: dict) -> dict:
        sampling = self._sampling(body)
        with self._lock:
            s = self._session(sid)
            if s.inflight:
                raise SessionError(
                    409, "turn_in_progress", f"session {sid!r} is already generating; wait for its reply"
                )
            new_ids = self._extend_ids(s, _check_messages(body.get("messages")))
            rid = f"{sid}/{len(s.finish_reasons)}"
            s.inflight = rid
        try:
            out = self.policy.generate(rid, s.token_ids + new_ids, sampling)
        except EngineError as e:
            code = "context_length_exceeded" if "max_seq_len" in str(e) else "engine_error"
            raise SessionError(400, code, f"session {sid!r}: {e}") from None
        finally:
            with self._lock:
                s.inflight = ""
                self._idle.notify_all()
        with self._lock:
            if s.aborted or out.finish_reason == "abort":
                s.aborted = True
                raise SessionError(
                    409, "session_aborted", f"session {sid!r} was aborted by a flush of instance {self.instance_id}"
                )
            return self._commit(s, body["messages"], new_ids, out)

    def _sampling(self, body: dict) -> SamplingParams:
        try:
            raw = body.get("max_completion_tokens", body.get("max_tokens"))
            max_tokens = 64 if raw is None else int(raw)
            temperature = float(body.get("temperature", 1.0))
            top_p = float(body.get("top_p", 1.0))
        except (TypeError, ValueError) as e:
            raise SessionError(
                400, "invalid_request", f"max_tokens / temperature / top_p must be numbers ({e})"
            ) from None
        if max_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
            raise SessionError(
                400,
                "invalid_request",
                f"max_tokens = {max_tokens} must be >= 1, temperature = {temperature} >= 0, top_p = {top_p} in (0, 1]",
            )
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stop_token_ids=tuple(self.tok.stop_token_ids),
        )

    def _extend_ids(self, s: Session, messages: list[dict]) -> list[int]:
        """Token ids for the messages this session has not seen; the seen ones must match its record exactly."""
        n = len(s.messages)
        if len(messages) <= n:
            raise SessionError(
                400,
                "invalid_request",
                f"the request has {len(messages)} messages, the session already holds "
                f"{n}; send the whole history plus at least one new message",
            )
        for i, (old, new) in enumerate(zip(s.messages, messages)):
            if old["role"] != new.get("role") or (old.get("content") or "") != (new.get("content") or ""):
                raise SessionError(
                    400,
                    "history_mismatch",
                    f"messages[{i}] ({new.get('role')}) differs from the session's "
                    f"record ({old['role']}: {str(old.get('content'))[:60]!r}); a session only grows: resend "
                    "its history unchanged, or open a new session",
                )
        fresh = [{"role": m["role"], "content": m.get("content") or ""} for m in messages[n:]]
        if not s.token_ids:
            return list(self.tok.apply_chat_template(fresh, add_generation_prompt=True))
        close = [] if s.token_ids[-1] in self.tok.stop_token_ids else self.tok.encode("<|im_end|>")
        return close + self.tok.encode("\n") + list(self.tok.apply_chat_template(fresh, add_generation_prompt=True))

    def _commit(self, s: Session, messages: list[dict], new_ids: list[int], out) -> dict:
        s.token_ids += new_ids + out.output_ids
        s.loss_mask += [0] * len(new_ids) + [1] * len(out.output_ids)
        s.log_probs += [0.0] * len(new_ids) + list(out.output_log_probs)
        s.weight_versions.append(out.weight_version)
        s.finish_reasons.append(out.finish_reason)
        stops = set(self.tok.stop_token_ids)
        text = self.tok.decode([t for t in out.output_ids if t not in stops], skip_special_tokens=False)
        calls, errors = parse_tool_calls(text)
        content = text if not calls else text[: text.find("<tool>")]
        s.messages = [dict(m) for m in messages] + [{"role": "assistant", "content": content}]
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        finish = "tool_calls" if calls else ("length" if out.finish_reason == "length" else "stop")
        n_prompt = len(s.token_ids) - len(out.output_ids)
        return {
            "id": f"chatcmpl-{s.sid}-{len(s.finish_reasons)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.instance_id,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": len(out.output_ids),
                "total_tokens": len(s.token_ids),
            },
            "miles": {
                "session_id": s.sid,
                "instance_id": self.instance_id,
                "output_ids": out.output_ids,
                "output_log_probs": out.output_log_probs,
                "weight_version": out.weight_version,
                "tool_call_errors": errors,
            },
        }

    # ---- flush --------------------------------------------------------------------------------------------
    def flush(self, timeout_s: float = 5.0, rollout: str = "", step: int = -1) -> dict:
        """Abort every session of this instance: in-flight turns end on the engine, sessions are dropped. With a
        ``rollout`` id and ``step`` >= 0, later opens of that rollout for that step (or an earlier one) are refused:
        on an instance that stalled, an open queued before the flush may run after it, and its caller is gone."""
        t0 = time.perf_counter()
        with self._lock:
            if rollout and step >= 0:
                self.fences[rollout] = max(self.fences.pop(rollout, -1), step)  # re-inserted: newest last
                while len(self.fences) > 1024:
                    del self.fences[next(iter(self.fences))]
            rids = [s.inflight for s in self.sessions.values() if s.inflight]
            for s in self.sessions.values():
                s.aborted = True
        if rids:
            self.policy.abort(rids)
        with self._lock:
            deadline = time.monotonic() + timeout_s
            while any(s.inflight for s in self.sessions.values()) and time.monotonic() < deadline:
                self._idle.wait(timeout=max(0.0, deadline - time.monotonic()))
            running = [s.sid for s in self.sessions.values() if s.inflight]
            n = len(self.sessions)
            if len(self.flushed) > 100_000:
                self.flushed.clear()
            self.flushed |= set(self.sessions)
            self.sessions = {sid: s for sid, s in self.sessions.items() if s.inflight}
            self.num_flushes += 1
        return {
            "instance_id": self.instance_id,
            "aborted_sessions": n,
            "aborted_requests": len(rids),
            "still_running": running,
            "seconds": time.perf_counter() - t0,
        }

    def health(self) -> dict:
        with self._lock:
            return {
                "instance_id": self.instance_id,
                "pid": os.getpid(),
                "sessions": len(self.sessions),
                "running": sum(bool(s.inflight) for s in self.sessions.values()),
                "flushes": self.num_flushes,
            }


def _check_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise SessionError(400, "invalid_request", "'messages' must be a non-empty list of {'role', 'content'} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content") or "", str):
            raise SessionError(
                400, "invalid_request", f"messages[{i}] = {str(m)[:80]!r} needs a string 'role' and 'content'"
            )
    return messages


def create_app(server: SessionServer, *, token: str, host: str = "127.0.0.1") -> FastAPI:
    """The instance's HTTP surface behind the guard: ``token`` on every path but /health, Host names of loopback
    and ``host`` (the bound address)."""
    if not token:
        raise ValueError(
            "a session server needs a run token (miles.agents.run_token.new_token()); it never serves without"
        )
    app = FastAPI(title=f"miles session server {server.instance_id}")
    app.add_middleware(HttpGuard, api_key=token, allowed_hosts=allowed_hosts(host), key_hint=KEY_HINT)

    @app.exception_handler(SessionError)
    async def _error(request: Request, e: SessionError):
        return JSONResponse({"error": {"message": str(e), "type": e.code, "code": e.code}}, status_code=e.status)

    @app.post("/sessions")
    def open_session(body: dict = Body(default={})):
        return {"session_id": server.open(body.get("metadata")), "instance_id": server.instance_id}

    @app.post("/sessions/{sid}/v1/chat/completions")
    def chat(sid: str, body: dict = Body(...)):
        return server.chat(sid, body)

    @app.post("/v1/chat/completions")
    def chat_by_field(body: dict = Body(...)):
        if not isinstance(body.get("session_id"), str):
            raise SessionError(
                400,
                "invalid_request",
                "POST /v1/chat/completions needs 'session_id' in the body (or use /sessions/<id>/v1 as the base URL)",
            )
        return server.chat(body["session_id"], body)

    @app.get("/sessions/{sid}")
    def get(sid: str):
        return server.get(sid)

    @app.delete("/sessions/{sid}")
    def close(sid: str):
        return server.close(sid)

    @app.post("/flush")
    def flush(body: dict = Body(default={})):
        rollout, step = body.get("rollout", ""), body.get("step", -1)
        if not isinstance(step, int) or not isinstance(rollout, str):
            raise SessionError(
                400,
                "invalid_request",
                f"POST /flush: 'rollout' = {rollout!r} should be a string and 'step' = {step!r} an integer",
            )
        return server.flush(float(body.get("timeout_s", 5.0)), rollout, step)

    @app.get("/health")
    def health():
        return server.health()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": server.instance_id, "object": "model"}]}

    return app


def main(argv: list[str] | None = None) -> int:
    """One instance per port. A port range forks one child process per port after the imports, so N instances
    pay for one torch import; each child is still its own process (its pid is in /health)."""
    from miles.config import parse_ports

    p = argparse.ArgumentParser(prog="python -m miles.agents.session_server")
    p.add_argument("--port", required=True, help="a port (8100) or a range (8100-8103): one instance per port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--instance-id", default="", help="for a single port; default agent-<port>")
    p.add_argument("--engine", default="embedded", help="'embedded' or an SGLang-compatible URL")
    p.add_argument("--model-json", default="", help="ModelConfig fields as JSON (embedded engine)")
    p.add_argument("--tokenizer", default="bytes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seq-len", type=int, default=0)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads (embedded engine)")
    p.add_argument("--device", default="cpu", help="embedded engine device (cuda: each instance builds its own)")
    p.add_argument(
        "--token-file",
        default="",
        help="file (mode 600) holding the run token; default $MILES_AGENT_TOKEN, else a fresh one (path printed)",
    )
    a = p.parse_args(argv)
    ports = parse_ports(a.port)
    a.token = server_token("miles session server", a.token_file)  # read once, before any fork
    torch.set_num_threads(a.threads)
    engine = None
    if a.engine == "embedded" and a.device == "cpu":  # built once, before the fork: children share it copy-on-write
        engine = _engine(a)
    if len(ports) == 1:
        return _serve(a, ports[0], a.instance_id or f"agent-{ports[0]}", engine)
    children = []
    for port in ports:
        pid = os.fork()
        if pid == 0:
            os._exit(_serve(a, port, f"agent-{port}", engine))
        children.append(pid)
    signal.signal(signal.SIGTERM, lambda *_: [_kill_quietly(c) for c in children])
    for c in children:
        os.waitpid(c, 0)
    return 0


def _engine(a):
    from miles.agents.policy import make_engine

    return make_engine(
        a.model_json, seed=a.seed, max_seq_len=a.max_seq_len, max_batch_size=a.max_batch_size, device=a.device
    )


def _serve(a, port: int, instance_id: str, engine) -> int:
    from miles.agents.policy import make_policy
    from miles.model.tokenizer import load_tokenizer

    if engine is None and a.engine == "embedded":  # CUDA cannot cross a fork: build after it
        engine = _engine(a)
    policy = make_policy(a.engine, engine)  # threads start here, after any fork
    server = SessionServer(policy, load_tokenizer(a.tokenizer), instance_id=instance_id)
    app = create_app(server, token=a.token, host=a.host)
    uvicorn.run(app, host=a.host, port=port, log_level="warning", http=guarded_protocol())
    return 0


def _kill_quietly(pid: int) -> None:
    try:  # instances hold only ephemeral sessions: no graceful shutdown to wait for
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    raise SystemExit(main())
