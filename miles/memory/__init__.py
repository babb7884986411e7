"""Tagged device memory: who holds which bytes where, and moving them out of the way between phases."""

from miles.memory.ledger import LedgerEvent, MemoryLedger
from miles.memory.tagged import TaggedMemory

__all__ = ["LedgerEvent", "MemoryLedger", "TaggedMemory"]
