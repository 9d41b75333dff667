"""Idempotency keys: at most one item per key in a queue, however many posts race in however many
processes sharing the data directory.

A key is a file in keys/, named for the key's SHA-256: a hard link of its item's file as posted
(one link more than a plain post), so it says which item holds the key without a lookup table or
a scan. (That first file stays on disk as long as the key, until retention deletes the item.)
Posts of one key take turns under the key's lock (a stripe of locks/keys, like the item locks),
held from the look-up until the new item is in place.

A key whose item is gone is stale: its item was deleted by retention (which then removes the key
itself), or its poster died between the link and the move. Under the key's lock no poster is
mid-way, so a key found there with no item is stale for sure: the next post with it removes it,
and the sweep removes one left by a dead poster when it clears that poster's file from tmp/.
"""

import hashlib
import json
import logging
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

from .. import ids
from ..exceptions import InvalidRequest
from . import files
from .layout import Layout
from .locks import KEY_STRIPES, QueueLocks

MAX_KEY_LENGTH = 200

log = logging.getLogger(__name__)


def check_key(key: object) -> None:
    """InvalidRequest unless `key` is 1 to 200 printable ASCII characters (U+0020 to U+007E)."""
    if not (
        isinstance(key, str)
        and 1 <= len(key) <= MAX_KEY_LENGTH
        and key.isascii()
        and key.isprintable()
    ):
        raise InvalidRequest(
            f"an idempotency key is 1 to {MAX_KEY_LENGTH} printable ASCII characters (space to '~')"
        )


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def same_payload(first: Any, second: Any) -> bool:
    """Whether two payloads are the same JSON, whatever the order of their objects' members."""
    return _canonical(first) == _canonical(second)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class Keys:
    def __init__(self, layout: Layout):
        self.layout = layout
        self._locks: dict[str, QueueLocks] = {}
        self._setup_lock = threading.Lock()

    def hold(self, queue: str, keys: list[str]) -> AbstractContextManager[None]:
        """Hold the locks of these keys, taken in one order everywhere so two batches never wait
        for each other. Most posts have no key: they take nothing."""
        return self._holding(queue, keys) if keys else nullcontext()

    @contextmanager
    def _holding(self, queue: str, keys: list[str]) -> Iterator[None]:
        locks = self._locks_of(queue)
        digests = sorted({digest(key) for key in keys}, key=locks.stripe_of)
        with ExitStack() as stack:
            for name in digests:
                stack.enter_context(locks.hold(name))
            yield

    def holder(self, queue: str, key: str) -> str | None:
        """The id of the item posted with the key; None if there is none (a key file that is not
        one of ours is removed: it holds nothing). Call under the key's lock."""
        path = self.layout.key(queue, digest(key))
        try:
            raw, _ = files.read(path)
        except FileNotFoundError:
            return None
        item_id = _posted_id(raw, key)
        if item_id is None:
            log.warning("removing the key file %s: it is not a posted item with its key", path)
            files.remove(path)
        return item_id

    def link(self, queue: str, key: str, item_file: str) -> str:
        """Make the key name the item of this file; the key's path. Call under the key's lock."""
        path = self.layout.key(queue, digest(key))
        files.link(item_file, path)
        return path

    def remove(self, queue: str, key: str) -> None:
        """Forget a stale key. Call under the key's lock."""
        files.remove(self.layout.key(queue, digest(key)))

    def any(self, queue: str) -> bool:
        """Whether the queue has a key at all (reads one entry, however many there are)."""
        return files.any_entry(self.layout.directory(queue, "keys"))

    def close(self, queue: str) -> None:
        with self._setup_lock:
            locks = self._locks.pop(queue, None)
        if locks is not None:
            locks.close()

    def _locks_of(self, queue: str) -> QueueLocks:
        locks = self._locks.get(queue)
        if locks is None:
            with self._setup_lock:
                locks = self._locks.get(queue)
                if locks is None:
                    locks = QueueLocks.for_file(self.layout.key_lock_file(queue), stripes=KEY_STRIPES)
                    self._locks[queue] = locks
        return locks


def key_of(raw: bytes) -> tuple[str, str] | None:
    """The item id and key of an item file's content; None if it has no key."""
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    item_id, key = record.get("id"), record.get("key")
    if not (isinstance(key, str) and isinstance(item_id, str) and ids.is_valid_id(item_id)):
        return None
    return item_id, key


def _posted_id(raw: bytes, key: str) -> str | None:
    found = key_of(raw)
    return found[0] if found is not None and found[1] == key else None
