"""The decoder's architecture config, with Hugging Face ``config.json`` field names (Llama / Qwen2)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    architecture: Literal["llama", "qwen2"] = "qwen2"
    vocab_size: int = 264
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    attention_bias: bool = True  # Qwen2 has q/k/v biases; Llama has none
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    init_std: float = 0.02
    checkpoint: str = ""  # HF-style directory (config.json + *.safetensors) or a .gguf file; "" = random init
    tokenizer: str = "bytes"  # "bytes" (built in) or "hf:<dir-or-gguf>" (needs transformers)

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} = {getattr(self, name)} must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model.num_attention_heads = {self.num_attention_heads} is not a multiple of "
                f"model.num_key_value_heads = {self.num_key_value_heads}; pick a divisor for the KV heads"
            )
        if not self.head_dim:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"model.hidden_size = {self.hidden_size} is not divisible by "
                    f"num_attention_heads = {self.num_attention_heads}; set model.head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim = {self.head_dim} must be even for rotary embeddings")

    @property
    def num_parameters(self) -> int:
        h, i, v, L = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_hidden_layers
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        layer = attn + 3 * h * i + 2 * h
        return v * h * (1 if self.tie_word_embeddings else 2) + L * layer + h

    def to_hf(self) -> dict:
        """The ``config.json`` a Hugging Face loader expects for this architecture."""
        cls = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.architecture]
        out = {
            "architectures": [cls],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": self.dtype,
        }
        if self.architecture == "llama":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = False
        return out

    @classmethod
    def from_hf(cls, hf: dict | str | Path, **overrides) -> "ModelConfig":
        if not isinstance(hf, dict):
            hf = json.loads(Path(hf).read_text())
        arch = hf.get("model_type", "llama")
        if arch not in ("llama", "qwen2"):
            raise ValueError(f"model_type {arch!r} is not supported by the embedded decoder; use llama or qwen2")
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in hf.items() if k in known and k not in ("architecture", "dtype")}
        kw["architecture"] = arch
        kw["attention_bias"] = hf.get("attention_bias", arch == "qwen2")
        kw["head_dim"] = hf.get("head_dim") or 0
        kw.update(overrides)
        return cls(**kw)

    def as_dict(self) -> dict:
        return asdict(self)
