"""Write files so that a crash leaves the old version or the new one, never half of either."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], object]) -> None:
    """Call ``write`` on a temp file beside ``path`` (mode 0600), fsync it, rename it over ``path``, fsync the dir.

    A directory this call creates (a shard's first checkpoint makes ``shard-<id>``) has its own entry fsynced in its
    parent too: without that, a power loss can take the new directory, and the file in it, after the write was
    reported durable (and the checkpoint committed)."""
    target = Path(path)
    created = [d for d in (target.parent, *target.parent.parents) if not d.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    for directory in (target.parent, *(d.parent for d in created)):
        fsync_dir(directory)


def fsync_dir(directory: Path) -> None:
    """Make ``directory``'s entries durable: a file created or renamed in it survives a power loss."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
