"""Tool calls in model text: ``<tool>{"name": ..., "arguments": {...}}``, read into OpenAI's ``tool_calls`` shape.

The byte-level tokenizer has a ``<tool>`` special token; a call is that token followed by one JSON object.
Anything else after ``<tool>`` is a malformed call: it is reported (never raised), so a model that writes
garbage gets an error message back and, in the end, zero reward.
"""

from __future__ import annotations

import json

MARK = "<tool>"
_DECODER = json.JSONDecoder()


def parse_tool_calls(text: str) -> tuple[list[dict], list[str]]:
    """(OpenAI tool_calls, error strings) for every ``<tool>`` mark in ``text``."""
    calls, errors = [], []
    start = text.find(MARK)
    while start >= 0:
        body = text[start + len(MARK) :].lstrip()
        try:
            obj, _ = _DECODER.raw_decode(body)
        except ValueError as e:
            obj, err = None, f"call {len(calls) + len(errors)}: not JSON after <tool> ({e.msg} at char {e.pos})"
        else:
            err = _check(obj, len(calls) + len(errors))
        if err:
            errors.append(err)
        else:
            calls.append(
                {
                    "id": f"call_{len(calls)}",
                    "type": "function",
                    "function": {"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}))},
                }
            )
        start = text.find(MARK, start + len(MARK))
    return calls, errors


def _check(obj, i: int) -> str:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return f"call {i}: needs an object with a string 'name', got {str(obj)[:60]!r}"
    if not isinstance(obj.get("arguments", {}), dict):
        return f"call {i} ({obj['name']}): 'arguments' must be an object"
    return ""


def format_tool_call(name: str, **arguments) -> str:
    """The text a model should write to call ``name`` (for prompts and scripted test agents)."""
    return MARK + json.dumps({"name": name, "arguments": arguments})
