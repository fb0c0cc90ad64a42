"""One service per flash dir: an exclusive ``flock`` on ``<flash dir>/lock`` for the service's
life.

Two services writing one flash dir would disagree about its contexts and lose data (two writers
of one journal record, one segment sequence). The first process to start takes the lock; a second
process on the same flash dir is refused (:class:`~sparkv.device.errors.FlashInUse`, naming the
holder's pid, which the lock file records). The kernel releases a ``flock`` when its holder
exits, however it exits: a service killed by ``SIGKILL`` leaves a lock file but no lock, and the
next start takes it.

Within one process the lock is shared: services made on the same flash dir (a test reopening it,
a tool) count on one open lock file (``flock`` locks belong to an open file, so a second open in
the same process would be refused), released when the last of them is closed or collected.

State: the process's table of held locks (lock file identity -> its descriptor and holders),
guarded by ``_TABLE_LOCK``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from pathlib import Path

from sparkv.device.errors import FlashInUse
from sparkv.device.private import FILE_MODE

LOCK_NAME = "lock"

_TABLE_LOCK = threading.Lock()
_HELD: dict[tuple[int, int], list[int]] = {}      # (st_dev, st_ino) -> [fd, holders]


class FlashDirLock:
    """The exclusive lock of flash dir ``root`` (module docstring), taken when made;
    :meth:`release` (or collection) gives this holder's share back."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.path = Path(root) / LOCK_NAME
        self._key: tuple[int, int] | None = _acquire(self.path)

    def release(self) -> None:
        key, self._key = self._key, None
        if key is not None:
            _release(key)

    def __del__(self) -> None:
        self.release()


def _acquire(path: Path) -> tuple[int, int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    with _TABLE_LOCK:
        held = _HELD.get(key)
        if held is not None:            # this process holds it: one more holder
            os.close(fd)
            held[1] += 1
            return key
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise FlashInUse(f"the flash dir {path.parent} is in use by another sparkv device "
                             f"service{holder}: one service per flash dir (stop that one, or "
                             "give this one another flash dir)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _HELD[key] = [fd, 1]
        return key


def _release(key: tuple[int, int]) -> None:
    with _TABLE_LOCK:
        held = _HELD.get(key)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _HELD[key]
            os.close(held[0])            # closing the descriptor releases the flock


def _holder(fd: int) -> str:
    """`` (pid N)`` as the lock file records its holder, or nothing."""
    try:
        pid = os.pread(fd, 32, 0).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""
    return f" (pid {pid})" if pid.isdigit() else ""
