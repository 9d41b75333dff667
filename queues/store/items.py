"""One item on disk: its lock, finding and reading it, writing its next file aside, moving it in,
ending it in done/ and recording a claim. The transitions and the sweep are made of these.

An item ends by a done file written to tmp/ and flushed, linked into done/ (only if done/ has no
file of it yet: the first to link wins), done/ flushed, and only then its old file retired. A
crash in between leaves two copies: done wins everywhere, and the sweep removes the other. A
failed item is also marked in failed/ (before its link), one finished with an error result in
errors/, so counts never read a done file.
"""

import logging
import os
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Protocol

from . import files, turn
from .layout import DIRECTORIES, Layout
from .keys import Keys
from .locks import QueueLocks
from .pending import PendingIndex
from .records import Item, Unreadable, decode, encode, encode_claim, is_error_result
from .schedule import DueMark, Schedule
from .tallies import Tallies

# A claim (and an extension) records attempts, claim time, lease and claim token in this extended
# attribute of the processing file instead of rewriting the file. Where the file system has no
# xattrs, a claim rewrites the file.
CLAIM_XATTR = "user.taskhoster"
# of two copies a crash (or a failed unlink) left, the one that wins: the sweep keeps the same
SEARCH_ORDER = ("done", "pending", "scheduled", "processing")
MOVES_FOLLOWED = 8  # moves of a post's new item followed while it is flushed, before flushing all

log = logging.getLogger(__name__)


class Events(Protocol):
    """Told of items that may be claimed now, of items that just ended, and of a processing item
    canceled (so the socket holding it can tell its worker)."""

    def items_available(self, queue: str, count: int) -> int | None:
        """How many waiting claims of this process it woke (None: not known)."""

    def items_terminal(self, queue: str, item_ids: list[str]) -> None: ...

    def item_canceled(self, queue: str, item_id: str, claim_token: str | None) -> None: ...


class NoEvents:
    def items_available(self, queue: str, count: int) -> None:
        pass

    def items_terminal(self, queue: str, item_ids: list[str]) -> None:
        pass

    def item_canceled(self, queue: str, item_id: str, claim_token: str | None) -> None:
        pass


class Observer(Protocol):
    """Told of every transition made in this process, once it is on disk (for metrics): items
    posted (retries included), claimed, given back (`reason` as in `Release`) and ended."""

    def items_posted(self, queue: str, items: Sequence[Item]) -> None: ...

    def items_claimed(self, queue: str, items: Sequence[Item]) -> None: ...

    def item_requeued(self, queue: str, item: Item, reason: str) -> None: ...

    def items_ended(self, queue: str, items: Sequence[Item]) -> None: ...


class NoObserver:
    def items_posted(self, queue: str, items: Sequence[Item]) -> None:
        pass

    def items_claimed(self, queue: str, items: Sequence[Item]) -> None:
        pass

    def item_requeued(self, queue: str, item: Item, reason: str) -> None:
        pass

    def items_ended(self, queue: str, items: Sequence[Item]) -> None:
        pass


