"""The file store: the only code that touches the data directory.

Layout: `<data_dir>/<queue>/tmp|pending|processing|done|quarantine/<id>.json`, plus `<queue>/.lock`
and `<queue>/stats/<minute>.<finished|failed>`, whose size is how many items ended that minute.
The directory a file is in is the item's state. Every write goes to `tmp/` first and is moved into
place by rename (or by link, where "only if absent" matters), so no reader ever sees half a file.

Every transition of one item runs under that item's lock (`_ItemLocks`), so transitions from any
number of threads and processes are serialised per item; a lost race shows up as a missing file
and is a normal outcome. A crash between linking an item into done/ and unlinking its old file
leaves two copies: done wins everywhere (reads, claims, results, the sweep), and the sweep's
repair removes the other copy.

A claim renames the posted file into processing/ and records attempts, claim time, lease and
claim token beside its bytes, in an extended attribute (`CLAIM_XATTR`): the file itself is
written once, at the post. Where the file system has no xattrs, a claim rewrites the file.

Durable before answered (with fsync on): a post's files and a result's done file, and the
directory entries that name them. A claim is not flushed; a power cut may undo it, which leaves
the item pending or its lease lapsing.

What the file system itself records, so that the sweep never has to read a file to decide:
- the posting time is in the id (UUIDv7), so aged items are found by name;
- a processing file's mtime is its lease expiry;
- a done file's mtime is when its retention clock started, and its group-read bit says it has been
  fetched (retainFrom `fetched` never deletes an unfetched item).

Nothing scales with the queue on the hot path: a claim pops from an in-memory view of the oldest
pending ids (`_PendingIndex`), and a sweep pass lists each state directory once and checks the
names in bulk, reading only the files it will change (and stat-ing only the done files of items
posted long enough ago to be due). A batch of results syncs done/ once for the batch.
"""

import errno
import fcntl
import heapq
import itertools
import json
import logging
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import ids
from .exceptions import (
    InvalidRequest,
    ItemNotFound,
    NotHeld,
    PayloadTooLarge,
    StorageUnavailable,
    TaskhosterError,
    UnknownQueue,
    UnsafePath,
)

QUEUE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
STATE_DIRS = ("tmp", "pending", "processing", "done", "quarantine", "stats")
_STATES = frozenset(STATE_DIRS)
MAX_BATCH = 1000
STALE_TMP_SECONDS = 3600
ID_CLOCK_MARGIN_SECONDS = 60  # how far an id's time may run ahead of the clock that ends the item

# A claim (and an extend) records attempts, claim time, lease and claim token in this extended
# attribute of the processing file instead of rewriting the file: the claim stays a rename plus
# two metadata writes. Where xattrs are missing (macOS, some file systems) the file is rewritten.
CLAIM_XATTR = "user.taskhoster"
_NO_XATTRS = (errno.ENOTSUP, errno.EOPNOTSUPP)
_START_WRITEBACK = hasattr(os, "posix_fadvise")  # not on macOS
# every item file is made with this mode; only a fetched done file differs, and done files never
# become spares, so a spare written over keeps the mode it was made with
_ITEM_MODE = 0o600
_FETCHED_MODE = 0o640  # the group-read bit marks a done item as fetched
_LOCK_STRIPES = 256
INDEX_CAPACITY = 100_000  # pending ids one process keeps in memory per queue
_READ_SIZE = 1 << 16
# old item files a process keeps per queue, to write new ones over: enough for a burst of a few
# thousand items (at most 16 MB of disk), since every file deleted instead makes the next
# creations slower for a while on this kind of disk (measured: deleting 20,000 small files took
# creating one from 24 us to 800 us for over 30 s)
SPARES_PER_QUEUE = 4096
_SPARE_MAX_BYTES = 4096  # one block: cutting a longer file down would free blocks after all
# a spare is written over within this long of being kept, or deleted (so an old payload does not
# linger, and a spare is never near the age at which tmp/ files count as stale)
SPARE_SECONDS = 60
_SPARE_SERIAL = itertools.count()  # names unique in this process, whatever Store names them
_CHUNK = 10_000  # names handled at once, so a large directory never costs much memory

log = logging.getLogger(__name__)


def is_valid_queue_name(name: object) -> bool:
    return isinstance(name, str) and QUEUE_NAME.fullmatch(name) is not None


@dataclass(frozen=True)
class QueueConfig:
    """A queue's settings as the store needs them (the database owns the real record)."""

    name: str
    lease_seconds: int = 60
    queue_seconds: int = 86400
    retain_seconds: int = 3600
    retain_from: str = "finished"
    paused: bool = False


@dataclass(frozen=True)
class Item:
    id: str
    queue: str
    status: str
    attempts: int = 0
    claimed_at: float | None = None
    lease_expires_at: float | None = None
    finished_at: float | None = None
    payload: Any = None
    result: Any = None
    error: str | None = None
    claim_token: str | None = field(default=None, repr=False)

    @property
    def posted_at(self) -> float:
        return ids.id_millis(self.id) / 1000

    @property
    def terminal(self) -> bool:
        return self.status in ("finished", "failed")

    def to_json(self, *, payload: bool = False) -> dict:
        """The item as the API shows it."""
        data = {
            "id": self.id,
            "queue": self.queue,
            "status": self.status,
            "attempts": self.attempts,
            "postedAt": ids.iso(self.posted_at),
            "claimedAt": ids.iso(self.claimed_at),
            "leaseExpiresAt": ids.iso(self.lease_expires_at),
            "finishedAt": ids.iso(self.finished_at),
        }
        if self.status == "finished":
            data["result"] = self.result
        if self.status == "failed":
            data["error"] = self.error
        if payload:
            data["payload"] = self.payload
        return data


@dataclass(frozen=True)
class FinishOutcome:
    id: str
    accepted: bool
    status: str


@dataclass(frozen=True)
class Counts:
    pending: int
    processing: int
    finished: int
    failed: int
    oldest_pending_posted_at: float | None


@dataclass(frozen=True)
class SweepChanges:
    """What one sweep pass over a queue changed: the ids it touched, and tmp files removed."""

    repaired: list[str]
    failed: list[str]
    requeued: list[str]
    deleted: list[str]
    tmp_removed: int


# made once: json.dumps with any option builds a new encoder per call
_to_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
# allow_nan=False: NaN and Infinity are not JSON, and no client could read them back
_to_strict_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode


def _encode(item: Item) -> bytes:
    record = item.to_json(payload=True)
    record["result"] = item.result
    record["error"] = item.error
    record["claimToken"] = item.claim_token
    return _to_json(record).encode()


def _encode_claim(item: Item) -> bytes:
    # "attempts claimedAt leaseExpiresAt claimToken", about 55 bytes: small enough to live inside
    # an ext4 inode. A larger value takes a block of its own, freed (and discarded) at each unlink
    return f"{item.attempts} {item.claimed_at:.6f} {item.lease_expires_at:.6f} {item.claim_token}".encode()


def _with_claim(item: Item, raw: bytes) -> Item:
    """`item` as its claim record says: attempts and claim time always (they outlive a re-queue),
    lease and claim token while it is processing."""
    attempts, claimed_at, lease_expires_at, claim_token = raw.decode("ascii").split(" ")
    processing = item.status == "processing"
    return replace(
        item,
        attempts=int(attempts),
        claimed_at=float(claimed_at),
        lease_expires_at=float(lease_expires_at) if processing else None,
        claim_token=claim_token if processing else None,
    )


