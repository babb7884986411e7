"""One episode: an environment, its conversation, its trajectory and its rewards, advanced one turn at a time.

The sample source drives many episodes in lockstep (miles.envs.runner); an episode only knows its own state:

    ep = Episode(env, row, renderer, limits, index=0, group=0)
    ep.opened(bounded_all([ep.reset_call()], timeout_s)[0])   # env.reset's answer: the prompt's tokens
    req = ep.request(sampling, rid)        # None once the episode is over or out of token budget
    ep.absorb(output)                      # the sampled tokens, parsed into an assistant message
    ep.finish_step(result_or_error)        # env.step's answer: rewards, the env turn's tokens, or the end
    sample = ep.to_sample()

An environment that raises, runs past ``step_timeout_s`` or answers with garbage ends its episode as ``failed``
with the error kind counted; its tokens are then not trained on (the failure is the environment's, not the
policy's). An episode whose request the engine aborted ends as ``aborted``, likewise untrained.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from miles.envs.api import EnvError, StepResult, check_reset, check_step
from miles.envs.drift import DriftReport, compare, rerender_ids
from miles.envs.trajectory import Trajectory, char_ranges
from miles.protocols.engine import GenerateOutput, GenerateRequest, SamplingParams
from miles.samples import Sample


@dataclass(frozen=True, slots=True)
class Limits:
    max_turns: int
    max_tokens_per_turn: int
    max_episode_tokens: int
    step_timeout_s: float
    check_drift: bool = True


@dataclass(slots=True)
class Episode:
    env: object
    row: dict
    renderer: object
    limits: Limits
    index: int
    group: int
    name: str = "env"
    messages: list[dict] = field(default_factory=list)  # the conversation as the template re-renders it
    tools: list[dict] = field(default_factory=list)
    traj: Trajectory | None = None
    turn: int = 0
    rewards: list[float] = field(default_factory=list)
    status: str = "running"  # running | done | max_turns | budget | failed | aborted
    error: str = ""
    error_kind: str = ""
    num_tool_calls: int = 0
    num_malformed: int = 0
    num_truncated: int = 0  # turns cut at max_tokens_per_turn (closed by the template's end token, masked)
    info: dict = field(default_factory=dict)
    weight_version: int = 0  # of the last turn the engine answered (abort included: it keeps no trained token)
    answered: bool = False  # the engine answered a turn (a failed reset or an aborted first turn: no)
    pending: dict | None = None  # the parsed assistant message awaiting env.step
    drift: DriftReport | None = None
    finish_reason: str = "stop"

    @property
    def running(self) -> bool:
        return self.status == "running"

    # ---- the episode's steps -------------------------------------------------------------------------------
    def reset_call(self):
        """What the runner calls (in a bounded thread) to open this episode."""
        return lambda: self.env.reset(self.row)

    def opened(self, result) -> None:
        """env.reset's answer (or the EnvError it ended in): the conversation, the tools, the prompt's tokens."""
        try:
            self.messages, self.tools = check_reset(_raise(result), self.name)
            text = self.renderer.text(self.messages, self.tools, generation_prompt=True)
        except EnvError as e:
            return self.fail(e, prompt=[])
        except Exception as e:  # the template refused the env's messages (e.g. roles it does not allow)
            return self.fail(EnvError("garbage", f"rendering the opening messages: {type(e).__name__}: {e}"), prompt=[])
        self.traj = Trajectory(self.renderer.tok.encode(text))

    def request(self, sampling: SamplingParams, rid: str) -> GenerateRequest | None:
        if not self.running:
            return None
        budget = min(self.limits.max_tokens_per_turn, self.limits.max_episode_tokens - len(self.traj))
        if budget < 1:
            self.status = "budget"
            return None
        s = SamplingParams(
            max_new_tokens=budget,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            stop_token_ids=sampling.stop_token_ids,
        )
        return GenerateRequest(rid=rid, input_ids=list(self.traj.token_ids), sampling=s)

    def absorb(self, out: GenerateOutput) -> None:
        """The engine's answer to this turn's request: its tokens join the trajectory, its text is parsed."""
        tok, fmt = self.renderer.tok, self.renderer.format
        self.finish_reason = out.finish_reason
        self.num_truncated += out.finish_reason == "length"
        if out.finish_reason != "abort":  # an abort's version may be made up (the runner's flush answers 0)
            self.weight_version, self.answered = out.weight_version, True
        if out.finish_reason == "abort":
            self.status, self.error = "aborted", "the engine aborted this turn's request (a flush)"
            self.traj.zero_mask()
            return
        texts = tok.token_text(out.output_ids)
        text = tok.decode(out.output_ids, skip_special_tokens=False)
        calls = char_ranges(text, fmt.call_open.strip(), fmt.call_close.strip())
        prefix = self.renderer.rules.generation_prompt
        parsed = fmt.parse(text, prefix=prefix)
        names = [c["function"]["name"] for c in parsed.get("tool_calls", [])]
        labels = [(a, b, names[i] if i < len(names) else "?") for i, (a, b) in enumerate(calls)]
        self.traj.add_model(out.output_ids, out.output_log_probs, turn=self.turn, texts=texts, calls=labels)
        self.num_tool_calls += len(names)
        self.num_malformed += len(parsed.get("tool_call_errors", []))
        self.messages = self.messages + [self.renderer.assistant_for_render(parsed, text)]
        self.pending = parsed

    def step_call(self):
        """What the runner calls (in a bounded thread) for this episode's env.step."""
        message = self.pending
        return lambda: self.env.step(message)

    def finish_step(self, result) -> None:
        """env.step's answer (or the EnvError it ended in): rewards, then the next turn's tokens or the end."""
        self.pending = None
        try:
            step = result if isinstance(result, StepResult) else check_step(_raise(result), self.name)
        except EnvError as e:
            return self.fail(e)
        self.rewards.append(step.reward)
        self.info |= step.info
        self.turn += 1
        if step.done:
            return self._end("done")
        if self.turn >= self.limits.max_turns:
            return self._end("max_turns")
        try:
            env_text = self.renderer.env_text(self.messages, step.messages, self.tools)
        except Exception as e:  # a template error is the template's, reported on the episode
            return self.fail(EnvError("garbage", f"rendering the environment's turn: {type(e).__name__}: {e}"))
        if self.finish_reason == "length":  # the turn ran out of tokens: the template's end token closes it (masked)
            env_text = self.renderer.rules.turn_end + env_text
        ids = self.renderer.tok.encode(env_text)
        if len(self.traj) + len(ids) >= self.limits.max_episode_tokens:
            return self._end("budget")
        contents = [(m.get("content") or "", m["role"]) for m in step.messages]
        results = _find_all(env_text, contents)
        self.traj.add_env(ids, turn=self.turn - 1, texts=self.renderer.tok.token_text(ids), results=results)
        self.messages = self.messages + step.messages

    def fail(self, e: EnvError, prompt: list[int] | None = None) -> None:
        self.status, self.error_kind, self.error = "failed", e.kind, str(e)[:500]
        if self.traj is None:
            self.traj = Trajectory(prompt if prompt is not None else [])
        self.traj.zero_mask()
        self.pending = None
        self._close()

    def abort(self) -> None:
        if self.running:
            self.status, self.error = "aborted", "the rollout was flushed before this episode ended"
            self.traj.zero_mask()
            self._close()

    def _end(self, status: str) -> None:
        self.status = status
        if self.limits.check_drift and self.traj.model_turns():
            reference = rerender_ids(self.renderer, self.messages, self.tools, self.renderer.tok)
            self.drift = compare(self.traj.token_ids, reference, self.renderer.tok)
        self._close()

    def _close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            try:
                bounded(close, self.limits.step_timeout_s, self.name, "close")
            except EnvError:
                pass  # a close that fails leaves nothing this episode still needs

    # ---- the result ----------------------------------------------------------------------------------------
    @property
    def reward(self) -> float:
        return float(sum(self.rewards)) if self.status not in ("failed", "aborted") else 0.0

    def to_sample(self) -> Sample:
        tok = self.renderer.tok
        t = self.traj if self.traj is not None and len(self.traj) else Trajectory([tok.stop_token_ids[0]])
        p = t.prompt_len
        response, mask, log_probs = t.token_ids[p:], t.mask[p:], t.log_probs[p:]
        if not response:  # no model turn: one masked stop token stands in (a sample needs a response)
            response, mask, log_probs = [tok.stop_token_ids[0]], [0], [0.0]
        meta = {
            "loss_mask": mask,
            "spans": t.span_rows(),
            "status": self.status,
            "answered": self.answered,  # no: no token of it was sampled, so it has no weight version (staleness)
            "error": self.error,
            "error_kind": self.error_kind,
            "num_turns": self.turn,
            "num_tool_calls": self.num_tool_calls,
            "num_malformed": self.num_malformed,
            "num_truncated": self.num_truncated,
            "turn_rewards": list(self.rewards),
            "passed": bool(self.info.get("passed", False)),
            "drift": self.drift.row() if self.drift else None,
            "messages": self.messages,
        }
        return Sample(
            index=self.index,
            group=self.group,
            prompt=str(self.row.get("prompt", "")),
            target=str(self.row.get("answer", "")),
            prompt_ids=t.token_ids[:p],
            response_ids=response,
            rollout_log_probs=log_probs,
            response_text=tok.decode(response, skip_special_tokens=False),
            finish_reason=self.finish_reason if self.status != "aborted" else "abort",
            reward=self.reward,
            weight_version=self.weight_version,
            metadata=meta,
        )