class ItemFiles:
    def __init__(
        self,
        layout: Layout,
        *,
        fsync: bool,
        clock: Callable[[], float],
        events: Events,
        index_capacity: int,
        observer: Observer | None = None,
    ):
        self.layout = layout
        self.fsync = fsync
        self.clock = clock
        self.events = events
        self.observer = observer or NoObserver()
        self.index_capacity = index_capacity
        self.claim_xattrs = hasattr(os, "setxattr")  # False once the file system refuses them
        self.tallies = Tallies(layout)
        self.schedule = Schedule(layout)
        self.keys = Keys(layout)
        self._ready: set[str] = set()  # queues whose directories were made by this process
        self._locks: dict[str, QueueLocks] = {}
        self._indexes: dict[str, PendingIndex] = {}
        self._setup_lock = threading.Lock()

    # ---- queues -----------------------------------------------------------------------------

    def ensure_queue(self, queue: str) -> None:
        """Make the queue's directories; a no-op once made. A state directory removed later is
        made again when a file is written, moved or linked into it."""
        if queue in self._ready:
            return
        files.make_directory(self.layout.root)
        for name in DIRECTORIES:
            files.make_directory(self.layout.directory(queue, name))
        # the new directories' own entries must survive a power cut too, or the items in them
        # would not, flushed as they are
        self.flush(self.layout.queue_dir(queue))
        self.flush(self.layout.root)
        # made now, so undoing a transition never needs a new file (the disk may be full then)
        with self._setup_lock:
            if queue not in self._locks:
                self._locks[queue] = QueueLocks.for_file(self.layout.lock_file(queue))
        self._ready.add(queue)
        self.index(queue).warm()  # so a first claim finds what is pending

    def forget_queue(self, queue: str) -> None:
        """Drop what this process keeps about a queue (it is being deleted)."""
        with self._setup_lock:
            locks = self._locks.pop(queue, None)
            self._indexes.pop(queue, None)
            self._ready.discard(queue)
        if locks is not None:
            locks.close()
        self.tallies.close(queue)
        self.keys.close(queue)
        files.forget_directories(self.layout.queue_dir(queue) + "/")

    def lock(self, queue: str, item_id: str) -> AbstractContextManager[None]:
        locks = self._locks.get(queue)
        if locks is None:
            self.ensure_queue(queue)
            locks = self._locks[queue]
        return locks.hold(item_id)

    def index(self, queue: str) -> PendingIndex:
        index = self._indexes.get(queue)
        if index is None:
            with self._setup_lock:
                index = self._indexes.get(queue)
                if index is None:
                    index = self._indexes[queue] = PendingIndex(
                        self.layout.directory(queue, "pending"),
                        capacity=self.index_capacity,
                        on_found=lambda count: self.events.items_available(queue, count),
                    )
        return index

    # ---- reading ----------------------------------------------------------------------------

    def read(self, queue: str, state: str, item_id: str) -> Item | None:
        """The item in `state`/; None if it is not there, or unreadable (then quarantined)."""
        path = self.layout.item(queue, state, item_id)
        # read twice before quarantining: a reader without the item's lock may have opened a file
        # that was then set aside and taken over for another (see files.retire)
        for _ in range(2):
            try:
                raw, claim = files.read(path, xattr=CLAIM_XATTR if state != "done" and self.claim_xattrs else None)
            except FileNotFoundError:
                return None
            try:
                return decode(raw, state=state, queue=queue, item_id=item_id, claim=claim)
            except Unreadable as exc:
                error = exc
        log.warning("quarantining %s: %s", path, error)
        self.quarantine(queue, state, os.path.basename(path))
        return None

    def find(self, queue: str, item_id: str) -> tuple[str, Item] | None:
        """The item's state and content, in SEARCH_ORDER. Under the item's lock this is exact; without
        it, a move under way may hide the item for an instant (None)."""
        for state in SEARCH_ORDER:
            item = self.read(queue, state, item_id)
            if item is not None:
                return state, item
        return None

    def quarantine(self, queue: str, state: str, name: str) -> None:
        """Move a file that is not an item of ours out of the way, so it never stops a read, a
        claim or a sweep. One that cannot be moved is logged and left for the next sweep."""
        try:
            files.move(self.layout.in_directory(queue, state, name), self.layout.quarantined(queue, state, name))
        except FileNotFoundError:
            pass  # moved already
        except OSError:
            log.warning("could not quarantine %s/%s of queue %s", state, name, queue, exc_info=True)

    # ---- writing and moving -----------------------------------------------------------------

    def write_aside(self, queue: str, item: Item, *, mtime: float | None = None) -> str:
        """Write the item's file to tmp/, not yet flushed; its path."""
        path = self.layout.tmp(queue, item.id)
        files.write_new(path, encode(item), mtime=mtime)
        return path

    def flush_files(self, paths: list[str]) -> None:
        if self.fsync:
            files.flush_files(paths)

    def flush(self, *directories: str) -> None:
        if self.fsync:
            for directory in directories:
                files.flush_directory(directory)

    def flush_states(self, queue: str, *names: str) -> None:
        self.flush(*(self.layout.directory(queue, name) for name in names))

    def publish(self, queue: str, items: Sequence[Item]) -> list[DueMark]:
        """Write new items and move them in, scheduled ones (with a `run_at`) into scheduled/ and
        the others into pending/: all of them on disk when it returns, or none of them left
        behind when it raises (a process killed while it moves them in leaves those moved). A
        batch's files are flushed before any is moved in, and a scheduled item's mark is on disk
        before the item shows;
        a single pending item is moved in first and flushed there, which on some file systems
        (ext4 without a journal) also flushes the directory that names it, one flush fewer.
        An item's idempotency key is linked to its file before the item shows (call under the
        keys' locks), so no item is ever without its key.

        Pending items are in view for this process's claims, and waiting claims told, as soon as
        they may be claimed: a single one while it is flushed, so a worker's part overlaps the
        disk's (were the flush to fail, the item is taken back out, from a claim too).

        Returns the marks of the scheduled items (see promote.promote_if_due)."""
        if len(items) == 1 and items[0].status == "pending" and items[0].key is None:
            self._publish_one(queue, items[0])
            self.observer.items_posted(queue, items)
            return []
        written: list[str] = []
        marks: list[DueMark] = []
        keys: dict[str, str] = {}  # item id -> its key's link
        try:
            for item in items:
                # a scheduled item's file is timed when it was posted: what tells its promotion
                # the post's own file (promote.py)
                mtime = item.posted_at if item.status == "scheduled" else None
                written.append(self.write_aside(queue, item, mtime=mtime))
                if item.key is not None:
                    keys[item.id] = self.keys.link(queue, item.key, written[-1])
            self.flush_files(written)
            marks = [self.schedule.mark(queue, item.id, item.run_at, at_run_at=True) for item in items if item.status == "scheduled"]
            ahead = self.schedule.directories(queue, marks) if marks else []
            self.flush(*ahead, *([self.layout.directory(queue, "keys")] if keys else []))
        except BaseException:
            for path in written + [mark.path for mark in marks] + list(keys.values()):
                files.remove_quietly(path)
            raise
        moved: list[Item] = []
        try:
            for item, path in zip(items, written):
                files.move(path, self.layout.item(queue, item.status, item.id))
                moved.append(item)
            self.flush_states(queue, *sorted({item.status for item in items}))
        except BaseException:
            for path in written[len(moved) :] + [mark.path for mark in marks]:
                files.remove_quietly(path)
            for item in moved:
                self._take_back(queue, item.status, item.id)
            for item_id, link in keys.items():  # unless its item lives on: done by another process
                if not files.exists(self.layout.item(queue, "done", item_id)):
                    files.remove_quietly(link)
            raise
        self._claimable(queue, [item.id for item in items if item.status == "pending"])
        self.observer.items_posted(queue, items)
        return marks

    def _claimable(self, queue: str, item_ids: list[str]) -> None:
        if item_ids:
            self.index(queue).push(item_ids)
            if self.events.items_available(queue, len(item_ids)):
                turn.let_woken_go_first()

    def _publish_one(self, queue: str, item: Item) -> None:
        """A single pending item: written to tmp/, moved in, then flushed through the descriptor
        it was written with (no second open), and where it is now (`_flush_where_it_is`)."""
        written = self.layout.tmp(queue, item.id)
        pending = self.layout.item(queue, "pending", item.id)
        made = moved = False
        try:
            with files.new_file(written, encode(item)) as fd:  # a failed write leaves no file
                made = True
                files.move(written, pending)
                moved = True
                self._claimable(queue, [item.id])
                if self.fsync:
                    files.flush_open(fd, pending)
                    self._flush_where_it_is(queue, item.id, fd)
        except BaseException:  # its close too
            if moved:
                self._take_back(queue, "pending", item.id)
            elif made:
                files.remove_quietly(written)
            raise

    def _flush_where_it_is(self, queue: str, item_id: str, flushed_fd: int) -> None:
        """Flush the directory that names a post's new item now: pending/, or processing/ if a
        claim took it meanwhile (pending/ flushed after that would record it gone), or wherever
        else a result, a cancel or a release put it; and again if it moved while that flush ran
        (threads and other processes go on meanwhile). `flushed_fd`: the post's file, flushed
        already. After MOVES_FOLLOWED moves, every state's directory is flushed."""
        for _ in range(MOVES_FOLLOWED):
            state = next((s for s in SEARCH_ORDER if files.exists(self.layout.item(queue, s, item_id))), None)
            if state is None:
                continue  # a move under way hid it: look again
            try:
                if self._flushed_there(queue, state, item_id, flushed_fd):
                    return
            except FileNotFoundError:  # moved on meanwhile: look again
                continue
        self.flush_states(queue, *SEARCH_ORDER)

    def _flushed_there(self, queue: str, state: str, item_id: str, flushed_fd: int) -> bool:
        """Flush `state`/, and where claims replace files whole (no xattrs) the item's file there
        now unless it is the one `flushed_fd` flushed; whether that same file is still there after."""
        path = self.layout.item(queue, state, item_id)
        seen = files.identity(path)
        if not self.claim_xattrs and seen[0] != os.fstat(flushed_fd).st_ino:
            self.flush_files([path])
        self.flush_states(queue, state)
        # with xattrs a claim records itself on the same file, which was flushed already
        return files.identity(path) == seen or self.claim_xattrs

    def _take_back(self, queue: str, state: str, item_id: str) -> None:
        """Undo a move into `state`/ that cannot be made durable; from processing/ too, if another
        process claimed it meanwhile (a done copy stays: a result for it was accepted)."""
        with self.lock(queue, item_id):
            for where in {state, "processing"}:
                files.remove_quietly(self.layout.item(queue, where, item_id))

    def move(self, queue: str, item: Item, source: str, target: str) -> Item:
        """Move an item from `source`/ to `target`/ as it is (under its lock): a rename alone. A
        pending file's lease and claim token mean nothing, and its attempts stay for the next
        claim; one moved into pending/ is in view for this process's claims."""
        files.move(self.layout.item(queue, source, item.id), self.layout.item(queue, target, item.id))
        if target == "pending":
            self.index(queue).push([item.id])
        return replace(item, status=target, lease_expires_at=None, claim_token=None)

    def move_rewritten(self, queue: str, item: Item, source: str, target: str, *, mtime: float | None = None) -> Item:
        """Move an item from `source`/ to `target`/ with new content (under its lock): written in
        `target`/ and flushed there, then its old file retired (so a power cut never leaves
        neither). Until the move it is as it was; a crash after it leaves two copies, and the
        sweep keeps the one in `target`/. `mtime` as for `rewrite`."""
        try:
            self.rewrite(queue, target, item, mtime=mtime)
        except BaseException:  # not flushed there: the old copy, still in place, stays the item
            files.remove_quietly(self.layout.item(queue, target, item.id))
            raise
        self._retire(queue, source, item.id)
        if target == "pending":
            self.index(queue).push([item.id])
        return item

    def rewrite(self, queue: str, state: str, item: Item, *, mtime: float | None = None) -> None:
        """Replace the item's file in `state`/ with this content (under its lock), whole: the old
        or the new one is there at every instant; flushed before it returns. `mtime` is set once
        the file is in place: in tmp/, an old one would make it a leftover to every sweep."""
        tmp = self.write_aside(queue, item)
        path = self.layout.item(queue, state, item.id)
        try:
            self.flush_files([tmp])
            files.move(tmp, path)
        except BaseException:
            files.remove_quietly(tmp)
            raise
        if mtime is not None:
            try:
                files.set_mtime(path, mtime)
            except OSError:  # it only times the item's retention, from now instead
                log.warning("could not set the time of %s", path, exc_info=True)
        self.flush_states(queue, state)

    def record_claim(self, queue: str, item: Item) -> None:
        """Record a processing item's claim (under its lock): the claim record, which commits it,
        then the lease as the file's mtime, which only spares the sweep a read: it passes over a
        file whose mtime is to come, and reads the record of any other before it re-queues it.
        So a record that cannot be written leaves the mtime as it was (set first, a failed
        extension would hide a lapsed lease from the sweep for as long as it asked), and an
        mtime that cannot be set leaves the sweep reading the record, or waiting at most for the
        lease the item had before. Not flushed: only posts and results must be on disk before
        they are answered (after a power cut the item is pending again, or its lease lapses).
        Without xattrs the file is replaced whole."""
        path = self.layout.item(queue, "processing", item.id)
        if self.claim_xattrs:
            if files.set_xattr(path, CLAIM_XATTR, encode_claim(item)):
                try:
                    files.set_mtime(path, item.lease_expires_at)
                except OSError:
                    log.warning("could not set the lease of %s as its time; the sweep reads its record", path,
                                exc_info=True)
                return
            self.claim_xattrs = False
        tmp = self.write_aside(queue, item, mtime=item.lease_expires_at)
        try:
            files.move(tmp, path)
        except BaseException:
            files.remove_quietly(tmp)
            raise

    # ---- ending -----------------------------------------------------------------------------

    def link_done(self, queue: str, state: str, done: Item, tmp: str) -> bool:
        """Link a done file written to tmp/ into done/ (not yet flushed); False if done/ already
        has the item. Call under its lock, and flush done/ (and failed/) before answering. An
        item that ends from scheduled/ is marked due now, so a crash before its old file is
        removed is settled by the next look for due items (the sweep lists no scheduled/)."""
        if state == "scheduled":
            self.schedule.mark(queue, done.id, self.clock(), at_run_at=False)
        kind = _mark_of(done)
        for other in ("failed", "errors", "fetched"):
            # left by an earlier end that a crash cut short before its link, or a fetch of an end
            # whose flush failed: the item is not done, so no mark it has is its own
            if other != kind:
                files.remove(self.layout.mark(queue, other, done.id))
        mark = self.layout.mark(queue, kind, done.id) if kind else None
        marked = False
        if mark is not None:
            try:
                files.write_new(mark, b"")
                marked = True
            except FileExistsError:
                pass
        try:
            files.link(tmp, self.layout.item(queue, "done", done.id))
            return True
        except FileExistsError:
            return False
        except BaseException:
            if marked:  # the item did not end: its mark would count it all the same
                files.remove_quietly(mark)
            raise

    def unlink_done(self, queue: str, state: str, done: Item) -> None:
        """Undo `link_done` whose flush failed, so the item is as it was in `state`/. Only while
        that old file is there: once a sweep settled the two copies (done wins), done stays."""
        with self.lock(queue, done.id):
            if files.exists(self.layout.item(queue, state, done.id)):
                self._remove_done(queue, done)

    def _remove_done(self, queue: str, done: Item) -> None:
        """Take a done file whose flush failed back out, with its marks (call under its lock): a
        reader may have fetched it meanwhile, and a fetched mark would start its retention."""
        files.remove_quietly(self.layout.item(queue, "done", done.id))
        for mark in filter(None, (_mark_of(done), "fetched")):
            files.remove_quietly(self.layout.mark(queue, mark, done.id))

    def ended(self, queue: str, moved: list[tuple[str, Item]]) -> None:
        """After done/ was flushed: retire the items' old files, count them, and say they ended
        (so whoever is told finds each in one state). A file retired but not kept is removed,
        which may wait for the disk to discard its block: the retirements are one wait, out of
        the store's turn."""
        turn.outside(self._retire_all, queue, moved)
        for _, done in moved:
            self.tallies.count(queue, done.status, done.finished_at)
        self.events.items_terminal(queue, [done.id for _, done in moved])
        self.observer.items_ended(queue, [done for _, done in moved])

    def _retire_all(self, queue: str, moved: list[tuple[str, Item]]) -> None:
        for state, done in moved:
            self._retire(queue, state, done.id)

    def _retire(self, queue: str, state: str, item_id: str) -> None:
        """Be done with the item's old file in `state`/ (its new one is in place, flushed)."""
        try:
            files.retire(self.layout.item(queue, state, item_id), self.layout.spare(queue, item_id))
        except FileNotFoundError:
            pass  # the sweep settled the two copies first
        except OSError:  # the newer copy wins over the one left, and the sweep removes it
            log.warning("could not set aside the old file of %s in %s", item_id, queue, exc_info=True)

    def end(self, queue: str, state: str, done: Item) -> bool:
        """Move an item from `state`/ to done/ with this content, durably; False if done/ had it
        already. Call under its lock."""
        tmp = self.write_aside(queue, done, mtime=done.finished_at)
        try:
            self.flush_files([tmp])
            linked = self.link_done(queue, state, done, tmp)
        finally:
            files.remove_quietly(tmp)
        if not linked:
            return False
        try:
            self.flush_states(queue, *done_directories([done]))
        except BaseException:
            self._remove_done(queue, done)
            raise
        self.ended(queue, [(state, done)])
        return True

    def done_status(self, queue: str, item_id: str) -> str:
        """finished or failed, for an item done/ has."""
        return "failed" if files.exists(self.layout.mark(queue, "failed", item_id)) else "finished"


def _mark_of(done: Item) -> str | None:
    """The mark a done item gets, so counts tell it apart without reading it: failed/ for one the
    server failed, errors/ for one finished with an error result."""
    if done.status == "failed":
        return "failed"
    return "errors" if is_error_result(done.result) else None


def done_directories(done: Sequence[Item]) -> tuple[str, ...]:
    """The directories that ending these items changes: done/, and the marks' they got."""
    return ("done", *sorted({mark for item in done if (mark := _mark_of(item))}))
