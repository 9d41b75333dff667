"""Which scheduled items are due. Each scheduled item has a mark in `schedule/<slot>/`, named for
when it is due (milliseconds) and for its id; a slot holds the marks of SLOT_SECONDS. A look for
what is due lists only the slots that began since the last look ended (and the current one
again), so it costs the same however many items wait for later. The slots that exist are listed
when a process first looks at a queue and every RELIST_SECONDS after, for marks a look may have
passed by (made by a process whose clock is behind, or whose item could not be moved then).

A mark is made, and flushed, before its item shows in scheduled/, so no scheduled item is ever
without one; a mark whose item has moved on from scheduled/ (it ended, or another process moved
it) is removed when it comes due, and one whose item is not there yet stays for a later look (a
leftover after STALE_SECONDS). A mark that is due by the time its item shows is left to its
maker, which promotes the item then (promote.py): a look may have passed its slot for good
before the item showed. A post's mark is for the item's runAt, and the item can be moved
without reading it; any other mark (a worker's release for later, whose item may be scheduled again
if the release fails; when the item ages out, or ends) is named `<due>.<id>.read`: its item is read
to see what is due."""

import math
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .. import ids
from . import files
from .layout import SLOT_SECONDS, Layout

RELIST_SECONDS = 60.0


READ_SUFFIX = ".read"


@dataclass(frozen=True)
class DueMark:
    due: float
    item_id: str
    path: str
    at_run_at: bool  # due at the item's runAt: it may be moved without reading it


@dataclass(frozen=True)
class Due:
    marks: list[DueMark]  # soonest first, then oldest
    past_slots: list[str]  # the slots before the current one that were looked at: empty once handled


class Schedule:
    def __init__(self, layout: Layout):
        self.layout = layout
        self._next_slot: dict[str, int] = {}  # queue -> the first slot not yet looked at for good
        self._listed_at: dict[str, float] = {}
        self._lock = threading.Lock()

    def mark(self, queue: str, item_id: str, due: float, *, at_run_at: bool) -> DueMark:
        """Make the item's mark, not yet flushed (see `directories`). `at_run_at`: `due` is the
        item's runAt."""
        due_ms = math.ceil(due * 1000)  # the millisecond at or after it: an item never comes due early
        path = self.layout.due_mark(queue, due_ms, item_id) + ("" if at_run_at else READ_SUFFIX)
        try:
            files.write_new(path, b"")
        except FileExistsError:  # made already: for this item, due then
            pass
        return DueMark(due_ms / 1000, item_id, path, at_run_at)

    def directories(self, queue: str, marks: list[DueMark]) -> list[str]:
        """What to flush so that these marks survive a power cut: their slots, and schedule/,
        which names the slots."""
        return sorted({mark.path.rsplit("/", 1)[0] for mark in marks}) + [self.layout.directory(queue, "schedule")]

    def due(self, queue: str, now: float) -> Due:
        """The marks due by `now`. The slots before the current one are looked at for good: once
        their marks are handled, `passed` removes them."""
        current = int(now) // SLOT_SECONDS
        with self._lock:
            start = self._next_slot.get(queue)
            relist = start is None or time.monotonic() - self._listed_at.get(queue, 0.0) > RELIST_SECONDS
            self._next_slot[queue] = current
            if relist:
                self._listed_at[queue] = time.monotonic()
        slots = set(range(start, current + 1)) if start is not None else set()
        if relist:
            slots |= {slot for slot in self._slots(queue) if slot <= current}
        marks = [mark for mark in self._marks_in(queue, sorted(slots)) if mark.due <= now]
        past = [self.layout.slot(queue, slot) for slot in sorted(slots) if slot < current]
        return Due(sorted(marks, key=lambda mark: (mark.due, mark.item_id)), past)

    def soonest(self, queue: str) -> dict[str, float]:
        """Every marked item's soonest mark: item id -> when it is due. Lists every slot."""
        soonest: dict[str, float] = {}
        for mark in self._marks_in(queue, self._slots(queue)):
            if mark.due < soonest.get(mark.item_id, float("inf")):
                soonest[mark.item_id] = mark.due
        return soonest

    def _slots(self, queue: str) -> list[int]:
        """The slots that exist now."""
        return [int(name) for name in files.names(self.layout.directory(queue, "schedule")) if name.isdigit()]

    def _marks_in(self, queue: str, slots: Iterable[int]) -> Iterator[DueMark]:
        for slot in slots:
            for name in files.names(self.layout.slot(queue, slot)):
                mark = _parse(name, self.layout.in_slot(queue, slot, name))
                if mark is not None:
                    yield mark

    @staticmethod
    def passed(due: Due) -> None:
        """Remove the past slots that hold no mark any more (one whose mark could not be handled
        stays, for the next relisting)."""
        for directory in due.past_slots:
            files.remove_directory(directory)


def _parse(name: str, path: str) -> DueMark | None:
    due, _, rest = name.partition(".")
    item_id = rest.removesuffix(READ_SUFFIX)
    if not (due.isdigit() and ids.is_valid_id(item_id)):
        return None
    return DueMark(int(due) / 1000, item_id, path, at_run_at=item_id == rest)
