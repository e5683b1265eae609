"""One process at a time per directory whose files it owns: ``pstrain local``'s ``--out``, a coordinator's
``--out`` (its journal and job key) and its ``checkpoint.dir`` (the manifests it commits and prunes), and a PS
shard's files in ``checkpoint.dir`` on its own host (``shard-<id>/``, ``sparse-<id>/``: shards of two jobs pointed
at one directory would prune each other's snapshots, and a coordinator's lock on another host cannot see them).

A second process writing the same files would interleave them: two coordinators appending to one journal, each
pruning the other's checkpoints. The owner therefore holds an exclusive ``flock`` on a lock file in the directory
for its whole life. The kernel releases the lock when the holder dies, however it dies, so a process killed with
SIGKILL leaves a file behind but never a lock: only a live process blocks another. Each kind of owner has a lock
file of its own (``pstrain local`` and the coordinator it starts share ``--out``).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

LOCAL_RUN = "pstrain.lock"  # pstrain local's, in --out
COORDINATOR = "coordinator.lock"  # a coordinator's, in --out and in checkpoint.dir


def ps_shard_lock(shard_id: int) -> str:
    """PS shard ``shard_id``'s, in checkpoint.dir: the shards of one job hold different ones, so they share it."""
    return f"ps-{shard_id}.lock"


class DirectoryBusy(RuntimeError):
    """Another live process holds the directory's lock: this one must not start (exit 2; a PS shard, which learns
    its checkpoint.dir only once it has joined, exits 3: the job's)."""

    def __init__(self, directory: Path, holder: int | None, what: str, owner: str) -> None:
        who = f"pid {holder}" if holder is not None else "a process that has not written its pid yet"
        super().__init__(
            f"{what} {directory} is in use by another {owner} ({who}); wait for it to end, stop it, or name another "
            "directory"
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
    """Write our pid into the lock file (for the message a blocked process prints); only the holder truncates it."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


@contextmanager
def hold_directory(directory: Path, lock_name: str, what: str, owner: str) -> Iterator[Path]:
    """Create ``directory`` and hold its ``lock_name`` lock until the block ends; ``DirectoryBusy`` at once if
    another process holds it (the message names the directory as ``what``, e.g. ``--out``, and the holder as
    ``owner``, e.g. ``pstrain local run``).

    The descriptor is close-on-exec (``os.open``'s default), so children never inherit the lock: it lives exactly
    as long as this process holds it. A file system without ``flock`` (some network mounts answer ENOLCK) is
    used unlocked, with a warning: refusing to start there would be worse than the race the lock prevents.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / lock_name
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: the holder's pid stays readable
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DirectoryBusy(directory, _holder_pid(fd), what, owner) from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            log.warning(
                "%s %s cannot be locked (%s); nothing stops a second process from using it",
                what,
                directory,
                exc.strerror,
            )
        _publish_pid(fd)
        yield path
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race with a process about to lock it)
