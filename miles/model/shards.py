"""The safetensors files of a Hugging Face checkpoint directory: which files hold the weights (every file, or the
shards its ``model.safetensors.index.json`` names, each one inside the directory), and their headers, read
without reading a tensor (the driver checks shapes before Ray starts and never holds the weights).

    files = shard_files("ckpt/")           # [ckpt/model-00001-of-00002.safetensors, ...]
    header_shapes(files)                   # {"model.embed_tokens.weight": (300, 64), ...}
"""

from __future__ import annotations

from pathlib import Path, PurePath

from miles.model.config import read_json

INDEX = "model.safetensors.index.json"


def shard_files(directory: str | Path) -> list[Path]:
    """The safetensors files of ``directory``; with an index, the shards it names, refused before any is opened
    when one lies outside the directory or is absent."""
    d = Path(directory)
    index = d / INDEX
    if index.exists():
        names = set(weight_map(index).values())
        files = sorted(d / _inside(d, name, index) for name in names)
        absent = [f.name for f in files if not f.exists()]
        if absent:
            raise FileNotFoundError(f"{index} lists shards that are not in {d}: {absent}; copy the whole checkpoint")
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {d}; expected a Hugging Face style checkpoint directory")
    return files


def weight_map(index: Path) -> dict[str, str]:
    """The index's tensor name -> shard file name, checked to be exactly that."""
    data = read_json(index)
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        shown = repr(wm if isinstance(data, dict) else data)[:80]
        raise ValueError(
            f"{index}: weight_map = {shown} must be an object of tensor name -> shard file name, e.g. "
            '{"model.norm.weight": "model-00001-of-00002.safetensors"}; use the index the model was saved with'
        )
    return wm


def _inside(directory: Path, name: str, index: Path) -> PurePath:
    """``name`` as a path inside the directory, judged on the name alone (a link inside it is followed as the
    filesystem does: the Hugging Face cache links each file to a blob outside the snapshot directory)."""
    rel = PurePath(name)
    if not name or rel.is_absolute() or rel.anchor or ".." in rel.parts:
        raise ValueError(
            f"{index} names the shard {name!r}, which is not a file inside {directory}; a shard is a file name "
            "such as model-00001-of-00002.safetensors beside the index: fix the index"
        )
    return rel


def header_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over every file, from the headers alone (safetensors validates each header against
    the file's size; a damaged file is refused naming it)."""
    from safetensors import SafetensorError, safe_open

    out = {}
    for f in files:
        try:
            with safe_open(f, "pt") as h:
                for name in h.keys():
                    out[name] = tuple(h.get_slice(name).get_shape())
        except SafetensorError as e:
            raise ValueError(
                f"{f} is not a readable safetensors file ({e}); the copy is damaged or cut: copy it again"
            ) from None
    return out
