"""Counts and listings: what the API's queue figures and the dashboard's lists show. Counts list
names only (a failed item is told from a finished one by its mark in failed/, an error result by
its mark in errors/); a listing reads just the files of the page it shows."""

import heapq

from .. import ids
from . import files
from .items import ItemFiles
from .layout import ITEM_STATES, ITEM_SUFFIX, Layout
from .records import Counts, Item

_SUFFIX = len(ITEM_SUFFIX)


def _ids_in(layout: Layout, queue: str, state: str) -> list[str]:
    return [name[:-_SUFFIX] for name in files.names(layout.directory(queue, state)) if name.endswith(ITEM_SUFFIX)]


def count_items(layout: Layout, queue: str) -> Counts:
    scheduled = len(_ids_in(layout, queue, "scheduled"))
    pending = _ids_in(layout, queue, "pending")
    processing = _ids_in(layout, queue, "processing")
    done = _ids_in(layout, queue, "done")
    failed = len(set(files.names(layout.directory(queue, "failed"))).intersection(done))
    errors = len(set(files.names(layout.directory(queue, "errors"))).intersection(done))
    oldest = min(pending, default=None)
    if oldest is not None and not ids.is_valid_id(oldest):  # a stray name: the sweep moves it
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


def list_items(items: ItemFiles, queue: str, state: str, *, offset: int, limit: int,
               status: str | None = None) -> tuple[int, list[Item]]:
    """One page of a state's items, newest first, and the state's total; of done items, only the
    `status` ("finished" or "failed") ones when it is given, told apart by the failed marks."""
    if state not in ITEM_STATES:
        raise ValueError(f"no state {state!r}")
    item_ids = _ids_in(items.layout, queue, state)
    if state == "done" and status in ("finished", "failed"):
        failed = set(files.names(items.layout.directory(queue, "failed")))
        item_ids = [item_id for item_id in item_ids if (item_id in failed) == (status == "failed")]
    # the newest offset+limit names only: a full sort of a million names costs far more
    newest = heapq.nlargest(offset + limit, item_ids)[offset:]
    page = [items.read(queue, state, item_id) for item_id in newest if ids.is_valid_id(item_id)]
    return len(item_ids), [item for item in page if item is not None]  # None: moved on meanwhile
