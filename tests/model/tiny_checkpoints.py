"""Tiny real checkpoints for the model tests, made offline by the libraries users make them with: a random-init
transformers model of each family saved by ``save_pretrained`` (a Qwen3 and a Llama 3 with rope_type llama3
among them), a real tokenizer (a byte-level BPE trained here on a few lines with ``tokenizers``, saved as a
PreTrainedTokenizerFast with a chat template), and a small GGUF file written by gguf-py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SMALL = dict(
    vocab_size=320,  # > the tokenizer's ids and the byte tokenizer's 264
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
FAMILIES = {
    "llama": ("LlamaConfig", dict(rope_theta=10000.0, tie_word_embeddings=False)),
    "llama3": (  # an untied head and rms_norm_eps 1e-5: both differ from the quickstart recipe's
        "LlamaConfig",
        dict(
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            num_key_value_heads=1,
            tie_word_embeddings=False,
            rope_scaling={  # original context 16 << the 40 tokens tested: every frequency band is in play
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=24, rope_theta=1000000.0, tie_word_embeddings=True)),
    "smollm2": ("LlamaConfig", dict(rope_theta=100000.0, tie_word_embeddings=True, num_key_value_heads=1)),
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "user assistant hello world",
    "What is 2 + 3? Answer with the number only.",
    "sort abcdef= abc bca cab fed def",
    "rev abc= copy abc= 0123456789",
]


def hf_model(family: str, **overrides):
    """A random-init transformers model of ``family`` (FP32, eval), its norms and biases moved off their
    initial values so that a missing one shows in the logits."""
    import transformers

    cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, cls)(**{**SMALL, **extra, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def save_tokenizer(directory: Path):
    """A byte-level BPE like Qwen's and Llama 3's (every string encodes), trained on ``CORPUS``, with ChatML
    special tokens and template; transformers writes tokenizer.json and tokenizer_config.json."""
    import tokenizers
    import transformers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def save_checkpoint(directory: Path, family: str, *, tokenizer: bool = True, shard: str = "1GB", **overrides):
    """``hf_model(family)`` saved by save_pretrained into ``directory`` (with the tokenizer files unless
    ``tokenizer=False``); returns the transformers model."""
    model = hf_model(family, **overrides)
    model.save_pretrained(directory, max_shard_size=shard)
    if tokenizer:
        save_tokenizer(directory)
    return model


def write_gguf(path: Path, seed: int, *, vocab: int = 300, hidden: int = 16, inter: int = 32, heads: int = 2) -> None:
    """A one-layer Llama as a GGUF file of FP32 tensors (random, from ``seed``), the metadata transformers'
    GGUF reader needs for the config; no tokenizer."""
    import gguf

    rng = np.random.default_rng(seed)
    t = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    kv = hidden // heads
    w.add_tensor("token_embd.weight", t(vocab, hidden))
    w.add_tensor("output_norm.weight", t(hidden))
    shapes = {
        "attn_norm": (hidden,),
        "ffn_norm": (hidden,),
        "attn_q": (hidden, hidden),
        "attn_k": (kv, hidden),
        "attn_v": (kv, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (inter, hidden),
        "ffn_up": (inter, hidden),
        "ffn_down": (hidden, inter),
    }
    for name, shape in shapes.items():
        w.add_tensor(f"blk.0.{name}.weight", t(*shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
