"""What ``miles serve`` knows about the model it serves beyond the engine: its name, its tokenizer (text prompts,
detokenized ``text``, stop strings, chat templates) and the token ids that end generation by default.

SGLang's server holds the model's tokenizer and stops at its EOS unless ``ignore_eos`` (0.5.10.post1,
``schedule_batch.Req._check_token_based_finish``: the tokenizer's ``eos_token_id`` and the model config's
``eos_token_id``, which may be a list). ``ServedModel.of(model_cfg, max_seq_len)`` builds the same from a
ModelConfig: ``tokenizer`` (the built-in byte tokenizer, or a Hugging Face one) and, for a checkpoint directory,
its config.json and generation_config.json.

    model = ServedModel.of(engine.cfg, engine.max_seq_len)
    ids = model.encode("2 + 2 =")                  # as SGLang tokenizes a text prompt
    text = model.decode(out_ids)                   # skip_special_tokens by default, as SGLang
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class ServedModel:
    name: str  # the served model name (/v1/models, model_path): the checkpoint, else the recipe
    vocab_size: int
    max_seq_len: int
    tokenizer: object | None = None  # miles.model.tokenizer.ByteTokenizer / HFTokenizer
    tokenizer_path: str = ""
    eos_ids: tuple[int, ...] = ()
    model_type: str = ""
    architectures: list = field(default_factory=list)

    @staticmethod
    def of(m, max_seq_len: int, name: str = "") -> "ServedModel":
        """From a ModelConfig; ``name`` defaults to the checkpoint, else "miles"."""
        from miles.model.tokenizer import load_tokenizer

        tok = load_tokenizer(m.tokenizer)
        eos = {tok.eos_token_id} | _checkpoint_eos(m.checkpoint)
        hf = _read_json(os.path.join(m.checkpoint, "config.json")) if os.path.isdir(m.checkpoint or "") else {}
        return ServedModel(
            name=name or m.checkpoint or "miles",
            vocab_size=m.vocab_size,
            max_seq_len=max_seq_len,
            tokenizer=tok,
            tokenizer_path=m.tokenizer.removeprefix("hf:") if m.tokenizer != "bytes" else "bytes",
            eos_ids=tuple(sorted(i for i in eos if isinstance(i, int) and 0 <= i < m.vocab_size)),
            model_type=hf.get("model_type") or m.architecture,
            architectures=hf.get("architectures") or [],
        )

    # ---- text <-> ids ------------------------------------------------------------------------------------------
    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise ValueError(f"{what} needs the model's tokenizer, and this server has none; send input_ids")
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        """A text prompt's ids as SGLang makes them (``tokenizer.encode(text)``: with the tokenizer's own special
        tokens, e.g. Llama's BOS)."""
        tok = self._need_tokenizer("a text prompt")
        hf = getattr(tok, "tok", None)
        return list(hf.encode(text)) if hf is not None else tok.encode(text)

    def encode_plain(self, text: str) -> list[int]:
        """Ids without special tokens (how SGLang measures a stop string's length in tokens)."""
        return self._need_tokenizer("a stop string").encode(text)

    def decode(self, ids, *, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> str:
        tok = self._need_tokenizer("text output")
        hf = getattr(tok, "tok", None)
        if hf is None:
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)
        kw = {"skip_special_tokens": skip_special_tokens}
        try:
            return hf.decode([int(i) for i in ids], spaces_between_special_tokens=spaces_between_special_tokens, **kw)
        except TypeError:  # tokenizers without the option (fast ones ignore it anyway)
            return hf.decode([int(i) for i in ids], **kw)

    def token_texts(self, ids) -> list[str]:
        """One string per token, special tokens written out (SGLang's ``batch_decode([[id] ...])``)."""
        return [self.decode([i], skip_special_tokens=False) for i in ids]

    def chat_ids(self, messages: list[dict], *, tools=None, add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """The prompt ids of a chat through the model's chat template (the tokenizer's own for a HF model)."""
        tok = self._need_tokenizer("a chat request")
        hf = getattr(tok, "tok", None)
        if hf is None:
            if tools:
                raise ValueError("tools need a chat template that renders them; the byte tokenizer's does not")
            return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        out = hf.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
        )
        return list(out["input_ids"] if hasattr(out, "keys") else out)


def _checkpoint_eos(path: str) -> set[int]:
    """``eos_token_id`` of a checkpoint directory's config.json and generation_config.json (an int or a list)."""
    if not path or not os.path.isdir(path):
        return set()
    out: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        v = _read_json(os.path.join(path, name)).get("eos_token_id")
        out |= set(v) if isinstance(v, list) else {v} if isinstance(v, int) else set()
    return out


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}
