"""How many items ended each minute, per queue and status: one byte appended per item to the
minute's file (`stats/<minute>.<status>`), whose size is the count. Appends are atomic, so every
server process and sweeper counts into the same file. The current minute's file stays open, so a
count is one write. A count that cannot be written (a full disk) is only logged: the item's end
stands, and the dashboard's figure is a little low."""

import logging
import os
import threading

from . import files
from .layout import Layout

log = logging.getLogger(__name__)


class Tallies:
    def __init__(self, layout: Layout):
        self.layout = layout
        self._open: dict[tuple[str, str], tuple[int, int]] = {}  # (queue, status) -> (minute, fd)
        self._lock = threading.Lock()

    def count(self, queue: str, status: str, at: float) -> None:
        minute = int(at // 60)
        path = self.layout.tally(queue, minute, status)
        try:
            with self._lock:
                open_minute, fd = self._open.get((queue, status), (None, -1))
                if open_minute != minute:
                    new_fd = files.open_append(path)
                    if open_minute is not None:
                        os.close(fd)
                    fd = new_fd
                    self._open[(queue, status)] = minute, fd
                files.append(fd, path, b".")
        except OSError:
            log.warning("could not count an ended item in %s", path, exc_info=True)

    def close(self, queue: str) -> None:
        with self._lock:
            for status in ("finished", "failed"):
                _, fd = self._open.pop((queue, status), (None, -1))
                if fd >= 0:
                    os.close(fd)

    def per_minute(self, queue: str, *, minutes: int, now: float) -> list[tuple[float, int, int]]:
        """(minute start, finished, failed) for each of the last `minutes` minutes, oldest first."""
        current = int(now // 60)
        rows = []
        for minute in range(current - minutes + 1, current + 1):
            counts = []
            for status in ("finished", "failed"):
                info = files.status(self.layout.tally(queue, minute, status))
                counts.append(info.st_size if info else 0)
            rows.append((minute * 60.0, counts[0], counts[1]))
        return rows
