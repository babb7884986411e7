"""``miles export --merged``: a LoRA checkpoint (PEFT's adapter directory) turned into a plain Hugging Face
checkpoint, each adapted weight ``W + scale * B @ A`` in FP32 rounded once to the base's dtype (what
``peft``'s ``merge_and_unload`` computes), so anything that loads HF checkpoints serves the trained model.

The base is a Hugging Face directory, or for a random-init run the run's model config and seed (``miles export``
picks: miles.cli.export).

    lora = read_lora("adapter/")
    export_merged("adapter/", "merged/", hf_base_config("hf/Llama-3.2-1B", lora))
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from miles.model.config import ModelConfig
from miles.model.lora_config import LoRAConfig
from miles.model.peft_format import CONFIG_FILE, is_adapter_dir, load_adapter


def lora_of(adapter_config: dict, source: str) -> LoRAConfig:
    """The LoRAConfig a PEFT ``adapter_config.json`` describes (plain LoRA only)."""
    plain = {"peft_type": "LORA", "bias": "none", "use_rslora": False, "fan_in_fan_out": False}
    odd = {k: adapter_config.get(k) for k, v in plain.items() if adapter_config.get(k, v) != v}
    if odd:
        raise ValueError(f"{source} is not a plain LoRA adapter ({odd}); miles merges plain LoRA (no bias, no rsLoRA)")
    targets = adapter_config["target_modules"]
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    return LoRAConfig(
        rank=int(adapter_config["r"]),
        alpha=float(adapter_config["lora_alpha"]),
        target_modules=targets,
    )


def read_lora(adapter_dir: str | os.PathLike) -> LoRAConfig:
    """The LoRAConfig of a LoRA checkpoint directory, or a ValueError saying what the directory is not."""
    d = Path(adapter_dir)
    if not is_adapter_dir(d) or not (d / CONFIG_FILE).is_file():
        raise ValueError(
            f"{d} is not a LoRA checkpoint (no adapter_model.safetensors + {CONFIG_FILE}); export --merged takes the "
            "checkpoint directory of a run with model.lora.rank >= 1 (run_dir/checkpoints/step_N) or a PEFT adapter"
        )
    return lora_of(json.loads((d / CONFIG_FILE).read_text()), str(d / CONFIG_FILE))


def named_base(adapter_dir: str | os.PathLike) -> str:
    """The base model directory the adapter names ("" for a random-init run's)."""
    return json.loads((Path(adapter_dir) / CONFIG_FILE).read_text()).get("base_model_name_or_path") or ""


def hf_base_config(base: str, lora: LoRAConfig) -> ModelConfig:
    """The model config of the Hugging Face directory ``base``, with ``lora``."""
    if not (Path(base) / "config.json").is_file():
        raise ValueError(f"base {base!r} has no config.json; pass --base with a Hugging Face model directory")
    return ModelConfig.from_hf(Path(base) / "config.json", checkpoint=str(base), lora=lora)


def export_merged(adapter_dir: str | os.PathLike, out: str | os.PathLike, model_cfg: ModelConfig, *, seed: int = 0):
    """Write ``out/config.json`` + ``out/model.safetensors``: the base ``model_cfg`` describes (its checkpoint, or
    its random init from ``seed``) with the adapter merged. Returns ``out``."""
    import torch

    from miles.atomic import atomic_write_bytes, atomic_write_text
    from miles.model.decoder import build_decoder
    from miles.model.lora import adapter_parameters, merged_state_dict

    d = Path(adapter_dir)
    model = build_decoder(model_cfg, seed=seed)
    saved, own = load_adapter(d), dict(adapter_parameters(model))
    if set(saved) != set(own):
        missing, extra = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
        raise ValueError(
            f"{d} does not fit the base: {len(missing)} adapter tensors missing (e.g. {missing[:2]}), {len(extra)} "
            f"unknown (e.g. {extra[:2]}); is it the adapter of this base model?"
        )
    with torch.no_grad():
        for name, t in saved.items():
            own[name].copy_(t)
    from safetensors.torch import save

    o = Path(out)
    sd = {k: v.contiguous().cpu() for k, v in merged_state_dict(model).items()}
    atomic_write_bytes(o / "model.safetensors", save(sd, metadata={"format": "pt"}))
    plain = replace(model_cfg, lora=LoRAConfig(), checkpoint="")
    atomic_write_text(o / "config.json", json.dumps(plain.to_hf(), indent=2))
    return o
