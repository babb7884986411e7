"""A GGUF checkpoint: its weights dequantized to FP32 once (through transformers' GGUF reader, offline) and
cached as safetensors under a key of the file's content; a cut or damaged file said as that (transformers' reader
fails on it with whatever its first short read raises).

Dequantizing takes minutes on a small CPU and every engine and trainer process of a run reads the same file, so
the cache matters; a key of (name, size, mtime) served one file's weights for another of the same size and
mtime (a second download, another directory). The key is the xxh3-128 hash of the whole file, a read at memory
speed next to loading the cached FP32 weights (``benchmarks/gguf_cache.py`` measures both).

    check_gguf(Path("model.gguf"))        # ValueError naming the file when it is cut short or not GGUF
    sd = read_gguf(Path("model.gguf"))    # {"model.embed_tokens.weight": tensor, ...} (FP32)
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import xxhash
from safetensors.torch import load_file, save

from miles.atomic import atomic_write_bytes

CACHE_FORMAT = 2  # part of the key: bump when what is cached changes


def check_gguf(path: Path) -> None:
    """Refuse a file that is not a complete GGUF (a cut download), naming it; called where transformers' reader
    failed (a second parse of the whole file, tokenizer table included)."""
    try:
        from gguf import GGUFReader
    except ImportError as e:  # pragma: no cover
        raise ImportError("reading a .gguf checkpoint needs gguf: pip install gguf (or 'miles[dev]')") from e
    size = path.stat().st_size
    try:  # gguf-py fails on a cut file with whatever the first short read raises (IndexError, ValueError, ...)
        tensors = GGUFReader(path).tensors
        end = max((int(t.data_offset) + int(t.n_bytes) for t in tensors), default=0)
    except Exception as e:
        raise ValueError(
            f"{path} is not a complete GGUF file ({size} bytes; {type(e).__name__}: {e}); a cut download is the "
            "usual cause: download it again"
        ) from None
    if end > size:
        raise ValueError(
            f"{path} holds {size} bytes, its tensors end at byte {end}: the file is cut; download it again"
        )


def content_key(path: Path, chunk: int = 8 << 20) -> str:
    """The xxh3-128 hash of the file's bytes, as hex."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def cache_path(path: Path) -> Path:
    root = Path(os.environ.get("MILES_CACHE_DIR", Path.home() / ".cache" / "miles")) / "gguf"
    return root / f"{path.stem}-v{CACHE_FORMAT}-{content_key(path)}.safetensors"


def read_gguf(path: Path) -> dict[str, torch.Tensor]:
    """Dequantized FP32 weights of a GGUF file under Hugging Face names (a tied lm_head left out)."""
    cached = cache_path(path)
    if cached.exists():
        return load_file(cached)
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # pragma: no cover
        raise ImportError("loading a .gguf checkpoint needs transformers and gguf: pip install 'miles[dev]'") from e
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception:
        check_gguf(path)  # a cut or damaged file is said as that; anything else as transformers says it
        raise
    sd, seen = {}, set()
    for k, v in hf.state_dict().items():  # a tied lm_head shares the embedding's storage: keep the first name only
        if v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            sd[k] = v.detach().contiguous()
    atomic_write_bytes(cached, save(sd, metadata={"format": "pt", "source": str(path)}))
    return sd
