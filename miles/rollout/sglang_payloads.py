"""SGLang's tensor payloads for ``/update_weights_from_tensor``: ``MultiprocessingSerializer`` strings (sglang
0.5.10.post1 ``srt/utils/common.py``: base64 of a ``multiprocessing.reduction.ForkingPickler`` pickle), holding a
list of ``(name, tensor)`` pairs, or with ``load_format="flattened_bucket"`` slime's
``{"flattened_tensor": uint8 tensor, "metadata": [FlattenedTensorMetadata, ...]}``
(``srt/weight_sync/tensor_bucket.py``). The tensors are not in the payload: each is a handle to memory of the
sender's process on this machine (CUDA IPC on GPU, a shared-memory file on CPU).

A pickle can build any object its bytes name, so these are read by ``SGLangUnpickler``, which admits exactly:

- ``torch.Size``, torch dtypes (``torch.bfloat16`` ...), ``torch.Tensor`` / ``torch.nn.Parameter`` (the class a
  tensor is rebuilt as) and ``torch.UntypedStorage`` / ``torch.storage.TypedStorage`` (passed as classes, never
  called with pickle-supplied arguments except through the rebuild functions below);
- from ``torch.multiprocessing.reductions``: ``rebuild_tensor`` (a view of a storage: offset, size and stride are
  checked against the storage by torch), ``rebuild_typed_storage`` and ``rebuild_storage_empty``;
- ``rebuild_storage_filename`` (a CPU tensor shared with torch's file_system strategy) replaced by
  ``_open_torch_shm``: the handle must name torch's shared memory (``/torch_<pid>_<n>_<n>``), a regular file
  in /dev/shm owned by this user with one link and at least the declared size, mapped read-only; torch's
  shared-memory manager socket named in the pickle is never contacted;
- ``rebuild_cuda_tensor`` (a CUDA IPC handle, how SGLang and slime send GPU tensors; the device may be a UUID, as
  SGLang's ``monkey_patch_torch_reductions`` writes it) after its arguments are type-checked;
- ``FlattenedTensorMetadata`` (both module paths SGLang used) as a plain record of its six fields.

Everything else is refused naming it, file-descriptor handles included (``rebuild_storage_fd`` /
``resource_sharer.DupFd`` would connect to a socket the pickle names, with an authkey an HTTP peer never shares;
send with ``torch.multiprocessing.set_sharing_strategy("file_system")`` or CUDA tensors). ``serialize`` writes
the same format (CPU tensors through torch's file_system sharing), so miles' client speaks it to SGLang and to
``miles serve``.

    s = serialize([("model.norm.weight", t)])            # str, as MultiprocessingSerializer(output_str=True)
    named = named_tensors(deserialize(s), None)           # [(name, tensor)]; "flattened_bucket" for slime's dict
"""

from __future__ import annotations

import base64
import io
import mmap
import os
import pickle
import re
import warnings
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing.reductions as reductions

from miles.rollout.sglang_api import WireError

_TORCH_SHM = re.compile(rb"/torch_\d+_\d+_\d+")  # at::NewProcessWideShmHandle / THManagedMapAllocator names
_REFCOUNT_HEADER = 64  # a file_system storage's file: a 64-byte refcount header (RefcountedMapAllocator), then data
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


class FlattenedMeta:
    """SGLang's FlattenedTensorMetadata (name, shape, dtype, start_idx, end_idx, numel) as a plain record."""

    FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")

    def __setstate__(self, state):
        if not isinstance(state, dict) or set(state) != set(self.FIELDS):
            raise pickle.UnpicklingError(f"FlattenedTensorMetadata state must have the fields {self.FIELDS}")
        self.__dict__.update(state)


def _open_torch_shm(cls, manager, handle, size, dtype=None):
    """torch's rebuild_storage_filename without its manager: the named shared memory mapped read-only."""
    if not (isinstance(handle, bytes) and _TORCH_SHM.fullmatch(handle)) or not isinstance(size, int) or size < 0:
        raise pickle.UnpicklingError(f"shared-memory handle {str(handle)[:80]} is not torch's (/torch_<pid>_<n>_<n>)")
    nbytes = size * (dtype.itemsize if dtype is not None else 1)
    from miles.sync.flat_bucket import _file_problem

    path = "/dev/shm" + handle.decode()
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise pickle.UnpicklingError(
            f"{path} cannot be opened read-only ({e.strerror}): not on this machine?"
        ) from None
    try:
        if problem := _file_problem(os.fstat(fd), _REFCOUNT_HEADER + nbytes):
            raise pickle.UnpicklingError(f"{path} {problem}")
        mapped = mmap.mmap(fd, _REFCOUNT_HEADER + nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # read-only on purpose: the receiver only copies out of it
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        data = torch.frombuffer(mapped, dtype=torch.uint8, offset=_REFCOUNT_HEADER, count=nbytes) if nbytes else None
    storage = torch.UntypedStorage(0) if data is None else data.untyped_storage()  # starts at the data, no copy
    return storage if dtype is None else torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)


