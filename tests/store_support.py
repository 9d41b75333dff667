"""What the store tests share: where an item's files are, and short ways to make items."""

import os
import time
from pathlib import Path

from queues.store import QueueConfig, Store
from storekit import post_batch

Q = "jobs"


def queue_dir(store: Store, queue: str = Q) -> Path:
    return store.data_dir / queue


def states_of(store: Store, item_id: str, queue: str = Q) -> list[str]:
    """Every state directory that holds a file for `item_id` (G1: exactly one)."""
    states = ("scheduled", "pending", "processing", "done")
    return [s for s in states if (queue_dir(store, queue) / s / f"{item_id}.json").exists()]


def files_in(store: Store, state: str, queue: str = Q) -> list[str]:
    directory = queue_dir(store, queue) / state
    return sorted(os.listdir(directory)) if directory.is_dir() else []


def post(store: Store, *payloads, queue: str = Q) -> list[str]:
    return [item.id for item in post_batch(store, queue, list(payloads) or [{"n": 1}])]


def claim_one(store: Store, config: QueueConfig):
    (item,) = store.claim_items(config=config, max_items=1)
    return item


def copy_file(store: Store, item_id: str, source: str, target: str) -> None:
    """What a crash between two steps of a transition leaves: the same id in two states."""
    data = (queue_dir(store) / source / f"{item_id}.json").read_bytes()
    (queue_dir(store) / target / f"{item_id}.json").write_bytes(data)


def half_written(store: Store, queue: str = Q) -> list[str]:
    """What tmp/ holds but the old files kept for reuse: files a writer left half done."""
    return [name for name in files_in(store, "tmp", queue) if not name.endswith(".spare")]


def first_listing_done(store: Store, queue: str = Q) -> None:
    """Wait for the background listing a queue's first use starts: when it finds items in an empty
    view it tells waiting claims, which a test counting such wake-ups must not mistake for its own."""
    index = store._items.index(queue)
    while index._in_background:
        time.sleep(0.005)
