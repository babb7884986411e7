"""A multi-turn trajectory: the exact token ids of an episode, which of them the model sampled, and where each turn,
tool call and tool result lies.

Tokens only ever append: the prompt's tokens, then per turn the tokens the engine sampled (mask 1, the engine's
log-probs) and the tokens of the environment's rendered answer (mask 0, log-prob 0). The loss mask covers exactly
the sampled tokens. Spans (token ranges) name the parts for the dashboard: ``prompt``, ``model`` and ``env`` turns,
and inside them ``tool_call`` and ``tool_result`` ranges, found by the characters of each token's text.

    t = Trajectory(prompt_ids)
    t.add_model(out.output_ids, out.output_log_probs, turn=0, texts=tok.token_text(out.output_ids), calls=[(a, b, "calculate")])
    t.add_env(env_ids, turn=0, texts=tok.token_text(env_ids), results=[(a, b, "tool")])
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class Span:
    start: int  # first token
    end: int  # one past the last token
    kind: str  # "prompt" | "model" | "env" | "tool_call" | "tool_result"
    turn: int  # -1 for the prompt
    label: str = ""  # a tool call's name, a tool result's role


@dataclass(slots=True)
class Trajectory:
    token_ids: list[int]
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    prompt_len: int = 0

    def __post_init__(self):
        self.token_ids = list(self.token_ids)
        self.prompt_len = len(self.token_ids)
        self.mask = [0] * self.prompt_len
        self.log_probs = [0.0] * self.prompt_len
        self.spans = [Span(0, self.prompt_len, "prompt", -1)]

    def __len__(self) -> int:
        return len(self.token_ids)

    def add_model(
        self, ids: list[int], log_probs: list[float], *, turn: int, texts: list[str] = (), calls: list = ()
    ) -> None:
        """Sampled tokens; ``calls`` are (start char, end char, name) ranges in the turn's text."""
        if len(log_probs) != len(ids):
            raise ValueError(f"turn {turn}: {len(ids)} sampled tokens but {len(log_probs)} log-probs")
        start = len(self.token_ids)
        self._append(ids, [1] * len(ids), list(log_probs))
        self.spans.append(Span(start, len(self.token_ids), "model", turn))
        self._sub_spans(start, texts, calls, "tool_call", turn)

    def add_env(self, ids: list[int], *, turn: int, texts: list[str] = (), results: list = ()) -> None:
        """The environment's rendered turn; ``results`` are (start char, end char, label) ranges in its text."""
        start = len(self.token_ids)
        self._append(ids, [0] * len(ids), [0.0] * len(ids))
        self.spans.append(Span(start, len(self.token_ids), "env", turn))
        self._sub_spans(start, texts, results, "tool_result", turn)

    def _append(self, ids, mask, log_probs) -> None:
        self.token_ids += list(ids)
        self.mask += mask
        self.log_probs += log_probs

    def _sub_spans(self, start: int, texts, ranges, kind: str, turn: int) -> None:
        if not texts:
            return
        ends, total = [], 0
        for t in texts:
            total += len(t)
            ends.append(total)
        for a, b, label in ranges:
            first = next((i for i, e in enumerate(ends) if e > a), None)
            last = next((i for i, e in enumerate(ends) if e >= b), len(ends) - 1)
            if first is not None and b > a:
                self.spans.append(Span(start + first, start + last + 1, kind, turn, label))

    def zero_mask(self) -> None:
        """No token of this trajectory is trained on (a failed or aborted episode)."""
        self.mask = [0] * len(self.mask)

    def span_rows(self) -> list[dict]:
        return [asdict(s) for s in self.spans]

    def model_turns(self) -> list[tuple[int, int]]:
        return [(s.start, s.end) for s in self.spans if s.kind == "model"]


def char_ranges(text: str, open_tag: str, close_tag: str) -> list[tuple[int, int]]:
    """(start, end) character ranges of every ``open_tag ... close_tag`` in ``text`` (an unclosed one runs to the end);
    with an empty ``open_tag``, the whole stripped text when it starts with '{' (a Llama 3 JSON call)."""
    if not open_tag:
        stripped = text.strip()
        return [(text.index(stripped), text.index(stripped) + len(stripped))] if stripped.startswith("{") else []
    out, at = [], text.find(open_tag)
    while at >= 0:
        end = text.find(close_tag, at + len(open_tag))
        end = len(text) if end < 0 else end + len(close_tag)
        out.append((at, end))
        at = text.find(open_tag, end)
    return out
