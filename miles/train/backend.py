"""The trainer backend of a run, built in one place, and what every rank does with one: the TrainActor's rank
(miles.train.actor) and Colocated's in-process rank (miles.colocated) both build it with ``build_backend``, read
its per-sample log-probs with ``sample_log_probs`` and write and read its checkpoint files here."""

from __future__ import annotations

from pathlib import Path

import torch

from miles.checkpoints import BASE_DIR
from miles.config import RunConfig
from miles.memory import MemoryLedger
from miles.policy.objective import resolved_trainer


def build_backend(
    cfg: RunConfig,
    device,
    *,
    rank: int = 0,
    world_size: int = 1,
    ledger: MemoryLedger | None = None,
    disk_dir: str | None = None,
):
    """A TorchBackend, or a MegatronBackend for ``trainer.backend = "megatron"`` (GPU only), holding rank ``rank``
    of ``world_size``; ``disk_dir`` takes what ``handoff.offload_train = "disk"`` writes."""
    if cfg.trainer.backend == "megatron":
        from miles.train.megatron_backend import MegatronBackend as Backend  # noqa: N814 (GPU only)
    else:
        from miles.train.torch_backend import TorchBackend as Backend
    return Backend(
        cfg.model,
        resolved_trainer(cfg),  # run-dependent defaults filled (loss_norm_tokens, lr_decay_steps)
        rank=rank,
        world_size=world_size,
        device=device,
        seed=cfg.seed,
        temperature=cfg.rollout.temperature,
        ledger=ledger,
        offload_policy=cfg.handoff.offload_train,
        disk_dir=disk_dir,
        true_on_policy=cfg.true_on_policy,
    )


def sample_log_probs(backend, batch) -> dict[int, list[float]]:
    """The log-probs the last train step computed before its update, per sample index, up to each sample's last
    trained token (for the rollout dump)."""
    lp = backend.last_log_probs
    lengths = [int(m.nonzero().max()) + 1 if m.any() else 0 for m in batch.loss_mask]
    return {idx: lp[i, : lengths[i]].tolist() for i, idx in enumerate(batch.sample_index)}


def write_checkpoint_files(directory: str, state: dict) -> None:
    """model.safetensors, or for LoRA the PEFT adapter (adapter_config.json + adapter_model.safetensors) and, when
    a warm-up trained the base, that base as a Hugging Face checkpoint in base/ (config.json + model.safetensors: what
    ``peft`` loads the adapter onto and ``miles export --merged`` merges into); and optimizer.pt."""
    import json

    from safetensors.torch import save_file

    if "adapter_config" in state:
        from miles.model.peft_format import save_adapter

        save_adapter(directory, state["model"], state["adapter_config"])
    else:
        save_file({k: v.contiguous() for k, v in state["model"].items()}, str(Path(directory) / "model.safetensors"))
    if "base" in state:
        base = Path(directory) / BASE_DIR
        base.mkdir(exist_ok=True)
        save_file({k: v.contiguous() for k, v in state["base"].items()}, str(base / "model.safetensors"))
        (base / "config.json").write_text(json.dumps(state["base_config"], indent=2))
    torch.save(state["optimizer"], Path(directory) / "optimizer.pt")


def read_checkpoint_files(directory: str) -> dict:
    """The trainer state of a checkpoint directory. optimizer.pt is unpickled with ``weights_only=True``: tensors,
    containers and numbers only, so a crafted file in a copied or shared run directory cannot run code."""
    import pickle

    from safetensors.torch import load_file

    from miles.model.peft_format import is_adapter_dir, load_adapter

    model = (
        load_adapter(directory) if is_adapter_dir(directory) else load_file(str(Path(directory) / "model.safetensors"))
    )
    path = Path(directory) / "optimizer.pt"
    try:
        optim = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [line for line in str(e).splitlines() if "GLOBAL" in line or "Unsupported" in line]
        first = lines[0].strip() if lines else type(e).__name__
        raise ValueError(
            f"{path} holds objects other than tensors and plain containers, so it is not loaded (weights_only=True; "
            f"{first}). Resume only from checkpoints written by miles train, or delete that checkpoint directory"
        ) from None
    state = {"model": model, "optimizer": optim}
    if (Path(directory) / BASE_DIR / "model.safetensors").is_file():
        state["base"] = load_file(str(Path(directory) / BASE_DIR / "model.safetensors"))
    return state
