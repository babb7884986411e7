"""``model.checkpoint`` means "this model": the run's model config is rebuilt from the checkpoint's own config
(an HF directory's ``config.json`` or a GGUF file's metadata) and tokenizer, whatever the recipe said, and the
weights' headers are checked against it before Ray starts.

What the checkpoint decides: the architecture fields (``ARCHITECTURE``: family, sizes, RoPE incl. llama3
scaling, rms_norm_eps, tying, attention bias). A recipe value that differs is replaced, and one line says which;
an explicit ``--set model.X=`` that differs is refused with the checkpoint's value. What the run decides: dtype,
init_std, ``max_position_embeddings`` (the longest sequence the run uses, at most the checkpoint's), and the
tokenizer: the checkpoint's own unless ``model.tokenizer`` is set explicitly (a vocabulary that differs from the
checkpoint's is said; one with more ids than the embeddings is refused).

    model_from_checkpoint(quickstart().model.as_dict() | {"checkpoint": "tiny-qwen3/"}, explicit={})
    -> ModelConfig(architecture="qwen3", hidden_size=64, ..., tokenizer="hf:tiny-qwen3/")
    check_weights_match(cfg.model)   # before Ray: ValueError naming missing / extra / reshaped tensors
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path

from miles.model.config import ModelConfig
from miles.model.config_json import decoder_fields
from miles.model.shards import INDEX, header_shapes, shard_files, weight_map
from miles.model.tokenizer import has_own_tokenizer, tokenizer_size

log = logging.getLogger("miles")

ARCHITECTURE = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_theta",
    "rope_type",
    "rope_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_bias",
)


def config_from_checkpoint(path, **explicit) -> ModelConfig:
    """The decoder config of an HF directory or a GGUF file, its tokenizer included when it has one; ``explicit``
    fields are applied and held against it as ``--set model.X=`` values are (an architecture field that differs is
    refused, a run field such as max_position_embeddings, dtype or tokenizer is the caller's)."""
    base = ModelConfig().as_dict()
    unknown = sorted(set(explicit) - set(base))
    if unknown:
        raise ValueError(
            f"{', '.join(f'model.{k}' for k in unknown)} is not a model field; the fields are {', '.join(base)}"
        )
    return model_from_checkpoint(base | dict(explicit) | {"checkpoint": str(path)}, explicit)


def run_model_section(model: dict, explicit: Mapping[str, object]) -> dict:
    """A run config's model section with its checkpoint (``model_from_checkpoint``). A checkpoint that is not on
    this machine cannot be read here (a cluster's nodes may hold it; servers at rollout.engine_urls load their
    own): the section is kept as set, which is said, and a run whose actors start here refuses it before Ray
    starts (miles.preflight)."""
    if not os.path.exists(model["checkpoint"]):
        log.warning(
            "model.checkpoint = %r is not on this machine: the model config is the recipe's and --set's, not read "
            "from it",
            model["checkpoint"],
        )
        return model
    return model_from_checkpoint(model, explicit).as_dict()


def model_from_checkpoint(base: dict, explicit: Mapping[str, object]) -> ModelConfig:
    """The model of ``base["checkpoint"]``: ``base`` (a model section: a recipe's values, with ``explicit`` ones,
    those a user set by name, already in it) with the checkpoint's architecture."""
    path = os.path.abspath(base["checkpoint"])  # Ray's workers need not start in this directory
    own, source = checkpoint_config(path)
    _refuse_contradictions(own, explicit, source)
    merged = dict(base, checkpoint=path)
    replaced = [f"{k} {base[k]!r} -> {getattr(own, k)!r}" for k in ARCHITECTURE if not _same(base[k], getattr(own, k))]
    merged.update({k: getattr(own, k) for k in ARCHITECTURE})
    longest = own.max_position_embeddings
    if merged["max_position_embeddings"] > longest:
        if "max_position_embeddings" in explicit:
            raise ValueError(
                f"model.max_position_embeddings = {explicit['max_position_embeddings']} is longer than {source} "
                f"allows ({longest}); use at most {longest}"
            )
        replaced.append(f"max_position_embeddings {merged['max_position_embeddings']} -> {longest}")
        merged["max_position_embeddings"] = longest
    merged["tokenizer"] = _tokenizer(path, merged["tokenizer"], "tokenizer" in explicit, own.vocab_size, replaced)
    if replaced:
        log.info("model from %s: %s (the checkpoint's values replace the recipe's)", source, ", ".join(replaced))
    return ModelConfig(**merged)


def checkpoint_config(path: str) -> tuple[ModelConfig, str]:
    """(the checkpoint's own model config, where it was read), read once per version of the file."""
    p = Path(path)
    if p.suffix == ".gguf" and p.is_file():
        target, source = p, f"{p} (GGUF metadata)"
    elif p.is_dir():
        target, source = p / "config.json", str(p / "config.json")
        if not target.is_file():
            raise FileNotFoundError(
                f"model.checkpoint = {path!r} has no config.json; give an HF directory (config.json + "
                "*.safetensors, as save_pretrained writes it) or a .gguf file"
            )
    else:
        state = "does not exist" if not p.exists() else "is not a directory or a .gguf file"
        raise FileNotFoundError(
            f"model.checkpoint = {path!r} {state}; give an HF directory (config.json + *.safetensors, as "
            "save_pretrained writes it) or a .gguf file, or leave it empty for a random init"
        )
    st = target.stat()
    fields = _fields(str(target.resolve()), st.st_size, st.st_mtime_ns, source)
    return ModelConfig(**fields, checkpoint=str(path)), source


@functools.lru_cache(maxsize=16)
def _fields(target: str, size: int, mtime_ns: int, source: str) -> dict:
    from miles.model.config import read_json

    t = Path(target)
    if t.suffix != ".gguf":
        return decoder_fields(read_json(t), source)
    from miles.model.gguf_file import check_gguf

    try:
        from transformers import AutoConfig
    except ImportError as e:  # pragma: no cover
        raise ImportError("reading a .gguf checkpoint needs transformers and gguf: pip install 'miles[dev]'") from e
    try:  # transformers parses the whole file (tensor table included): a cut one fails here, in its own words
        hf = AutoConfig.from_pretrained(str(t.parent), gguf_file=t.name).to_dict()
    except Exception:
        check_gguf(t)  # ... said as what it is when the file is cut or damaged
        raise
    return decoder_fields(hf, source)


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and math.isclose(a, b, rel_tol=1e-6)
    return a == b


def _refuse_contradictions(own: ModelConfig, explicit: Mapping[str, object], source: str) -> None:
    bad = [
        f"model.{k}={v!r} (it says {getattr(own, k)!r})"
        for k, v in explicit.items()
        if k in ARCHITECTURE and not _same(v, getattr(own, k)) and not (k == "head_dim" and v == 0)
    ]
    if bad:
        raise ValueError(
            f"{', '.join(bad)} contradicts {source}; the checkpoint's architecture is used as it is: drop "
            f"{'that override' if len(bad) == 1 else 'those overrides'}, or point model.checkpoint at another model"
        )


def _tokenizer(path: str, current: str, explicit: bool, vocab_size: int, replaced: list[str]) -> str:
    own = f"hf:{path}" if has_own_tokenizer(path) else None
    if explicit or own is None:
        chosen = current
        if own is None:
            log.warning(
                "%s has no tokenizer files (%s); the run uses model.tokenizer = %r, which the checkpoint was not "
                "trained with: set model.tokenizer=hf:DIR to its tokenizer",
                path,
                " / ".join(("tokenizer.json", "tokenizer_config.json")),
                current,
            )
        elif current != own and tokenizer_size(current) != tokenizer_size(own):
            log.warning(
                "model.tokenizer = %r has %s ids, the checkpoint's own tokenizer (%s) %s: its ids do not mean what "
                "the checkpoint's embeddings were trained on",
                current,
                tokenizer_size(current) or "an unknown number of",
                own,
                tokenizer_size(own) or "an unknown number",
            )
    else:
        chosen = own
        if current != own:
            replaced.append(f"tokenizer {current!r} -> {own!r}")
    n = tokenizer_size(chosen)
    if n is not None and n > vocab_size:
        raise ValueError(
            f"model.tokenizer = {chosen!r} has {n} ids, the checkpoint's vocab_size is {vocab_size}: ids from "
            f"{vocab_size} on have no embedding; use the checkpoint's own tokenizer"
        )
    return chosen


def check_weights_match(cfg: ModelConfig) -> None:
    """Before Ray starts: the checkpoint's tensor names and shapes (safetensors headers only) are the model's; for
    a GGUF file, whose tensors transformers names and shapes from its own metadata, that metadata's architecture
    is the model's."""
    if not cfg.checkpoint:
        return
    p = Path(cfg.checkpoint)
    if p.suffix == ".gguf" and p.is_file():
        own, source = checkpoint_config(cfg.checkpoint)
        differ = [
            f"{k} {getattr(cfg, k)!r} (it says {getattr(own, k)!r})"
            for k in ARCHITECTURE
            if not _same(getattr(cfg, k), getattr(own, k))
        ]
        if differ:
            raise ValueError(
                f"the model config does not describe {source}: {', '.join(differ)}. Set it with --model PATH or "
                "--set model.checkpoint=PATH (the model is then read from the file)"
            )
        return
    files = shard_files(p)
    found = header_shapes(files)
    if (p / INDEX).exists():
        lost = sorted(set(weight_map(p / INDEX)) - set(found))
        if lost:
            raise ValueError(f"{p / INDEX} maps {len(lost)} tensors that its shards lack, e.g. {lost[:3]}")
    import torch

    from miles.model.checkpoint import expected_tensors, mismatch_message
    from miles.model.decoder import Decoder

    with torch.device("meta"):
        model = Decoder(cfg)
    missing, unexpected, reshaped = expected_tensors(model, found)
    if missing or unexpected or reshaped:
        raise ValueError(
            f"{mismatch_message(p, missing, unexpected, reshaped)}: the model config does not describe it. Set it "
            "with --model PATH or --set model.checkpoint=PATH (the model is then read from its config.json), or "
            "fix the checkpoint's config.json"
        )
