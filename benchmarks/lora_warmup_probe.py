"""Why the LoRA quickstart warms up its base: the supervised warm-up's loss of recipe ``quickstart_lora`` under
several settings, side by side in one process. A one-off probe, not a ``miles bench`` name.

Each variant starts from the same random-init model (seed 0) and takes the same warm-up batches; the loss is
printed at steps 0, 4, 9 and 24 (and 49, 99 with ``--steps 100``). Variants:

- ``full``: full fine-tuning (``model.lora.rank=0``);
- ``base``: the recipe (``model.lora.warmup=base``: the base trains, adapters off);
- ``adapters``: the adapters alone (``model.lora.warmup=adapters``), also at other ranks and lrs (``--set``);
- ``adapters+embedding``: the adapters and the (tied) embedding/head trained together, what PEFT calls
  ``modules_to_save``; miles does not offer it (every sync would carry the embedding), the probe sets it by hand.

    python benchmarks/lora_warmup_probe.py --steps 25
    python benchmarks/lora_warmup_probe.py --steps 100 --only adapters --set model.lora.rank=64 model.lora.alpha=512
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from miles.config import apply_overrides
from miles.policy.objective import resolved_trainer
from miles.recipes import get_recipe
from miles.rollout.manager import RolloutManager
from miles.sources import make_sources
from miles.train.torch_backend import TorchBackend

VARIANTS = {
    "full": ["model.lora.rank=0", "model.lora.warmup=adapters"],
    "base": [],
    "adapters": ["model.lora.warmup=adapters"],
    "adapters+embedding": ["model.lora.warmup=adapters"],
}
REPORT = (0, 4, 9, 24, 49, 99)


def losses(name: str, steps: int, extra: list[str], lr: float | None) -> list[float]:
    torch.manual_seed(0)
    cfg = apply_overrides(get_recipe("quickstart_lora"), [*VARIANTS[name], *extra])
    manager = RolloutManager(cfg, sources=make_sources)
    backend = TorchBackend(cfg.model, resolved_trainer(cfg), seed=cfg.seed, offload_policy="none")
    if name == "adapters+embedding":
        backend.model.model.embed_tokens.weight.requires_grad_(True)  # tied: the head trains with it
        backend.optimizer = backend._build_optimizer()
    backend.set_lr(lr or cfg.trainer.warmup_sft_lr)
    return [backend.sft_step(manager.sft_batches(i)[0])["sft_loss"] for i in range(steps)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--only", nargs="*", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--set", nargs="*", default=[], help="overrides for every variant (section.field=value)")
    p.add_argument("--lr", type=float, default=None, help="the warm-up lr (default trainer.warmup_sft_lr)")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = {}
    for name in args.only:
        t0 = time.perf_counter()
        ls = losses(name, args.steps, args.set, args.lr)
        out[name] = [round(ls[i], 3) for i in REPORT if i < len(ls)]
        print(
            f"{name:20s} loss at steps {[i for i in REPORT if i < len(ls)]}: {out[name]}  "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    print(json.dumps({"steps": args.steps, "set": args.set, "lr": args.lr, "losses": out}))


if __name__ == "__main__":
    main()
