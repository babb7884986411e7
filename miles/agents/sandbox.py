"""The harness's sandbox directories: one per episode, named by its ``episode_id``, directly under the harness root.

An episode id arrives over HTTP, so it is a name and never a path: ``[A-Za-z0-9_.-]``, 1-128 characters, not
``.`` or ``..``. The directory is resolved (symlinks followed) and must sit directly under the resolved root
before anything is created, and a directory is removed only if this object created it: an id that names an
existing directory gets an error and the directory is left alone.

    boxes = Sandboxes(root)
    box = boxes.create("s0-g1-0-abc", {"util.py": "...", "test_util.py": "..."})
    boxes.remove(box)          # only what create made; anything else is left where it is
    boxes.remove_all()         # at exit
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

EPISODE_ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def check_episode_id(episode_id) -> str:
    """``episode_id`` when it is a valid name, else a ValueError that says what a name is."""
    if not isinstance(episode_id, str) or not EPISODE_ID_RE.fullmatch(episode_id) or episode_id in (".", ".."):
        raise ValueError(
            f"episode_id = {str(episode_id)[:80]!r} must be a name of 1-128 characters from A-Z a-z 0-9 _ . - "
            "(not '.' or '..'): it names the episode's sandbox directory under the harness root"
        )
    return episode_id


class Sandboxes:
    """Sandbox directories under one root; see the module docstring for the rules."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.created: set[Path] = set()

    def path(self, episode_id: str) -> Path:
        box = (self.root / check_episode_id(episode_id)).resolve()
        if box.parent != self.root:
            raise ValueError(f"episode {episode_id!r}: {box} is not directly under the harness root {self.root}")
        return box

    def create(self, episode_id: str, files: dict[str, str]) -> Path:
        box = self.path(episode_id)
        try:
            box.mkdir()
        except FileExistsError:
            raise ValueError(
                f"episode {episode_id!r}: {box} already exists and this harness did not create it; it is left "
                "alone (use a fresh episode id)"
            ) from None
        self.created.add(box)
        for rel, text in files.items():
            (box / rel).write_text(text)
        return box

    def remove(self, box: Path | None) -> None:
        if box is not None and box in self.created:
            shutil.rmtree(box, ignore_errors=True)
            self.created.discard(box)

    def remove_all(self) -> None:
        for box in list(self.created):
            self.remove(box)

    def names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir()) if self.root.exists() else []
