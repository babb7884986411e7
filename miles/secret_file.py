"""Secrets (an API key, an agent run's token) reach a process through a file or its environment, never its argv:
``ps`` shows every process's arguments to every user of the machine, while a 0600 file and /proc/PID/environ are
readable by the owner only.

    path = write_secret_file(directory / "token", secrets.token_urlsafe(32))   # 0600, never over an existing file
    key = read_secret_file(path, "--api-key-file")
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path


def read_secret_file(path: str | os.PathLike, flag: str) -> str:
    """The file's text, stripped. A missing or empty file is a ValueError naming ``flag``; a file that other users
    may read is used, with a warning on stderr."""
    p = Path(path)
    try:
        text = p.read_text().strip()
        mode = p.stat().st_mode
    except OSError as e:
        raise ValueError(
            f"{flag} {str(path)!r} cannot be read ({e.strerror}); give a file holding the secret"
        ) from None
    if not text:
        raise ValueError(f"{flag} {str(path)!r} is empty; write the secret into it (one line)")
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        print(
            f"WARNING: {flag} {str(path)!r} is readable by other users (mode {stat.S_IMODE(mode):o}); chmod 600 it",
            file=sys.stderr,
            flush=True,
        )
    return text


def write_secret_file(path: str | os.PathLike, secret: str) -> Path:
    """Create ``path`` with mode 0600 holding ``secret``; an existing file is an error (nothing is overwritten)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return Path(path)
