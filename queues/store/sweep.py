"""One sweep pass over a queue: settle what crashes left behind, fail aged items, re-queue lapsed
leases, delete done items past retention, and clear out old leftovers.

It lists each directory once and decides from names and file metadata, reading only the files it
will change. What the file system records, so that no file has to be read to decide:
- the posting time is in the id (UUIDv7), so aged items are found by name;
- a processing file's mtime is its lease expiry;
- a done file's mtime is when it ended; a mark in fetched/ says it was fetched, its mtime when.
Every change is made under the item's lock, after reading the item again: one another sweeper
or a transition made meanwhile is simply skipped.
"""

import logging
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from .. import ids
from . import files
from .items import SEARCH_ORDER, ItemFiles
from .keys import key_of
from .layout import MARKS, STALE_SECONDS, item_id_of
from .records import QueueConfig, SweepChanges, timed_out
from .requeue import give_back

WATCHED = ("pending", "processing", "done")
KEEP_FIRST = SEARCH_ORDER  # of two copies a crash left, the one kept
ID_CLOCK_MARGIN_SECONDS = 60  # how far an id's time may run ahead of the clock that ends the item
_CHUNK = 10_000

log = logging.getLogger(__name__)
T = TypeVar("T")


def sweep_queue(items: ItemFiles, config: QueueConfig) -> SweepChanges:
    queue = config.name
    items.ensure_queue(queue)
    # not scheduled/: scheduled items come due through their marks (see schedule), and a pass
    # must cost the same however many wait
    listing = {state: files.names(items.layout.directory(queue, state)) for state in WATCHED}
    repaired = _step(queue, _repair, items, queue, listing, nothing=[])
    # failing first: an item both aged and lapsed ends failed, not re-queued
    failed = _step(queue, _fail_aged, items, config, listing["pending"] + listing["processing"], nothing=[])
    requeued, ended = _step(queue, _requeue_lapsed, items, config, listing["processing"], nothing=([], []))
    deleted = _step(queue, _delete_expired, items, config, listing["done"], nothing=[])
    tmp_removed = _step(queue, _remove_leftovers, items, queue, set(listing["done"]), nothing=0)
    if requeued:
        items.events.items_available(queue, len(requeued))
    return SweepChanges(repaired, failed + ended, requeued, deleted, tmp_removed)


def _step(queue: str, step: Callable[..., T], /, *args, nothing: T) -> T:
    """One step of a pass; a disk fault that ends it (one outside any item's change, such as a
    listing) is logged and the pass goes on with the next step."""
    try:
        return step(*args)
    except OSError:
        log.exception("sweep of queue %s: %s failed; the pass goes on", queue, step.__name__.lstrip("_"))
        return nothing


def _each(queue: str, step: str, item_ids: Iterable[str], change: Callable[[str], T]) -> list[tuple[str, T]]:
    """`change(item_id)` for each item, and what it came to; a disk fault on one item is logged
    (the first, then how many) and the step goes on with the others: one item whose done file
    cannot be written must not keep every lapsed lease after it from going back."""
    outcomes, faults = [], 0
    for item_id in item_ids:
        try:
            outcomes.append((item_id, change(item_id)))
        except OSError:
            faults += 1
            if faults == 1:
                log.exception("sweep of queue %s: %s failed on %s; the others go on", queue, step, item_id)
    if faults > 1:
        log.warning("sweep of queue %s: %s failed on %d items in all; the next pass tries them again",
                    queue, step, faults)
    return outcomes


def _repair(items: ItemFiles, queue: str, listing: dict[str, list[str]]) -> list[str]:
    """Quarantine names that are not item files, and settle every id found in two states (a
    crash mid-transition): the copy kept is the first in KEEP_FIRST (done, then pending, then
    scheduled)."""
    for state, names in listing.items():
        for name in _not_item_files(names):
            items.quarantine(queue, state, name)
    doubled = _doubled(*listing.values())
    # scheduled/ is not listed: an item given back for later by a transition that died before it
    # removed the processing copy is found from processing/: one stat per item in flight
    doubled.update(name for name in listing["processing"]
                   if files.exists(items.layout.in_directory(queue, "scheduled", name)))

    def settle(item_id: str) -> bool:
        with items.lock(queue, item_id):
            present = [s for s in KEEP_FIRST if files.exists(items.layout.item(queue, s, item_id))]
            for state in present[1:]:
                files.remove(items.layout.item(queue, state, item_id))
        return len(present) > 1

    item_ids = filter(None, map(item_id_of, sorted(doubled)))
    return [item_id for item_id, settled in _each(queue, "repair", item_ids, settle) if settled]


