"""One ``pstrain local`` run per output directory.

A run writes its journal, job key, checkpoints, model and logs into ``--out``; a second run into the same
directory would interleave them (two coordinators appending to one journal, pruning each other's
checkpoints). The run therefore holds an exclusive ``flock`` on ``<out>/pstrain.lock`` for its whole life.
The kernel releases the lock when the holder dies, however it dies, so a run killed with SIGKILL leaves a
file behind but never a lock: only a live run blocks another.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_NAME = "pstrain.lock"


class OutDirBusy(RuntimeError):
    """Another live process holds the output directory's lock: the run must not start (exit 2)."""

    def __init__(self, directory: Path, holder: int | None) -> None:
        who = f"pid {holder}" if holder is not None else "a process that has not written its pid yet"
        super().__init__(
            f"--out {directory} is in use by another pstrain local run ({who}); "
            f"wait for it to end, stop it, or name another --out"
        )
        self.directory = directory
        self.holder = holder


def _holder_pid(fd: int) -> int | None:
    """The pid the holder wrote into the lock file, if it has written one yet."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _publish_pid(fd: int) -> None:
    """Write our pid into the lock file (for the message a blocked run prints); only the holder truncates it."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


@contextmanager
def hold_out_dir(directory: Path) -> Iterator[Path]:
    """Create ``directory`` and hold its lock until the block ends; ``OutDirBusy`` at once if another run holds it.

    The descriptor is close-on-exec (``os.open``'s default), so the cluster's children never inherit the lock:
    it lives exactly as long as this process holds it.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: the holder's pid stays readable
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutDirBusy(directory, _holder_pid(fd)) from None
        _publish_pid(fd)
        yield path
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race with a run about to lock it)
