"""Locks across threads and processes sharing the data directory: every transition of one item
runs under that item's lock, and every post of one idempotency key under that key's lock.

Each queue has a lock file for its items and one for its keys; a name maps to one byte of it (a
stripe). A `Stripe` excludes the threads of this process and its transitions on the event loop
(POSIX record locks are per process), a record lock on the byte excludes other processes, and the
kernel drops it if the process dies. A holder may take a stripe it holds again (an item's
transition that makes another item, such as a retry): the record lock is taken by the outermost
hold and dropped by it. Key locks are always taken before item locks, and several keys' in
stripe order.
"""

import errno
import fcntl
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager

import greenlet

from . import files, turn

ITEM_STRIPES = 256  # from an id's last two hex digits: the same in every version of the server
KEY_STRIPES = 1 << 16  # a batch's keys take one each, so posts of other keys rarely wait on them


class QueueLocks:
    """One queue's item locks. One instance per lock file and process (`for_file`): two in one
    process would not exclude each other, and closing either would drop the other's record
    locks."""

    _open: dict[tuple[int, int], "QueueLocks"] = {}  # by (device, inode) of the lock file
    _open_lock = threading.Lock()

    def __init__(self, fd: int, key: tuple[int, int], stripes: int):
        self._fd = fd
        self._key = key
        self.stripes = stripes
        self._stripes: dict[int, Stripe] = {}  # made as stripes are first taken
        self._made = threading.Lock()

    @classmethod
    def for_file(cls, path: str, *, stripes: int = ITEM_STRIPES) -> "QueueLocks":
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
            locks = cls._open[key] = cls(fd, key, stripes)
            return locks

    def stripe_of(self, name: str) -> int:
        """The stripe of an item id or a key digest (names ending in hex digits)."""
        return int(name[-4:] if self.stripes > 256 else name[-2:], 16) % self.stripes

    @contextmanager
    def hold(self, name: str) -> Iterator[None]:
        stripe = self.stripe_of(name)
        in_process = self._stripes.get(stripe)
        if in_process is None:
            with self._made:
                in_process = self._stripes.setdefault(stripe, Stripe())
        outermost = in_process.take()
        try:
            if outermost:
                _lock_byte(self._fd, stripe)
            try:
                yield
            finally:
                if outermost:
                    fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, stripe)
        finally:
            in_process.release()

    def close(self) -> None:
        with self._open_lock:
            if self._open.pop(self._key, None) is self:
                os.close(self._fd)


class Stripe:
    """A lock held by one thread, or one transition on the event loop, at a time, which may take
    it again while it holds it. Waiters get it in the order they asked, each waiting as every
    wait of a transition does (turn.wait_for): out of the store's turn, and holding no thread
    while on the loop."""

    def __init__(self):
        self._guard = threading.Lock()
        self._holder: greenlet.greenlet | None = None  # a thread's own greenlet, or a transition's
        self._depth = 0
        self._waiters: deque[tuple[greenlet.greenlet, Future]] = deque()

    def take(self) -> bool:
        """Hold it; whether this is the holder's outermost hold."""
        me = greenlet.getcurrent()
        with self._guard:
            if self._holder is None or self._holder is me:
                self._holder = me
                self._depth += 1
                return self._depth == 1
            handed = Future()
            self._waiters.append((me, handed))
        try:
            turn.wait_for(handed)  # release makes this one the holder before it settles `handed`
            return True
        except BaseException:
            with self._guard:
                queued = (me, handed) in self._waiters
                if queued:
                    self._waiters.remove((me, handed))
            if not queued:  # it was handed over meanwhile: hand it on
                self.release()
            raise

    def release(self) -> None:
        with self._guard:
            self._depth -= 1
            if self._depth:
                return
            if not self._waiters:
                self._holder = None
                return
            self._holder, handed = self._waiters.popleft()
            self._depth = 1
        handed.set_result(None)


def _lock_byte(fd: int, offset: int) -> None:
    """Take the record lock on one byte, waiting (out of the store's turn) if another process has
    it. The kernel's deadlock check counts record locks per process, so threads of two processes
    each holding one stripe and waiting for the other's are refused with EDEADLK; locks are taken
    in one order everywhere (keys, in stripe order, before items; a second item stripe only for an
    item made a moment ago, that nobody waits for), so it is no deadlock: try again."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
        return
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EAGAIN):
            raise
    turn.aside(_wait_for_byte, fd, offset)


def _wait_for_byte(fd: int, offset: int) -> None:
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX, 1, offset)
            return
        except OSError as exc:
            if exc.errno != errno.EDEADLK:
                raise
            time.sleep(0.001)
