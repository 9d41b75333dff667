"""Where everything lives under the data directory: the one place a path is built.

    <root>/<queue>/<state>/<id>.json     item files; the directory is the item's state; mtime:
                                         processing, the lease's end; done, the end; scheduled
                                         by its post, when it was posted
    <root>/<queue>/tmp/<id>.<nonce>.json  files being written, before they are moved into place
    <root>/<queue>/tmp/<id>.<nonce>.spare  old files of items, kept for the next write to reuse
    <root>/<queue>/quarantine/            unreadable files, moved out of the way
    <root>/<queue>/failed/<id>            marks of done items that failed (counts read no file)
    <root>/<queue>/fetched/<id>           marks of done items fetched once; mtime: the first fetch
    <root>/<queue>/errors/<id>            marks of finished items whose result is an error
    <root>/<queue>/stats/<minute>.<status>  how many items ended that minute (the file's size)
    <root>/<queue>/schedule/<slot>/<due>.<id>  marks of scheduled items, by when they are due
    <root>/<queue>/keys/<sha256 of key>   an idempotency key: a hard link of its item's first file
    <root>/<queue>/deleted                the queue was deleted: what posts racing that left goes
                                          when a queue of its name is made again
    <root>/<queue>/locks/items            the queue's item locks
    <root>/<queue>/locks/keys             its key locks

Every piece is checked before it reaches the file system: a queue name, a state, an id or a mark
that breaks its rule raises UnsafePath.
"""

import os
import re
import secrets

from .. import ids
from ..exceptions import UnsafePath

# tmp/ files, tallies and stray marks older than this are leftovers of writers that died
STALE_SECONDS = 3600

QUEUE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
ITEM_STATES = ("scheduled", "pending", "processing", "done")
STATES = ("tmp", *ITEM_STATES)
MARKS = ("failed", "fetched", "errors")
LOCKS_DIRECTORY = "locks"
DELETED_MARK = "deleted"
DIRECTORIES = (*STATES, *MARKS, "quarantine", "stats", LOCKS_DIRECTORY, "schedule", "keys")
SLOT_SECONDS = 10  # a schedule slot: the marks of items due within the same ten seconds
ITEM_SUFFIX = ".json"
SPARE_SUFFIX = ".spare"


def is_valid_queue_name(name: object) -> bool:
    return isinstance(name, str) and QUEUE_NAME.fullmatch(name) is not None


def item_id_of(name: str) -> str | None:
    """The item id a file name in a state directory stands for; None for any other name."""
    item_id = name[: -len(ITEM_SUFFIX)]
    return item_id if name.endswith(ITEM_SUFFIX) and ids.is_valid_id(item_id) else None


class Layout:
    def __init__(self, root: str | os.PathLike):
        self.root = os.fspath(root)
        self._checked: set[str] = set()  # queue names already found good

    def queue_dir(self, queue: str) -> str:
        if queue not in self._checked:
            if not is_valid_queue_name(queue):
                raise UnsafePath(f"bad queue name {str(queue)[:80]!r}")
            self._checked.add(queue)
        return f"{self.root}/{queue}"

    def directory(self, queue: str, name: str) -> str:
        if name not in DIRECTORIES:
            raise UnsafePath(f"bad directory {name!r}")
        return f"{self.queue_dir(queue)}/{name}"

    def item(self, queue: str, state: str, item_id: str) -> str:
        if state not in ITEM_STATES or not ids.is_valid_id(item_id):
            raise UnsafePath(f"bad state or id {state!r} {str(item_id)[:80]!r}")
        return f"{self.queue_dir(queue)}/{state}/{item_id}{ITEM_SUFFIX}"

    def tmp(self, queue: str, item_id: str) -> str:
        """A new name in tmp/ for a file of this item: unique, so writers never collide."""
        if not ids.is_valid_id(item_id):
            raise UnsafePath(f"bad id {str(item_id)[:80]!r}")
        return f"{self.queue_dir(queue)}/tmp/{item_id}.{secrets.token_hex(6)}{ITEM_SUFFIX}"

    def spare(self, queue: str, item_id: str) -> str:
        """A new name in tmp/ for an old file of this item, kept for reuse (see files.retire)."""
        return self.tmp(queue, item_id)[: -len(ITEM_SUFFIX)] + SPARE_SUFFIX

    def mark(self, queue: str, mark: str, item_id: str) -> str:
        if mark not in MARKS or not ids.is_valid_id(item_id):
            raise UnsafePath(f"bad mark or id {mark!r} {str(item_id)[:80]!r}")
        return f"{self.queue_dir(queue)}/{mark}/{item_id}"

    def quarantined(self, queue: str, state: str, name: str) -> str:
        """Where an unreadable file of a state directory goes (its name kept, the state before it)."""
        if state not in STATES or "/" in name or name in ("", ".", ".."):
            raise UnsafePath(f"bad state or name {state!r} {name[:80]!r}")
        return f"{self.queue_dir(queue)}/quarantine/{state}-{name}"

    def in_directory(self, queue: str, name: str, entry: str) -> str:
        """A name found by listing one of the queue's directories."""
        if "/" in entry or entry in ("", ".", ".."):
            raise UnsafePath(f"bad name {entry[:80]!r}")
        return f"{self.directory(queue, name)}/{entry}"

    def health_probe(self) -> str:
        """A new name for the file /healthz writes, beside the queues (no queue has a dot)."""
        return f"{self.root}/.healthz-{secrets.token_hex(6)}"

    def slot(self, queue: str, slot: int) -> str:
        """The directory of the schedule marks due within one slot."""
        return f"{self.queue_dir(queue)}/schedule/{int(slot)}"

    def in_slot(self, queue: str, slot: int, entry: str) -> str:
        """A name found by listing a schedule slot."""
        if "/" in entry or entry in ("", ".", ".."):
            raise UnsafePath(f"bad name {entry[:80]!r}")
        return f"{self.slot(queue, slot)}/{entry}"

    def due_mark(self, queue: str, due_ms: int, item_id: str) -> str:
        """A scheduled item's mark: its name says when the item is due, and which it is."""
        if not ids.is_valid_id(item_id):
            raise UnsafePath(f"bad id {str(item_id)[:80]!r}")
        return f"{self.slot(queue, due_ms // 1000 // SLOT_SECONDS)}/{int(due_ms):013d}.{item_id}"

    def tally(self, queue: str, minute: int, status: str) -> str:
        if status not in ("finished", "failed"):
            raise UnsafePath(f"bad status {status!r}")
        return f"{self.queue_dir(queue)}/stats/{int(minute)}.{status}"

    def deleted_mark(self, queue: str) -> str:
        return f"{self.queue_dir(queue)}/{DELETED_MARK}"

    def lock_file(self, queue: str) -> str:
        return f"{self.queue_dir(queue)}/{LOCKS_DIRECTORY}/items"

    def key_lock_file(self, queue: str) -> str:
        return f"{self.queue_dir(queue)}/{LOCKS_DIRECTORY}/keys"

    def key(self, queue: str, digest: str) -> str:
        """The file of an idempotency key, named for its SHA-256 (a key may hold any printable
        character, a file name may not)."""
        if not _DIGEST.fullmatch(digest):
            raise UnsafePath(f"bad key digest {digest[:80]!r}")
        return f"{self.queue_dir(queue)}/keys/{digest}"