def _fail_aged(items: ItemFiles, config: QueueConfig, names: list[str]) -> list[str]:
    """Fail every pending or processing item older than the queue allows (G6)."""
    queue, now = config.name, items.clock()
    # names sort by posting time: those below the bound were posted at or before the cutoff
    bound = ids.time_prefix(int((now - config.queue_seconds) * 1000) + 1)

    def fail(item_id: str) -> bool:
        with items.lock(queue, item_id):
            found = items.find(queue, item_id)
            if found is None or found[0] == "done" or now - found[1].posted_at <= config.queue_seconds:
                return False
            return items.end(queue, found[0], timed_out(found[1], now))

    item_ids = filter(None, map(item_id_of, filter(bound.__gt__, names)))
    return [item_id for item_id, ended in _each(queue, "fail_aged", item_ids, fail) if ended]


def _requeue_lapsed(items: ItemFiles, config: QueueConfig, names: list[str]) -> tuple[list[str], list[str]]:
    """Move every processing item whose lease has lapsed back to pending, or end it failed if it
    aged meanwhile or had its maxAttempts; the ids re-queued, and those ended."""
    queue, now = config.name, items.clock()

    def requeue(item_id: str) -> str | None:
        """What became of the item: "pending", "failed" (aged, G6, or it had its maxAttempts), or
        None (left as it was)."""
        info = files.status(items.layout.item(queue, "processing", item_id))
        if info is None or info.st_mtime > now:
            return None  # gone, or the mtime (the lease expiry) says it still runs
        with items.lock(queue, item_id):
            found = items.find(queue, item_id)  # the copy that wins: a stray copy stays put
            if found is None or found[0] != "processing":
                return None
            item = found[1]
            if item.lease_expires_at is not None and item.lease_expires_at > now:
                return None  # extended meanwhile
            return "failed" if give_back(items, config, item, now=now, reason="lease").status == "failed" else "pending"

    outcomes = _each(queue, "requeue_lapsed", filter(None, map(item_id_of, names)), requeue)
    return ([item_id for item_id, became in outcomes if became == "pending"],
            [item_id for item_id, became in outcomes if became == "failed"])


def _delete_expired(items: ItemFiles, config: QueueConfig, done: list[str]) -> list[str]:
    """Delete done items whose retention has passed (G7), and free their idempotency keys. A
    done file's mtime is when it ended, a fetched mark's when the item was first fetched; only
    in a queue that has keys is a deleted item's file read, for its key."""
    queue, layout = config.name, items.layout
    cutoff = items.clock() - config.retain_seconds
    if config.retain_from == "fetched":
        fetched = filter(ids.is_valid_id, files.names(layout.directory(queue, "fetched")))  # a stray file stays put
        due = [item_id for item_id in fetched if _ended_by(layout.mark(queue, "fetched", item_id), cutoff)]
    else:
        # retention starts when an item ends, never before it was posted, so an item posted after
        # the cutoff is not due and needs no stat: the names say so at C speed (with a margin for
        # ids made ahead of this clock: a clock stepped back, or another process's clock)
        bound = ids.time_prefix(int((cutoff + ID_CLOCK_MARGIN_SECONDS) * 1000) + 1)
        candidates = (item_id_of(name) for name in filter(bound.__gt__, done))
        due = [i for i in candidates if i is not None and _ended_by(layout.item(queue, "done", i), cutoff)]
    keyed = items.keys.any(queue)

    def delete(item_id: str) -> bool:
        key = _key_of(items, layout.item(queue, "done", item_id), item_id) if keyed else None
        with items.keys.hold(queue, [key] if key else []), items.lock(queue, item_id):
            if not files.exists(layout.item(queue, "done", item_id)):
                return False  # deleted by another sweeper, or a fetched mark of an end that was undone
            # a copy a crash left in another state goes first, so the item never comes back
            for state in ("pending", "processing", "scheduled"):
                files.remove(layout.item(queue, state, item_id))
            if not files.remove(layout.item(queue, "done", item_id)):
                return False  # another sweeper was first
            for mark in MARKS:
                files.remove(layout.mark(queue, mark, item_id))
            if key and items.keys.holder(queue, key) == item_id:
                items.keys.remove(queue, key)  # the key goes with its item: a later post makes a new one
        return True

    return [item_id for item_id, gone in _each(queue, "delete_expired", due, delete) if gone]