def bounded(fn, timeout_s: float, name: str, what: str):
    """``fn()`` in a daemon thread, at most ``timeout_s``: its value, or EnvError('raised' | 'timeout').

    A call past its time is abandoned, not stopped (Python cannot kill a thread): it runs on in the background
    and its result is dropped. An environment whose calls hang should run its work out of process, as the
    Python tool does (miles.envs.python_tool)."""
    return _raise(bounded_all([fn], timeout_s, name, what)[0])


def bounded_all(calls: list, timeout_s: float, name: str = "env", what: str = "step") -> list:
    """Each call in its own daemon thread, all started together and given ``timeout_s`` from now: per call its
    value or an EnvError ('raised' | 'timeout'), in order (see ``bounded`` for what a late call leaves behind)."""
    boxes = [{} for _ in calls]

    def run(fn, box):
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (any failure of user code fails that episode only)
            box["error"] = e

    threads = [
        threading.Thread(target=run, args=(fn, box), name=f"env-{what}", daemon=True) for fn, box in zip(calls, boxes)
    ]
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.start()
    out = []
    for t, box in zip(threads, boxes):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            out.append(EnvError("timeout", f"{name}.{what} did not return within env.step_timeout_s = {timeout_s} s"))
        elif "error" in box:
            e = box["error"]
            out.append(EnvError("raised", f"{name}.{what} raised {type(e).__name__}: {e}"))
        else:
            out.append(box.get("value"))
    return out


def _raise(result):
    if isinstance(result, EnvError):
        raise result
    return result


def _find_all(text: str, contents: list[tuple[str, str]]) -> list[tuple[int, int, str]]:
    """Character ranges of each message's content in the env text, searched in order."""
    out, at = [], 0
    for content, role in contents:
        if not content:
            continue
        i = text.find(content, at)
        if i >= 0:
            out.append((i, i + len(content), role))
            at = i + len(content)
    return out
