"""The canonical baseline of a disk-delta sync: a safetensors checkpoint whose bytes the first delta is taken
against, read through its headers so every tensor's layout is checked before any byte is trusted.

The engines loaded this checkpoint; the trainer's first delta is ``trainer bytes XOR baseline bytes``. If a name
is missing, or its dtype, shape or byte count differ from what the trainer emits, the delta would be applied to
the wrong bytes, so ``read_bytes`` refuses with both layouts in the message. A baseline written by
``save_baseline`` also records an xxh3 checksum per tensor in the safetensors metadata; reads verify it.

    baseline = Baseline.from_checkpoint("ckpt/")          # headers only: cheap
    w = baseline.read("lm_head.weight", expected_dtype=torch.bfloat16, expected_shape=(V, D))
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

from miles.atomic import atomic_write_bytes
from miles.sync.disk_delta.codec import CHECKSUMS, checksum
from miles.sync.disk_delta.safetensors_dtypes import (
    TORCH_DTYPE,
    HeaderEntry,
    Layout,
    check_layout,
    read_header,
    safetensors_dtype,
)
from miles.sync.disk_delta.staging_pool import byte_view

CHECKSUM_KEY = "miles.checksum."  # metadata key prefix; value "<format>:<hex digest>"


class MissingTensorError(KeyError):
    """A tensor name the trainer emits is absent from the baseline (or an engine)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


def trainer_layout(name: str, tensor: torch.Tensor) -> Layout:
    """Layout.of with the tensor's name in the error for an unsupported dtype."""
    try:
        return Layout.of(tensor)
    except ValueError as e:
        raise ValueError(f"tensor {name!r} ({tensor.dtype}{list(tensor.shape)}): {e}") from None


class Baseline:
    """Name -> (file, offset, layout) for every tensor of a safetensors checkpoint (one file or a directory)."""

    def __init__(self, entries: dict[str, HeaderEntry], checksums: dict[str, str], source: str):
        self.entries, self.checksums, self.source = entries, checksums, source

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike) -> "Baseline":
        path = Path(path)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files or not files[0].exists():
            raise FileNotFoundError(
                f"no safetensors files at {path}; point the baseline at the checkpoint the "
                f"engines loaded (a directory of *.safetensors or one file)"
            )
        entries, checksums = {}, {}
        for file in files:
            file_entries, metadata, _ = read_header(file)
            for name, entry in file_entries.items():
                if name in entries:
                    raise ValueError(
                        f"tensor {name!r} appears in both {entries[name].file} and {file}; "
                        f"a checkpoint must hold each name once"
                    )
                entries[name] = entry
            checksums.update({k[len(CHECKSUM_KEY) :]: v for k, v in metadata.items() if k.startswith(CHECKSUM_KEY)})
        return cls(entries, checksums, str(path))

    def names(self) -> list[str]:
        return list(self.entries)

    def layout(self, name: str) -> Layout:
        return self._entry(name).layout

    def _entry(self, name: str, expected: Layout | None = None) -> HeaderEntry:
        try:
            return self.entries[name]
        except KeyError:
            close = difflib.get_close_matches(name, self.entries, n=3)
            emits = f" (the trainer emits {expected})" if expected else ""
            raise MissingTensorError(
                f"tensor {name!r}{emits} is not in the baseline {self.source} ({len(self.entries)} tensors"
                f"{'; close names: ' + str(close) if close else ''}); every tensor the trainer emits must be in the "
                f"baseline with the same layout: re-export the baseline from the trainer's weights"
            ) from None

    def read_bytes(self, name: str, expected: Layout) -> np.ndarray:
        """The tensor's bytes (a fresh uint8 array) after checking its layout against ``expected`` and its
        recorded checksum, if any."""
        entry = self._entry(name, expected)
        if entry.layout.dtype not in TORCH_DTYPE:
            raise ValueError(
                f"tensor {name!r}: the baseline {entry.file} stores dtype {entry.layout.dtype!r} "
                f"{list(entry.layout.shape)} ({entry.layout.nbytes} bytes), which has no torch dtype here "
                f"(supported: {sorted(TORCH_DTYPE)}); the trainer emits {expected}. Re-export the baseline."
            )
        if entry.layout.expected_nbytes() != entry.layout.nbytes:
            raise ValueError(
                f"tensor {name!r}: the baseline {entry.file} header says {entry.layout.dtype}"
                f"{list(entry.layout.shape)} but its data_offsets span {entry.layout.nbytes} bytes "
                f"({entry.layout.expected_nbytes()} expected): baseline {entry.layout}, the trainer emits {expected}. "
                f"The header is inconsistent; re-export the baseline."
            )
        check_layout(name, entry.layout, expected, got_from=f"the baseline {entry.file}")
        data = np.fromfile(entry.file, dtype=np.uint8, count=entry.layout.nbytes, offset=entry.offset)
        if data.size != entry.layout.nbytes:
            raise ValueError(
                f"tensor {name!r}: the baseline {entry.file} is truncated: {entry.layout} at byte {entry.offset} "
                f"but only {data.size} bytes could be read (the trainer emits {expected}); copy the file again"
            )
        self._verify(name, entry, data)
        return data

    def _verify(self, name: str, entry: HeaderEntry, data: np.ndarray) -> None:
        recorded = self.checksums.get(name)
        if recorded is None:
            return
        fmt, _, digest = recorded.partition(":")
        if fmt not in CHECKSUMS:
            raise ValueError(
                f"tensor {name!r}: the baseline {entry.file} records a {fmt!r} checksum; supported: {sorted(CHECKSUMS)}"
            )
        got = checksum(data, fmt)
        if got != digest:
            raise ValueError(
                f"tensor {name!r}: checksum mismatch in the baseline {entry.file} ({entry.layout}): recorded "
                f"{fmt} {digest}, bytes on disk hash to {got}; the file is corrupt, copy it again"
            )

    def read(self, name: str, *, expected_dtype: torch.dtype, expected_shape) -> torch.Tensor:
        """The tensor itself, validated against the trainer's dtype and shape."""
        dtype = safetensors_dtype(expected_dtype)
        shape = tuple(int(d) for d in expected_shape)
        expected = Layout(dtype=dtype, shape=shape, nbytes=Layout(dtype=dtype, shape=shape, nbytes=0).expected_nbytes())
        data = self.read_bytes(name, expected)
        return torch.from_numpy(data).view(expected_dtype).reshape(shape)


def save_baseline(
    named_tensors: dict[str, torch.Tensor], path: str | os.PathLike, *, checksum_format: str = "xxh3_128"
) -> Path:
    """Write a single-file safetensors baseline, atomically, with a checksum per tensor in its metadata."""
    # copies: exporting a storage to numpy (the checksum, the writer) marks it non-resizable for good, and a live
    # parameter's storage must stay resizable (TaggedMemory frees it at every offload)
    tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in named_tensors.items()}
    metadata = {
        CHECKSUM_KEY + name: f"{checksum_format}:{checksum(byte_view(t).numpy(), checksum_format)}"
        for name, t in tensors.items()
    }
    atomic_write_bytes(path, safetensors.torch.save(tensors, metadata=metadata))
    return Path(path)
