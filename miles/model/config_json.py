"""The fields of a Hugging Face ``config.json`` that the embedded decoder is built from, each read with its type
checked: a ``config.json`` is a file on disk that anyone may have written by hand, and ``"64"``, ``64.5``,
``true`` or ``null`` where a count belongs would otherwise become a traceback deep in torch, or a model other
than the one the file describes (``"false"`` is truthy, ``true`` is 1 layer).

A field the file leaves out takes the value transformers gives it for that family, so that the decoder is the
model transformers would load from the same file.

    decoder_fields({"model_type": "qwen3", "hidden_size": 64, ...}, "ckpt/config.json")
    -> {"architecture": "qwen3", "hidden_size": 64, "num_key_value_heads": 4, "head_dim": 128, ...}
    decoder_fields({"hidden_size": "64", ...}, "ckpt/config.json")
    -> ValueError: ckpt/config.json: hidden_size = '64' must be an integer (a JSON number without quotes) ...
"""

from __future__ import annotations

import math

HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SUPPORTED = (
    "Llama (LlamaForCausalLM, incl. Llama 3.x rope_type llama3 and SmolLM2), Qwen2/2.5 (Qwen2ForCausalLM), "
    "Qwen3 (Qwen3ForCausalLM)"
)
REQUIRED_COUNTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# transformers' defaults for a field the file leaves out (LlamaConfig, Qwen2Config, Qwen3Config)
MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768}
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_RMS_NORM_EPS = 1e-6


def decoder_fields(hf, source: str) -> dict:
    """ModelConfig keyword arguments for the model ``hf`` (a parsed config.json, named ``source`` in errors)."""
    if not isinstance(hf, dict):
        raise ValueError(
            f"{source} holds a JSON {_json_kind(hf)}, not an object; a config.json is an object of fields such as "
            '{"model_type": "llama", "hidden_size": 64, ...}: use the file the model was saved with'
        )
    read = _Reader(hf, source)
    arch = _family(read)
    rope = _rope_fields(read)  # what the decoder cannot do is said before what the file lacks
    out = {k: read.count(k) for k in REQUIRED_COUNTS}
    heads = out["num_attention_heads"]
    out["num_key_value_heads"] = read.count("num_key_value_heads", default=heads)
    out["head_dim"] = read.count(
        "head_dim", default=128 if arch == "qwen3" else 0
    )  # Qwen3Config's; 0: hidden // heads  # Qwen3Config's default; 0 derives hidden // heads
    out["max_position_embeddings"] = read.count("max_position_embeddings", default=MAX_POSITIONS[arch])
    out["rms_norm_eps"] = read.number("rms_norm_eps", default=DEFAULT_RMS_NORM_EPS)
    out["tie_word_embeddings"] = read.flag("tie_word_embeddings", default=False)
    out["attention_bias"] = True if arch == "qwen2" else read.flag("attention_bias", default=False)
    out.update(rope)
    out["architecture"] = arch
    return out


_REQUIRED = object()


class _Reader:
    """One typed getter per kind of field; each error names the file, the field, the value and the fix. A null
    reads as a missing field (transformers writes null for "the family's default")."""

    def __init__(self, hf: dict, source: str, prefix: str = ""):
        self.hf, self.source, self.prefix = hf, source, prefix

    def fail(self, key: str, value, want: str, fix: str = ""):
        fix = fix or f"write {self.prefix}{key} as {want}, as transformers saves it"
        raise ValueError(f"{self.source}: {self.prefix}{key} = {value!r} must be {want}; {fix}")

    def _absent(self, key: str, default):
        if default is _REQUIRED:
            state = "is null" if key in self.hf else "is missing"
            raise ValueError(
                f"{self.source}: {self.prefix}{key} {state}; the decoder needs it: use the config.json the model "
                "was saved with"
            )
        return default

    def count(self, key: str, default=_REQUIRED) -> int:
        value = self.hf.get(key)
        if value is None:
            return self._absent(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            self.fail(key, value, "a positive integer (a JSON number without quotes or fraction)")
        return value

    def number(self, key: str, default=_REQUIRED) -> float:
        value = self.hf.get(key)
        if value is None:
            return self._absent(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            self.fail(key, value, "a finite positive number (a JSON number without quotes)")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.hf.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.fail(key, value, "true or false (a JSON boolean without quotes)")
        return value

    def text(self, key: str, default: str | None) -> str | None:
        value = self.hf.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            self.fail(key, value, "a string")
        return value


def _json_kind(value) -> str:
    kinds = {list: "list", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def _family(read: _Reader) -> str:
    model_type = read.text("model_type", "llama")
    names = read.hf.get("architectures") or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        read.fail("architectures", names, 'a list of class names, e.g. ["LlamaForCausalLM"]')
    if model_type not in HF_CLASSES or any(n != HF_CLASSES[model_type] for n in names):
        what = f"architecture {', '.join(names)} with " if names else ""
        raise ValueError(
            f"{what}model_type {model_type!r} is not supported by the embedded decoder; supported: {SUPPORTED}"
        )
    names = names or [HF_CLASSES[model_type]]
    layer_types = read.hf.get("layer_types") or []
    unsupported = {
        "hidden_act": read.text("hidden_act", "silu") != "silu",
        "mlp_bias": read.flag("mlp_bias", default=False),
        "use_sliding_window": read.flag("use_sliding_window", default=False),
        "layer_types": isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(
            f"{names[0]} with {', '.join(f'{k}={read.hf.get(k)!r}' for k in bad)} is not supported by the embedded "
            "decoder (it implements SiLU MLPs without bias and full attention)"
        )
    return model_type


def _rope_fields(read: _Reader) -> dict:
    """RoPE settings from either spelling: ``rope_scaling`` (transformers 4) or ``rope_parameters`` (5)."""
    hf = read.hf
    spelling = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    rope = hf.get(spelling) or {}
    if not isinstance(rope, dict):
        read.fail(spelling, rope, 'an object such as {"rope_type": "default", "rope_theta": 10000.0}')
    nested = _Reader(rope, read.source, f"{spelling}.")
    kind = nested.text("rope_type", None) or nested.text("type", "default")
    if "rope_theta" in hf and hf["rope_theta"] is None and rope.get("rope_theta") is None:
        read.fail("rope_theta", None, "a positive number", "write the rotary base, e.g. 10000.0 or 1000000.0")
    out = {"rope_theta": DEFAULT_ROPE_THETA}
    if hf.get("rope_theta") is not None:
        out["rope_theta"] = read.number("rope_theta")
    elif rope.get("rope_theta") is not None:
        out["rope_theta"] = nested.number("rope_theta")
    if kind == "llama3":
        return out | {
            "rope_type": "llama3",
            "rope_factor": nested.number("factor"),
            "rope_low_freq_factor": nested.number("low_freq_factor"),
            "rope_high_freq_factor": nested.number("high_freq_factor"),
            "rope_original_max_position_embeddings": nested.count("original_max_position_embeddings"),
        }
    if kind != "default":
        raise ValueError(
            f"rope_type {kind!r} is not supported by the embedded decoder; it implements 'default' and 'llama3'"
        )
    return out | {"rope_type": "default"}
