"""Token drift: how a trajectory's tokens differ from a full re-render of the same conversation. Reported, never fixed.

Trainers that re-tokenize a transcript train on tokens the policy did not sample wherever the two differ, and they
differ for two reasons, told apart here:

- ``template``: the re-rendered text is not the text the model saw (Qwen3 drops earlier ``<think>`` blocks and the
  empty one of a non-final turn; a template adds or drops a newline at a turn boundary; Llama 3 drops the text
  beside a tool call);
- ``tokenization``: the text is the same but the ids are not (the model sampled a non-canonical split, or a merge
  crosses a turn boundary).

The comparison is a token diff (difflib over the id sequences), the drift figure the number of trajectory tokens
outside matching blocks; ``first`` is the first differing position, with the text around it on both sides.

    report = compare(traj.token_ids, reference_ids, tokenizer)
    report.kind, report.num_tokens, report.first
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class DriftReport:
    kind: str  # "none" | "tokenization" | "template"
    num_tokens: int  # trajectory tokens that the re-render does not have at the matching place
    first: int  # first differing token position in the trajectory (-1: none)
    trajectory_text: str = ""  # the text around ``first``, as sampled
    rerender_text: str = ""  # the same place in the re-render

    @property
    def drifted(self) -> bool:
        return self.kind != "none"

    def row(self) -> dict:
        return asdict(self)


def compare(trajectory: list[int], reference: list[int], tokenizer, context: int = 8) -> DriftReport:
    """The drift of ``trajectory`` against ``reference`` (the full re-render's tokens, cut where the trajectory ends)."""
    if list(trajectory) == list(reference):
        return DriftReport("none", 0, -1)
    ops = difflib.SequenceMatcher(None, trajectory, reference, autojunk=False).get_opcodes()
    changed = [(i1, i2, j1, j2) for tag, i1, i2, j1, j2 in ops if tag != "equal"]
    num = sum(max(i2 - i1, j2 - j1) for i1, i2, j1, j2 in changed)
    i1, _, j1, _ = changed[0]
    same_text = _text(tokenizer, trajectory) == _text(tokenizer, reference)
    return DriftReport(
        "tokenization" if same_text else "template",
        num,
        i1,
        _text(tokenizer, trajectory[max(0, i1 - context) : i1 + context]),
        _text(tokenizer, reference[max(0, j1 - context) : j1 + context]),
    )


def _text(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def rerender_ids(renderer, history: list[dict], tools: list[dict], tokenizer) -> list[int]:
    """The full re-render of a finished episode's ``history`` (ending with an assistant turn), tokenized in one go and
    cut after that turn's end token (what follows it, e.g. ChatML's newline, the model never conditioned on)."""
    text = renderer.text(history, tools, generation_prompt=False)
    rules = renderer.rules
    at = text.rfind(rules.header)
    end = text.find(rules.turn_end, at + len(rules.header)) if at >= 0 else -1
    return tokenizer.encode(text if end < 0 else text[: end + len(rules.turn_end)])
