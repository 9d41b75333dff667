"""Moving scheduled items whose marks came due to pending (those past their queue timeout are
failed instead). A look for due items finds the marks (schedule.py); whoever schedules an item
also checks its mark once the item is in scheduled/: a mark already due by then may have been
passed by every look, so its maker promotes the item at once. A look that finds a due mark
before its item is in scheduled/ (its maker writes the mark first) leaves the mark for a later
look, so the item is promoted even if its maker dies before it checks; a mark whose item never
came is a leftover after STALE_SECONDS."""

import logging

from .. import ids
from . import files
from .items import ItemFiles
from .layout import STALE_SECONDS
from .records import QueueConfig, timed_out
from .schedule import DueMark

log = logging.getLogger(__name__)


def promote(items: ItemFiles, config: QueueConfig, marks: list[DueMark], now: float) -> list[str]:
    """Promote the items of these due marks, each under its lock, and remove the marks; the ids
    moved to pending, claimable once this returns."""
    queue, moved, spent = config.name, [], []
    for mark in marks:
        with items.lock(queue, mark.item_id):
            outcome = _promote_one(items, config, mark, now)
        if outcome is not _COMING:
            spent.append(mark)
        if outcome is True:
            moved.append(mark.item_id)
    if moved:  # on disk before their marks go, so none is left without both
        items.flush_states(queue, "pending", "scheduled")
        items.index(queue).push(moved)
        items.events.items_available(queue, len(moved))
    for mark in spent:
        files.remove(mark.path)
    return moved


def promote_if_due(items: ItemFiles, config: QueueConfig, marks: list[DueMark]) -> set[str]:
    """Call once the items of these marks are in scheduled/: a mark a look removed as stale
    (due, with no item there yet) is made again, and the items whose marks are due already are
    promoted now; the ids promoted. A failure is logged, not raised: the post or release that
    scheduled them stands, and their marks bring them to a later look."""
    if not marks:
        return set()
    try:
        # a mark missing while its item is in scheduled/ was removed as stale; one missing with
        # its item moved on went with a promotion, and is not made again
        gone = [mark for mark in marks if not files.exists(mark.path)
                and files.exists(items.layout.item(config.name, "scheduled", mark.item_id))]
        for mark in gone:
            items.schedule.write(mark)
        if gone:
            items.flush(*items.schedule.directories(config.name, gone))
        now = items.clock()
        due = [mark for mark in marks if mark.due <= now]
        return set(promote(items, config, due, now)) if due else set()
    except OSError:
        log.warning("could not promote the items of %s that are due already", config.name, exc_info=True)
        return set()


_COMING = "coming"  # the item is not in scheduled/ yet: its mark stays for a later look


def _promote_one(items: ItemFiles, config: QueueConfig, mark: DueMark, now: float) -> bool | str:
    """Promote one scheduled item whose mark came due (under its lock); whether it went to
    pending, or _COMING. An item due at its runAt, and not aged out by its id's time, moves
    unread."""
    queue, layout, item_id = config.name, items.layout, mark.item_id
    scheduled = layout.item(queue, "scheduled", item_id)
    if files.exists(layout.item(queue, "done", item_id)):
        files.remove(scheduled)  # a copy a crash left, if any: done wins
        return False
    if mark.at_run_at and now - ids.id_millis(item_id) / 1000 <= config.queue_seconds:
        try:
            files.move(scheduled, layout.item(queue, "pending", item_id))
        except FileNotFoundError:
            return _COMING if _may_be_coming(items, queue, mark, now) else False
        return True
    item = items.read(queue, "scheduled", item_id)
    if item is None:
        return False
    if now - item.posted_at > config.queue_seconds:
        items.end(queue, "scheduled", timed_out(item, now))
        return False
    if item.run_at is not None and item.run_at > now:
        # marked for its queue timeout, which was raised since: due at its run_at again
        again = items.schedule.mark(queue, item_id, item.run_at, at_run_at=True)
        items.flush(*items.schedule.directories(queue, [again]))
        if again.due > items.clock():
            return False
        files.remove(again.path)  # due already, as any mark made meanwhile: moved by its maker
    files.move(scheduled, layout.item(queue, "pending", item_id))
    return True


def _may_be_coming(items: ItemFiles, queue: str, mark: DueMark, now: float) -> bool:
    """Whether an item missing from scheduled/ may be on its way there: in no later state (where
    a promotion or an end took it), and its mark not a leftover."""
    if now - mark.due >= STALE_SECONDS:
        return False
    return not any(files.exists(items.layout.item(queue, state, mark.item_id)) for state in ("pending", "processing", "done"))
