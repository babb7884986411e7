"""Hugging Face checkpoint I/O: ``config.json`` + ``model.safetensors`` written atomically, and weights loaded
from an HF directory (miles.model.shards) or a GGUF file (miles.model.gguf_file) into a decoder, refusing what
would train silently wrong: a missing, extra or reshaped tensor, an untied lm_head into a tied model, NaN or inf."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from miles.atomic import atomic_write_bytes, atomic_write_text
from miles.model.gguf_file import read_gguf
from miles.model.shards import INDEX, shard_files, weight_map

# buffers some checkpoints carry that the decoder computes itself
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def save_hf(model, directory: str | os.PathLike) -> None:
    d = Path(directory)
    sd = {k: v.detach().contiguous().cpu() for k, v in model.hf_state_dict().items()}
    atomic_write_bytes(d / "model.safetensors", save(sd, metadata={"format": "pt"}))
    atomic_write_text(d / "config.json", json.dumps(model.config.to_hf(), indent=2))


def read_hf_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    p = Path(path)
    if p.suffix == ".gguf":
        return read_gguf(p)
    sd = {}
    for f in shard_files(p):
        sd.update(load_file(f))
    if (p / INDEX).exists():
        lost = sorted(set(weight_map(p / INDEX)) - set(sd))
        if lost:
            raise KeyError(f"{p / INDEX} maps {len(lost)} tensors that its shards lack, e.g. {lost[:3]}")
    return sd


def expected_tensors(model, found: dict) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, reshaped) names of the checkpoint tensors ``found`` (name -> tensor or shape) against
    the decoder's parameters; a tied lm_head may be absent or present (its values are compared at load)."""
    tied = model.config.tie_word_embeddings
    own = {k: tuple(p.shape) for k, p in model.named_parameters(remove_duplicate=False)}
    optional = {"lm_head.weight"} if tied else set()
    missing = [k for k in own if k not in found and k not in optional]
    unexpected = sorted(k for k in found if k not in own and not k.endswith(IGNORED_SUFFIXES))
    shape = lambda t: tuple(t.shape) if hasattr(t, "shape") else tuple(t)
    reshaped = [f"{k} {shape(found[k])} (expected {own[k]})" for k in own if k in found and shape(found[k]) != own[k]]
    return missing, unexpected, reshaped


def mismatch_message(path, missing, unexpected, reshaped) -> str:
    parts = [f"lacks {len(missing)} tensors, e.g. {missing[:3]}"] if missing else []
    parts += [f"has {len(unexpected)} tensors the model does not, e.g. {unexpected[:3]}"] if unexpected else []
    parts += [f"has {len(reshaped)} tensors of another shape, e.g. {reshaped[:2]}"] if reshaped else []
    return f"checkpoint {path} {'; '.join(parts)}"


def load_weights(model, path: str | os.PathLike) -> None:
    sd = read_hf_state_dict(path)
    missing, unexpected, reshaped = expected_tensors(model, sd)
    if missing or unexpected or reshaped:
        raise ValueError(
            f"{mismatch_message(path, missing, unexpected, reshaped)}; is it the same architecture? A run's model "
            "is read from the checkpoint when model.checkpoint is set with --model or --set (or built with "
            "config_from_checkpoint)"
        )
    if model.config.tie_word_embeddings and "lm_head.weight" in sd:
        if not torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"]):
            raise ValueError(
                f"checkpoint {path} has its own lm_head.weight, unlike its embeddings, but the model ties them "
                "(tie_word_embeddings = true) and would drop it: set tie_word_embeddings to false (in its "
                "config.json or model.tie_word_embeddings)"
            )
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in own.items():
            if name in sd:
                p.copy_(sd[name].to(p.dtype))
    refuse_non_finite(own, path)


def tensors_for_update(model, path: str | os.PathLike) -> list[tuple[str, torch.Tensor]]:
    """A HF checkpoint directory's tensors for a live update of ``model`` (SGLang's update_weights_from_disk with
    a model path): the whole model, each tensor cast to its parameter's dtype as SGLang's weight loaders do; the
    same refusals as a load (missing, extra or reshaped tensors; NaN or inf)."""
    try:
        sd = read_hf_state_dict(path)
    except (OSError, KeyError) as e:
        raise ValueError(f"checkpoint {path} cannot be read ({e}); the engine keeps its weights") from None
    except Exception as e:  # noqa: BLE001 - safetensors' own error type: a damaged shard
        if type(e).__name__ != "SafetensorError":
            raise
        raise ValueError(f"checkpoint {path} has a damaged shard ({e}); the engine keeps its weights") from None
    missing, unexpected, reshaped = expected_tensors(model, sd)
    if missing or unexpected or reshaped:
        raise ValueError(f"{mismatch_message(path, missing, unexpected, reshaped)}; the engine keeps its weights")
    own = dict(model.named_parameters())
    out = [(k, sd[k].to(p.dtype)) for k, p in own.items() if k in sd]
    refuse_non_finite(dict(out), path)
    return out


def refuse_non_finite(params: dict, path) -> None:
    """A NaN or inf weight makes every logit NaN downstream (and NaN gradients from then on): nothing a run could
    learn from, so the checkpoint is refused rather than warned about. A NaN or inf anywhere makes a tensor's sum
    non-finite, so one sum per tensor tells; the elementwise count runs only then (finite weights whose sum
    overflowed pass)."""
    bad = []
    for name, t in params.items():
        if t.is_floating_point() and not bool(torch.isfinite(t.sum())):
            if n := int((~torch.isfinite(t)).sum()):
                bad.append(f"{name} ({n} of {t.numel()})")
    if bad:
        raise ValueError(
            f"checkpoint {path} has NaN or inf weights in {len(bad)} tensors, e.g. {bad[:3]}: it is damaged or "
            "was saved after training diverged; use an earlier or another copy"
        )
