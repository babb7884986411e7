"""Native tool-call formats: how a model family writes a call, and how its reply is read back into a message.

Two formats, each as data: the text a call is written as (the same text the family's chat template renders for
an assistant ``tool_calls`` entry, so a sampled call and its re-render agree), and a transformers response
template (``transformers.utils.chat_parsing``, the maintained parser behind ``tokenizer.parse_response``) that
reads a reply into ``{"role": "assistant", "content", "tool_calls", "reasoning_content"}``.

- ``hermes``: Hermes / Qwen2.5 / Qwen3 / SmolLM2: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  several per reply, reasoning in ``<think>...</think>``.
- ``llama3``: Llama 3.1-3.3 custom tools: the whole reply is ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``), one call per reply.

A reply that does not parse (bad JSON, a call without a name, arguments that are not an object) is not an error of
the run: the message keeps the reply's text as its content and ``tool_call_errors`` says what was wrong, so the
environment can answer it (and the reward can say it was wrong).

    fmt = tool_format("hermes")
    text = fmt.call_text("calculate", {"expression": "17*23"})
    message = fmt.parse(text + "<|im_end|>", prefix=prompt_text)
"""

from __future__ import annotations

import json
from dataclasses import dataclass

HERMES_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"},
        "tool_calls": {
            "open": "<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        # text before, between and after calls (a single field would keep only the last piece)
        "content": {
            "close": ["<|im_end|>", "<|endoftext|>", "<eos>"],
            "content": "text",
            "repeats": True,
            "join": "\n",
        },
    },
}

LLAMA3_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r"^\s*(?:<\|python_tag\|>)?(?=\{)",
            "close_pattern": r"(?=<\|eot_id\|>|<\|eom_id\|>)|$",
            "repeats": True,
            "content": "json",
            "transform": {
                "type": "function",
                "function": {"name": "{content.name}", "arguments": "{content.parameters}"},
            },
        },
        "content": {"close": ["<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"], "content": "text"},
    },
}


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    response_template: dict
    call_open: str  # the text before a call's JSON
    call_close: str  # the text after it
    arguments_key: str  # "arguments" (Hermes) or "parameters" (Llama 3)

    def call_text(self, name: str, arguments: dict) -> str:
        """A call as the family's template renders it (json.dumps separators, non-ASCII kept, as jinja's tojson)."""
        body = '{"name": "' + name + '", "' + self.arguments_key + '": ' + json.dumps(arguments, ensure_ascii=False)
        return self.call_open + body + "}" + self.call_close

    def tools_preamble(self, tools: list[dict]) -> str:
        """The system text that lists ``tools`` for a chat template that ignores ``tools=`` (SmolLM2's): Hermes
        wording, the format the family's own templates use when they do support tools."""
        lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        example = self.call_text("<function-name>", {}).replace("{}", "<args-json-object>")
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\n"
            f"For each function call, return a json object with function name and arguments within these tags:\n{example}"
        )

    def parse(self, text: str, *, prefix: str = "") -> dict:
        """The assistant message in ``text`` (one model turn, stop token included or not)."""
        from transformers.utils.chat_parsing import parse_response

        try:
            parsed = parse_response(text, self.response_template, prefix=prefix)
        except ValueError as e:
            return {"role": "assistant", "content": _strip_stop(text), "tool_call_errors": [_one_line(e)]}
        message = {"role": "assistant", "content": (parsed.get("content") or "").strip()}
        if parsed.get("reasoning_content"):
            message["reasoning_content"] = parsed["reasoning_content"]
        calls, errors = [], []
        for i, call in enumerate(parsed.get("tool_calls") or []):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                errors.append(f"call {i}: needs an object with a string 'name', got {str(fn)[:60]!r}")
            elif not isinstance(fn.get("arguments", {}), dict):
                errors.append(f"call {i} ({fn['name']}): '{self.arguments_key}' must be an object")
            else:
                calls.append(
                    {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": fn.get("arguments", {})},
                    }
                )
        if calls:
            message["tool_calls"] = calls
        if errors:
            message["tool_call_errors"] = errors
            message["content"] = message["content"] or _strip_stop(text)
        return message


FORMATS = {
    "hermes": ToolFormat("hermes", HERMES_TEMPLATE, "<tool_call>\n", "\n</tool_call>", "arguments"),
    "llama3": ToolFormat("llama3", LLAMA3_TEMPLATE, "", "", "parameters"),
}


def tool_format(name: str) -> ToolFormat:
    if name not in FORMATS:
        raise ValueError(f"tool format {name!r} is not known; use one of {', '.join(FORMATS)}")
    return FORMATS[name]


def detect_format(chat_template: str) -> str:
    """The family's format from its chat template's text: Llama 3's headers and "parameters", else Hermes."""
    if "<|start_header_id|>" in chat_template and '"parameters"' in chat_template:
        return "llama3"
    return "hermes"


def _strip_stop(text: str) -> str:
    for stop in ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>", "<eos>"):
        text = text.replace(stop, "")
    return text.strip()


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:300]
