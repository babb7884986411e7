"""Tokenizers: a self-contained byte-level one (the CPU default) and a thin adapter over a Hugging Face one.

Both expose the same small surface the rollout side needs: encode/decode, special ids, a chat template and
per-token display strings for the dashboard.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ("<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>", "<tool>", "<unk>", "<sep>")


class ByteTokenizer:
    """UTF-8 bytes 0..255, then the special tokens. Round-trips any string exactly.

    tok = ByteTokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    tok.decode(ids, skip_special_tokens=False)  # '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'
    """

    name = "bytes"

    def __init__(self):
        self.special_ids = {s: 256 + i for i, s in enumerate(SPECIALS)}
        self.pad_token_id = self.special_ids["<pad>"]
        self.bos_token_id = self.special_ids["<bos>"]
        self.eos_token_id = self.special_ids["<eos>"]
        self.im_end_id = self.special_ids["<|im_end|>"]

    @property
    def vocab_size(self) -> int:
        return 256 + len(SPECIALS)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = []
        i = 0
        while i < len(text):  # special tokens written literally in the text become their ids
            if text[i] == "<":
                for s, sid in self.special_ids.items():
                    if text.startswith(s, i):
                        ids.append(sid)
                        i += len(s)
                        break
                else:
                    ids.extend(text[i].encode())
                    i += 1
            else:
                ids.extend(text[i].encode())
                i += 1
        return ([self.bos_token_id] if add_bos else []) + ids

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        out, buf = [], bytearray()
        names = {v: k for k, v in self.special_ids.items()}
        for i in ids:
            i = int(i)
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode(errors="replace"))
            buf = bytearray()
            if not skip_special_tokens:
                out.append(names.get(i, "<unk>"))
        out.append(buf.decode(errors="replace"))
        return "".join(out)

    def token_text(self, ids) -> list[str]:
        """One display string per token (bytes that are not printable ASCII shown as \\xNN)."""
        names = {v: k for k, v in self.special_ids.items()}
        out = []
        for i in ids:
            i = int(i)
            if i >= 256:
                out.append(names.get(i, "<unk>"))
            elif 32 <= i < 127 or i in (9, 10):
                out.append(chr(i))
            else:
                out.append(f"\\x{i:02x}")
        return out

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self.encode(text)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.eos_token_id, self.im_end_id)


class HFTokenizer:
    """Adapter over a transformers tokenizer (e.g. SmolLM2's, read offline from its GGUF file)."""

    def __init__(self, source: str):
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # pragma: no cover
            raise ImportError("model.tokenizer = 'hf:...' needs transformers: pip install 'miles[dev]'") from e
        path = source.removeprefix("hf:")
        if path.endswith(".gguf"):
            import os

            self.tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        else:
            self.tok = AutoTokenizer.from_pretrained(path)
        self.name = source
        self.pad_token_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.eos_token_id = self.tok.eos_token_id
        self.bos_token_id = self.tok.bos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False)
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_text(self, ids) -> list[str]:
        return [self.tok.decode([int(i)]) for i in ids]

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        out = self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        ids = {self.eos_token_id}
        im_end = self.tok.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != self.tok.unk_token_id:
            ids.add(im_end)
        return tuple(i for i in ids if i is not None)


def load_tokenizer(spec: str):
    if spec == "bytes":
        return ByteTokenizer()
    if spec.startswith("hf:"):
        return HFTokenizer(spec)
    raise ValueError(f"model.tokenizer = {spec!r} is not known; use 'bytes' or 'hf:<dir or .gguf file>'")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_own_tokenizer(checkpoint: str) -> bool:
    """Whether a checkpoint carries its tokenizer: a GGUF file does (its metadata), an HF directory when it has
    tokenizer.json or tokenizer_config.json."""
    p = Path(checkpoint)
    return p.suffix == ".gguf" or any((p / f).is_file() for f in TOKENIZER_FILES)


def tokenizer_size(spec: str) -> int | None:
    """How many ids the tokenizer ``spec`` produces (its largest id + 1), from its files without loading it;
    None where only loading it would tell (a GGUF file, a tokenizer without tokenizer.json)."""
    if spec == "bytes":
        return ByteTokenizer().vocab_size
    path = Path(spec.removeprefix("hf:")) / "tokenizer.json"
    if not spec.startswith("hf:") or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (ValueError, OSError):
        return None  # loading it will say what is wrong, with transformers' words
    vocab = (data.get("model") or {}).get("vocab") if isinstance(data, dict) else None
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab or [])))
    ids += [t.get("id") for t in data.get("added_tokens") or [] if isinstance(t, dict)]
    ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]
    return max(ids) + 1 if ids else None
