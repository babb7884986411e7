"""The checkpoint's own chat template, rendered with tools, and the rule that splices environment turns into a
trajectory without re-tokenizing what the model sampled.

A trajectory is the prompt's tokens, then for each turn the tokens the model sampled and the tokens of the
environment's answer. The environment's answer is rendered by the template itself, as the text that a render of
the whole conversation puts after the assistant turn just sampled (``env_text``): the family's ``TurnRules`` (the
assistant header and the token that ends an assistant turn, read off the template by rendering a probe
conversation) find where that turn ends. Nothing before it is rendered again, so a template that is not
append-only (Qwen3 drops earlier ``<think>`` blocks and the empty one of a non-final turn; a template that adds or
drops a newline at a turn boundary) cannot change tokens the model already conditioned on: the trajectory keeps
them, and ``miles.envs.drift`` reports where a full re-render would differ.

Tools: a template that renders ``tools`` and assistant ``tool_calls`` itself (Qwen, Llama 3) gets them as they are
(native style). A template that ignores them (SmolLM2's) gets the tools listed in a system message in the family's
format, and the model's replies rendered as the text it wrote (inline style), which keeps such a template
append-only.

    r = Renderer(tokenizer, tool_format="auto")
    ids = tokenizer.encode(r.text(messages, tools, generation_prompt=True))     # the first prompt
    history = messages + [r.assistant_for_render(parsed, sampled_text)]
    env_ids = tokenizer.encode(r.env_text(history, new_messages, tools))      # appended after the sampled tokens
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from miles.envs.tool_formats import ToolFormat, detect_format, tool_format

# The byte tokenizer's conversation format (miles.model.tokenizer.ByteTokenizer.apply_chat_template) as a template.
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PROBE_USER, PROBE_REPLY = "P1NG-q7", "P0NG-a9"


class TemplateError(ValueError):
    """The chat template cannot be spliced by the family rules read off it (named, with what was found)."""


@dataclass(frozen=True, slots=True)
class TurnRules:
    """Where an assistant turn starts and ends in a family's rendering, read off its template by a probe."""

    header: str  # the text that opens an assistant turn, e.g. "<|im_start|>assistant"
    turn_end: str  # the token text that ends one, e.g. "<|im_end|>" or "<|eot_id|>"
    generation_prompt: str  # what add_generation_prompt appends, e.g. "<|im_start|>assistant\n"


