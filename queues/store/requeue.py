"""Giving an item back for another try: to pending now, or to scheduled with a delay, with what
went wrong kept as its lastError; or ended instead: failed `timeout` once it is older than its
queue allows (G6), else failed `max_attempts` once it had its queue's maxAttempts. Every re-queue
goes through here: a worker's release, a socket closed, a lapsed lease, staff. Only a server that
stops gives items back without counting their tries."""

from dataclasses import replace
from typing import Any

from .items import ItemFiles
from .promote import promote_if_due
from .records import ABSENT, Item, QueueConfig, failed, timed_out

NEVER_ENDS = ("shutdown", "unsent")  # reasons that never end an item for its attempts: no worker had it


def give_back(
    items: ItemFiles,
    config: QueueConfig,
    item: Item,
    *,
    now: float,
    delay: float = 0.0,
    error: Any = ABSENT,
    reason: str,
) -> Item:
    """Give back a processing item (under its lock); the item as it is now."""
    queue = config.name
    if error is not ABSENT:
        item = replace(item, last_error=error)
    if now - item.posted_at > config.queue_seconds:
        done = timed_out(item, now)
        items.end(queue, "processing", done)
        return done
    if config.max_attempts is not None and item.attempts >= config.max_attempts and reason not in NEVER_ENDS:
        done = failed(item, "max_attempts", now)
        items.end(queue, "processing", done)
        return done
    if delay <= 0 and error is ABSENT:
        back = items.move(queue, item, "processing", "pending")
        items.observer.item_requeued(queue, back, reason)
        return back
    target = "scheduled" if delay > 0 else "pending"
    back = replace(item, status=target, lease_expires_at=None, claim_token=None, run_at=now + delay if delay > 0 else item.run_at)
    if target == "scheduled":
        # due at its run_at, or when it ages out if that comes first (it fails then). Its item is
        # read when it comes due: should this move fail, the item may be scheduled again for later
        # while this mark stays, and a mark moving its item unread would promote it too soon.
        due = min(back.run_at, back.posted_at + config.queue_seconds)
        mark = items.schedule.mark(queue, back.id, due, at_run_at=False)
        items.flush(*items.schedule.directories(queue, [mark]))
    # timed by the clock that times the marks: a post's mark listed before this never moves it (promote.py)
    moved = items.move_rewritten(queue, back, "processing", target, mtime=now if target == "scheduled" else None)
    items.observer.item_requeued(queue, moved, reason)
    if target == "scheduled" and promote_if_due(items, config, [mark]):
        return replace(moved, status="pending")
    return moved
