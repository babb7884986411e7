"""A bounded pool of reusable host buffers through which device tensors are copied to the host in chunks.

Encoding a weight delta needs the trainer's bytes on the host. Copying a whole 10 GB shard at once would need a
second 10 GB of host memory, and allocating pinned memory per tensor is slow; instead a fixed number of fixed-size
buffers (pinned when CUDA is present, so device-to-host copies run at full speed and asynchronously) are reused,
chunk after chunk. Host memory used by staging is at most ``num_buffers * buffer_bytes``.

    pool = StagingPool(num_buffers=2, buffer_bytes=64 << 20)
    for offset, new, scratch in pool.stage(tensor):   # uint8 numpy arrays, valid until the next iteration
        consume(offset, new, out=scratch)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import numpy as np
import torch

from miles.sync.buckets import byte_view, host_bytes


class StagingPool:
    """Call ``stage(tensor)`` and consume each chunk before asking for the next; buffers are allocated lazily
    on first use and reused for the pool's lifetime."""

    def __init__(self, *, num_buffers: int = 2, buffer_bytes: int = 64 << 20, pin: bool | None = None):
        if num_buffers < 1 or buffer_bytes < 8 or buffer_bytes % 8:
            raise ValueError(
                f"staging pool of {num_buffers} x {buffer_bytes} bytes: need >= 1 buffer of a "
                f"positive multiple of 8 bytes (chunk offsets must stay 8-byte aligned)"
            )
        self.num_buffers, self.buffer_bytes = num_buffers, buffer_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._free: list[torch.Tensor] = []
        self.num_allocated = 0

    @property
    def capacity_bytes(self) -> int:
        return self.num_buffers * self.buffer_bytes

    def _acquire(self) -> torch.Tensor:
        if self._free:
            return self._free.pop()
        assert self.num_allocated < self.num_buffers, "staging pool over-subscribed"
        self.num_allocated += 1
        return torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=self.pin)

    def stage(self, tensor: torch.Tensor) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Yield (byte offset, new bytes, scratch) chunks covering the tensor, each a uint8 numpy array.

        A device tensor's chunk is copied into a pool buffer (``new`` and ``scratch`` are then the same
        buffer: the consumer may overwrite it); the copy of chunk i+1 is issued before chunk i is handed out,
        so on CUDA the transfer overlaps the consumer's work. A host tensor is not copied: ``new`` is a view
        of its own bytes (read it, never write it) and ``scratch`` a pool buffer for the consumer's output.
        """
        src = byte_view(tensor)
        on_device = src.device.type != "cpu"
        in_flight: deque = deque()
        try:
            for lo in range(0, src.numel(), self.buffer_bytes):
                n = min(self.buffer_bytes, src.numel() - lo)
                buf = self._acquire()
                in_flight.append((lo, n, buf, None if on_device else host_bytes(src[lo : lo + n]), None))
                if on_device:
                    buf[:n].copy_(src[lo : lo + n], non_blocking=self.pin)
                    if src.device.type == "cuda":
                        event = torch.cuda.Event()
                        event.record()
                        in_flight[-1] = (lo, n, buf, None, event)
                if len(in_flight) == self.num_buffers:
                    yield from self._hand_out(in_flight)
            while in_flight:
                yield from self._hand_out(in_flight)
        finally:  # a consumer that stops early (an error) must not leak buffers
            self._free.extend(item[2] for item in in_flight)

    def _hand_out(self, in_flight: deque) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        lo, n, buf, host_view, event = in_flight[0]
        if event is not None:
            event.synchronize()
        scratch = buf[:n].numpy()
        yield lo, (scratch if host_view is None else host_view), scratch
        in_flight.popleft()
        self._free.append(buf)
