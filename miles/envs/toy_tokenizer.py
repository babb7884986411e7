"""A CPU-sized stand-in for a checkpoint's tokenizer: a byte-level BPE trained on calculator episodes, with SmolLM2's
chat template and special tokens, so that a tool call is a dozen tokens instead of a hundred bytes.

The quickstart tool run (recipe ``quickstart_tools``) and notebook 14 train a tiny model with it; the code path is
the one a real checkpoint takes (``model.tokenizer = 'hf:<dir>'``, the template rendered by transformers, Hermes
tool calls parsed by transformers' response parser). Written once per directory; deterministic.

    path = toy_tokenizer_dir()            # ~/.cache/miles/toy-tokenizer-v1 (or $MILES_CACHE_DIR)
    cfg.model.tokenizer = f"hf:{path}"
"""

from __future__ import annotations

import os
from pathlib import Path

# SmolLM2-135M-Instruct's chat template (its tokenizer_config.json "chat_template"), verbatim
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>'"
    " + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt "
    "%}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
VERSION = 2


def toy_tokenizer_dir(out_dir: str | os.PathLike | None = None, vocab_size: int = 1024) -> str:
    """The tokenizer directory (built on first use). Digits are single tokens and newlines stand alone (as in SmolLM2's
    pre-tokenizer, so no merge crosses a turn boundary); between them the BPE may merge across words, which packs the
    tool list and the call's JSON into a few tokens each: the point of a CPU-sized vocabulary for this one task."""
    root = Path(
        out_dir
        or Path(os.environ.get("MILES_CACHE_DIR", Path.home() / ".cache" / "miles"))
        / f"toy-tokenizer-v{VERSION}-{vocab_size}"
    )
    if not (root / "tokenizer_config.json").exists():
        _build(root, vocab_size)
    return str(root)


def _corpus() -> list[str]:
    from miles.envs.calculator import TOOL, TOOL_SHORT, CalculatorEnv, rows
    from miles.envs.tool_formats import tool_format

    fmt = tool_format("hermes")
    texts = [
        fmt.tools_preamble([TOOL]),
        fmt.tools_preamble([TOOL_SHORT]),
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    ]
    for row in rows(300, seed=12345):
        env = CalculatorEnv()
        messages, _ = env.reset(row)
        call = env.expert_reply(messages, fmt)
        texts += [row["prompt"], call, f"The answer is {row['answer']}.", "user assistant system tool"]
    return texts


def _build(root: Path, vocab_size: int) -> None:
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split("\n", behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = SMOLLM2_TEMPLATE
    tmp = root.with_name(root.name + f".tmp{os.getpid()}")
    fast.save_pretrained(tmp)
    os.makedirs(root.parent, exist_ok=True)
    try:
        os.rename(tmp, root)
    except OSError:  # another process built it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
