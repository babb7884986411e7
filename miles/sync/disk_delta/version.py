"""One published weight version on disk, and how an engine turns it into new weights.

A version is a directory ``<root>/v00000007/`` holding one safetensors shard per source rank (each tensor a
uint8 blob: its zstd-compressed delta) and ``index.json``: version, base version, encoding, compression,
checksum format, the shards with their byte sizes, and per tensor its layout, encoding, shard and the checksum
of its new bytes. Tensors that did not change are absent. The directory appears by rename, so a reader sees a
whole version or none; ``LATEST`` names the newest.

``load_version`` is the engine side: it never modifies the engine's tensors; it builds the changed ones anew,
verifies every checksum, and only then returns the full new mapping, so a corrupt, incomplete or mismatched
version raises ``VersionError`` and the engine keeps serving its current weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from miles.sync.buckets import host_bytes
from miles.sync.disk_delta.baseline import MissingTensorError
from miles.sync.disk_delta.codec import apply_delta, checksum
from miles.sync.disk_delta.safetensors_dtypes import Layout, check_layout, torch_dtype
from miles.sync.disk_delta.staging_pool import byte_view

FORMAT = "miles-disk-delta/1"
INDEX = "index.json"
LATEST = "LATEST"


class VersionError(ValueError):
    """A weight version that cannot be applied: absent, incomplete, corrupt, or not based on the engine's copy."""


def version_dir(root: str | os.PathLike, version: int) -> Path:
    return Path(root) / f"v{version:08d}"


def published_versions(root: str | os.PathLike) -> list[int]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(p.name[1:]) for p in root.iterdir() if p.is_dir() and p.name[:1] == "v" and p.name[1:].isdigit())


def read_index(root: str | os.PathLike, version: int) -> dict:
    path = version_dir(root, version) / INDEX
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise VersionError(
            f"weight version {version} is not published under {root} (no {path}); "
            f"published versions: {published_versions(root)}"
        ) from None
    except (UnicodeDecodeError, ValueError) as e:
        raise VersionError(f"{path} is corrupt ({e}); the version cannot be applied") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != version:
        raise VersionError(
            f"{path} is not a {FORMAT} index for version {version} "
            f"(format {index.get('format') if isinstance(index, dict) else None!r})"
        )
    missing = [
        k for k in ("base_version", "encoding", "compression", "checksum", "shards", "tensors") if k not in index
    ]
    if missing or index["compression"] != "zstd":
        raise VersionError(
            f"{path} is incomplete or unsupported: missing {missing}, compression "
            f"{index.get('compression')!r} (supported: 'zstd')"
        )
    return index


def _chain(root: Path, version: int, local_version: int | None) -> list[dict]:
    """The indices to apply, oldest first, to go from the engine's version to ``version``."""
    indices = [read_index(root, version)]
    if local_version is None:
        return indices
    if local_version == version:
        return []
    while indices[0]["base_version"] != local_version:
        base = indices[0]["base_version"]
        if base < local_version:
            raise VersionError(
                f"the engine holds version {local_version}, which is not on the chain to version "
                f"{version} (it passes from {base} to {indices[0]['version']}); reload a full checkpoint"
            )
        try:
            indices.insert(0, read_index(root, base))
        except VersionError as e:
            raise VersionError(
                f"the engine holds version {local_version}; reaching {version} needs version {base}: {e}. "
                f"Keep more versions (keep_versions) or reload a full checkpoint"
            ) from None
    return indices


def load_version(
    path: str | os.PathLike,
    version: int,
    local_copy: dict[str, torch.Tensor],
    *,
    local_version: int | None = None,
    changed_only: bool = False,
) -> dict[str, torch.Tensor]:
    """Apply version ``version`` under the sync root ``path`` to the engine's ``local_copy`` and return the full
    new mapping (changed tensors are new tensors on the same device; unchanged ones are ``local_copy``'s own), or
    with ``changed_only`` just the changed tensors (what an engine needs to copy into its parameters).

    ``local_copy`` must hold the engine's canonical weights at the index's base version; pass ``local_version``
    to check that, and to walk several published versions when the engine fell behind. Raises ``VersionError``
    (or ``MissingTensorError``) and leaves ``local_copy`` untouched when the version is absent, incomplete or
    corrupt, or does not match the engine's tensors.
    """
    state, changed = dict(local_copy), {}
    for index in _chain(Path(path), version, local_version):
        new = _apply(Path(path), index, state)
        state.update(new)
        changed.update(new)
    return changed if changed_only else state


def _apply(root: Path, index: dict, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    vdir = version_dir(root, index["version"])
    for shard, nbytes in index["shards"].items():
        size = (vdir / shard).stat().st_size if (vdir / shard).exists() else None
        if size != nbytes:
            raise VersionError(
                f"version {index['version']} is incomplete: shard {vdir / shard} has "
                f"{size if size is not None else 'no'} bytes, the index says {nbytes}"
            )
    by_shard: dict[str, list[str]] = {}
    for name, info in index["tensors"].items():
        by_shard.setdefault(info["shard"], []).append(name)
    new: dict[str, torch.Tensor] = {}
    for shard, names in by_shard.items():
        try:
            handle = safe_open(str(vdir / shard), framework="numpy")
        except Exception as e:  # safetensors raises its own error types for a damaged file
            raise VersionError(f"version {index['version']}: shard {vdir / shard} is unreadable ({e})") from None
        for name in names:
            new[name] = _apply_tensor(name, index, handle, state)
    return new


def _apply_tensor(name: str, index: dict, handle, state: dict[str, torch.Tensor]) -> torch.Tensor:
    info, version = index["tensors"][name], index["version"]
    layout = Layout(dtype=info["dtype"], shape=tuple(info["shape"]), nbytes=info["nbytes"])
    if name not in state:
        raise MissingTensorError(
            f"tensor {name!r} ({layout}) of weight version {version} is not among the "
            f"engine's {len(state)} tensors; the engine and trainer disagree on parameter names"
        )
    local = state[name]
    check_layout(name, Layout.of(local), layout, got_from="the engine", expected_from=f"weight version {version}")
    try:
        payload = handle.get_tensor(name).tobytes()
    except Exception as e:
        raise VersionError(f"version {version}: tensor {name!r} cannot be read from its shard ({e})") from None
    local_bytes = byte_view(local).cpu()  # held while `old` views it
    old = host_bytes(local_bytes)
    try:
        data = apply_delta(info["encoding"], payload, old, torch_dtype(layout.dtype).itemsize) if layout.nbytes else old
    except ValueError as e:
        raise VersionError(f"version {version}: tensor {name!r}: {e}; the version is corrupt") from None
    got = checksum(data, index["checksum"])
    if got != info["checksum"]:
        raise VersionError(
            f"version {version}: tensor {name!r} ({layout}) checksum mismatch after applying the {info['encoding']} "
            f"delta: the index says {info['checksum']}, the result hashes to {got}. Either the version is corrupt or "
            f"the engine's copy is not at base version {index['base_version']}; the engine keeps its weights"
        )
    out = torch.from_numpy(data if data is not old else data.copy()).view(torch_dtype(layout.dtype))
    return out.reshape(layout.shape).to(local.device)


def write_index(vdir: Path, index: dict) -> None:
    """Write ``index.json`` into a not-yet-published version directory and fsync it."""
    path = vdir / INDEX
    with open(path, "w") as f:
        json.dump(index, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
