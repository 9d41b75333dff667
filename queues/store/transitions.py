"""The store: each transition of an item one public method, typed, with keyword arguments only,
safe to call from any thread of any process sharing the data directory. The lifecycle's rules
live here; `items` does the work on disk, each transition under the item's lock, so a lost race
shows up as a missing file and is a normal outcome.

Durable before answered (with fsync on): a post's files and a result's done file, and the
directory entries that name them. A claim is not flushed; a power cut may undo it, which leaves
the item pending or its lease lapsing.

Any failure of the disk at any step leaves the item as it was before the transition and raises
StorageUnavailable (or gives it as that item's outcome in a batch).
"""

import logging
import secrets
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import ids
from ..exceptions import (
    InvalidRequest,
    ItemNotFound,
    KeyConflict,
    NotEnded,
    NotHeld,
    PayloadTooLarge,
    StorageUnavailable,
    TaskhosterError,
    UnknownQueue,
)
from . import files, stats, sweep
from .items import Events, ItemFiles, NoEvents, Observer, done_directories
from .keys import check_key, same_payload
from .layout import DELETED_MARK, LOCKS_DIRECTORY, Layout, is_valid_queue_name, item_id_of
from .pending import CAPACITY
from .records import (
    ABSENT,
    Counts,
    FinishOutcome,
    Health,
    Item,
    NewItem,
    Posted,
    QueueConfig,
    Release,
    SweepChanges,
    ended,
    failed,
    json_size,
    timed_out,
)
from .promote import promote, promote_if_due
from .requeue import give_back
from .schedule import DueMark

MAX_BATCH = 1000
DEFAULT_MIN_FREE_BYTES = 64 << 20
MIN_FREE_SHARE = 0.05  # the default reserve is at most this share of the file system
_PROBE_BYTES = 4096  # /healthz writes a real block: an empty file needs no room at all
PROMOTE_CHUNK = 1000  # due items made claimable together: the first are handed out while the rest move

log = logging.getLogger(__name__)

Result = tuple[QueueConfig, str, Any]  # a result handed in: its queue, the item's id, the value


@dataclass(frozen=True)
class _Settling:
    """A result about to end an item: the state it was read in and the done content."""

    state: str
    identity: tuple[int, int, int]  # of its file when read: if it changed before the link, settle afresh
    done: Item
    outcome: FinishOutcome


def _check_queue_name(queue: str) -> None:
    if not is_valid_queue_name(queue):
        raise InvalidRequest(
            "a queue name is 1 to 64 characters of a-z, 0-9, '_' and '-', starting with a letter or digit"
        )


