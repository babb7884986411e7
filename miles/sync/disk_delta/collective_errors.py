"""Hold-then-gather error handling for code that runs between collectives on several ranks.

A rank that raises in the middle of a collective protocol leaves the others waiting in the next collective
until the process-group timeout (minutes). Instead each rank holds its error, still reaches the next gather,
and every rank then raises the same ``CollectiveError`` naming the first failing rank. Any transport can use it:

    held = HeldError()
    with held:
        work_that_may_raise()                      # an exception is caught and kept, not raised
    values = gather_or_raise(my_value, held.error) # every rank calls it; raises on all ranks if any failed

Without an initialised process group (one process) the held error is re-raised unchanged.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class RankError:
    """A picklable summary of one rank's exception (exceptions themselves may not pickle)."""

    rank: int
    type: str
    message: str
    traceback: str = ""

    @classmethod
    def of(cls, rank: int, error: BaseException) -> "RankError":
        tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        return cls(rank=rank, type=type(error).__name__, message=str(error), traceback=tb)


class CollectiveError(RuntimeError):
    """Raised on every rank when at least one rank failed; ``errors`` are all failures, lowest rank first."""

    def __init__(self, errors: list[RankError], world_size: int):
        self.errors, self.world_size = errors, world_size
        first = errors[0]
        others = (
            ""
            if len(errors) == 1
            else f" ({len(errors)} of {world_size} ranks failed: ranks {[e.rank for e in errors]})"
        )
        super().__init__(f"rank {first.rank} of {world_size} failed: {first.type}: {first.message}{others}")


class HeldError:
    """Context manager that catches an ``Exception`` and keeps it in ``.error`` instead of raising.

    ``BaseException``s that are not ``Exception`` (KeyboardInterrupt, SystemExit) still propagate: a user
    stopping the process should not be turned into a collective. Reusable: entering clears nothing, so a
    sequence of steps can share one holder and the first error is kept.
    """

    def __init__(self):
        self.error: Exception | None = None

    def __enter__(self) -> "HeldError":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and isinstance(exc, Exception):
            if self.error is None:
                self.error = exc
            return True
        return False


def gather_or_raise(value, error: BaseException | None, group=None) -> list:
    """Gather ``(value, error)`` from every rank of ``group``; raise ``CollectiveError`` on all ranks if any
    rank passed an error, else return the values ordered by rank. Every rank must call it, error or not."""
    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return [value]
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = (None, RankError.of(rank, error)) if error is not None else (value, None)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    errors = [e for _, e in gathered if e is not None]
    if errors:
        raise CollectiveError(errors, world) from error
    return [v for v, _ in gathered]


def raise_together(error: BaseException | None, group=None) -> None:
    """Every rank calls this; if any rank passes an error, every rank raises ``CollectiveError``."""
    gather_or_raise(None, error, group)
