"""The decoder's architecture config, with Hugging Face ``config.json`` field names.

Supported families: Llama (Llama 2/3.x, incl. ``rope_type: llama3`` scaling; SmolLM2 is one), Qwen2/2.5 (q/k/v
biases) and Qwen3 (per-head q/k RMSNorm, no attention bias). ``from_hf`` refuses anything else, naming it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from miles.config_check import check, require_finite
from miles.model.config_json import HF_CLASSES, decoder_fields
from miles.model.lora_config import LoRAConfig, targets


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    architecture: Literal["llama", "qwen2", "qwen3"] = "qwen2"  # the decoder family (HF model_type)
    vocab_size: int = 264  # rows of the embedding (the tokenizer's ids must fit)
    hidden_size: int = 128  # width of the residual stream
    intermediate_size: int = 384  # width of the MLP
    num_hidden_layers: int = 4  # decoder layers
    num_attention_heads: int = 4  # query heads
    num_key_value_heads: int = 2  # key/value heads (grouped-query attention when fewer than the query heads)
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rope_theta: float = 10000.0  # the rotary embedding's base
    rope_type: Literal["default", "llama3"] = "default"  # llama3: Llama 3.1+ frequency scaling (the fields below)
    rope_factor: float = 8.0  # llama3 scaling: low frequencies divided by this
    rope_low_freq_factor: float = 1.0  # llama3 scaling: wavelengths above original / this are divided fully
    rope_high_freq_factor: float = 4.0  # llama3 scaling: wavelengths below original / this are kept
    rope_original_max_position_embeddings: int = 8192  # llama3 scaling: the context the model was trained at
    rms_norm_eps: float = 1e-6  # RMSNorm's epsilon
    max_position_embeddings: int = 512  # longest sequence, prompt and completion together (at most the checkpoint's)
    tie_word_embeddings: bool = True  # the output head shares the embedding matrix
    attention_bias: bool = True  # Qwen2 has q/k/v biases; Llama and Qwen3 have none
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # the weights' dtype
    init_std: float = 0.02  # random init: the normal's standard deviation
    checkpoint: str = ""  # HF directory or .gguf file (--model): the model then is its, tokenizer too; "" = random init
    tokenizer: str = "bytes"  # "bytes" (built in) or "hf:<dir-or-gguf>" (needs transformers)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # low-rank adapters; rank 0 = full fine-tuning

    def __post_init__(self):
        if isinstance(self.lora, dict):  # as_dict() round trips (a checkpoint's model rebuilt from a section)
            self.lora = LoRAConfig(**self.lora)
        require_finite("model", self)
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
        check("model.head_dim", self.head_dim, ge=0, fix="0 derives it: hidden_size // num_attention_heads")
        check("model.rope_theta", self.rope_theta, gt=0, fix="the rotary base, e.g. 10000 (Llama 2) or 1e6 (Qwen2)")
        check("model.rope_factor", self.rope_factor, gt=0, fix="llama3 scaling's divisor, e.g. 8")
        check("model.rope_high_freq_factor", self.rope_high_freq_factor, gt=0, fix="e.g. 4 (llama3 scaling)")
        check("model.rope_low_freq_factor", self.rope_low_freq_factor, gt=0, fix="e.g. 1 (llama3 scaling)")
        check("model.rope_original_max_position_embeddings", self.rope_original_max_position_embeddings, gt=0)
        check("model.rms_norm_eps", self.rms_norm_eps, gt=0, fix="e.g. 1e-6")
        check("model.init_std", self.init_std, gt=0, fix="the random-init scale, e.g. 0.02")
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
        if self.rope_type == "llama3" and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError(
                f"model.rope_low_freq_factor = {self.rope_low_freq_factor} must be in (0, rope_high_freq_factor = "
                f"{self.rope_high_freq_factor}) for rope_type 'llama3'"
            )
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim = {self.head_dim} must be even for rotary embeddings")
        if self.lora.enabled:
            targets(self)  # a rank above a projection's size or a target matching nothing, refused here

    @property
    def num_parameters(self) -> int:
        h, i, v, L = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_hidden_layers
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        layer = attn + 3 * h * i + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        return v * h * (1 if self.tie_word_embeddings else 2) + L * layer + h

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises each head's queries and keys (RMSNorm over head_dim) before RoPE."""
        return self.architecture == "qwen3"

    def to_hf(self) -> dict:
        """The ``config.json`` a Hugging Face loader expects for this architecture."""
        cls = HF_CLASSES[self.architecture]
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
        if self.architecture in ("llama", "qwen3"):
            out["attention_bias"] = self.attention_bias
        if self.architecture == "llama":
            out["mlp_bias"] = False
        if self.rope_type == "llama3":
            out["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": self.rope_factor,
                "low_freq_factor": self.rope_low_freq_factor,
                "high_freq_factor": self.rope_high_freq_factor,
                "original_max_position_embeddings": self.rope_original_max_position_embeddings,
            }
        return out

    @classmethod
    def from_hf(cls, hf: dict | str | Path, **overrides) -> "ModelConfig":
        """From a ``config.json`` (dict or path), every field type-checked (miles.model.config_json); refuses an
        architecture or option the decoder does not implement. ``overrides`` replace fields as given (no check
        against the file: miles.model.from_checkpoint does that for a run's model)."""
        source = str(hf) if isinstance(hf, str | Path) else "config.json"
        if isinstance(hf, str | Path):
            hf = read_json(hf)
        return cls(**(decoder_fields(hf, source) | overrides))

    def as_dict(self) -> dict:
        return asdict(self)


def read_json(path: str | Path):
    """A config.json parsed, or a ValueError naming the file and where it stops being JSON."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); use the config.json the model was saved with") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text; use the config.json the model was saved with") from None
