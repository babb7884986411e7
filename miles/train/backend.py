"""The trainer backend of a run, built in one place: the TrainActor's rank (miles.train.actor) and Colocated's
in-process rank (miles.colocated) both call ``build_backend``."""

from __future__ import annotations

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
