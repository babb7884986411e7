"""Per-tensor byte deltas: XOR, sparse XOR or overwrite (positions + new values), zstd-compressed, with a checksum.

RL updates of bf16 weights are sparse at the byte level: with a small learning rate most elements round back to
the same bf16 value. ``xor``: the whole ``new ^ old`` stream, mostly zero bytes, through zstd. ``sparse_xor``: a
bitmap of the 8-byte words that changed plus the XOR of just those words (as byte planes), both through zstd; it skips the
full-size XOR pass and hands zstd a short array, so it is faster than ``xor`` and usually smaller at RL densities
(see ``miles bench disk-delta``). ``overwrite``: positions and new values of the changed elements, smallest when
very few change. All work on raw bytes, so they are exact for every dtype, NaN payloads included. Encoding
streams over chunks so that a tensor larger than a staging buffer never needs a second full-size buffer.

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

ENCODINGS = ("xor", "sparse_xor", "overwrite")
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

    def __init__(
        self,
        encoding: str,
        *,
        nbytes: int,
        itemsize: int,
        level: int = 1,
        threads: int = 0,
        checksum_format: str = "xxh3_128",
        compressor: zstandard.ZstdCompressor | None = None,
    ):
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
        self._word_masks: list[np.ndarray] = []
        self._num_words = 0

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
        elif self.encoding == "sparse_xor":
            self._feed_sparse(new, old)
        else:
            new_e, old_e = _elements(new, self.itemsize), _elements(old, self.itemsize)
            changed = np.flatnonzero(new_e != old_e)
            self._positions.append(changed + offset // self.itemsize)
            self._values.append(new_e[changed])

    def _feed_sparse(self, new: np.ndarray, old: np.ndarray) -> None:
        # Only 8-byte words that changed are XORed and kept: no full-size XOR pass, and zstd sees a short array.
        if new.size % 8:  # the tensor's last partial word, zero-padded on both sides
            pad_new, pad_old = np.zeros(new.size // 8 * 8 + 8, np.uint8), np.zeros(new.size // 8 * 8 + 8, np.uint8)
            pad_new[: new.size], pad_old[: old.size] = new, old
            new, old = pad_new, pad_old
        new_w, old_w = new.view(np.uint64), old.view(np.uint64)
        mask = new_w != old_w
        changed = np.flatnonzero(mask)
        self._word_masks.append(mask)
        self._positions.append(changed + self._num_words)
        self._values.append(np.bitwise_xor(new_w[changed], old_w[changed]))
        self._num_words += mask.size

    def apply_in_place(self, old: np.ndarray) -> None:
        """sparse_xor only, after ``finish``: turn ``old`` (all the tensor's old bytes) into the new bytes by
        XORing just the changed words, so the encoder's caller needs no full-size copy of the new bytes."""
        assert self.encoding == "sparse_xor" and old.size == self.nbytes
        positions, words = np.concatenate(self._positions), np.concatenate(self._values)
        body = old.size // 8
        inside = positions < body
        old[: body * 8].view(np.uint64)[positions[inside]] ^= words[inside]
        if not inside.all():  # the zero-padded last partial word
            tail = np.zeros(8, np.uint8)
            tail[: old.size - body * 8] = old[body * 8 :]
            tail.view(np.uint64)[0] ^= words[~inside][0]
            old[body * 8 :] = tail[: old.size - body * 8]

    def finish(self) -> tuple[bytes, str]:
        """Returns (zstd payload, hex checksum of the new bytes)."""
        if self.encoding == "xor":
            if self._stream is not None:
                self._parts.append(self._stream.flush())
            return b"".join(self._parts), self._hash.hexdigest()
        if self.encoding == "sparse_xor":
            mask = np.concatenate(self._word_masks) if self._word_masks else np.zeros(0, bool)
            words = np.concatenate(self._values) if self._values else np.zeros(0, np.uint64)
            bitmap = self._zstd.compress(np.packbits(mask))
            self._word_masks = []  # positions and words stay, for apply_in_place
            # byte planes (all first bytes, then all second bytes, ...): ~20% smaller at the same speed, since
            # the XOR of a small bf16 change lives in the low mantissa bytes
            planes = np.ascontiguousarray(words.view(np.uint8).reshape(-1, 8).T)
            return (
                np.array([len(bitmap)], np.uint64).tobytes() + bitmap + self._zstd.compress(planes),
                self._hash.hexdigest(),
            )
        positions = np.concatenate(self._positions) if self._positions else np.zeros(0, np.int64)
        values = np.concatenate(self._values) if self._values else np.zeros(0, _UINT[self.itemsize])
        return self._zstd.compress(
            _pack_overwrite(positions, values, self.nbytes // self.itemsize)
        ), self._hash.hexdigest()


def _pack_overwrite(positions: np.ndarray, values: np.ndarray, numel: int) -> bytes:
    # Gaps between sorted positions are small numbers, which zstd compresses far better than raw positions.
    gap_dtype = np.uint32 if numel < 2**32 else np.uint64
    gaps = np.diff(positions, prepend=0).astype(gap_dtype)
    head = np.array([len(positions), np.dtype(gap_dtype).itemsize], dtype=np.uint64)
    return head.tobytes() + gaps.tobytes() + values.tobytes()


def _unpack_overwrite(raw: bytes, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    count, gap_size = (int(x) for x in np.frombuffer(raw, np.uint64, count=2))
    if gap_size not in (4, 8) or len(raw) != 16 + count * (gap_size + itemsize):
        raise ValueError(
            f"overwrite payload is malformed: {count} positions of {gap_size} bytes and "
            f"{itemsize}-byte values do not add up to {len(raw)} bytes"
        )
    gaps = np.frombuffer(raw, _UINT[gap_size], count=count, offset=16)
    values = np.frombuffer(raw, _UINT[itemsize], count=count, offset=16 + count * gap_size)
    return np.cumsum(gaps, dtype=np.uint64).astype(np.int64), values


def _decompress(blob: bytes, limit: int) -> bytes:
    try:
        return zstandard.ZstdDecompressor().decompress(blob, max_output_size=limit)
    except zstandard.ZstdError as e:
        raise ValueError(f"payload does not decompress ({e})") from None


def _apply_sparse(payload: bytes, old: np.ndarray) -> np.ndarray:
    num_words = -(-old.nbytes // 8)
    if len(payload) < 8:
        raise ValueError(f"sparse_xor payload of {len(payload)} bytes is too short")
    bitmap_len = int(np.frombuffer(payload, np.uint64, count=1)[0])
    mask_bytes = _decompress(payload[8 : 8 + bitmap_len], -(-num_words // 8) + 64)
    mask = np.unpackbits(np.frombuffer(mask_bytes, np.uint8), count=num_words).view(bool)
    planes = np.frombuffer(_decompress(payload[8 + bitmap_len :], num_words * 8 + 64), np.uint8)
    if planes.size % 8:
        raise ValueError(f"sparse_xor payload is malformed: {planes.size} word bytes is not a multiple of 8")
    words = np.ascontiguousarray(planes.reshape(8, -1).T).view(np.uint64).reshape(-1)
    if len(mask_bytes) != -(-num_words // 8) or words.size != int(mask.sum()):
        raise ValueError(
            f"sparse_xor payload is malformed: {words.size} changed words for a bitmap of "
            f"{int(mask.sum())} set bits over {num_words} words"
        )
    new = np.zeros(num_words * 8, np.uint8)
    new[: old.nbytes] = old
    changed = np.flatnonzero(mask)  # integer indexing is faster than boolean-mask assignment here
    new.view(np.uint64)[changed] ^= words
    if new[old.nbytes :].any():
        raise ValueError("sparse_xor payload is malformed: it changes padding bytes past the end of the tensor")
    return new[: old.nbytes]


def apply_delta(encoding: str, payload: bytes, old: np.ndarray, itemsize: int) -> np.ndarray:
    """Return the new bytes (a fresh uint8 array; ``old`` is not modified). Raises ValueError on a payload
    that does not decompress to the right size; the caller verifies the checksum."""
    if encoding == "sparse_xor":
        return _apply_sparse(payload, old)
    raw = _decompress(payload, max(old.nbytes, 1) * 9 + 64)
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
