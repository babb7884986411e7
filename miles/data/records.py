"""Dataset files read into raw records: .jsonl (one JSON object per line), .parquet, or a `datasets`
save_to_disk directory. Only regular files are opened, and a jsonl line that does not decode or parse becomes a
BadRowError in its place, so the row mapping (miles.data.dataset) stops at it or skips and counts it.

    records = read_records("train.jsonl")        # [dict | BadRowError, ...] in file order, blank lines left out
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import BinaryIO


class BadRowError(ValueError):
    """A dataset row that cannot be used; the message names the file, the row and the field."""


def read_records(path: str) -> list:
    """The raw rows of a .jsonl / .parquet file or a `datasets` directory ('dir::split' for a DatasetDict). A jsonl
    line that does not decode or parse is a BadRowError in its place, so that ``load_rows`` stops at it or skips and
    counts it like any other bad row."""
    base, _, split = path.partition("::")
    p = Path(base)
    if not p.exists():
        raise FileNotFoundError(f"dataset {path!r} does not exist")
    if p.is_dir():
        return _read_datasets_dir(p, split)
    if p.suffix not in (".jsonl", ".parquet"):
        raise ValueError(f"dataset {path!r}: unknown format {p.suffix!r}; use .jsonl, .parquet or a datasets directory")
    with _open_regular_file(p) as f:
        if p.suffix == ".jsonl":
            return _read_jsonl(f, p)
        try:
            import pyarrow.parquet as pq
        except ImportError as e:  # pragma: no cover
            raise ImportError("reading .parquet datasets needs pyarrow: pip install 'miles[data]'") from e
        return pq.read_table(f).to_pylist()


_FILE_KINDS = (
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
)


def _open_regular_file(p: Path) -> BinaryIO:
    """``p`` opened for reading, refused unless it is a regular file: a FIFO would wait for a writer forever, a
    device would never end. Checked before the open and again on the open file (O_NONBLOCK: whatever ``p`` has
    become meanwhile, the open itself returns at once)."""
    _require_regular(p, os.stat(p).st_mode)
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        _require_regular(p, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def _require_regular(p: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "special file")
        raise ValueError(
            f"dataset {str(p)!r} is a {kind}, not a regular file; save the rows to a .jsonl or .parquet file first"
        )


def _read_jsonl(f: BinaryIO, p: Path) -> list:
    """One record per line. Lines end at b"\\n" only: U+2028, U+2029, U+0085 and the other characters that
    ``str.splitlines`` also splits at may stand raw inside a JSON string (``json.dumps(ensure_ascii=False)``
    writes them so). A UTF-8 byte-order mark at the start is dropped."""
    records: list = []
    for i, raw in enumerate(f):
        where = f"{p} row {len(records)} (line {i + 1})"
        try:
            line = raw.decode("utf-8-sig" if i == 0 else "utf-8")
        except UnicodeDecodeError as e:
            records.append(
                BadRowError(
                    f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line; save the "
                    "file as UTF-8)"
                )
            )
            continue
        if not line.strip(" \t\r\n"):
            continue
        try:
            records.append(json.loads(line))
        except (ValueError, RecursionError) as e:  # JSONDecodeError, an int over 4300 digits, nesting too deep
            records.append(BadRowError(f"{where}: not valid JSON ({str(e)[:200]})"))
    return records


def _read_datasets_dir(p: Path, split: str) -> list[dict]:
    try:
        import datasets
    except ImportError as e:  # pragma: no cover
        raise ImportError("reading a save_to_disk directory needs datasets: pip install 'miles[data]'") from e
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{p} holds the splits {list(ds)}; pick one with '{p}::{next(iter(ds))}'")
        ds = ds[split]
    return ds.to_list()
