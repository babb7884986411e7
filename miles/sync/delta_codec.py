"""Per-tensor byte deltas: XOR or overwrite (positions + new values), zstd-compressed, with a checksum.

Two encodings because RL updates come in two shapes. With bf16 weights and a small learning rate most elements
round back to the same bf16 value, so ``new ^ old`` is mostly zero bytes and zstd shrinks it to almost nothing
(XOR). When very few elements change at all, listing them is smaller still (overwrite). Both work on raw bytes,
so they are exact for every dtype, NaN payloads included. Encoding streams over chunks so that a tensor larger
than a staging buffer never needs a second full-size buffer.

    enc = TensorEncoder("xor", nbytes=old.nbytes, itemsize=2)
    for offset, chunk, scratch in chunks:    # uint8 chunks of the new bytes, offsets a multiple of 8
        enc.feed(offset, chunk, old[offset:offset + chunk.size], out=scratch)
    payload, digest = enc.finish()
    assert (apply_delta("xor", payload, old, 2) == new).all()
"""

from __future__ import annotations

import numpy as np
import xxhash
import zstandard

ENCODINGS = ("xor", "overwrite")
CHECKSUMS = {"xxh3_128": xxhash.xxh3_128, "xxh3_64": xxhash.xxh3_64}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def hasher(fmt: str):
    try:
        return CHECKSUMS[fmt]()
    except KeyError:
        raise ValueError(f"checksum format {fmt!r} is not supported; use one of {sorted(CHECKSUMS)}") from None


def checksum(data: np.ndarray, fmt: str = "xxh3_128") -> str:
    h = hasher(fmt)
    h.update(data)
    return h.hexdigest()


def _words(a: np.ndarray) -> np.ndarray:
    """A uint64 view when the byte count allows it (8x fewer numpy element operations), else uint8."""
    return a.view(np.uint64) if a.size % 8 == 0 else a


def _elements(a: np.ndarray, itemsize: int) -> np.ndarray:
    # complex64 and anything else of 8 bytes compares as uint64; only the bits matter.
    return a.view(_UINT[itemsize])


class TensorEncoder:
    """Streams one tensor's new bytes (against its old bytes) into a compressed delta and a checksum.

    Call ``feed`` once per chunk in order, then ``finish`` once. XOR is computed into ``out`` (a scratch
    buffer), or into ``new`` itself when ``out`` is not given.
    """

    def __init__(self, encoding: str, *, nbytes: int, itemsize: int, level: int = 1, threads: int = 0,
                 checksum_format: str = "xxh3_128", compressor: zstandard.ZstdCompressor | None = None):
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding {encoding!r} is not one of {ENCODINGS}")
        if itemsize not in _UINT:
            raise ValueError(f"element size {itemsize} bytes is not supported by the delta codec (1, 2, 4 or 8)")
        self.encoding, self.nbytes, self.itemsize = encoding, nbytes, itemsize
        self._hash = hasher(checksum_format)
        # a compressor can be reused across tensors (one at a time): creating its context costs more than a
        # small tensor's compression
        self._zstd = compressor or zstandard.ZstdCompressor(level=level, threads=threads)
        self._stream = None
        self._parts: list[bytes] = []
        self._positions: list[np.ndarray] = []
        self._values: list[np.ndarray] = []

    def feed(self, offset: int, new: np.ndarray, old: np.ndarray, out: np.ndarray | None = None) -> None:
        """Encode the chunk at byte ``offset``; XOR is computed into ``out`` (default: into ``new`` itself)."""
        self._hash.update(new)
        if self.encoding == "xor":
            out = new if out is None else out
            np.bitwise_xor(_words(new), _words(old), out=_words(out))
            if offset == 0 and out.size == self.nbytes:  # the whole tensor in one chunk: one-shot is ~15% faster
                self._parts.append(self._zstd.compress(out))
                return
            if self._stream is None:
                self._stream = self._zstd.compressobj(size=self.nbytes)
            self._parts.append(self._stream.compress(out))
        else:
            new_e, old_e = _elements(new, self.itemsize), _elements(old, self.itemsize)
            changed = np.flatnonzero(new_e != old_e)
            self._positions.append(changed + offset // self.itemsize)
            self._values.append(new_e[changed])

    def finish(self) -> tuple[bytes, str]:
        """Returns (zstd payload, hex checksum of the new bytes)."""
        if self.encoding == "xor":
            if self._stream is not None:
                self._parts.append(self._stream.flush())
            return b"".join(self._parts), self._hash.hexdigest()
        positions = np.concatenate(self._positions) if self._positions else np.zeros(0, np.int64)
        values = np.concatenate(self._values) if self._values else np.zeros(0, _UINT[self.itemsize])
        return self._zstd.compress(_pack_overwrite(positions, values, self.nbytes // self.itemsize)), self._hash.hexdigest()


def _pack_overwrite(positions: np.ndarray, values: np.ndarray, numel: int) -> bytes:
    # Gaps between sorted positions are small numbers, which zstd compresses far better than raw positions.
    gap_dtype = np.uint32 if numel < 2**32 else np.uint64
    gaps = np.diff(positions, prepend=0).astype(gap_dtype)
    head = np.array([len(positions), np.dtype(gap_dtype).itemsize], dtype=np.uint64)
    return head.tobytes() + gaps.tobytes() + values.tobytes()


def _unpack_overwrite(raw: bytes, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    count, gap_size = (int(x) for x in np.frombuffer(raw, np.uint64, count=2))
    if gap_size not in (4, 8) or len(raw) != 16 + count * (gap_size + itemsize):
        raise ValueError(f"overwrite payload is malformed: {count} positions of {gap_size} bytes and "
                         f"{itemsize}-byte values do not add up to {len(raw)} bytes")
    gaps = np.frombuffer(raw, _UINT[gap_size], count=count, offset=16)
    values = np.frombuffer(raw, _UINT[itemsize], count=count, offset=16 + count * gap_size)
    return np.cumsum(gaps, dtype=np.uint64).astype(np.int64), values


def apply_delta(encoding: str, payload: bytes, old: np.ndarray, itemsize: int) -> np.ndarray:
    """Return the new bytes (a fresh uint8 array; ``old`` is not modified). Raises ValueError on a payload
    that does not decompress to the right size; the caller verifies the checksum."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=max(old.nbytes, 1) * 8 + 64)
    except zstandard.ZstdError as e:
        raise ValueError(f"payload does not decompress ({e})") from None
    if encoding == "xor":
        if len(raw) != old.nbytes:
            raise ValueError(f"XOR payload decompresses to {len(raw)} bytes, the tensor has {old.nbytes}")
        new = np.frombuffer(raw, np.uint8).copy()
        np.bitwise_xor(_words(new), _words(old), out=_words(new))
        return new
    if encoding == "overwrite":
        positions, values = _unpack_overwrite(raw, itemsize)
        new = old.copy()
        new_e = _elements(new, itemsize)
        if len(positions) and positions[-1] >= new_e.size:
            raise ValueError(f"overwrite payload names element {positions[-1]} of a {new_e.size}-element tensor")
        new_e[positions] = values
        return new
    raise ValueError(f"encoding {encoding!r} is not one of {ENCODINGS}")
