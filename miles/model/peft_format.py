"""LoRA adapters as PEFT saves them: ``adapter_config.json`` + ``adapter_model.safetensors`` in one directory, which
``peft.PeftModel.from_pretrained(hf_base, directory)`` loads onto the Hugging Face base (and vLLM / SGLang serve).

PEFT names an adapter tensor ``base_model.model.<module>.lora_A.weight``: the decoder's own names (HF names,
miles.model.decoder) under PEFT's prefix. The config carries what PEFT needs to rebuild the same layers: rank,
alpha, dropout and the targeted modules (their names when every layer is adapted, else the full module names).

    save_adapter("ckpt/", dict(backend.named_weights()), adapter_config(model_cfg))
    load_adapter("ckpt/")     # {"model.layers.0.self_attn.q_proj.lora_A.weight": tensor, ...}
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from miles.atomic import atomic_write_bytes, atomic_write_text
from miles.model.lora_config import PROJECTIONS, targets

PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def adapter_config(model_cfg) -> dict:
    """PEFT's LoraConfig fields for ``model_cfg.lora``."""
    lora = model_cfg.lora
    chosen = [name for name, _, _ in targets(model_cfg)]
    leaves = sorted({n.rsplit(".", 1)[1] for n in chosen}, key=PROJECTIONS.index)
    every_layer = len(chosen) == len(leaves) * model_cfg.num_hidden_layers
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": leaves if every_layer else chosen,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
        "base_model_name_or_path": model_cfg.checkpoint or None,
    }


def save_adapter(directory: str | os.PathLike, adapters: dict[str, torch.Tensor], config: dict) -> None:
    """Write the PEFT directory (each file atomically). ``adapters``: miles names -> tensors; ``config``:
    ``adapter_config(model_cfg)``."""
    from safetensors.torch import save

    d = Path(directory)
    tensors = {PREFIX + k: v.detach().contiguous().cpu() for k, v in adapters.items()}
    atomic_write_bytes(d / WEIGHTS_FILE, save(tensors, metadata={"format": "pt"}))
    atomic_write_text(d / CONFIG_FILE, json.dumps(config, indent=2))


def load_adapter(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The adapter tensors of a PEFT directory under miles names; ValueError for a file that is not one."""
    from safetensors.torch import load_file

    sd = load_file(str(Path(directory) / WEIGHTS_FILE))
    foreign = [k for k in sd if not k.startswith(PREFIX) or (".lora_A." not in k and ".lora_B." not in k)]
    if foreign:
        raise ValueError(
            f"{Path(directory) / WEIGHTS_FILE} has {len(foreign)} tensors that are not LoRA A/B matrices under "
            f"{PREFIX!r}, e.g. {foreign[:2]}; miles loads plain LoRA adapters (no modules_to_save, no bias)"
        )
    return {k.removeprefix(PREFIX): v for k, v in sd.items()}


def is_adapter_dir(directory: str | os.PathLike) -> bool:
    return (Path(directory) / WEIGHTS_FILE).is_file()