class Renderer:
    """One tokenizer's chat template with tools, its turn rules and its tool-call format."""

    def __init__(self, tokenizer, *, tool_format: str = "auto", template_args: dict | None = None):
        self.tok = tokenizer
        self.template, self.special = _template_of(tokenizer)
        self.template_args = dict(template_args or {})
        self.native_tools = "tool_calls" in self.template  # the template renders assistant tool calls itself
        name = detect_format(self.template) if tool_format == "auto" else tool_format
        self.format: ToolFormat = _tool_format(name)
        self.rules = self._probe()
        self.stop_texts = {
            self.rules.turn_end,
            *(tokenizer.decode([i], skip_special_tokens=False) for i in tokenizer.stop_token_ids),
        }

    @property
    def family(self) -> str:
        return f"{self.format.name}/{'native' if self.native_tools else 'inline'}"

    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's stop ids and the family's turn-end token (Llama 3's <|eot_id|> is not always its eos)."""
        end = self.tok.encode(self.rules.turn_end)
        return tuple(dict.fromkeys([*self.tok.stop_token_ids, *(end if len(end) == 1 else [])]))

    # ---- rendering ----------------------------------------------------------------------------------------------
    def text(self, messages: list[dict], tools: list[dict] | None = None, *, generation_prompt: bool) -> str:
        """The template's text for ``messages`` (assistant turns as ``assistant_for_render`` made them)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        msgs, tools = self.with_tools(messages, tools or [])
        kwargs = {**self.special, **self.template_args}
        rendered, _ = render_jinja_template(
            [msgs], tools=tools or None, chat_template=self.template, add_generation_prompt=generation_prompt, **kwargs
        )
        return rendered[0]

    def with_tools(self, messages: list[dict], tools: list[dict]) -> tuple[list[dict], list[dict]]:
        """(messages, tools) as the template gets them: unchanged for native style; inline style moves the tools
        into the system message (a new one first when there is none)."""
        if self.native_tools or not tools:
            return messages, tools
        preamble = self.format.tools_preamble(tools)
        if messages and messages[0]["role"] == "system":
            first = {**messages[0], "content": messages[0]["content"] + "\n\n" + preamble}
            return [first, *messages[1:]], []
        return [{"role": "system", "content": preamble}, *messages], []

    def assistant_for_render(self, parsed: dict, sampled_text: str) -> dict:
        """The assistant message a re-render of this turn should show: the parsed message (content, tool calls with
        dict arguments, reasoning) for a template that renders tool calls, else the text the model wrote."""
        if self.native_tools and not parsed.get("tool_call_errors"):
            keep = ("role", "content", "tool_calls", "reasoning_content")
            return {k: parsed[k] for k in keep if k in parsed}
        return {"role": "assistant", "content": self.strip_stop(sampled_text)}

    def strip_stop(self, text: str) -> str:
        """``text`` without a trailing stop token (what a template puts back itself when it renders the turn)."""
        for stop in sorted(self.stop_texts, key=len, reverse=True):
            if stop and text.endswith(stop):
                return text[: -len(stop)]
        return text

    # ---- splicing ----------------------------------------------------------------------------------------------
    def env_text(self, history: list[dict], new_messages: list[dict], tools: list[dict] | None = None) -> str:
        """The text a render of ``history + new_messages`` (with the generation prompt) puts after the end token of
        the last assistant turn of ``history``: the environment's turn, to append after the sampled tokens."""
        n = self.text(history, tools, generation_prompt=False).count(self.rules.header)
        full = self.text(history + new_messages, tools, generation_prompt=True)
        at = _nth(full, self.rules.header, n)
        end = full.find(self.rules.turn_end, at + len(self.rules.header)) if at >= 0 else -1
        if end < 0:
            raise TemplateError(
                f"the chat template's render has no {self.rules.turn_end!r} after assistant turn {n} (header "
                f"{self.rules.header!r}); these turn rules do not fit it: {_excerpt(full, at)}"
            )
        return full[end + len(self.rules.turn_end) :]

    def _probe(self) -> TurnRules:
        """Read the header, the turn end and the generation prompt off a two-message render."""
        user = [{"role": "user", "content": PROBE_USER}]
        bare = self.text(user, generation_prompt=False)
        prompt = self.text(user, generation_prompt=True)
        turn = self.text(user + [{"role": "assistant", "content": PROBE_REPLY}], generation_prompt=False)
        if not prompt.startswith(bare) or not turn.startswith(bare) or PROBE_REPLY not in turn:
            raise TemplateError(
                "the chat template does not render a user message and a reply as a prefix plus a turn; miles cannot "
                f"splice its turns (user-only render {bare[-80:]!r}, with a reply {turn[-120:]!r})"
            )
        gen, opened = prompt[len(bare) :], turn[len(bare) : turn.index(PROBE_REPLY)]
        header = os.path.commonprefix([gen, opened]).rstrip()
        after = turn[turn.index(PROBE_REPLY) + len(PROBE_REPLY) :]
        first = self.tok.encode(after)[:1]
        turn_end = self.tok.decode(first, skip_special_tokens=False) if first else ""
        if not header or not turn_end or first[0] not in self.stop_token_ids_raw():
            raise TemplateError(
                f"the chat template's assistant turn opens with {opened!r} and ends with {after!r}; miles needs a "
                "header and an end token that is a stop token of the tokenizer (model.tokenizer)"
            )
        return TurnRules(header=header, turn_end=turn_end, generation_prompt=gen)

    def stop_token_ids_raw(self) -> set[int]:
        ids = set(self.tok.stop_token_ids)
        for name in ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<end_of_turn>"):
            enc = self.tok.encode(name)
            if len(enc) == 1 and self.tok.decode(enc, skip_special_tokens=False) == name:
                ids.add(enc[0])
        return ids


def _template_of(tokenizer) -> tuple[str, dict]:
    """(template text, special-token variables) of an HF tokenizer adapter, or ChatML for the byte tokenizer."""
    hf = getattr(tokenizer, "tok", None)
    if hf is None:
        return CHATML, {"bos_token": "<bos>", "eos_token": "<eos>"}
    template = hf.chat_template
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str) or not template:
        raise TemplateError(
            f"tokenizer {getattr(tokenizer, 'name', '?')} has no chat template; environments render with the "
            "checkpoint's template (tokenizer_config.json 'chat_template', or a GGUF's tokenizer.chat_template)"
        )
    return template, dict(hf.special_tokens_map)


def _tool_format(name: str) -> ToolFormat:
    try:
        return tool_format(name)
    except ValueError as e:
        raise ValueError(f"env.tool_format: {e}") from None


def _nth(text: str, sub: str, n: int) -> int:
    """Index of the n-th (1-based) occurrence of ``sub`` in ``text``; -1 when there are fewer."""
    at = -1
    for _ in range(n):
        at = text.find(sub, at + 1)
        if at < 0:
            return -1
    return at


def _excerpt(text: str, at: int) -> str:
    return repr(text[max(0, at) : max(0, at) + 160])
