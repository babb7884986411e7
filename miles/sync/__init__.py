"""Weight sync: getting the trainer's weights into every rollout engine after a step, with a version."""

from __future__ import annotations


def make_sync(cfg, device: str, *, is_source: bool):
    """The transport named by ``cfg.sync.transport`` (a RunConfig), ready to ``connect(engines)``."""
    name = cfg.sync.transport
    if name == "tensor":
        from miles.sync.tensor import TensorSync

        return TensorSync(cfg.sync, device, is_source=is_source)
    raise NotImplementedError(f"sync.transport = {name!r} is not available yet in this build; use 'tensor'")
