"""The runs one dashboard serves: a run directory, or a folder whose sub-directories are runs (`miles dashboard runs/`).

A folder that is neither (it holds files but no run) is refused with the reason, so the page never shows a
directory that is not a run as if it were an empty one. An empty folder is taken as a run that has not written
anything yet (`miles dashboard --follow` started before `miles train`).
"""

from __future__ import annotations

import os
from pathlib import Path

from miles.dashboard.store import NotInRunDir, RunDirReader

# what `miles train` writes into a run directory (miles.run_dir); any one of them makes a directory a run
RUN_FILES = ("config.json", "metrics.jsonl", "ledger.jsonl", "rollouts")


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in RUN_FILES)


class NotARunDir(ValueError):
    """A directory that is not a run and holds no runs."""


class RunCatalog:
    """The run directories under one root, looked up by name; the root itself when it is a run.

    catalog = RunCatalog("runs")           # runs/quickstart/, runs/smollm2/ ... (or one run directory)
    catalog.names()                        # ["quickstart", "smollm2"]; ["quickstart"] for runs/quickstart itself
    catalog.reader("smollm2")              # its RunDirReader; None picks catalog.default()
    The listing is read again on every call, so a run started after the dashboard appears in it.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise FileNotFoundError(f"run directory {root} does not exist; pass the run_dir a driver wrote")
        if not self.single and not self.names():
            shown = ", ".join(sorted(p.name for p in self.root.iterdir())[:6])
            raise NotARunDir(
                f"{root} is not a run directory (none of {', '.join(RUN_FILES)}) and holds none (it has {shown}); "
                "pass a run_dir written by `miles train`, or a folder of them"
            )
        self._readers: dict[str, RunDirReader] = {}

    @property
    def single(self) -> bool:
        """True when the root is the run (or an empty directory a run will write into)."""
        return is_run_dir(self.root) or not any(self.root.iterdir())

    def names(self) -> list[str]:
        if self.single:
            return [self.root.name]
        return sorted(p.name for p in self.root.iterdir() if not p.name.startswith(".") and is_run_dir(p))

    def default(self) -> str:
        """The run the page opens with: the root itself, or the run written to most recently."""
        names = self.names()
        if self.single or not names:
            return self.root.name
        return max(names, key=lambda name: (_last_write(self.root / name), name))

    def path(self, name: str) -> Path:
        return self.root if self.single else self.root / name

    def reader(self, name: str | None = None) -> RunDirReader:
        names = self.names()
        name = name or self.default()
        if name not in names:
            raise NotInRunDir(f"run {name!r} (the runs under {self.root} are: {', '.join(names) or 'none'})")
        if name not in self._readers:
            self._readers[name] = RunDirReader(self.path(name))
        return self._readers[name]

    def listing(self) -> list[dict]:
        """One line per run for the page's run picker (polled while following): name, last write (Unix seconds)."""
        return [{"name": name, "modified": _last_write(self.path(name))} for name in self.names()]


def _last_write(path: Path) -> float:
    stamps = [(path / name).stat().st_mtime for name in RUN_FILES if (path / name).exists()]
    return max(stamps, default=0.0)
