"""Calling engines the same way whether they are in-process objects or Ray actor handles: ``submit`` starts a
method, named by reference (``e.commit_weight_update``: a bound method, or a Ray actor method), and returns a Ray
ObjectRef for an actor or the finished result for a local object; ``wait`` collects results in order.

    pending = [submit(e.commit_weight_update, version) for e in engines]
    wait(pending, timeout=60)        # raises the first remote error
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def call(method: Callable, *args, **kwargs):
    """Call an in-process engine's method or a Ray actor handle's alike (blocking): ``call(e.named_weights)``."""
    return wait([submit(method, *args, **kwargs)])[0]


def submit(method: Callable, *args, **kwargs):
    """Start ``method`` (``e.update_weights_from_bucket``): a Ray ObjectRef for an actor's method, the result itself
    for an in-process engine's."""
    if hasattr(method, "remote"):
        return method.remote(*args, **kwargs)
    return _Done(method(*args, **kwargs))


def wait(pending: list, timeout: float | None = None) -> list:
    """Results of ``submit`` calls, in order (raises the first remote error)."""
    refs = [p for p in pending if not isinstance(p, _Done)]
    got = iter(_ray_get(refs, timeout) if refs else [])
    return [p.value if isinstance(p, _Done) else next(got) for p in pending]


def is_actor(engine: Any) -> bool:
    """True for a Ray actor handle (its methods have ``.remote``)."""
    return hasattr(getattr(engine, "set_weight_version", None), "remote")


@dataclass(frozen=True, slots=True)
class _Done:
    value: Any


def _ray_get(refs, timeout):
    import ray

    return ray.get(refs, timeout=timeout)