def _decode(raw: bytes, *, state: str) -> Item:
    record = json.loads(raw)
    status = record.get("status") if state == "done" else state
    if status not in ("pending", "processing", "finished", "failed"):
        raise ValueError(f"bad status {status!r}")
    processing = state == "processing"
    return Item(
        id=record["id"],
        queue=record["queue"],
        status=status,
        attempts=int(record.get("attempts", 0)),
        claimed_at=ids.parse_iso(record.get("claimedAt")),
        # a file moved but not yet rewritten (a crash mid-transition) shows its directory's truth
        lease_expires_at=ids.parse_iso(record.get("leaseExpiresAt")) if processing else None,
        finished_at=ids.parse_iso(record.get("finishedAt")) if state == "done" else None,
        payload=record.get("payload"),
        result=record.get("result"),
        error=record.get("error"),
        claim_token=record.get("claimToken") if processing else None,
    )


class _ItemLocks:
    """Serialises transitions of one item across threads and processes.

    Each queue has one lock file; an item maps to one byte of it (striped by id). A thread lock
    per stripe excludes threads of this process (POSIX record locks are per process), a record
    lock on the byte excludes other processes, and the kernel drops it if the process dies.
    One instance per lock file and process (`for_file`): two instances in one process would not
    exclude each other, and closing either would drop the other's record locks.
    """

    _open: dict[tuple[int, int], "_ItemLocks"] = {}  # (device, inode) of the lock file
    _open_lock = threading.Lock()

    def __init__(self, fd: int, key: tuple[int, int]):
        self._fd = fd
        self._key = key
        self._threads = [threading.Lock() for _ in range(_LOCK_STRIPES)]

    @classmethod
    def for_file(cls, path: str) -> "_ItemLocks":
        with cls._open_lock:
            try:
                info = os.stat(path)
                known = cls._open.get((info.st_dev, info.st_ino))
                if known is not None:
                    return known
            except FileNotFoundError:
                pass
            # never close a second descriptor of a registered file: that drops its record locks
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            info = os.fstat(fd)
            key = (info.st_dev, info.st_ino)
            locks = cls._open[key] = cls._open.get(key) or cls(fd, key)
            return locks

    @contextmanager
    def hold(self, item_id: str) -> Iterator[None]:
        stripe = _stripe(item_id)
        with self._threads[stripe]:
            _lock_byte(self._fd, stripe)
            try:
                yield
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, stripe)

    @contextmanager
    def hold_if_free(self, item_id: str) -> Iterator[bool]:
        """Hold the item's lock if no thread or process holds it now (True), never waiting."""
        stripe = _stripe(item_id)
        lock = self._threads[stripe]
        if not lock.acquire(blocking=False):
            yield False
            return
        try:
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, stripe)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                yield False
                return
            try:
                yield True
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, stripe)
        finally:
            lock.release()

    @contextmanager
    def hold_all(self, item_ids: Iterable[str]) -> Iterator[None]:
        """Hold many items' locks at once. Stripes are taken in ascending order, and every other
        holder holds one stripe or takes them in the same order, so no two wait for each other."""
        held: list[int] = []
        try:
            for stripe in sorted({_stripe(item_id) for item_id in item_ids}):
                self._threads[stripe].acquire()
                try:
                    _lock_byte(self._fd, stripe)
                except BaseException:
                    self._threads[stripe].release()
                    raise
                held.append(stripe)
            yield
        finally:
            for stripe in reversed(held):
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, stripe)
                self._threads[stripe].release()

    def close(self) -> None:
        with self._open_lock:
            if self._open.pop(self._key, None) is self:
                os.close(self._fd)


def _stripe(item_id: str) -> int:
    return int(item_id[-2:], 16) % _LOCK_STRIPES  # the same in every process, unlike hash()


def _lock_byte(fd: int, offset: int) -> None:
    """Wait for the record lock on one byte. The kernel's deadlock check counts record locks per
    process, so threads of two processes each holding one stripe and waiting for the other's are
    refused with EDEADLK; threads take stripes one at a time or in ascending order (`hold_all`),
    so it is no deadlock: try again."""
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX, 1, offset)
            return
        except OSError as exc:
            if exc.errno != errno.EDEADLK:
                raise
            time.sleep(0.001)


class _PendingIndex:
    """This process's view of a queue's oldest pending ids, so a claim never lists the directory.

    Items posted or re-queued here are pushed as they go. The directory is listed again when the
    view runs dry (`refill`, which the claim waits for), and in a background thread now and then
    (rarely for a large directory) to pick up what other processes posted or re-queued; posts go
    on meanwhile. Only about `capacity` of the oldest ids are kept: ids at or past `_horizon` may
    be left out, and a later listing finds them. The directory is the truth; the view only saves
    listing it, so a stale id costs one failed rename.
    """

    def __init__(self, directory: str, *, capacity: int):
        self._directory = directory
        self._capacity = capacity
        self._lock = threading.Lock()  # guards every field below
        self._heap: list[str] = []
        self._horizon: str | None = None  # None: nothing was left out
        self._listed_at = float("-inf")
        self._listing_took = 0.0
        self._listing = False  # a listing is under way: ids pushed meanwhile are kept for it
        self._pushed_meanwhile: list[str] = []
        self._in_background = False
        self._listing_lock = threading.Lock()  # one listing at a time

    def push(self, item_ids: Iterable[str]) -> None:
        with self._lock:
            for item_id in item_ids:
                self._add(item_id)
                if self._listing:
                    self._pushed_meanwhile.append(item_id)

    def _add(self, item_id: str) -> None:
        if self._horizon is not None and item_id >= self._horizon:
            return
        if len(self._heap) >= self._capacity:
            self._horizon = item_id  # full: leave this one and all younger ones to a listing
            return
        heapq.heappush(self._heap, item_id)

    def pop(self) -> str | None:
        """The oldest id in view, or None when the view is empty (`refill` then)."""
        with self._lock:
            if not self._heap:
                return None
            if not self._in_background and self._due():
                self._in_background = True
                threading.Thread(target=self._refresh_in_background, daemon=True).start()
            return heapq.heappop(self._heap)

    @property
    def listed(self) -> bool:
        return self._listed_at != float("-inf")

    def list_once(self) -> None:
        """List the directory unless this view ever was."""
        with self._listing_lock:
            if not self.listed:
                self._relist()

    def refill(self) -> None:
        """List the directory now, unless another thread's listing refilled the view meanwhile."""
        with self._listing_lock:
            with self._lock:
                if self._heap:
                    return
            self._relist()

    def _due(self) -> bool:
        age = time.monotonic() - self._listed_at
        if age >= max(1.0, 50 * self._listing_took):
            return True
        running_low = self._horizon is not None and len(self._heap) < self._capacity // 4
        return running_low and age >= max(1.0, 2 * self._listing_took)

    def _refresh_in_background(self) -> None:
        try:
            with self._listing_lock:
                self._relist()
        except Exception:  # the next claim that finds the view empty lists again
            log.exception("listing %s failed", self._directory)
        finally:
            with self._lock:
                self._in_background = False

    def _relist(self) -> None:
        """Replace the view with a fresh listing. Call holding `_listing_lock`."""
        with self._lock:
            self._listing = True
        started = time.monotonic()
        try:
            heap, horizon = self._oldest_in_directory()
        except BaseException:
            with self._lock:
                self._listing, self._pushed_meanwhile = False, []
            raise
        with self._lock:
            self._heap, self._horizon = heap, horizon
            for item_id in self._pushed_meanwhile:  # made after the listing began: perhaps missed
                self._add(item_id)
            self._listing, self._pushed_meanwhile = False, []
            self._listed_at, self._listing_took = time.monotonic(), time.monotonic() - started

    def _oldest_in_directory(self) -> tuple[list[str], str | None]:
        """About `capacity` of the oldest ids, as a heap, and the horizon. Streams the directory
        in chunks, so a million names never sit in memory at once."""
        kept: list[str] = []
        horizon = None
        try:
            with os.scandir(self._directory) as entries:
                while names := [entry.name for entry in itertools.islice(entries, _CHUNK)]:
                    found = [name[:-5] for name in names if name.endswith(".json")]
                    kept += found if horizon is None else filter(horizon.__gt__, found)
                    if len(kept) > 2 * self._capacity:
                        horizon = _keep_oldest(kept, self._capacity)
        except FileNotFoundError:
            pass
        if len(kept) > self._capacity:
            horizon = _keep_oldest(kept, self._capacity)
        heapq.heapify(kept)
        return kept, horizon


