"""Counts and listings: what the API's queue figures and the dashboard's lists show. Both list
names (a failed item is told from a finished one by its mark in failed/, an error result by its
mark in errors/) and read the files this process has not met before, once (`ReadNames`); a
listing then reads the files of the page it shows."""

import heapq
import threading

from .. import ids
from . import files
from .items import ItemFiles
from .layout import ITEM_STATES, ITEM_SUFFIX
from .records import Counts, Item

_SUFFIX = len(ITEM_SUFFIX)


# A state holding more names than this is counted by its names alone (stray names too, until the
# sweep moves them): reading them all would hold up the count, and remembering them would cost
# more memory than the count is worth.
MAX_READ_NAMES = 20_000


class ReadNames:
    """The ids in each queue's state directories that this process's counts have read as items,
    so counts and listings leave out files that are not items (read once, and quarantined then)
    while a count reads only the names it has not met."""

    def __init__(self):
        self._read: dict[tuple[str, str], set[str]] = {}
        self._lock = threading.Lock()

    def items_in(self, items: ItemFiles, queue: str, state: str) -> list[str]:
        """The ids of the items in `state`/: its names that are ids of item files (in a state of
        more than MAX_READ_NAMES, its names as they are: a listing's page may then come back
        short of the stray names among the newest, until the sweep moves them)."""
        directory = items.layout.directory(queue, state)
        names = [name[:-_SUFFIX] for name in files.names(directory) if name.endswith(ITEM_SUFFIX)]
        if len(names) > MAX_READ_NAMES:
            return names
        item_ids = [name for name in names if ids.is_valid_id(name)]  # a stray name: the sweep moves it
        with self._lock:
            read = self._read.get((queue, state), set())
        # None: not an item (quarantined now), or moved on since the listing
        item_ids = [i for i in item_ids if i in read or items.read(queue, state, i) is not None]
        with self._lock:
            self._read[(queue, state)] = set(item_ids)
        return item_ids

    def forget_queue(self, queue: str) -> None:
        with self._lock:
            for key in [key for key in self._read if key[0] == queue]:
                del self._read[key]


def count_items(items: ItemFiles, read_names: ReadNames, queue: str) -> Counts:
    layout = items.layout
    scheduled = len(read_names.items_in(items, queue, "scheduled"))
    pending = read_names.items_in(items, queue, "pending")
    processing = read_names.items_in(items, queue, "processing")
    done = read_names.items_in(items, queue, "done")
    failed = len(set(files.names(layout.directory(queue, "failed"))).intersection(done))
    errors = len(set(files.names(layout.directory(queue, "errors"))).intersection(done))
    oldest = min(pending, default=None)
    if oldest is not None and not ids.is_valid_id(oldest):  # a stray name in a big state
        oldest = min((i for i in pending if ids.is_valid_id(i)), default=None)
    return Counts(
        scheduled=scheduled,
        pending=len(pending),
        processing=len(processing),
        finished=len(done) - failed,
        failed=failed,
        oldest_pending_posted_at=ids.id_millis(oldest) / 1000 if oldest else None,
        errors=errors,
    )


def list_items(items: ItemFiles, read_names: ReadNames, queue: str, state: str, *, offset: int, limit: int,
               status: str | None = None) -> tuple[int, list[Item]]:
    """One page of a state's items, newest first, and the state's total; of done items, only the
    `status` ("finished" or "failed") ones when it is given, told apart by the failed marks."""
    if state not in ITEM_STATES:
        raise ValueError(f"no state {state!r}")
    item_ids = read_names.items_in(items, queue, state)
    if state == "done" and status in ("finished", "failed"):
        failed = set(files.names(items.layout.directory(queue, "failed")))
        item_ids = [item_id for item_id in item_ids if (item_id in failed) == (status == "failed")]
    # the newest offset+limit names only: a full sort of a million names costs far more
    newest = heapq.nlargest(offset + limit, item_ids)[offset:]
    # a big state's names may hold strays
    page = [items.read(queue, state, item_id) for item_id in newest if ids.is_valid_id(item_id)]
    return len(item_ids), [item for item in page if item is not None]  # None: moved on meanwhile