def _key_of(items: ItemFiles, path: str, item_id: str) -> str | None:
    """The idempotency key in an item's file, if it has one."""
    try:
        raw, _ = files.read(path)
    except FileNotFoundError:
        return None
    found = key_of(raw)
    return found[1] if found is not None and found[0] == item_id else None


def _ended_by(path: str, cutoff: float) -> bool:
    info = files.status(path)
    return info is not None and info.st_mtime <= cutoff


def _remove_leftovers(items: ItemFiles, queue: str, done_names: set[str]) -> int:
    """Remove tmp/ files and tallies older than STALE_SECONDS (leftovers of writers that died, and
    counts the dashboard no longer shows), and marks that old whose item is not done (the mark of
    a failure undone, or of an item deleted mid-way). How many tmp/ files went."""
    cutoff = time.time() - STALE_SECONDS
    removed = 0
    for name in ("tmp", "stats", *MARKS):

        def remove(entry: str) -> bool:
            path = items.layout.in_directory(queue, name, entry)
            info = files.status(path)
            if info is None or info.st_mtime >= cutoff:
                return False
            if name == "tmp" and info.st_nlink > 1:
                _free_key_of_leftover(items, queue, path)
            return files.remove(path)

        entries = files.names(items.layout.directory(queue, name))
        if name in MARKS:
            entries = [entry for entry in entries if entry + ".json" not in done_names]
        gone = sum(went for _, went in _each(queue, f"remove_leftovers in {name}/", entries, remove))
        removed += gone if name == "tmp" else 0
    return removed


def _free_key_of_leftover(items: ItemFiles, queue: str, path: str) -> None:
    """A poster that died after linking its item's key and before moving the item in left the
    key naming an item that never showed: free it."""
    try:
        raw, _ = files.read(path)
    except FileNotFoundError:
        return
    found = key_of(raw)
    if found is None:
        return
    item_id, key = found
    with items.keys.hold(queue, [key]):
        with items.lock(queue, item_id):
            shown = items.find(queue, item_id) is not None
        if not shown and items.keys.holder(queue, key) == item_id:
            items.keys.remove(queue, key)


_ID_FILE_SHAPE = "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.json"
_HEX_AS_X = str.maketrans("0123456789abcdef", "x" * 16)


def _not_item_files(names: list[str]) -> list[str]:
    """The names that are not `<id>.json`. Such junk is rare and a directory may hold a million
    names, so each chunk of names is first checked as one string, at C speed."""
    width = len(_ID_FILE_SHAPE)
    junk = []
    for start in range(0, len(names), _CHUNK):
        chunk = names[start : start + _CHUNK]
        joined = "".join(chunk)
        if (
            set(map(len, chunk)) == {width}
            and joined.translate(_HEX_AS_X) == _ID_FILE_SHAPE * len(chunk)
            and joined[14::width] == "7" * len(chunk)  # the version
            and not joined[19::width].strip("89ab")  # the variant
        ):
            continue
        junk += [name for name in chunk if item_id_of(name) is None]
    return junk


def _doubled(*listings: list[str]) -> set[str]:
    """The names found in more than one listing; one pass over the longest, no set of it."""
    first, second, longest = sorted(listings, key=len)
    smaller = set(first)
    return smaller.intersection(second) | smaller.union(second).intersection(longest)