def _keep_oldest(item_ids: list[str], count: int) -> str:
    """Cut `item_ids` down to its `count` oldest, in place; returns the oldest one cut."""
    item_ids.sort()
    horizon = item_ids[count]
    del item_ids[count:]
    return horizon


class Store:
    """Owns `data_dir`. Every public method is one transition or one read, safe to call from any
    thread of any process sharing the directory."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        fsync: bool = True,
        max_payload_bytes: int = 1 << 20,
        clock: Callable[[], float] = time.time,
        index_capacity: int = INDEX_CAPACITY,
    ):
        self.data_dir = Path(data_dir)
        self._root = os.fspath(self.data_dir)
        self.fsync = fsync
        self.max_payload_bytes = max_payload_bytes
        self.clock = clock
        self.index_capacity = index_capacity
        self._ids = ids.IdMaker()
        self._locks: dict[str, _ItemLocks] = {}
        self._indexes: dict[str, _PendingIndex] = {}
        self._done_status: dict[str, dict[str, str]] = {}  # queue -> id -> finished|failed
        self._ready: dict[str, str] = {}  # queues whose directories exist -> their directory
        self._setup_lock = threading.Lock()
        self.claim_xattrs = hasattr(os, "setxattr")  # False once the file system refuses them
        self._tally_files: dict[tuple[str, str], tuple[int, int]] = {}  # (queue, status) -> (minute, fd)
        self._tally_lock = threading.Lock()
        self._spares: dict[str, deque[tuple[str, float]]] = {}  # queue -> (file in tmp/, kept at), oldest first
        self._spare_lock = threading.Lock()

    # ---- paths: the only place a path is built -------------------------------------------
    # Plain strings, not pathlib objects: building a Path costs several times more, and a
    # transition builds a handful of paths.

    def _queue_dir(self, queue: str) -> str:
        # a queue made by ensure_queue has a checked name: skip the pattern
        directory = self._ready.get(queue) if isinstance(queue, str) else None
        if directory is None:
            if not is_valid_queue_name(queue):
                raise UnsafePath(f"bad queue name {queue!r}")
            directory = f"{self._root}/{queue}"
        return directory

    def _path(self, queue: str, state: str, item_id: str) -> str:
        if state not in _STATES or not ids.is_valid_id(item_id):
            raise UnsafePath(f"bad state or id {state!r} {item_id!r}")
        return f"{self._queue_dir(queue)}/{state}/{item_id}.json"

    def _dir(self, queue: str, state: str) -> str:
        if state not in _STATES:
            raise UnsafePath(f"bad state {state!r}")
        return f"{self._queue_dir(queue)}/{state}"

    # ---- queues --------------------------------------------------------------------------

    def ensure_queue(self, queue: str) -> None:
        """Make the queue's directories; a no-op when they exist."""
        if not is_valid_queue_name(queue):
            raise InvalidRequest(
                "a queue name is 1 to 64 characters of a-z, 0-9, '_' and '-', "
                "starting with a letter or digit"
            )
        if queue in self._ready:
            return
        with self._storage_errors():
            for state in STATE_DIRS:
                os.makedirs(self._dir(queue, state), exist_ok=True)
            # the new directories' own entries must survive a power cut too, or the items in them
            # would not, fsync'd as they are
            self._sync_dir(self._queue_dir(queue))
            self._sync_dir(self._root)
        self._ready[queue] = self._queue_dir(queue)

    def check_writable(self) -> bool:
        """True when a file can be written and removed in the data directory (for /healthz)."""
        probe = f"{self._root}/.healthz-{secrets.token_hex(6)}"
        try:
            os.makedirs(self._root, exist_ok=True)
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            os.unlink(probe)
            return True
        except OSError:
            return False

    def delete_queue(self, queue: str) -> None:
        """Delete the queue's directory and every item in it."""
        directory = self._queue_dir(queue)
        with self._setup_lock:
            locks = self._locks.pop(queue, None)
            self._indexes.pop(queue, None)
            self._done_status.pop(queue, None)
            self._ready.pop(queue, None)
        if locks:
            locks.close()
        self._close_tallies(queue)
        with self._spare_lock:
            self._spares.pop(queue, None)
        shutil.rmtree(directory, ignore_errors=True)

    def _item_lock(self, queue: str, item_id: str):
        return self._queue_locks(queue).hold(item_id)

    def _queue_locks(self, queue: str) -> _ItemLocks:
        locks = self._locks.get(queue)
        if locks is None:
            with self._setup_lock:
                locks = self._locks.get(queue)
                if locks is None:
                    self.ensure_queue(queue)
                    locks = self._locks[queue] = _ItemLocks.for_file(f"{self._queue_dir(queue)}/.lock")
        return locks

    def _index(self, queue: str) -> _PendingIndex:
        index = self._indexes.get(queue)
        if index is None:
            with self._setup_lock:
                index = self._indexes.setdefault(
                    queue, _PendingIndex(self._dir(queue, "pending"), capacity=self.index_capacity)
                )
        return index

    # ---- low-level file operations --------------------------------------------------------

    @contextmanager
    def _storage_errors(self) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            if isinstance(exc, (FileNotFoundError, FileExistsError)):
                raise
            raise StorageUnavailable(f"the data directory cannot be written: {exc.strerror}") from exc

    def _write_tmp(self, queue: str, item: Item, *, mtime: float | None = None, sync: bool = True) -> str:
        """Write `item` to a fresh file in tmp/ (or over a spare), flushed to disk when fsync is
        on and `sync` (else `_sync_files` does it later); its path."""
        tmp, fd = self._open_tmp(queue, item, mtime=mtime)
        try:
            if self.fsync and sync:
                os.fsync(fd)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        finally:
            os.close(fd)
        return tmp

    def _open_tmp(self, queue: str, item: Item, *, mtime: float | None = None) -> tuple[str, int]:
        """Write `item` to a fresh file in tmp/ (or over a spare); its path and its descriptor,
        still open."""
        tmp = f"{self._dir(queue, 'tmp')}/{item.id}.{secrets.token_hex(6)}.json"
        data = _encode(item)
        reused = self._take_spare(queue, tmp)
        try:
            fd = os.open(tmp, os.O_WRONLY) if reused else os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _ITEM_MODE)
        except BaseException:
            if reused:
                _unlink_quietly(tmp)
            raise
        try:
            os.write(fd, data)
            if reused:
                os.ftruncate(fd, len(data))  # within its one block: nothing is freed
                self._drop_claim_record(fd)
            if mtime is not None:
                os.utime(fd, (mtime, mtime))
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        return tmp, fd

    # ---- spare files ---------------------------------------------------------------------
    # Deleting a file frees its inode and its block, and creating one takes them anew; on a disk
    # mounted with online discard, every block freed costs a discard the deletion waits for
    # (measured here: ~80 us, the dearest step of handing in a result). So when a result is in,
    # the item's old file is kept in tmp/ as a spare, and the next file this process writes for
    # the queue is written over it. A spare not taken within SPARE_SECONDS is deleted, by the
    # sweep's pass or by the next writer; one left by a process that died, after an hour with
    # the other stale tmp/ files.

    def _retire(self, queue: str, path: str) -> None:
        """Take an item's old file out of its state directory: keep it as a spare when there is
        room, else delete it."""
        with self._spare_lock:
            room = len(self._spares.get(queue, ())) < SPARES_PER_QUEUE
        try:
            if room and os.stat(path).st_size <= _SPARE_MAX_BYTES:
                spare = f"{self._dir(queue, 'tmp')}/spare-{os.getpid()}-{next(_SPARE_SERIAL)}"
                os.rename(path, spare)
                os.utime(spare)  # its age in tmp/ starts now
                with self._spare_lock:
                    self._spares.setdefault(queue, deque()).append((spare, time.monotonic()))
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass  # gone already

    def _take_spare(self, queue: str, tmp: str) -> bool:
        """Move one of the queue's spares to `tmp`, to be written over; False if none is left."""
        self.expire_spares(queue=queue)
        while True:
            with self._spare_lock:
                spares = self._spares.get(queue)
                if not spares:
                    return False
                spare, _ = spares.popleft()
            try:
                os.rename(spare, tmp)
                return True
            except FileNotFoundError:
                continue  # removed meanwhile

    def expire_spares(self, *, queue: str) -> int:
        """Delete the queue's spares kept longer than SPARE_SECONDS; how many."""
        expired = []
        with self._spare_lock:
            spares = self._spares.get(queue)
            while spares and time.monotonic() - spares[0][1] > SPARE_SECONDS:
                expired.append(spares.popleft()[0])
        for spare in expired:
            _unlink_quietly(spare)
        return len(expired)

    def _drop_claim_record(self, fd: int) -> None:
        if self.claim_xattrs:
            try:
                os.removexattr(fd, CLAIM_XATTR)
            except OSError as exc:
                if exc.errno != errno.ENODATA and exc.errno not in _NO_XATTRS:
                    raise

    def _sync_files(self, paths: list[str]) -> None:
        """Flush files written with `_write_tmp(sync=False)` (when fsync is on). All are sent on
        their way to disk first, then each is waited for, mostly finding its work done: about
        half the time a file of flushing each in turn, and half the CPU of flushing them all in
        parallel threads."""
        if not self.fsync:
            return
        if len(paths) > 1 and _START_WRITEBACK:
            for path in paths:
                _start_writeback(path)
        for path in paths:
            _fsync_path(path)

    def _sync_dir(self, directory: str) -> None:
        if self.fsync:
            _fsync_path(directory)

    def _read(self, queue: str, state: str, item_id: str) -> Item:
        """Read one file; FileNotFoundError if it is not there, quarantined if unreadable."""
        path = self._path(queue, state, item_id)
        fd = os.open(path, os.O_RDONLY)  # not open(): a buffered file costs four more system calls
        try:
            raw = _read_all(fd)
            record = self._claim_record(fd) if state != "done" else None
        finally:
            os.close(fd)
        try:
            item = _decode(raw, state=state)
            if item.id != item_id or item.queue != queue:
                raise ValueError("id or queue does not match the file name")
            return _with_claim(item, record) if record else item
        except (ValueError, KeyError, TypeError) as exc:
            self.quarantine(queue=queue, state=state, item_id=item_id)
            raise FileNotFoundError(path) from exc

    def _claim_record(self, fd: int) -> bytes | None:
        """The claim record of an open pending or processing file, if it has one."""
        if not self.claim_xattrs:
            return None
        try:
            return os.getxattr(fd, CLAIM_XATTR)
        except OSError as exc:
            if exc.errno in _NO_XATTRS:
                self.claim_xattrs = False
            elif exc.errno != errno.ENODATA:
                raise
            return None

    def _record_claim(self, queue: str, item: Item) -> None:
        """Record a processing item's claim (attempts, claim time, lease, claim token), the lease
        also as the file's mtime for the sweep. Not flushed: only posts and results must be on
        disk before they are answered (after a power cut the item is pending again, or its lease
        lapses). Without xattrs the file is replaced whole, by rename, so old or new content
        survives a power cut (ext4 and btrfs flush a replace-by-rename before it lands)."""
        path = self._path(queue, "processing", item.id)
        if self.claim_xattrs:
            try:
                os.setxattr(path, CLAIM_XATTR, _encode_claim(item))
                os.utime(path, (item.lease_expires_at, item.lease_expires_at))
                return
            except OSError as exc:
                if exc.errno not in _NO_XATTRS:
                    raise
                self.claim_xattrs = False
        tmp = self._write_tmp(queue, item, mtime=item.lease_expires_at, sync=False)
        try:
            os.rename(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise

    def _find(self, queue: str, item_id: str) -> tuple[str, Item]:
        """The item's state and content, done first (done wins over a stray copy). Call under the
        item's lock."""
        for state in ("done", "processing", "pending"):
            try:
                return state, self._read(queue, state, item_id)
            except FileNotFoundError:
                continue
        raise ItemNotFound(f"no item {item_id} in queue {queue}")

    def _move(self, queue: str, item_id: str, source: str, target: str) -> None:
        os.rename(self._path(queue, source, item_id), self._path(queue, target, item_id))

    def _check_size(self, value: Any, what: str) -> None:
        try:
            size = len(_to_strict_json(value).encode())
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"the {what} is not a JSON value") from exc
        if size > self.max_payload_bytes:
            raise PayloadTooLarge(
                f"the {what} is {size} bytes as JSON; the limit is {self.max_payload_bytes}"
            )

    def _valid_id(self, queue: str, item_id: str) -> None:
        if not is_valid_queue_name(queue):
            raise UnknownQueue(f"no queue named {str(queue)[:80]!r}")
        if not ids.is_valid_id(item_id):
            raise ItemNotFound("no item has this id")

    # ---- transitions ----------------------------------------------------------------------

    def post_items(self, *, queue: str, payloads: list[Any]) -> list[Item]:
        """Post a batch, all or nothing, and return once it would survive a power cut; see
        `begin_post`."""
        return self.begin_post(queue=queue, payloads=payloads)()

    def begin_post(
        self, *, queue: str, payloads: list[Any], on_claimable: Callable[[], None] | None = None
    ) -> Callable[[], list[Item]]:
        """The first half of a post. The second half, returned, waits until the post is on disk
        and gives the items; it may run on another thread while this one takes the next call.
        `on_claimable` is called (from either thread) once the items may be claimed.

        A batch is all or nothing: its files are written to tmp/ in the first half, and moved
        to pending/ in the second once all are on disk. A single item is moved into pending/ at
        once and may be claimed while it is flushed (see `_flush_post`), so a worker gets it
        while the disk catches up."""
        items = self._new_items(queue, payloads)
        if len(items) > 1:
            publish = self._begin_post(queue, items)

            def published() -> list[Item]:
                posted = publish()
                if on_claimable is not None:
                    on_claimable()
                return posted

            return published
        (item,) = items
        target = self._path(queue, "pending", item.id)
        with self._storage_errors():
            tmp, fd = self._open_tmp(queue, item)
            try:
                os.rename(tmp, target)
            except BaseException:
                os.close(fd)
                _unlink_quietly(tmp)
                raise
        self._index(queue).push([item.id])
        if on_claimable is not None:
            on_claimable()

        def flushed() -> list[Item]:
            try:
                with self._storage_errors():
                    self._flush_post(queue, item.id, fd)
            except BaseException:
                # unposted: take it back out, from processing/ too if it was claimed meanwhile
                with self._item_lock(queue, item.id):
                    _unlink_quietly(target)
                    _unlink_quietly(self._path(queue, "processing", item.id))
                raise
            finally:
                os.close(fd)
            return items

        return flushed

    def _flush_post(self, queue: str, item_id: str, fd: int) -> None:
        """Flush a single post's file, through the descriptor it was written with, and the
        directory that names it now: pending/, or processing/ if a claim moved it there
        meanwhile (pending/ synced after that would record it gone). A claim after pending/ was
        synced needs no flush: claims are not flushed anyway."""
        if not self.fsync:
            return
        os.fsync(fd)
        target = self._path(queue, "pending", item_id)
        if os.path.exists(target):
            self._sync_dir(self._dir(queue, "pending"))
            if os.path.exists(target):
                return
        # claimed before pending/ was synced, or while it was
        self._sync_dir(self._dir(queue, "processing"))

    def _new_items(self, queue: str, payloads: list[Any]) -> list[Item]:
        """The items a batch of payloads makes, checked, with new ids; the queue made if new."""
        if not isinstance(payloads, list) or not 1 <= len(payloads) <= MAX_BATCH:
            raise InvalidRequest(f"a batch holds 1 to {MAX_BATCH} items")
        for payload in payloads:
            self._check_size(payload, "payload")
        self.ensure_queue(queue)
        new_ids = self._ids.new_ids(len(payloads), self.clock())
        return [Item(id=i, queue=queue, status="pending", payload=p) for i, p in zip(new_ids, payloads)]

    def _begin_post(self, queue: str, items: list[Item]) -> Callable[[], list[Item]]:
        written: list[str] = []
        try:
            with self._storage_errors():
                for item in items:
                    written.append(self._write_tmp(queue, item, sync=False))
        except BaseException:
            for path in written:
                _unlink_quietly(path)
            raise

        def publish() -> list[Item]:
            moved: list[str] = []
            try:
                with self._storage_errors():
                    self._sync_files(written)  # flushed in tmp/, where nobody else moves them
                    for item, tmp in zip(items, written):
                        target = self._path(queue, "pending", item.id)
                        os.rename(tmp, target)
                        moved.append(target)
                    self._sync_dir(self._dir(queue, "pending"))
            except BaseException:
                for path in written + moved:
                    _unlink_quietly(path)
                raise
            self._index(queue).push(item.id for item in items)
            return items

        return publish

    def pending_listed(self, *, queue: str) -> bool:
        """Whether this process has listed the queue's pending directory (its first claim waits
        for that listing: 1.7 s at a million items)."""
        return self._index(queue).listed

    def list_pending(self, *, queue: str) -> None:
        """List the queue's pending directory if this process never has."""
        with self._storage_errors():
            self._index(queue).list_once()

    def claim_items(self, *, config: QueueConfig, max_items: int = 1) -> list[Item]:
        """Claim up to `max_items` pending items, oldest first, each under a lease and a claim
        token of its own. A paused queue hands out nothing."""
        if config.paused:
            return []
        queue = config.name
        self.ensure_queue(queue)
        index = self._index(queue)
        claimed: list[Item] = []
        listed_in_vain = False
        while len(claimed) < max_items:
            item_id = index.pop()
            if item_id is None:
                if listed_in_vain:
                    break  # files that cannot be claimed must not make a claim spin
                with self._storage_errors():
                    index.refill()
                listed_in_vain = True
                continue
            if not ids.is_valid_id(item_id):
                continue
            with self._item_lock(queue, item_id), self._storage_errors():
                item = self._claim_held(config, item_id)
            if item is not None:
                claimed.append(item)
                listed_in_vain = False
        return claimed

    def claim_items_now(self, *, config: QueueConfig, max_items: int = 1) -> list[Item] | None:
        """`claim_items` for the event loop, which must never wait: it claims while each step is
        quick (the item's lock free at once, its id in this process's view, the item not past
        its queue timeout, whose failing syncs the disk) and stops at the first that is not.
        The items claimed; None if it claimed none, for `claim_items` to do the waiting."""
        if config.paused:
            return []
        queue = config.name
        locks, index = self._locks.get(queue), self._indexes.get(queue)
        if locks is None or index is None or not index.listed:
            return None  # making either may list a directory or sync one
        claimed: list[Item] = []
        while len(claimed) < max_items:
            item_id = index.pop()
            if item_id is None:
                break
            if not ids.is_valid_id(item_id):
                continue
            if self.clock() - ids.id_millis(item_id) / 1000 > config.queue_seconds:
                index.push([item_id])
                break
            with locks.hold_if_free(item_id) as held:
                if not held:
                    index.push([item_id])
                    break
                with self._storage_errors():
                    item = self._claim_held(config, item_id)
            if item is not None:
                claimed.append(item)
        return claimed or None

    def _claim_held(self, config: QueueConfig, item_id: str) -> Item | None:
        """Claim one item whose id the view gave; None if it cannot be claimed (another
        claimant was first, or it timed out and is failed now). Call under the item's lock."""
        queue = config.name
        if os.path.exists(self._path(queue, "done", item_id)):
            return None  # a copy a crash left behind: done wins, and the sweep removes it
        try:
            self._move(queue, item_id, "pending", "processing")
            item = self._read(queue, "processing", item_id)
        except FileNotFoundError:
            return None  # another claimant was first: try the next one
        now = self.clock()
        if now - item.posted_at > config.queue_seconds:
            self._fail_timed_out(queue, "processing", item, now)
            return None
        item = replace(
            item,
            status="processing",
            attempts=item.attempts + 1,
            claimed_at=now,
            lease_expires_at=now + config.lease_seconds,
            claim_token=secrets.token_hex(8),  # tells this claim of the item from others
        )
        self._record_claim(queue, item)
        return item

    def finish_item(self, *, config: QueueConfig, item_id: str, result: Any) -> FinishOutcome:
        """Hand in a result. The first result for an item that is not terminal wins (G3, G4);
        an item past its queue timeout is failed instead (G6)."""
        return self.begin_finish_item(config=config, item_id=item_id, result=result)()

    def begin_finish_item(self, *, config: QueueConfig, item_id: str, result: Any) -> Callable[[], FinishOutcome]:
        """`finish_item` in two halves, as `begin_finish` for one result (which the second half
        raises if it is an error)."""
        commit = self.begin_finish(config=config, results=[(item_id, result)])

        def outcome() -> FinishOutcome:
            (settled,) = commit()
            if isinstance(settled, TaskhosterError):
                raise settled
            return settled

        return outcome

    def finish_items(
        self, *, config: QueueConfig, results: list[tuple[str, Any]]
    ) -> list[FinishOutcome | TaskhosterError]:
        """Hand in many (id, result) pairs of one queue, each as `finish_item` would, with one
        sync of done/ for the lot instead of one per item. Each pair's own trouble (an unknown
        id, a result too large) is its outcome, in order."""
        return self.begin_finish(config=config, results=results)()

    def begin_finish(
        self, *, config: QueueConfig, results: list[tuple[str, Any]]
    ) -> Callable[[], list[FinishOutcome | TaskhosterError]]:
        """The first half of `finish_items`: each result's done file written to tmp/ under its
        item's lock alone, on its way to disk. The second half, returned, waits until they are
        on disk, then takes all the batch's locks, links the files into done/ and syncs done/
        once, so nobody sees an item done before it would survive a power cut, and claims wait
        only for that last step. It gives the outcomes, and may run on another thread while this
        one takes the next call."""
        queue = config.name
        outcomes: list[FinishOutcome | TaskhosterError | None] = [None] * len(results)
        prepared: list[tuple[int, _Prepared]] = []
        try:
            for position, (item_id, result) in enumerate(results):
                try:
                    self._valid_id(queue, item_id)
                    self._check_size(result, "result")
                    with self._item_lock(queue, item_id), self._storage_errors():
                        ready = self._prepare_done(config, item_id, result, sync=False)
                except TaskhosterError as error:
                    outcomes[position] = error
                    continue
                if isinstance(ready, FinishOutcome):
                    outcomes[position] = ready
                else:
                    prepared.append((position, ready))
        except BaseException:
            for _, ready in prepared:
                _unlink_quietly(ready.tmp)
            raise

        def commit() -> list[FinishOutcome | TaskhosterError]:
            try:
                if prepared:
                    with self._storage_errors():
                        self._sync_files([ready.tmp for _, ready in prepared])
                    self._commit_all_done(config, results, prepared, outcomes)
            except BaseException:
                for _, ready in prepared:
                    _unlink_quietly(ready.tmp)
                raise
            return outcomes

        return commit

    def _prepare_done(
        self, config: QueueConfig, item_id: str, result: Any, *, sync: bool = True
    ) -> "FinishOutcome | _Prepared":
        """The outcome if the item is done already; else its done file written to tmp/ (and
        flushed if `sync`), with what to check before linking it. Call under the item's lock."""
        queue = config.name
        state, item = self._find(queue, item_id)
        if state == "done":
            return FinishOutcome(item_id, False, item.status)
        source = self._path(queue, state, item_id)
        identity = _identity(source)
        now = self.clock()
        if now - item.posted_at > config.queue_seconds:
            done, outcome = _timed_out(item, now), FinishOutcome(item_id, False, "failed")
        else:
            done = replace(
                item, status="finished", lease_expires_at=None, finished_at=now, result=result, claim_token=None
            )
            outcome = FinishOutcome(item_id, True, "finished")
        tmp = self._write_tmp(queue, done, mtime=done.finished_at, sync=sync)
        return _Prepared(done, tmp, source, identity, outcome)

    def _commit_all_done(
        self, config: QueueConfig, results: list, prepared: list[tuple[int, "_Prepared"]], outcomes: list
    ) -> None:
        queue = config.name
        sources = []  # files to remove once their items' done files are on disk
        with self._queue_locks(queue).hold_all(ready.item.id for _, ready in prepared):
            for position, ready in prepared:
                try:
                    with self._storage_errors():
                        outcomes[position], source = self._commit_done(config, ready, results[position][1])
                except TaskhosterError as error:
                    outcomes[position] = error
                    continue
                if source is not None:
                    sources.append(source)
            if sources:
                with self._storage_errors():
                    self._sync_dir(self._dir(queue, "done"))
            for path in sources:
                self._retire(queue, path)

    def _commit_done(self, config: QueueConfig, ready: "_Prepared", result: Any) -> tuple[FinishOutcome, str | None]:
        """Link a prepared done file into done/ (unsynced) if its item is still as it was read;
        else settle the item afresh. Call under the item's lock."""
        try:
            if _identity(ready.source) != ready.identity:
                raise FileNotFoundError(ready.source)
        except FileNotFoundError:  # claimed, re-queued or finished meanwhile
            _unlink_quietly(ready.tmp)
            return self._settle(config, ready.item.id, result)
        return self._link_prepared(config.name, ready)

    def _settle(self, config: QueueConfig, item_id: str, result: Any) -> tuple[FinishOutcome, str | None]:
        """Link the item's done file for this result (or its timeout) into done/, unsynced; the
        outcome and the file to remove once done/ is synced. Call under the item's lock."""
        ready = self._prepare_done(config, item_id, result)
        if isinstance(ready, FinishOutcome):
            return ready, None
        return self._link_prepared(config.name, ready)

    def _link_prepared(self, queue: str, ready: "_Prepared") -> tuple[FinishOutcome, str | None]:
        item_id = ready.item.id
        if not self._link_tmp(queue, ready.item, ready.tmp):
            return FinishOutcome(item_id, False, self._done_status_of(queue, item_id)), None
        return ready.outcome, ready.source

    def _put_done(self, queue: str, source: str, item: Item) -> bool:
        """Move `item` to done/ with its new content; False if done/ already had it."""
        if not self._link_tmp(queue, item, self._write_tmp(queue, item, mtime=item.finished_at)):
            return False
        self._sync_dir(self._dir(queue, "done"))
        self._retire(queue, self._path(queue, source, item.id))
        return True

    def _link_tmp(self, queue: str, item: Item, tmp: str) -> bool:
        """Link a done file written to tmp/ into done/ (not yet synced) and remove the tmp file;
        False if done/ already had the item."""
        try:
            os.link(tmp, self._path(queue, "done", item.id))
        except FileExistsError:
            return False
        finally:
            _unlink_quietly(tmp)
        self._done_status.setdefault(queue, {})[item.id] = item.status
        self._tally(queue, item.status, item.finished_at)
        return True

    def _fail_timed_out(self, queue: str, state: str, item: Item, now: float) -> None:
        self._put_done(queue, state, _timed_out(item, now))

    def release_item(self, *, queue: str, item_id: str, claim_token: str | None = None) -> Item:
        """Put a processing item back to pending now. With `claim_token`, only if that claim
        still holds it. Raises NotHeld otherwise."""
        self._valid_id(queue, item_id)
        with self._item_lock(queue, item_id), self._storage_errors():
            state, item = self._find(queue, item_id)
            if state != "processing" or (claim_token is not None and item.claim_token != claim_token):
                raise NotHeld(f"item {item_id} is {item.status}, not held")
            return self._requeue(queue, item)

    def requeue_item(self, *, queue: str, item_id: str, claim_token: str) -> bool:
        """Re-queue an item if the claim `claim_token` still holds it (G8); False if not."""
        try:
            self.release_item(queue=queue, item_id=item_id, claim_token=claim_token)
            return True
        except (NotHeld, ItemNotFound):
            return False

    def _requeue(self, queue: str, item: Item) -> Item:
        # a rename alone: a pending file's lease and claim token, in its claim record or its
        # content, mean nothing, and its attempts stay for the next claim to count on
        self._move(queue, item.id, "processing", "pending")
        self._index(queue).push([item.id])
        return replace(item, status="pending", lease_expires_at=None, claim_token=None)

    def extend_lease(
        self, *, queue: str, item_id: str, seconds: float, claim_token: str | None = None
    ) -> Item:
        """Set a processing item's lease to expire `seconds` from now."""
        self._valid_id(queue, item_id)
        with self._item_lock(queue, item_id), self._storage_errors():
            state, item = self._find(queue, item_id)
            if state != "processing" or (claim_token is not None and item.claim_token != claim_token):
                raise NotHeld(f"item {item_id} is {item.status}, not held")
            item = replace(item, lease_expires_at=self.clock() + seconds)
            self._record_claim(queue, item)
            return item

    def read_item(self, *, queue: str, item_id: str, fetch: bool = False, retain_from: str = "finished") -> Item:
        """Read one item. With `fetch`, a terminal item is marked fetched the first time, and under
        retainFrom `fetched` its retention clock starts now (G7)."""
        self._valid_id(queue, item_id)
        if not os.path.isdir(self._dir(queue, "done")):
            raise ItemNotFound(f"no item {item_id} in queue {queue}")
        with self._item_lock(queue, item_id), self._storage_errors():
            state, item = self._find(queue, item_id)
            if fetch and state == "done":
                self._mark_fetched(queue, item_id, restart_clock=retain_from == "fetched")
            return item

    def read_item_unlocked(
        self, *, queue: str, item_id: str, fetch: bool = False, retain_from: str = "finished"
    ) -> Item | None:
        """`read_item` for the event loop, which must never wait for a transition on the disk:
        None where `read_item` must be asked instead. Every file is whole (written aside, then
        renamed or linked in), so a pending or processing item is read without its lock; but a
        move under way may hide the item from all three states for an instant (None). A done
        item is answered only under its lock, taken if free (else None): its file is linked into
        done/ before done/ is synced, under that lock, and nobody may see an item done before a
        power cut would leave it so."""
        self._valid_id(queue, item_id)
        try:
            with self._storage_errors():
                state, item = self._find(queue, item_id)
                if state != "done":
                    return item
                locks = self._locks.get(queue)  # not _queue_locks: making them may wait and fsync
                if locks is None:
                    return None
                with locks.hold_if_free(item_id) as held:
                    if not held:
                        return None
                    if fetch:
                        self._mark_fetched(queue, item_id, restart_clock=retain_from == "fetched")
                    return item
        except ItemNotFound:
            return None

    def _mark_fetched(self, queue: str, item_id: str, *, restart_clock: bool) -> None:
        path = self._path(queue, "done", item_id)
        try:
            if os.stat(path).st_mode & stat.S_IRGRP:
                return
            if restart_clock:
                now = self.clock()
                os.utime(path, (now, now))
            os.chmod(path, _FETCHED_MODE)  # last, so a crash in between only repeats the fetch
        except FileNotFoundError:
            pass  # deleted by retention meanwhile

    def quarantine(self, *, queue: str, state: str, item_id: str) -> None:
        """Move an unreadable file out of the way, so it never stops a claim or a sweep."""
        source = self._path(queue, state, item_id)
        target = f"{self._dir(queue, 'quarantine')}/{state}-{item_id}.json"
        try:
            os.rename(source, target)
        except FileNotFoundError:
            pass

    # ---- sweep passes ---------------------------------------------------------------------

    def sweep_queue(self, *, config: QueueConfig) -> SweepChanges:
        """One sweep pass over a queue: settle crash leftovers, fail aged items, re-queue lapsed
        leases, delete retained items, remove stale tmp files and old spares. Lists each state
        directory once."""
        queue = config.name
        self.expire_spares(queue=queue)
        listing = {state: self._names(queue, state) for state in ("pending", "processing", "done")}
        repaired = self._repair(queue, listing)
        # failing first: an item both aged and lapsed ends failed, not re-queued
        failed = self._fail_aged(config, listing.pop("pending"), listing["processing"])
        requeued = self._requeue_lapsed(config, listing.pop("processing"))
        deleted = self._delete_expired(config, listing.pop("done"))
        return SweepChanges(repaired, failed, requeued, deleted, self.remove_stale_tmp(queue=queue))

    def _names(self, queue: str, state: str) -> list[str]:
        try:
            return os.listdir(self._dir(queue, state))
        except FileNotFoundError:
            return []

    def _ids_in(self, queue: str, state: str) -> list[str]:
        return [name[:-5] for name in self._names(queue, state) if name.endswith(".json")]

    def repair(self, *, queue: str) -> list[str]:
        """Settle every id found in two states (a crash mid-transition): done wins, then pending.
        Files whose names are not item ids are quarantined."""
        return self._repair(queue, {state: self._names(queue, state) for state in ("pending", "processing", "done")})

    def _repair(self, queue: str, listing: dict[str, list[str]]) -> list[str]:
        for state, names in listing.items():
            for name in _not_item_files(names):
                _quarantine_path(self._dir(queue, state), name, self._dir(queue, "quarantine"), state)
        repaired = []
        doubled = _doubled(listing["pending"], listing["processing"], listing["done"])
        for name in sorted(doubled):
            item_id = name[:-5]
            if not ids.is_valid_id(item_id):
                continue
            with self._item_lock(queue, item_id):
                states = ("done", "pending", "processing")
                present = [s for s in states if os.path.exists(self._path(queue, s, item_id))]
                for state in present[1:]:
                    _unlink_quietly(self._path(queue, state, item_id))
                if len(present) > 1:
                    repaired.append(item_id)
        return repaired

    def fail_aged(self, *, config: QueueConfig) -> list[str]:
        """Fail every pending or processing item older than the queue allows (G6)."""
        queue = config.name
        return self._fail_aged(config, self._names(queue, "pending"), self._names(queue, "processing"))

    def _fail_aged(self, config: QueueConfig, pending: list[str], processing: list[str]) -> list[str]:
        queue, now = config.name, self.clock()
        # names sort by posting time: those below the bound were posted at or before the cutoff
        bound = ids.time_prefix(int((now - config.queue_seconds) * 1000) + 1)
        failed = []
        for names in (pending, processing):
            for name in filter(bound.__gt__, names):
                item_id = name[:-5]
                if not (name.endswith(".json") and ids.is_valid_id(item_id)):
                    continue
                with self._item_lock(queue, item_id), self._storage_errors():
                    try:
                        current, item = self._find(queue, item_id)
                    except ItemNotFound:
                        continue
                    if current != "done" and now - item.posted_at > config.queue_seconds:
                        self._fail_timed_out(queue, current, item, now)
                        failed.append(item_id)
        return failed

    def requeue_lapsed(self, *, config: QueueConfig) -> list[str]:
        """Move every processing item whose lease has lapsed back to pending (an aged one fails)."""
        return self._requeue_lapsed(config, self._names(config.name, "processing"))

    def _requeue_lapsed(self, config: QueueConfig, processing: list[str]) -> list[str]:
        queue, now = config.name, self.clock()
        directory = self._dir(queue, "processing")
        requeued = []
        for name in processing:
            item_id = name[:-5]
            if not (name.endswith(".json") and ids.is_valid_id(item_id)):
                continue
            try:
                if os.stat(f"{directory}/{name}").st_mtime > now:
                    continue  # the mtime is the lease expiry: no need to read the file
            except FileNotFoundError:
                continue
            with self._item_lock(queue, item_id), self._storage_errors():
                try:
                    state, item = self._find(queue, item_id)  # done first: a stray copy stays put
                except ItemNotFound:
                    continue
                if state != "processing":
                    continue
                if item.lease_expires_at is not None and item.lease_expires_at > now:
                    continue  # extended meanwhile
                if now - item.posted_at > config.queue_seconds:
                    self._fail_timed_out(queue, "processing", item, now)
                    continue
                self._requeue(queue, item)
                requeued.append(item_id)
        return requeued

    def delete_expired(self, *, config: QueueConfig) -> list[str]:
        """Delete done items whose retention has passed (G7). Reads no file: the mtime is when
        the retention clock started, and the group-read bit says whether it was fetched."""
        return self._delete_expired(config, self._names(config.name, "done"))

    def _delete_expired(self, config: QueueConfig, done: list[str]) -> list[str]:
        queue = config.name
        cutoff = self.clock() - config.retain_seconds
        directory = self._dir(queue, "done")
        # retention starts when an item ends, never before it was posted, so an item posted after
        # the cutoff is not due and needs no stat: the names say so at C speed (with a margin for
        # ids made ahead of this clock: a clock stepped back, or another process's clock)
        bound = ids.time_prefix(int((cutoff + ID_CLOCK_MARGIN_SECONDS) * 1000) + 1)
        deleted = []
        for name in filter(bound.__gt__, done):
            item_id = name[:-5]
            if not (name.endswith(".json") and ids.is_valid_id(item_id)):
                continue
            try:
                info = os.stat(f"{directory}/{name}")
            except FileNotFoundError:
                continue
            if config.retain_from == "fetched" and not info.st_mode & stat.S_IRGRP:
                continue
            if info.st_mtime > cutoff:
                continue
            with self._item_lock(queue, item_id):
                # a copy a crash left in another state goes first, so the item never comes back
                _unlink_quietly(self._path(queue, "pending", item_id))
                _unlink_quietly(self._path(queue, "processing", item_id))
                try:
                    os.unlink(f"{directory}/{name}")
                except FileNotFoundError:
                    continue  # another sweeper was first
            self._done_status.get(queue, {}).pop(item_id, None)
            deleted.append(item_id)
        return deleted

    def remove_stale_tmp(self, *, queue: str) -> int:
        """Remove tmp/ files older than an hour (leftovers of writers that died), and tallies
        older than an hour."""
        cutoff = time.time() - STALE_TMP_SECONDS
        removed = 0
        for state in ("tmp", "stats"):
            directory = self._dir(queue, state)
            for name in self._names(queue, state):
                path = f"{directory}/{name}"
                try:
                    if os.stat(path).st_mtime < cutoff:
                        os.unlink(path)
                        removed += state == "tmp"
                except FileNotFoundError:
                    continue
        return removed

    # ---- throughput -----------------------------------------------------------------------

    def _tally(self, queue: str, status: str, at: float) -> None:
        """Count one item ended: one byte appended to the minute's tally. O_APPEND writes are
        atomic, so every process and sweeper can count into the same file. The file of the
        current minute stays open, so a count is one write."""
        minute = int(at // 60)
        with self._tally_lock:
            open_minute, fd = self._tally_files.get((queue, status), (None, -1))
            if open_minute != minute:
                path = f"{self._dir(queue, 'stats')}/{minute}.{status}"
                new_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                if open_minute is not None:
                    os.close(fd)
                self._tally_files[(queue, status)] = minute, new_fd
                fd = new_fd
            os.write(fd, b".")

    def _close_tallies(self, queue: str) -> None:
        with self._tally_lock:
            for status in ("finished", "failed"):
                _, fd = self._tally_files.pop((queue, status), (None, -1))
                if fd >= 0:
                    os.close(fd)

    def throughput(self, *, queue: str, minutes: int = 15) -> list[tuple[float, int, int]]:
        """(minute start, finished, failed) for each of the last `minutes` minutes, oldest first."""
        current = int(self.clock() // 60)
        directory = self._dir(queue, "stats")
        rows = []
        for minute in range(current - minutes + 1, current + 1):
            counts = []
            for status in ("finished", "failed"):
                try:
                    counts.append(os.stat(f"{directory}/{minute}.{status}").st_size)
                except FileNotFoundError:
                    counts.append(0)
            rows.append((minute * 60.0, counts[0], counts[1]))
        return rows

    # ---- counts and listings --------------------------------------------------------------

    def count_items(self, *, queue: str) -> Counts:
        pending = self._ids_in(queue, "pending")
        processing = self._ids_in(queue, "processing")
        done = self._ids_in(queue, "done")
        statuses = self._done_statuses(queue, done)
        failed = sum(1 for item_id in done if statuses.get(item_id) == "failed")
        oldest = min(pending, default=None)
        if oldest is not None and not ids.is_valid_id(oldest):  # a stray name: the sweep moves it
            oldest = min((i for i in pending if ids.is_valid_id(i)), default=None)
        return Counts(
            pending=len(pending),
            processing=len(processing),
            finished=len(done) - failed,
            failed=failed,
            oldest_pending_posted_at=ids.id_millis(oldest) / 1000 if oldest else None,
        )

    def _done_statuses(self, queue: str, done_ids: list[str]) -> dict[str, str]:
        """finished/failed for each done id, read once per process (a done file never changes
        status) and forgotten once the file is gone."""
        with self._setup_lock:
            known = self._done_status.setdefault(queue, {})
        present = set(done_ids)
        for item_id in list(known):
            if item_id not in present:
                known.pop(item_id, None)
        for item_id in done_ids:
            if item_id not in known:
                known[item_id] = self._done_status_of(queue, item_id)
        return known

    def _done_status_of(self, queue: str, item_id: str) -> str:
        try:
            return self._read(queue, "done", item_id).status
        except (FileNotFoundError, UnsafePath):
            return "finished"

    def list_items(self, *, queue: str, state: str, offset: int = 0, limit: int = 50) -> tuple[int, list[Item]]:
        """One page of a state's items, newest first, and the state's total. Lists names only
        and reads just the page's files."""
        if state not in ("pending", "processing", "done"):
            raise InvalidRequest(f"no state {state!r}")
        item_ids = self._ids_in(queue, state)
        # the newest offset+limit names only: a full sort of a million names costs ~0.5 s
        newest = heapq.nlargest(offset + limit, item_ids)[offset:]
        page = []
        for item_id in newest:
            if not ids.is_valid_id(item_id):
                continue
            try:
                page.append(self._read(queue, state, item_id))
            except FileNotFoundError:
                continue  # moved on while we looked
        return len(item_ids), page


@dataclass(frozen=True)
class _Prepared:
    """A done file written to tmp/ for a batch of results, not yet linked into done/."""

    item: Item  # the done content
    tmp: str
    source: str  # the item's file when it was read
    identity: tuple[int, int, int]  # of `source` then: any transition since replaced the file
    outcome: FinishOutcome  # once linked


def _read_all(fd: int) -> bytes:
    chunk = os.read(fd, _READ_SIZE)
    if len(chunk) < _READ_SIZE:  # the usual small file: one read
        return chunk
    chunks = [chunk]
    while chunk := os.read(fd, _READ_SIZE):
        chunks.append(chunk)
    return b"".join(chunks)


def _start_writeback(path: str) -> None:
    """Start writing the file out, without waiting (its pages stay cached)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _identity(path: str) -> tuple[int, int, int]:
    """What changes whenever a transition replaces the file at `path`: a rewrite is a new file,
    and a claim or an extension also moves the mtime (the lease expiry)."""
    info = os.stat(path)
    return info.st_ino, info.st_ctime_ns, info.st_mtime_ns


def _timed_out(item: Item, now: float) -> Item:
    return replace(item, status="failed", error="timeout", lease_expires_at=None, finished_at=now, claim_token=None)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _quarantine_path(directory: str, name: str, quarantine: str, state: str) -> None:
    try:
        os.rename(f"{directory}/{name}", f"{quarantine}/{state}-{name}")
    except (FileNotFoundError, IsADirectoryError, OSError):
        pass


_ID_FILE_SHAPE = "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.json"
_HEX_AS_X = str.maketrans("0123456789abcdef", "x" * 16)


def _not_item_files(names: list[str]) -> list[str]:
    """The names that are not `<id>.json`. Such junk is rare and a directory may hold a million
    names, so each chunk of names is first checked as one string, at C speed."""
    width = len(_ID_FILE_SHAPE)
    shape, versions = _ID_FILE_SHAPE * _CHUNK, "7" * _CHUNK
    junk = []
    for start in range(0, len(names), _CHUNK):
        chunk = names[start : start + _CHUNK]
        if len(chunk) < _CHUNK:
            shape, versions = _ID_FILE_SHAPE * len(chunk), "7" * len(chunk)
        joined = "".join(chunk)
        if (
            set(map(len, chunk)) == {width}
            and joined.translate(_HEX_AS_X) == shape
            and joined[14::width] == versions
            and not joined[19::width].strip("89ab")  # the variant
        ):
            continue
        junk += [name for name in chunk if not (name.endswith(".json") and ids.is_valid_id(name[:-5]))]
    return junk


def _doubled(*listings: list[str]) -> set[str]:
    """The names found in more than one listing; one pass over the longest, no set of it."""
    first, second, longest = sorted(listings, key=len)
    smaller = set(first)
    return smaller.intersection(second) | smaller.union(second).intersection(longest)
