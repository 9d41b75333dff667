"""This process's view of a queue's oldest pending ids, so a claim never lists the directory.

Items posted or re-queued here are pushed as they go. The directory is listed again when the view
runs dry (`refill`), and in a background thread now and then (rarely for a large directory) to
pick up what other processes posted or re-queued; claims go on meanwhile. A claim never waits for
a large directory to be listed, so it may run on the event loop: a small directory (its entries in
a few blocks) is listed at once, a large one in the background, and `on_found` is told when that
listing fills an empty view, so claims waiting for items try again. Only about `capacity` of the
oldest ids are kept: ids at or past the horizon may be left out, and a later listing finds them.
The directory is the truth; the view only saves listing it, so a stale id costs one failed
rename.
"""

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable

from . import files
from .layout import ITEM_SUFFIX

SUFFIX_LENGTH = len(ITEM_SUFFIX)

CAPACITY = 100_000  # pending ids one process keeps in memory per queue
_CHUNK = 10_000  # names handled at once, so a large directory never costs much memory
# a directory whose entries take no more than this (its size) is listed at once: a thousand
# names or so, cheaper than a hop to a thread
SMALL_DIRECTORY_BYTES = 64 << 10

log = logging.getLogger(__name__)


class PendingIndex:
    def __init__(self, directory: str, *, capacity: int = CAPACITY, on_found: Callable[[int], None] = lambda n: None):
        self._directory = directory
        self._capacity = capacity
        self._on_found = on_found
        self._lock = threading.Lock()  # guards every field below
        self._heap: list[str] = []
        self._horizon: str | None = None  # None: nothing was left out
        self._listed_at = float("-inf")
        self._listing_took = 0.0
        self._listing = False  # a listing is under way: ids pushed meanwhile are kept for it
        self._pushed_meanwhile: list[str] = []
        self._in_background = False
        self._listing_lock = threading.Lock()  # one listing at a time

    def push(self, item_ids: Iterable[str]) -> None:
        with self._lock:
            for item_id in item_ids:
                self._add(item_id)
                if self._listing:
                    self._pushed_meanwhile.append(item_id)

    def _add(self, item_id: str) -> None:
        if self._horizon is not None and item_id >= self._horizon:
            return
        if len(self._heap) >= self._capacity:
            self._horizon = item_id  # full: leave this one and all younger ones to a listing
            return
        heapq.heappush(self._heap, item_id)

    def pop(self) -> str | None:
        """The oldest id in view, or None when the view is empty (`refill` then)."""
        with self._lock:
            if not self._heap:
                return None
            if self._due():
                self._list_in_background()
            return heapq.heappop(self._heap)

    def refill(self) -> None:
        """Fill an empty view: list the directory now if it is small, else in the background."""
        info = files.status(self._directory)
        if info is not None and info.st_size > SMALL_DIRECTORY_BYTES:
            with self._lock:
                self._list_in_background()
            return
        with self._listing_lock:
            with self._lock:
                if self._heap:
                    return  # another thread's listing refilled it meanwhile
            self._relist()

    def warm(self) -> None:
        """Start listing the directory in the background, unless it was listed."""
        with self._lock:
            if self._listed_at == float("-inf"):
                self._list_in_background()

    def _list_in_background(self) -> None:
        """Call holding `_lock`."""
        if not self._in_background:
            self._in_background = True
            threading.Thread(target=self._refresh_in_background, daemon=True).start()

    def _due(self) -> bool:
        age = time.monotonic() - self._listed_at
        if age >= max(1.0, 50 * self._listing_took):
            return True
        running_low = self._horizon is not None and len(self._heap) < self._capacity // 4
        return running_low and age >= max(1.0, 2 * self._listing_took)

    def _refresh_in_background(self) -> None:
        try:
            with self._listing_lock:
                with self._lock:
                    was_empty = not self._heap
                self._relist()
            with self._lock:
                found = len(self._heap)
            if was_empty and found:
                self._on_found(found)
        except Exception:  # the next claim that finds the view empty lists again
            log.exception("listing %s failed", self._directory)
        finally:
            with self._lock:
                self._in_background = False

    def _relist(self) -> None:
        """Replace the view with a fresh listing. Call holding `_listing_lock`."""
        with self._lock:
            self._listing = True
        started = time.monotonic()
        try:
            heap, horizon = self._oldest_in_directory()
        except BaseException:
            with self._lock:
                self._listing, self._pushed_meanwhile = False, []
            raise
        with self._lock:
            self._heap, self._horizon = heap, horizon
            for item_id in self._pushed_meanwhile:  # made after the listing began: perhaps missed
                self._add(item_id)
            self._listing, self._pushed_meanwhile = False, []
            self._listed_at, self._listing_took = time.monotonic(), time.monotonic() - started

    def _oldest_in_directory(self) -> tuple[list[str], str | None]:
        """About `capacity` of the oldest ids, as a heap, and the horizon. Takes the names in
        chunks, so a million names never sit in memory at once as ids."""
        kept: list[str] = []
        horizon = None
        with files.scan(self._directory) as names:
            while chunk := list(itertools.islice(names, _CHUNK)):
                # checked as ids when popped: most names are good, and this runs at C speed
                found = [name[:-SUFFIX_LENGTH] for name in chunk if name.endswith(ITEM_SUFFIX)]
                kept += found if horizon is None else filter(horizon.__gt__, found)
                if len(kept) > 2 * self._capacity:
                    horizon = _keep_oldest(kept, self._capacity)
        if len(kept) > self._capacity:
            horizon = _keep_oldest(kept, self._capacity)
        heapq.heapify(kept)
        return kept, horizon


def _keep_oldest(item_ids: list[str], count: int) -> str:
    """Cut `item_ids` down to its `count` oldest, in place; returns the oldest one cut."""
    item_ids.sort()
    horizon = item_ids[count]
    del item_ids[count:]
    return horizon
