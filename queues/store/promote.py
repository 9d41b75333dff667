"""Moving scheduled items whose marks came due to pending (those past their queue timeout are
failed instead). A look for due items finds the marks (schedule.py); whoever schedules an item
also checks its mark once the item is in scheduled/: a mark already due by then may have been
passed by every look, so its maker promotes the item at once. A look that finds a due mark
before its item is in scheduled/ (its maker writes the mark first) leaves the mark for a later
look, so the item is promoted even if its maker dies before it checks; a mark whose item never
came is a leftover after STALE_SECONDS."""

import logging
from enum import Enum

from .. import ids
from . import files
from .items import ItemFiles
from .layout import ITEM_STATES, STALE_SECONDS
from .records import QueueConfig, timed_out
from .schedule import DueMark

log = logging.getLogger(__name__)


def promote(items: ItemFiles, config: QueueConfig, marks: list[DueMark], now: float) -> list[str]:
    """Promote the items of these due marks, each under its lock, and remove the marks; the ids
    moved to pending, claimable once this returns."""
    queue, moved, spent = config.name, [], []
    for mark in marks:
        try:
            with items.lock(queue, mark.item_id):
                outcome = _promote_one(items, config, mark, now)
        except OSError:  # its mark stays for a later look; the items after it go on
            log.exception("could not promote item %s of %s", mark.item_id, queue)
            continue
        if outcome is not Outcome.COMING:
            spent.append(mark)
        if outcome is Outcome.MOVED:
            moved.append(mark.item_id)
    if moved:  # on disk before their marks go, so none is left without both
        items.flush_states(queue, "pending", "scheduled")
        items.index(queue).push(moved)
        items.events.items_available(queue, len(moved))
    for mark in spent:
        files.remove(mark.path)
    return moved


def promote_if_due(items: ItemFiles, config: QueueConfig, marks: list[DueMark]) -> set[str]:
    """Call once the items of these marks are in scheduled/: the items whose marks are due
    already are promoted now (a look may have passed their marks' slots for good); the ids
    promoted. A failure is logged, not raised: the post or release that scheduled them stands,
    and their marks bring them to a later look."""
    if not marks:
        return set()
    try:
        now = items.clock()
        due = [mark for mark in marks if mark.due <= now]
        return set(promote(items, config, due, now)) if due else set()
    except OSError:
        log.warning("could not promote the items of %s that are due already", config.name, exc_info=True)
        return set()


class Outcome(Enum):
    """What became of a due mark's item."""

    MOVED = "moved to pending"
    SPENT = "ended, or moved on before: the mark is spent"
    COMING = "not in scheduled/ yet: the mark stays for a later look"


def _promote_one(items: ItemFiles, config: QueueConfig, mark: DueMark, now: float) -> Outcome:
    """Promote one scheduled item whose mark came due (under its lock). An item due at its
    runAt, not aged out by its id's time, and still as it was posted, moves unread."""
    queue, layout, item_id = config.name, items.layout, mark.item_id
    scheduled = layout.item(queue, "scheduled", item_id)
    if files.exists(layout.item(queue, "done", item_id)):
        files.remove(scheduled)  # a copy a crash left, if any: done wins
        return Outcome.SPENT
    if mark.at_run_at and now - ids.id_millis(item_id) / 1000 <= config.queue_seconds:
        info = files.status(scheduled)
        if info is None:
            return _missing(items, queue, mark, now)
        # a post's file is timed when it was posted, before its mark came due; one put there
        # after (a release for later, since another look promoted it) is read for its runAt
        if info.st_mtime < mark.due:
            try:
                files.move(scheduled, layout.item(queue, "pending", item_id))
            except FileNotFoundError:
                return _missing(items, queue, mark, now)
            return Outcome.MOVED
    item = items.read(queue, "scheduled", item_id)
    if item is None:  # not there (yet), or not an item (quarantined)
        return _missing(items, queue, mark, now)
    if now - item.posted_at > config.queue_seconds:
        items.end(queue, "scheduled", timed_out(item, now))
        return Outcome.SPENT
    if item.run_at is not None and item.run_at > now:
        # marked for its queue timeout, which was raised since: due at its run_at again
        again = items.schedule.mark(queue, item_id, item.run_at, at_run_at=True)
        items.flush(*items.schedule.directories(queue, [again]))
        if again.due > items.clock():
            return Outcome.SPENT
        files.remove(again.path)  # due already, as any mark made meanwhile: moved by its maker
    files.move(scheduled, layout.item(queue, "pending", item_id))
    return Outcome.MOVED


def _missing(items: ItemFiles, queue: str, mark: DueMark, now: float) -> Outcome:
    """An item not in scheduled/ may be on its way there: unless it is in a later state (where a
    promotion or an end took it), or its mark is a leftover. (A release for later holds the
    item's lock from its mark until its move, as this look does: its item, still processing,
    is never found here on its way.)"""
    if now - mark.due >= STALE_SECONDS:
        return Outcome.SPENT
    later = [state for state in ITEM_STATES if state != "scheduled"]
    if any(files.exists(items.layout.item(queue, state, mark.item_id)) for state in later):
        return Outcome.SPENT
    return Outcome.COMING
