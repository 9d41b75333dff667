"""The file store: the only code that touches the data directory.

    records      items, queue settings, outcomes; how an item is written to its file
    layout       the one path builder, and the rules for names
    files        every file-system call, its outcome checked; flushes shared by callers
    locks        item locks across threads and processes
    turn         where a transition runs (the loop, or threads taking turns) and where it waits
    pending      this process's view of a queue's oldest pending ids
    items        one item on disk: read, write aside, move, end, claim record
    schedule     which scheduled items are due, from marks named for when
    promote      moving scheduled items that came due to pending
    keys         idempotency keys: which item holds each, and their locks
    requeue      giving an item back: now, later, or ended (too old, or at its maxAttempts)
    transitions  the Store: one public method per transition
    sweep        one pass over a queue's timers and crash leftovers
    stats        counts and listings; tallies: items ended per minute
"""

from .layout import QUEUE_NAME, is_valid_queue_name
from .records import ABSENT, Counts, FinishOutcome, Health, Item, NewItem, Posted, QueueConfig, Release, SweepChanges, single
from .transitions import MAX_BATCH, Store

__all__ = [
    "ABSENT",
    "MAX_BATCH",
    "QUEUE_NAME",
    "Counts",
    "FinishOutcome",
    "Health",
    "Item",
    "NewItem",
    "Posted",
    "QueueConfig",
    "Release",
    "Store",
    "SweepChanges",
    "is_valid_queue_name",
    "single",
]
