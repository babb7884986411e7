"""Tokenizer files of three chat-model families, made here: each family's real chat template (tests/envs/templates,
read from the families' published tokenizer_config.json files) over a byte-level BPE trained on a few lines, with
the family's special tokens and pre-tokenizer. The ids differ from the real vocabularies; what the tests check (how
a template renders turns, where tokens merge across a boundary) does not depend on them."""

from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"
# the pre-tokenizer split patterns of the published tokenizer.json files
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
FAMILIES = {
    "smollm2": {
        "template": "smollm2.jinja",
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "added": [],
        "bos": "<|im_start|>",
        "eos": "<|im_end|>",
        "split": None,
    },
    "qwen3": {
        "template": "qwen3.jinja",
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "added": ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"],
        "bos": None,
        "eos": "<|im_end|>",
        "split": QWEN_SPLIT,
    },
    "llama3": {
        "template": "llama3_1.jinja",
        "special": [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ],  # fmt: skip
        "added": [],
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "split": LLAMA3_SPLIT,
    },
}
CORPUS = [
    "What is 37 * 48 + 125? Give the final answer as a number.",
    'The answer is 1901.\n\n{"name": "calculate", "arguments": {"expression": "37 * 48 + 125"}}',
    '{"name": "calculate", "parameters": {"expression": "(12 + 7) * 3"}}',
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "user assistant system tool ipython function call result expression tools",
    "# Tools\n\nYou may call one or more functions to assist with the user query.",
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n",
    "Let me think.\n\nFirst multiply, then add.\n\n\n",
]


def family_tokenizer_dir(family: str, out: Path, vocab_size: int = 700, corpus: list[str] = ()) -> Path:
    """A directory with tokenizer.json + tokenizer_config.json for ``family`` (load with 'hf:<dir>')."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    spec = FAMILIES[family]
    tok = tokenizers.Tokenizer(models.BPE())
    if spec["split"] is None:  # SmolLM2: digits one by one, then GPT-2's byte level
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(tokenizers.Regex(spec["split"]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=spec["special"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*CORPUS, *corpus] * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=spec["eos"], bos_token=spec["bos"])
    if spec["added"]:
        fast.add_tokens(spec["added"])
    fast.chat_template = (TEMPLATES / spec["template"]).read_text()
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return out


def family_tokenizer(family: str, out: Path, **kw):
    from miles.model.tokenizer import load_tokenizer

    return load_tokenizer(f"hf:{family_tokenizer_dir(family, out, **kw)}")
