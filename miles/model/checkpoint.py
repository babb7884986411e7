"""Hugging Face checkpoint I/O: ``config.json`` + ``model.safetensors`` written atomically, and loading from
an HF directory or a GGUF file (through transformers' GGUF reader, offline)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from miles.atomic import atomic_write_bytes, atomic_write_text
from miles.model.config import ModelConfig


def save_hf(model, directory: str | os.PathLike) -> None:
    d = Path(directory)
    sd = {k: v.detach().contiguous().cpu() for k, v in model.hf_state_dict().items()}
    atomic_write_bytes(d / "model.safetensors", save(sd, metadata={"format": "pt"}))
    atomic_write_text(d / "config.json", json.dumps(model.config.to_hf(), indent=2))


def read_hf_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    p = Path(path)
    if p.suffix == ".gguf":
        return _read_gguf(p)
    index = p / "model.safetensors.index.json"
    if index.exists():  # a sharded checkpoint: the index names the file of every tensor
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({p / f for f in weight_map.values()})
        absent = [f.name for f in files if not f.exists()]
        if absent:
            raise FileNotFoundError(f"{index} lists shards that are not in {p}: {absent}; copy the whole checkpoint")
    else:
        files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {p}; expected a Hugging Face style checkpoint directory")
    sd = {}
    for f in files:
        sd.update(load_file(f))
    if index.exists():
        lost = sorted(set(weight_map) - set(sd))
        if lost:
            raise KeyError(f"{index} maps {len(lost)} tensors that its shards lack, e.g. {lost[:3]}")
    return sd


def _read_gguf(path: Path) -> dict[str, torch.Tensor]:
    """Dequantized FP32 weights of a GGUF file, cached as safetensors: dequantizing through transformers takes
    minutes on a small CPU, and every engine and trainer process of a run reads the same file."""
    st = path.stat()
    cache = Path(os.environ.get("MILES_CACHE_DIR", Path.home() / ".cache" / "miles")) / "gguf"
    cached = cache / f"{path.stem}-{st.st_size}-{int(st.st_mtime)}.safetensors"
    if cached.exists():
        return load_file(cached)
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # pragma: no cover
        raise ImportError("loading a .gguf checkpoint needs transformers and gguf: pip install 'miles[dev]'") from e
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    sd, seen = {}, set()
    for k, v in hf.state_dict().items():  # a tied lm_head shares the embedding's storage: keep the first name only
        if v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            sd[k] = v.detach().contiguous()
    atomic_write_bytes(cached, save(sd, metadata={"format": "pt", "source": str(path)}))
    return sd


def load_weights(model, path: str | os.PathLike) -> None:
    sd = read_hf_state_dict(path)
    own = dict(model.named_parameters())
    missing = [k for k in own if k not in sd and not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing:
        raise KeyError(
            f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}; is it the same architecture?"
        )
    with torch.no_grad():
        for name, p in own.items():
            if name in sd:
                t = sd[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(
                        f"checkpoint tensor {name} has shape {tuple(t.shape)}, the model expects {tuple(p.shape)}"
                    )
                p.copy_(t.to(p.dtype))


def config_from_checkpoint(path: str | os.PathLike, **overrides) -> ModelConfig:
    """The decoder config of an HF directory or a GGUF file; its tokenizer and chat template come from the same
    place when it has one (``tokenizer.json`` / ``tokenizer_config.json``, or the GGUF's own), unless overridden."""
    p = Path(path)
    has_tokenizer = p.suffix == ".gguf" or any((p / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    if has_tokenizer:
        overrides.setdefault("tokenizer", f"hf:{p}")
    if p.suffix == ".gguf":
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name).to_dict()
    else:
        hf = json.loads((p / "config.json").read_text())
    return ModelConfig.from_hf(hf, checkpoint=str(p), **overrides)
