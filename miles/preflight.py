"""What a run needs from this machine, checked before Ray starts, each refusal with its fix: the GPUs of
``device=cuda``, SGLang for ``rollout.engine=sglang`` when miles launches the servers, the checkpoint (its tensors
the model's), the tokenizer the model names (and transformers to read an HF tokenizer), and on the CPU a model whose
weights alone exceed this machine's memory.

Without these checks the same mistakes surface inside a Ray actor after its start-up (16 s for a missing
SGLang), or as a placement group that waits forever for a GPU. A run that joins a cluster (``cluster.address``)
is checked only for what this machine decides: its actors run on other nodes, with their own packages and files.

    check_environment(cfg)      # raises ValueError / ImportError / FileNotFoundError naming the field and the fix
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # per parameter, by model.dtype


def check_environment(cfg) -> None:
    """Every check below, for a RunConfig ``cfg``."""
    if cfg.cluster.address:
        return
    check_device(cfg)
    check_sglang_installed(cfg)
    check_model_files(cfg)
    check_model_fits_in_memory(cfg)


def check_device(cfg) -> None:
    """Refuse device=cuda on a machine without enough CUDA devices when Ray would run here (no cluster.address):
    the placement group would wait for a GPU that never comes."""
    if cfg.device != "cuda" or cfg.cluster.address:
        return
    import torch

    have, need = (torch.cuda.device_count() if torch.cuda.is_available() else 0), cfg.trainer.world_size
    if have < need:
        raise ValueError(
            f"device = 'cuda' needs {need} CUDA device(s) (trainer.world_size = {need}) but this machine has {have} "
            "and cluster.address is empty (Ray runs here); use device=cpu (or auto), or cluster.address=... to join a "
            "cluster that has the GPUs"
        )


def check_sglang_installed(cfg) -> None:
    """rollout.engine=sglang launches ``python -m <rollout.sglang_launcher>`` here: its package must import."""
    from miles.sglang_flags import STANDIN

    r = cfg.rollout
    if r.engine != "sglang" or r.engine_urls or r.sglang_launcher == STANDIN:
        return
    package = r.sglang_launcher.split(".")[0]
    if importlib.util.find_spec(package) is None:
        raise ImportError(
            f"rollout.engine = 'sglang' launches `python -m {r.sglang_launcher}`, but {package} is not installed "
            "here: pip install 'miles[sglang]' (a CUDA machine); or attach to running servers with "
            "rollout.engine_urls=http://HOST:PORT, or on a CPU use rollout.sglang_launcher=miles-serve (the stand-in) "
            "or rollout.engine=http"
        )


def check_model_files(cfg) -> None:
    """model.checkpoint and an ``hf:`` model.tokenizer exist here; transformers is installed to read the latter;
    the checkpoint's tensors are the model's (names and shapes from the safetensors headers, no weight read)."""
    m = cfg.model
    if m.checkpoint and not Path(m.checkpoint).exists():
        raise FileNotFoundError(
            f"model.checkpoint = {m.checkpoint!r} does not exist; give an HF directory (config.json + "
            "*.safetensors) or a .gguf file, or leave it empty for a random init"
        )
    if m.checkpoint:
        from miles.model.from_checkpoint import check_weights_match

        check_weights_match(m)
    if m.tokenizer.startswith("hf:"):
        path = m.tokenizer.removeprefix("hf:")
        if not Path(path).exists():
            raise FileNotFoundError(
                f"model.tokenizer = {m.tokenizer!r}: {path!r} does not exist; name the checkpoint's directory or "
                ".gguf file (hf:PATH), or use model.tokenizer=bytes"
            )
        if importlib.util.find_spec("transformers") is None:
            raise ImportError(
                f"model.tokenizer = {m.tokenizer!r} needs transformers: pip install transformers (or 'miles[dev]')"
            )


def check_model_fits_in_memory(cfg) -> None:
    """On the CPU, refuse a model whose weights alone (one copy in model.dtype: ModelConfig.num_parameters) exceed
    this machine's memory (cgroup memory.max, else MemTotal): the run holds more than that (the trainer's copy, its
    optimizer, the engine's copy), so it could only fail in an allocation after Ray started, or swap until killed.
    torch is imported (to ask for CUDA under device=auto) only when the model is that large."""
    from miles.handoff.hardware import this_cpu

    m = cfg.model
    weights, budget = m.num_parameters * WEIGHT_BYTES[m.dtype], this_cpu().host_bytes
    if weights <= budget or cfg.device == "cuda":
        return
    if cfg.device == "auto":
        import torch

        if torch.cuda.is_available():
            return
    raise ValueError(
        f"the model's weights alone take {weights / 2**30:,.1f} GiB ({m.dtype}; vocab_size {m.vocab_size}, "
        f"hidden_size {m.hidden_size}, num_hidden_layers {m.num_hidden_layers}) but this machine has "
        f"{budget / 2**30:.1f} GiB of memory; choose a smaller model, or run on GPUs (device=cuda, or "
        "cluster.address=... to join a cluster that has them)"
    )
