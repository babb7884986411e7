"""The MemoryLedger: every byte that enters or leaves a memory pool, with its owner and tag.

Each process keeps its own ledger; the driver drains them after every phase and merges them into the run's
``ledger.jsonl``. Peaks per pool are computed from the merged event stream, so the planner's predicted
per-step bytes can be compared with what really moved.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from miles.nodes import this_node

POOLS = ("device", "host", "disk")
DIRECTIONS = ("in", "out")


@dataclass(frozen=True, slots=True)
class LedgerEvent:
    time: float
    owner: str  # "trainer/0", "engine/0", ...
    tag: str  # "params", "grads", "optimizer", "weights", "kv_cache", ...
    pool: str  # one of POOLS
    bytes: int
    direction: str  # "in": bytes now held in `pool`; "out": bytes released from it
    phase: str = ""  # the handoff step or activity that caused it ("offload_train", "init", ...)

    def signed(self) -> int:
        return self.bytes if self.direction == "in" else -self.bytes


def pool_peaks(events, held: dict[str, int]) -> dict[str, int]:
    """Each pool's peak over ``events`` (LedgerEvents, in time order) from the bytes ``held`` before them; ``held``
    is updated in place, so calls over consecutive steps carry what each step leaves held (mem/<pool>_peak)."""
    peak = dict(held)
    for e in events:
        held[e.pool] = held.get(e.pool, 0) + e.signed()
        peak[e.pool] = max(peak.get(e.pool, 0), held[e.pool])
    return peak


@dataclass(frozen=True, slots=True)
class ProcessSample:
    time: float
    owner: str
    phase: str
    rss_bytes: int
    device_allocated: int = 0
    device_reserved: int = 0
    node_id: str = ""  # the Ray node the process ran on (miles.nodes.this_node; "" outside Ray)
    node_ip: str = ""  # that node's address


def process_rss_bytes() -> int:
    """Resident set size of this process as the OS sees it (not what was asked for)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass(slots=True)
class MemoryLedger:
    """Records moves and process samples; ``drain()`` hands them over (to the driver) and forgets them.

    ledger = MemoryLedger()
    ledger.record("trainer/0", "params", "device", 4096, "in", phase="init")
    ledger.record("trainer/0", "params", "device", 4096, "out", phase="offload_train")
    ledger.peaks()   # {"device": 4096, "host": 0, "disk": 0}
    """

    events: list[LedgerEvent] = field(default_factory=list)
    samples: list[ProcessSample] = field(default_factory=list)
    phase: str = ""

    def record(self, owner: str, tag: str, pool: str, nbytes: int, direction: str, phase: str | None = None) -> None:
        assert pool in POOLS and direction in DIRECTIONS, (pool, direction)
        if nbytes:
            self.events.append(LedgerEvent(time.time(), owner, tag, pool, int(nbytes), direction, phase or self.phase))

    def sample_process(self, owner: str, phase: str | None = None) -> ProcessSample:
        allocated = reserved = 0
        try:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        except ImportError:  # pragma: no cover - torch is a base dependency
            pass
        node = this_node()
        s = ProcessSample(
            time.time(),
            owner,
            phase or self.phase,
            process_rss_bytes(),
            allocated,
            reserved,
            node.node_id,
            node.node_ip,
        )
        self.samples.append(s)
        return s

    def drain(self) -> tuple[list[LedgerEvent], list[ProcessSample]]:
        events, samples = self.events, self.samples
        self.events, self.samples = [], []
        return events, samples

    def extend(self, events: list[LedgerEvent], samples: list[ProcessSample] = ()) -> None:
        self.events.extend(events)
        self.samples.extend(samples)
        self.events.sort(key=lambda e: e.time)

    def held(self) -> dict[tuple[str, str, str], int]:
        """Bytes currently held, per (owner, tag, pool)."""
        out: dict[tuple[str, str, str], int] = {}
        for e in self.events:
            key = (e.owner, e.tag, e.pool)
            out[key] = out.get(key, 0) + e.signed()
        return out

    def peaks(self, events: list[LedgerEvent] | None = None) -> dict[str, int]:
        """Peak bytes per pool over the event stream (time-ordered)."""
        current = dict.fromkeys(POOLS, 0)
        peak = dict.fromkeys(POOLS, 0)
        for e in sorted(events if events is not None else self.events, key=lambda e: e.time):
            current[e.pool] += e.signed()
            peak[e.pool] = max(peak[e.pool], current[e.pool])
        return peak

    def moved(self, phase: str | None = None) -> dict[tuple[str, str], int]:
        """Bytes moved *into* each pool per (tag, pool), optionally for one phase."""
        out: dict[tuple[str, str], int] = {}
        for e in self.events:
            if e.direction == "in" and (phase is None or e.phase == phase):
                out[(e.tag, e.pool)] = out.get((e.tag, e.pool), 0) + e.bytes
        return out