class Store:
    """Owns `data_dir`."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        fsync: bool = True,
        max_payload_bytes: int = 1 << 20,
        min_free_bytes: int | None = None,
        clock: Callable[[], float] = time.time,
        index_capacity: int = CAPACITY,
        events: Events | None = None,
        observer: Observer | None = None,
    ):
        self.data_dir = Path(data_dir)
        self.max_payload_bytes = max_payload_bytes
        self.min_free_bytes = min_free_bytes  # None: the default reserve
        self.clock = clock
        self._items = ItemFiles(
            Layout(data_dir), fsync=fsync, clock=clock, events=events or NoEvents(), index_capacity=index_capacity,
            observer=observer,
        )
        self._ids = ids.IdMaker()
        self._read_names = stats.ReadNames()

    # ---- queues and health ------------------------------------------------------------------

    def make_data_directory(self) -> None:
        """Make the data directory, and its parents, if missing (a queue's are made as needed)."""
        with _storage_errors:
            files.make_directory(self._items.layout.root)

    def ensure_queue(self, queue: str) -> None:
        """Make the queue's directories; a no-op when they exist."""
        _check_queue_name(queue)
        with _storage_errors:
            self._items.ensure_queue(queue)

    def create_queue(self, queue: str) -> None:
        """Make a new queue's directories. What a deleted queue of the name left behind (posts
        that raced its deletion in processes not told yet) goes first; a directory no deletion
        marked (its database lost and made again, say) keeps its items."""
        _check_queue_name(queue)
        with _storage_errors:
            mark = self._items.layout.deleted_mark(queue)
            if files.exists(mark):
                self._empty_queue(queue)
                files.remove(mark)
            self._items.ensure_queue(queue)

    def delete_queue(self, queue: str) -> None:
        """Delete every item of the queue and its directories, but its lock files: other server
        processes keep theirs open, and a queue made again under the name must lock the same
        files, or those processes would no longer exclude this one. Marked deleted first (see
        `create_queue`)."""
        with _storage_errors:
            try:
                files.write_new(self._items.layout.deleted_mark(queue), b"")
            except FileExistsError:
                pass
            self._items.flush(self._items.layout.queue_dir(queue))
            self._empty_queue(queue)

    def _empty_queue(self, queue: str) -> None:
        """Remove all of the queue's directory but its lock files and its deletion mark."""
        self._items.forget_queue(queue)
        self._read_names.forget_queue(queue)
        queue_dir = self._items.layout.queue_dir(queue)
        for name in files.names(queue_dir):
            if name not in (LOCKS_DIRECTORY, DELETED_MARK):
                files.remove_tree(f"{queue_dir}/{name}")

    def check_health(self) -> Health:
        """Whether the data directory takes a real write, flushed, and how much room is left."""
        layout = self._items.layout
        probe = layout.health_probe()
        try:
            files.make_directory(layout.root)
            files.write_new(probe, b"\0" * _PROBE_BYTES)
            try:
                self._items.flush_files([probe])
            finally:
                files.remove(probe)
            writable = True
        except OSError:
            log.warning("the data directory failed a write", exc_info=True)
            writable = False
        try:
            free, total = files.free_and_total_bytes(layout.root)
        except OSError:
            return Health(False, 0, 0)
        return Health(writable, free, self._reserve(total))

    def _reserve(self, total_bytes: int) -> int:
        if self.min_free_bytes is not None:
            return self.min_free_bytes
        return min(DEFAULT_MIN_FREE_BYTES, int(total_bytes * MIN_FREE_SHARE))

    # ---- transitions ------------------------------------------------------------------------

    def post_items(self, *, config: QueueConfig, items: list[NewItem]) -> list[Posted]:
        """Post a batch, all or nothing; returns once it would survive a power cut. An item with
        a `run_at` still to come is scheduled; it must come due before its queue timeout. An
        item whose idempotency key an existing item holds is that item, as it is now, unless
        its payload differs (KeyConflict: nothing is posted)."""
        queue = config.name
        if not isinstance(items, list) or not 1 <= len(items) <= MAX_BATCH:
            raise InvalidRequest(f"a batch holds 1 to {MAX_BATCH} items")
        for new in items:
            self._check_size(new.payload, "payload")
        keys = [new.key for new in items if new.key is not None]
        for key in keys:
            check_key(key)
        if len(set(keys)) < len(keys):
            raise InvalidRequest("two items of the batch have the same key")
        now = self.clock()
        self._check_schedule(config, [new.run_at for new in items if new.run_at is not None], now)
        self.ensure_queue(queue)
        with _storage_errors, self._items.keys.hold(queue, keys):
            held = {new.key: item for new in items if new.key is not None and (item := self._posted_with_key(queue, new))}
            fresh = [new for new in items if new.key is None or new.key not in held]
            made: list[Item] = []
            marks: list[DueMark] = []
            if fresh:
                self._check_room()
                made = [_made(item_id, queue, new, now) for item_id, new in zip(self._ids.new_ids(len(fresh), now), fresh)]
                marks = self._items.publish(queue, made)
        promoted = promote_if_due(self._items, config, marks)
        made_in_order = (replace(item, status="pending") if item.id in promoted else item for item in made)
        return [Posted(held[new.key], True) if new.key in held else Posted(next(made_in_order)) for new in items]

    def _posted_with_key(self, queue: str, new: NewItem) -> Item | None:
        """The item an earlier post with this item's key made, as it is now; None if there is
        none (a key whose item is gone is freed). Call under the key's lock."""
        item_id = self._items.keys.holder(queue, new.key)
        if item_id is None:
            return None
        with self._items.lock(queue, item_id):
            found = self._items.find(queue, item_id)
        if found is None:
            self._items.keys.remove(queue, new.key)
            return None
        item = found[1]
        if not same_payload(item.payload, new.payload):
            raise KeyConflict(f"the key {new.key!r} was posted with another payload: item {item.id}")
        return item

    @staticmethod
    def _check_schedule(config: QueueConfig, run_ats: list[float], now: float) -> None:
        # an item's postedAt is its id's time: `now` to the millisecond below, or later
        posted_at = int(now * 1000) / 1000
        if any(run_at >= posted_at + config.queue_seconds for run_at in run_ats):
            raise InvalidRequest(
                f"runAt must come before the item ages out: within queueSeconds ({config.queue_seconds} s) of the post"
            )

    def _check_room(self) -> None:
        root = self._items.layout.root
        try:
            free, total = files.free_and_total_bytes(root)
        except FileNotFoundError:  # the data directory was removed: made again, like a state directory
            files.make_directory(root)
            free, total = files.free_and_total_bytes(root)
        reserve = self._reserve(total)
        if free < reserve:
            raise StorageUnavailable(
                f"the disk is nearly full ({free} bytes free, {reserve} kept in reserve: "
                "TASKHOSTER_MIN_FREE_BYTES); new posts wait while workers drain the queues"
            )

    def claim_items(self, *, config: QueueConfig, max_items: int = 1) -> list[Item]:
        """Claim up to `max_items` pending items, oldest first, each under a lease and a claim
        token of its own. A paused queue hands out nothing. A disk failure after some items were
        claimed ends the claim early with those. Items past their queue timeout are left for the
        sweep to fail. A claim never waits for a flush or for a large directory to be listed (it
        finds nothing until the listing, in the background, is done), so it may run on the event
        loop."""
        if config.paused:
            return []
        queue = config.name
        self.ensure_queue(queue)
        index = self._items.index(queue)
        claimed: list[Item] = []
        listed_in_vain = False
        try:
            with _storage_errors:
                while len(claimed) < max_items:
                    item_id = index.pop()
                    if item_id is None:
                        if listed_in_vain:
                            break  # files that cannot be claimed must not make a claim spin
                        index.refill()
                        listed_in_vain = True
                        continue
                    if not ids.is_valid_id(item_id):
                        continue  # a stray name: the sweep quarantines it
                    with self._items.lock(queue, item_id):
                        item = self._claim_one(config, item_id)
                    if item is not None:
                        claimed.append(item)
                        listed_in_vain = False
        except StorageUnavailable:
            if not claimed:
                raise
            log.warning("a claim on %s stopped early", queue, exc_info=True)
        if claimed:
            self._items.observer.items_claimed(queue, claimed)
        return claimed

    def _claim_one(self, config: QueueConfig, item_id: str) -> Item | None:
        """Claim one item; None if it cannot be (another claimant was first, it is done or past
        its queue timeout, or it is unreadable). Call under the item's lock."""
        queue, layout = config.name, self._items.layout
        pending, processing = layout.item(queue, "pending", item_id), layout.item(queue, "processing", item_id)
        now = self.clock()
        if now - ids.id_millis(item_id) / 1000 > config.queue_seconds:
            return None  # aged: the sweep fails it
        if files.exists(layout.item(queue, "done", item_id)):
            return None  # a copy a crash left behind: done wins, and the sweep removes it
        try:
            files.move(pending, processing)
        except FileNotFoundError:
            return None  # another claimant was first
        try:
            item = self._items.read(queue, "processing", item_id)
            if item is None:
                return None
            claimed = replace(
                item,
                status="processing",
                attempts=item.attempts + 1,
                claimed_at=now,
                lease_expires_at=now + config.lease_seconds,
                claim_token=secrets.token_hex(8),  # tells this claim of the item from others
            )
            self._items.record_claim(queue, claimed)
            return claimed
        except BaseException:
            _move_back(processing, pending)
            raise

    def finish_items(self, *, results: list[Result]) -> list[FinishOutcome | TaskhosterError]:
        """Hand in results, of any queues. The first result for an item that is not terminal
        wins (G3, G4); an item past its queue timeout is failed instead (G6). Each result's own
        trouble (an unknown id, a result too large, the disk) is its outcome, in order.

        Each done file is written aside under its item's lock alone; then all are flushed
        together, linked into done/ one lock at a time, and done/ flushed once per queue."""
        outcomes: list[FinishOutcome | TaskhosterError | None] = [None] * len(results)
        prepared: list[tuple[int, _Settling, str]] = []  # position, what ends, its file in tmp/
        try:
            for position, (config, item_id, result) in enumerate(results):
                try:
                    self._check_item_id(config.name, item_id)
                    self._check_size(result, "result")
                    with _storage_errors, self._items.lock(config.name, item_id):
                        settling = self._settling(config, item_id, result)
                        if isinstance(settling, FinishOutcome):
                            outcomes[position] = settling
                            continue
                        tmp = self._items.write_aside(config.name, settling.done, mtime=settling.done.finished_at)
                except TaskhosterError as error:
                    outcomes[position] = error
                    continue
                prepared.append((position, settling, tmp))
            if prepared:
                self._link_all(results, prepared, outcomes)
        finally:
            for _, _, tmp in prepared:
                files.remove_quietly(tmp)
        return outcomes

    def _settling(self, config: QueueConfig, item_id: str, result: Any) -> "_Settling | FinishOutcome":
        """What this result does to the item: nothing if it ended already (the outcome), else
        ends it, finished with the result or failed if past its queue timeout. Call under the
        item's lock."""
        state, item = self._found(config.name, item_id)
        if state == "done":
            return FinishOutcome(item_id, False, item.status)
        now = self.clock()
        identity = files.identity(self._items.layout.item(config.name, state, item_id))
        if now - item.posted_at > config.queue_seconds:
            return _Settling(state, identity, timed_out(item, now), FinishOutcome(item_id, False, "failed"))
        done = ended(item, status="finished", at=now, result=result)
        return _Settling(state, identity, done, FinishOutcome(item_id, True, "finished"))

    def _link_all(self, results: list[Result], prepared: list[tuple[int, _Settling, str]], outcomes: list) -> None:
        try:
            with _storage_errors:
                self._items.flush_files([tmp for _, _, tmp in prepared])
        except StorageUnavailable as error:
            for position, _, _ in prepared:
                outcomes[position] = error
            return
        linked: dict[str, list[tuple[int, _Settling]]] = defaultdict(list)
        for position, settling, tmp in prepared:
            config, item_id, result = results[position]
            try:
                with _storage_errors, self._items.lock(config.name, item_id):
                    outcomes[position] = self._link_one(config, settling, tmp, result)
            except TaskhosterError as error:
                outcomes[position] = error
                continue
            if outcomes[position] is None:
                linked[config.name].append((position, settling))
        for queue, entries in linked.items():
            done = [settling.done for _, settling in entries]
            try:
                with _storage_errors:
                    self._items.flush_states(queue, *done_directories(done))
            except StorageUnavailable as error:
                for position, settling in entries:
                    self._items.unlink_done(queue, settling.state, settling.done)
                    outcomes[position] = error
                continue
            self._items.ended(queue, [(settling.state, settling.done) for _, settling in entries])
            for position, settling in entries:
                outcomes[position] = settling.outcome

    def _link_one(self, config: QueueConfig, settling: _Settling, tmp: str, result: Any) -> FinishOutcome | None:
        """Link a prepared done file if its item is still as it was read (None: linked, to be
        flushed); else settle the item afresh, durably (its outcome). Call under the lock."""
        queue, item_id = config.name, settling.done.id
        if not self._unchanged(queue, settling):
            # claimed, re-queued, extended or ended meanwhile
            again = self._settling(config, item_id, result)
            if isinstance(again, FinishOutcome):
                return again
            if not self._items.end(queue, again.state, again.done):
                return FinishOutcome(item_id, False, self._items.done_status(queue, item_id))
            return again.outcome
        if not self._items.link_done(queue, settling.state, settling.done, tmp):
            return FinishOutcome(item_id, False, self._items.done_status(queue, item_id))
        return None

    def _unchanged(self, queue: str, settling: _Settling) -> bool:
        """Whether the item is still as `settling` read it: no transition replaced its file or
        moved its lease (a claim, an extension, a re-queue) and done/ has none."""
        layout = self._items.layout
        try:
            same = files.identity(layout.item(queue, settling.state, settling.done.id)) == settling.identity
        except FileNotFoundError:
            return False
        return same and not files.exists(layout.item(queue, "done", settling.done.id))

    def release_items(self, *, releases: list[Release]) -> list[Item | TaskhosterError]:
        """Give processing items back (see `requeue`): to pending now, or scheduled after a delay,
        or ended failed `timeout` when too old, or `max_attempts` at the queue's limit. A claim
        token given must still hold its item, else NotHeld. Each release's outcome in order: the
        item as it is now, or the error."""
        outcomes: list[Item | TaskhosterError] = []
        requeued: Counter[str] = Counter()
        for release in releases:
            queue = release.config.name
            try:
                self._check_item_id(queue, release.item_id)
                if release.error is not ABSENT:
                    self._check_size(release.error, "error")
                with _storage_errors, self._items.lock(queue, release.item_id):
                    item = self._held(queue, release.item_id, release.claim_token)
                    back = give_back(
                        self._items, release.config, item, now=self.clock(),
                        delay=release.delay, error=release.error, reason=release.reason,
                    )
            except TaskhosterError as error:
                outcomes.append(error)
                continue
            outcomes.append(back)
            # one released with a delay and pending already was promoted, and waiters told, then
            requeued[queue] += back.status == "pending" and release.delay <= 0
        for queue, count in requeued.items():
            if count:
                self._items.events.items_available(queue, count)
        return outcomes

    def extend_lease(self, *, queue: str, item_id: str, seconds: float, claim_token: str | None = None) -> Item:
        """Set a processing item's lease to expire `seconds` from now (NotHeld if it is not
        processing, or no longer held by `claim_token` when one is given)."""
        self._check_item_id(queue, item_id)
        with _storage_errors, self._items.lock(queue, item_id):
            item = self._held(queue, item_id, claim_token)
            if item.claim_token is None:  # a claim that died before its record: the sweep puts it back
                raise NotHeld(f"item {item_id} is not held: its claim did not finish")
            item = replace(item, lease_expires_at=self.clock() + seconds)
            self._items.record_claim(queue, item)
            return item

    def _held(self, queue: str, item_id: str, claim_token: str | None) -> Item:
        state, item = self._found(queue, item_id)
        if state != "processing" or (claim_token is not None and item.claim_token != claim_token):
            raise NotHeld(f"item {item_id} is {item.status}, not held")
        return item

    def retry_item(self, *, config: QueueConfig, item_id: str) -> tuple[Item, bool]:
        """Post an ended item again as a new item (same payload, `retryOf` the old id), and
        record `retriedAs` on the old one; asked again, the same new item as it is now, while it
        lasts. Whether it was made now. NotEnded for an item that has not ended."""
        queue = config.name
        self._check_item_id(queue, item_id)
        gone = None  # a new item recorded as retriedAs and found gone
        with _storage_errors:
            while True:
                with self._items.lock(queue, item_id):
                    state, old = self._found(queue, item_id)
                    if state != "done":
                        raise NotEnded(f"item {item_id} is {old.status}: only a finished or failed item can be retried")
                    if old.retried_as is None or old.retried_as == gone:
                        return self._retried_anew(queue, old), True
                    earlier = old.retried_as
                # looked for under its own lock, never while holding the old one's (a second
                # item lock, taken in no set order, could deadlock): a move may not hide it
                with self._items.lock(queue, earlier):
                    found = self._items.find(queue, earlier)
                if found is not None:
                    return found[1], False
                gone = earlier  # lost to a crash before it was made, or ended and deleted since

    def _retried_anew(self, queue: str, old: Item) -> Item:
        """The new item of a retry, made under the old item's lock."""
        self._check_room()
        (new_id,) = self._ids.new_ids(1, self.clock())
        # recorded first, so a crash before the new item is made cannot make two of them
        self._items.rewrite(queue, "done", replace(old, retried_as=new_id), mtime=old.finished_at)
        self.ensure_queue(queue)
        new = Item(id=new_id, queue=queue, status="pending", payload=old.payload, retry_of=old.id)
        try:
            self._items.publish(queue, [new])
        except BaseException:
            self._unrecord_retry(queue, old, new_id)
            raise
        return new

    def _unrecord_retry(self, queue: str, old: Item, new_id: str) -> None:
        """The retry's new item could not be made: the old one names none again (unless the new
        one lives on after all: a worker ended it before its flush failed). Should that fail too
        (the disk that refused the new item), the next retry mends the name it keeps."""
        try:
            if self._items.find(queue, new_id) is None:
                self._items.rewrite(queue, "done", old, mtime=old.finished_at)
        except OSError:
            log.warning("could not take back the retry of item %s of %s", old.id, queue, exc_info=True)

    def cancel_item(self, *, config: QueueConfig, item_id: str) -> tuple[Item, bool]:
        """End a scheduled, pending or processing item at once, failed `canceled`; the item, and
        whether it was canceled now (an item that had ended is left as it is)."""
        queue = config.name
        self._check_item_id(queue, item_id)
        with _storage_errors, self._items.lock(queue, item_id):
            state, item = self._found(queue, item_id)
            if state == "done":
                return item, False
            done = failed(item, "canceled", self.clock())
            self._items.end(queue, state, done)
        if state == "processing":
            self._items.events.item_canceled(queue, item_id, item.claim_token)
        return done, True

    def promote_due(self, *, config: QueueConfig) -> list[str]:
        """Move the scheduled items that came due to pending (those past their queue timeout are
        failed instead); the ids moved. Looks only at what came due since the last look. Many
        due at once go in chunks, each claimable as soon as it is moved."""
        queue, now = config.name, self.clock()
        self.ensure_queue(queue)
        promoted: list[str] = []
        with _storage_errors:
            due = self._items.schedule.due(queue, now)
            for start in range(0, len(due.marks), PROMOTE_CHUNK):
                promoted += promote(self._items, config, due.marks[start:start + PROMOTE_CHUNK], now)
            self._items.schedule.passed(due)
        return promoted

    def mark_timeouts(self, *, config: QueueConfig) -> None:
        """Call once the queue's queueSeconds was lowered: a scheduled item is marked for when
        it comes due (or ages out, whichever came first) under the limit it was scheduled with,
        so each one now due to age out sooner gets a mark for then, and one aged already fails
        now. Lists every scheduled item and mark, once."""
        queue = config.name
        with _storage_errors:
            soonest = self._items.schedule.soonest(queue)
            marks = []
            for name in files.names(self._items.layout.directory(queue, "scheduled")):
                item_id = item_id_of(name)
                if item_id is None:
                    continue
                ages_out = ids.id_millis(item_id) / 1000 + config.queue_seconds
                if ages_out < soonest.get(item_id, float("inf")):
                    marks.append(self._items.schedule.mark(queue, item_id, ages_out, at_run_at=False))
            if marks:
                self._items.flush(*self._items.schedule.directories(queue, marks))
            now = self.clock()
            promote(self._items, config, [mark for mark in marks if mark.due <= now], now)

    def _found(self, queue: str, item_id: str) -> tuple[str, Item]:
        found = self._items.find(queue, item_id)
        if found is None:
            raise ItemNotFound(f"no item {item_id} in queue {queue}")
        return found

    def read_item(self, *, queue: str, item_id: str, fetch: bool = False) -> Item:
        """Read one item. With `fetch`, a done item is marked fetched the first time: under
        retainFrom `fetched` its retention clock starts then (G7). A read never waits for a flush
        (it takes an item's lock only when a move hid the item twice), so it may run on the
        event loop."""
        self._check_item_id(queue, item_id)
        with _storage_errors:
            found = self._items.find(queue, item_id) or self._items.find(queue, item_id)
            # a move under way may have hidden it twice: look again under its lock, if any item of
            # the queue was ever locked (every move is made under the lock, which makes the file)
            if found is None and files.exists(self._items.layout.lock_file(queue)):
                with self._items.lock(queue, item_id):
                    found = self._items.find(queue, item_id)
        if found is None:
            raise ItemNotFound(f"no item {item_id} in queue {queue}")
        state, item = found
        if fetch and state == "done":
            self._mark_fetched(queue, item_id)
        return item

    def _mark_fetched(self, queue: str, item_id: str) -> None:
        """The first fetch makes the mark, its mtime the moment. Not flushed: a mark a power cut
        loses only waits for the next fetch."""
        try:
            files.write_new(self._items.layout.mark(queue, "fetched", item_id), b"", mtime=self.clock())
        except FileExistsError:
            pass
        except OSError:
            log.warning("could not mark item %s of %s fetched", item_id, queue, exc_info=True)

    # ---- the sweep, counts and listings -----------------------------------------------------

    def sweep_queue(self, *, config: QueueConfig) -> SweepChanges:
        """One sweep pass over a queue (see `sweep`), scheduled items that came due promoted."""
        promoted = self.promote_due(config=config)
        with _storage_errors:
            return replace(sweep.sweep_queue(self._items, config), promoted=promoted)

    def count_items(self, *, queue: str) -> Counts:
        with _storage_errors:
            return stats.count_items(self._items, self._read_names, queue)

    def list_items(self, *, queue: str, state: str, offset: int = 0, limit: int = 50,
                   status: str | None = None) -> tuple[int, list[Item]]:
        """One page of a state's items, newest first, and the state's total (done: of `status` only, if given)."""
        with _storage_errors:
            return stats.list_items(self._items, self._read_names, queue, state, offset=offset, limit=limit,
                                    status=status)

    def throughput(self, *, queue: str, minutes: int = 15) -> list[tuple[float, int, int]]:
        """(minute start, finished, failed) for each of the last `minutes` minutes, oldest first."""
        return self._items.tallies.per_minute(queue, minutes=minutes, now=self.clock())

    # ---- checks -----------------------------------------------------------------------------

    def _check_size(self, value: Any, what: str) -> None:
        try:
            size = json_size(value)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"the {what} is not a JSON value") from exc
        if size > self.max_payload_bytes:
            raise PayloadTooLarge(
                f"the {what} is {size} bytes as JSON; the limit is {self.max_payload_bytes} "
                "(TASKHOSTER_MAX_PAYLOAD_BYTES)"
            )

    @staticmethod
    def _check_item_id(queue: str, item_id: str) -> None:
        if not is_valid_queue_name(queue):
            raise UnknownQueue(f"no queue named {str(queue)[:80]!r}")
        if not ids.is_valid_id(item_id):
            raise ItemNotFound("no item has this id")


def _made(item_id: str, queue: str, new: NewItem, now: float) -> Item:
    """The item a post makes: scheduled if its run_at is still to come (a past one means now)."""
    if new.run_at is not None and new.run_at > now:
        return Item(id=item_id, queue=queue, status="scheduled", payload=new.payload, run_at=new.run_at, key=new.key)
    return Item(id=item_id, queue=queue, status="pending", payload=new.payload, key=new.key)


def _move_back(source: str, target: str) -> None:
    """Undo a claim's move after a failure, so the item is pending again as it was."""
    try:
        files.move(source, target)
    except OSError:
        log.warning("could not move %s back to %s", source, target, exc_info=True)


class _StorageErrors:
    """`with _storage_errors:` makes a failed disk call StorageUnavailable, except a file found
    missing or there already, which callers act on. A class, not a generator: every transition
    enters it."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, traceback) -> bool:
        if isinstance(exc, OSError) and not isinstance(exc, (FileNotFoundError, FileExistsError)):
            raise StorageUnavailable(f"the data directory cannot be written: {exc.strerror or exc}") from exc
        return False


_storage_errors = _StorageErrors()