def _rebuild_cuda(*args):
    """torch's rebuild_cuda_tensor after its 15 arguments are checked; a device UUID (SGLang's patch) is resolved."""
    if len(args) != 15:
        raise pickle.UnpicklingError(f"rebuild_cuda_tensor takes 15 arguments, got {len(args)}")
    args = list(args)
    ok = (
        args[0] in (torch.Tensor, torch.nn.Parameter)
        and args[4] in (torch.UntypedStorage, torch.storage.TypedStorage)
        and isinstance(args[5], torch.dtype)
        and isinstance(args[7], (bytes, type(None)))
        and isinstance(args[11], bytes)
        and _TORCH_SHM.fullmatch(args[11]) is not None
        and all(isinstance(args[i], int) and args[i] >= 0 for i in (3, 8, 9, 12))
    )
    if not ok:
        raise pickle.UnpicklingError("a CUDA tensor's rebuild arguments are not a CUDA IPC handle")
    if isinstance(args[6], str):  # sglang's monkey_patch_torch_reductions sends the device's UUID
        uuids = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
        if args[6] not in uuids:
            raise pickle.UnpicklingError(f"CUDA device {args[6]} is not on this machine")
        args[6] = uuids[args[6]]
    return reductions.rebuild_cuda_tensor(*args)


ADMITTED = {
    ("torch", "Size"): torch.Size,
    ("torch", "Tensor"): torch.Tensor,
    ("torch._tensor", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
    ("torch.multiprocessing.reductions", "rebuild_tensor"): reductions.rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): reductions.rebuild_typed_storage,
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): reductions.rebuild_storage_empty,
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): _open_torch_shm,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedMeta,
    ("sglang.srt.model_executor.model_runner", "FlattenedTensorMetadata"): FlattenedMeta,
}


class SGLangUnpickler(pickle.Unpickler):
    """Builds only what ADMITTED names (module docstring): tensors from same-host handles, never code."""

    def find_class(self, module, name):
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if (module, name) in ADMITTED:
            return ADMITTED[(module, name)]
        hint = ""
        if (module, name) in (("torch.multiprocessing.reductions", "rebuild_storage_fd"),
                              ("multiprocessing.resource_sharer", "DupFd")):  # fmt: skip
            hint = (
                "; file-descriptor handles need the sender's multiprocessing authkey: send with "
                "torch.multiprocessing.set_sharing_strategy('file_system') or CUDA tensors"
            )
        raise pickle.UnpicklingError(f"{module}.{name} is not admitted in a weight payload{hint}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids are not admitted in a weight payload")


def is_pickle(raw: bytes) -> bool:
    """A MultiprocessingSerializer payload (a pickle) rather than miles' torch.save zip archive."""
    return raw[:1] == b"\x80"


def deserialize(raw: bytes):
    try:
        return SGLangUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, RuntimeError, AttributeError) as e:
        raise WireError(f"serialized_named_tensors entry refused: {str(e)[:300]}") from None


def named_tensors(obj, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a decoded payload: pairs for ``None`` / ``"direct"``, slime's dict for
    ``"flattened_bucket"`` (each tensor a view of the flat uint8 buffer, checked to lie inside it)."""
    if load_format == "flattened_bucket":
        return _flattened(obj)
    if load_format not in (None, "direct"):
        raise WireError(f"load_format = {load_format!r} is not supported; use null, 'direct' or 'flattened_bucket'")
    if isinstance(obj, dict):
        obj = list(obj.items())
    if not isinstance(obj, list) or not all(
        isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
        for p in obj
    ):
        raise WireError("serialized_named_tensors must decode to a list of (name, tensor) pairs")
    return [(n, t) for n, t in obj]


def _flattened(obj) -> list[tuple[str, torch.Tensor]]:
    if not (isinstance(obj, dict) and set(obj) == {"flattened_tensor", "metadata"}):
        raise WireError("a flattened_bucket payload is {'flattened_tensor': tensor, 'metadata': [...]}")
    flat, metas = obj["flattened_tensor"], obj["metadata"]
    if not (isinstance(flat, torch.Tensor) and flat.dim() == 1 and isinstance(metas, list)):
        raise WireError("flattened_tensor must be a 1-d tensor and metadata a list")
    flat = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    out = []
    for m in metas:
        if not isinstance(m, FlattenedMeta) or not isinstance(m.name, str) or not isinstance(m.dtype, torch.dtype):
            raise WireError(f"flattened_bucket metadata entries must be FlattenedTensorMetadata, got {str(m)[:80]}")
        shape = tuple(m.shape)
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * m.dtype.itemsize
        if not (0 <= m.start_idx and m.end_idx - m.start_idx == nbytes and m.end_idx <= flat.numel()):
            raise WireError(f"{m.name}: bytes [{m.start_idx}, {m.end_idx}) do not hold {m.dtype} {shape} in the bucket")
        out.append((m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(shape)))
    return out


# ---- the sending side -------------------------------------------------------------------------------------------
class _FileSystemPickler(ForkingPickler):
    """ForkingPickler, with CPU storages shared as torch's file_system strategy shares them (by a shared-memory
    name any process of this user can open) whatever the process-wide strategy is."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.UntypedStorage) and obj.device.type == "cpu" and obj.nbytes() > 0:
            metadata = obj._share_filename_cpu_()
            obj._shared_incref()
            reductions.shared_cache[metadata[1]] = reductions.StorageWeakRef(obj)
            return (reductions.rebuild_storage_filename, (type(obj),) + metadata)
        return NotImplemented


def serialize(obj) -> str:
    """base64 of a ForkingPickler pickle, as ``MultiprocessingSerializer.serialize(obj, output_str=True)``. The
    sender must keep the tensors alive until the receiver has answered."""
    buf = io.BytesIO()
    _FileSystemPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")
