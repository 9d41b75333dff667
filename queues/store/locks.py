"""Item locks: every transition of one item runs under that item's lock, so transitions from any
number of threads and processes sharing the data directory take turns per item.

Each queue has one lock file; an item maps to one byte of it (striped by id). A thread lock per
stripe excludes the threads of this process (POSIX record locks are per process), a record lock
on the byte excludes other processes, and the kernel drops it if the process dies. A thread may
take a stripe it holds again (an item's transition that makes another item, such as a retry):
the record lock is taken by the outermost hold and dropped by it.
"""

import errno
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from . import files

STRIPES = 256


class QueueLocks:
    """One queue's item locks. One instance per lock file and process (`for_file`): two in one
    process would not exclude each other, and closing either would drop the other's record
    locks."""

    _open: dict[tuple[int, int], "QueueLocks"] = {}  # by (device, inode) of the lock file
    _open_lock = threading.Lock()

    def __init__(self, fd: int, key: tuple[int, int]):
        self._fd = fd
        self._key = key
        self._threads = [threading.RLock() for _ in range(STRIPES)]
        self._depth = [0] * STRIPES  # holds of each stripe by the thread holding it

    @classmethod
    def for_file(cls, path: str) -> "QueueLocks":
        with cls._open_lock:
            info = files.status(path)
            known = info and cls._open.get((info.st_dev, info.st_ino))
            if known:
                return known
            # never close a second descriptor of a registered file: that drops its record locks
            fd = files.open_append(path)
            info = os.fstat(fd)
            key = (info.st_dev, info.st_ino)
            if key in cls._open:
                return cls._open[key]
            locks = cls._open[key] = cls(fd, key)
            return locks

    @contextmanager
    def hold(self, name: str) -> Iterator[None]:
        """Hold the lock of an item id or a key digest (names that end in two hex digits)."""
        stripe = stripe_of(name)
        with self._threads[stripe]:
            if not self._depth[stripe]:
                _lock_byte(self._fd, stripe)
            self._depth[stripe] += 1
            try:
                yield
            finally:
                self._depth[stripe] -= 1
                if not self._depth[stripe]:
                    fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, stripe)

    def close(self) -> None:
        with self._open_lock:
            if self._open.pop(self._key, None) is self:
                os.close(self._fd)


def stripe_of(name: str) -> int:
    """The stripe a name's lock is: the same in every process, unlike hash()."""
    return int(name[-2:], 16) % STRIPES


def _lock_byte(fd: int, offset: int) -> None:
    """Wait for the record lock on one byte. The kernel's deadlock check counts record locks per
    process, so threads of two processes each holding one stripe and waiting for the other's are
    refused with EDEADLK; a thread holds a second stripe only for an item made a moment ago, that
nobody else waits for, so it is no deadlock: try again."""
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX, 1, offset)
            return
        except OSError as exc:
            if exc.errno != errno.EDEADLK:
                raise
            time.sleep(0.001)
