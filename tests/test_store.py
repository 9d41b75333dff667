"""Every transition and every guarantee the store alone can show (SPEC G1-G7, G8 at store level,
G9's durability path), with the injected FakeClock instead of sleeps."""

import builtins
import errno
import json
import os
import stat
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from queues import ids
from queues import store as store_module
from queues.exceptions import (
    InvalidRequest,
    ItemNotFound,
    NotHeld,
    PayloadTooLarge,
    StorageUnavailable,
    UnknownQueue,
    UnsafePath,
)
from conftest import alongside
from queues.store import CLAIM_XATTR, STALE_TMP_SECONDS, QueueConfig, Store

Q = "jobs"


def queue_dir(store: Store, queue: str = Q) -> Path:
    return store.data_dir / queue


def states_of(store: Store, item_id: str, queue: str = Q) -> list[str]:
    """Every state directory that holds a file for `item_id` (G1: exactly one)."""
    return [s for s in ("pending", "processing", "done") if (queue_dir(store, queue) / s / f"{item_id}.json").exists()]


def files_in(store: Store, state: str, queue: str = Q) -> list[str]:
    directory = queue_dir(store, queue) / state
    return sorted(os.listdir(directory)) if directory.is_dir() else []


def spares(store: Store) -> list[str]:
    """Old item files kept in tmp/ to be written over (see Store._retire)."""
    return [name for name in files_in(store, "tmp") if name.startswith("spare-")]


def leftovers_in_tmp(store: Store) -> list[str]:
    return [name for name in files_in(store, "tmp") if not name.startswith("spare-")]


def post(store: Store, *payloads, queue: str = Q) -> list[str]:
    return [item.id for item in store.post_items(queue=queue, payloads=list(payloads) or [{"n": 1}])]


def claim_one(store: Store, config: QueueConfig):
    (item,) = store.claim_items(config=config, max_items=1)
    return item


# ---- posting ---------------------------------------------------------------------------------


def test_a_posted_item_is_pending_with_its_payload(store, clock):
    (item,) = store.post_items(queue=Q, payloads=[{"image": "a.png"}])
    assert item.status == "pending"
    assert item.attempts == 0
    assert item.posted_at == pytest.approx(clock.now, abs=0.001)
    assert states_of(store, item.id) == ["pending"]
    read = store.read_item(queue=Q, item_id=item.id)
    assert read.payload == {"image": "a.png"}
    assert read.to_json() == {
        "id": item.id,
        "queue": Q,
        "status": "pending",
        "attempts": 0,
        "postedAt": ids.iso(clock.now),
        "claimedAt": None,
        "leaseExpiresAt": None,
        "finishedAt": None,
    }
    assert read.to_json(payload=True)["payload"] == {"image": "a.png"}


def test_a_batch_posts_every_item_with_increasing_ids(store):
    items = store.post_items(queue=Q, payloads=list(range(1000)))
    assert [i.payload for i in items] == list(range(1000))
    assert [i.id for i in items] == sorted(i.id for i in items)
    assert len(files_in(store, "pending")) == 1000
    assert files_in(store, "tmp") == []


def test_a_batch_with_one_oversized_payload_writes_nothing(store):
    with pytest.raises(PayloadTooLarge, match="limit is 1024"):
        store.post_items(queue=Q, payloads=[{"ok": 1}, "x" * 2000, {"ok": 2}])
    assert files_in(store, "pending") == []
    assert files_in(store, "tmp") == []
    assert store.count_items(queue=Q).pending == 0


@pytest.mark.parametrize("payloads", [[], list(range(1001)), "not a list", [{1, 2}], [float("nan")]])
def test_a_bad_batch_is_refused_and_writes_nothing(store, payloads):
    with pytest.raises(InvalidRequest):
        store.post_items(queue=Q, payloads=payloads)
    assert files_in(store, "pending") == []
    assert files_in(store, "tmp") == []


def test_a_batch_that_fails_midway_on_disk_leaves_nothing_behind(store, monkeypatch):
    real_rename = os.rename
    calls = []

    def rename_until_disk_full(source, target):
        calls.append(target)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_rename(source, target)

    monkeypatch.setattr(os, "rename", rename_until_disk_full)
    with pytest.raises(StorageUnavailable, match="No space left"):
        store.post_items(queue=Q, payloads=[1, 2, 3, 4])
    monkeypatch.undo()
    assert files_in(store, "pending") == []
    assert files_in(store, "tmp") == []
    assert store.claim_items(config=QueueConfig(name=Q), max_items=10) == []


def test_a_bad_queue_name_is_refused_before_the_disk(store):
    for name in ("..", "a/b", "Jobs", "x" * 65, "", "-a"):
        with pytest.raises(InvalidRequest):
            store.post_items(queue=name, payloads=[1])
    assert not store.data_dir.exists()


# ---- claims ----------------------------------------------------------------------------------


def test_claims_hand_out_the_oldest_first_and_at_most_max(store, clock, config):
    first = post(store, "a")
    clock.advance(1)
    batch = post(store, "b", "c", "d")
    clock.advance(1)
    last = post(store, "e")
    claimed = store.claim_items(config=config, max_items=3)
    assert [i.id for i in claimed] == first + batch[:2]
    assert [i.payload for i in claimed] == ["a", "b", "c"]
    rest = store.claim_items(config=config, max_items=10)
    assert [i.id for i in rest] == batch[2:] + last
    assert store.claim_items(config=config, max_items=10) == []


def test_a_claim_leases_the_item_to_one_claim(store, clock, config):
    (item_id,) = post(store, {"p": 1})
    clock.advance(5)
    item = claim_one(store, config)
    assert item.id == item_id
    assert item.status == "processing"
    assert item.attempts == 1
    assert item.payload == {"p": 1}
    assert item.claimed_at == clock.now
    assert item.lease_expires_at == clock.now + config.lease_seconds
    assert item.claim_token
    assert states_of(store, item_id) == ["processing"]
    # the file's mtime is the lease expiry, so the sweep can skip it without reading it
    mtime = os.stat(queue_dir(store) / "processing" / f"{item_id}.json").st_mtime
    assert mtime == pytest.approx(item.lease_expires_at)
    shown = store.read_item(queue=Q, item_id=item_id).to_json()
    assert shown["claimedAt"] == ids.iso(clock.now)
    assert shown["leaseExpiresAt"] == ids.iso(clock.now + config.lease_seconds)


def test_a_claim_is_a_rename_that_keeps_the_posted_bytes_and_records_the_claim_beside_them(store, clock, config):
    (item_id,) = post(store, {"p": 1})
    pending = queue_dir(store) / "pending" / f"{item_id}.json"
    posted, inode = pending.read_bytes(), pending.stat().st_ino
    item = claim_one(store, config)
    processing = queue_dir(store) / "processing" / f"{item_id}.json"
    if store.claim_xattrs:
        assert (processing.stat().st_ino, processing.read_bytes()) == (inode, posted)
        attempts, _, _, claim_token = os.getxattr(processing, CLAIM_XATTR).decode().split(" ")
        assert len(os.getxattr(processing, CLAIM_XATTR)) <= 60  # it fits inside an ext4 inode
    else:  # no xattrs here: the file is replaced whole
        record = json.loads(processing.read_bytes())
        attempts, claim_token = record["attempts"], record["claimToken"]
    assert (int(attempts), claim_token) == (1, item.claim_token)
    clock.advance(10)
    extended = store.extend_lease(queue=Q, item_id=item_id, seconds=500)
    assert extended.lease_expires_at == clock.now + 500
    assert store.read_item(queue=Q, item_id=item_id).lease_expires_at == clock.now + 500
    assert processing.stat().st_mtime == pytest.approx(clock.now + 500)
    store.release_item(queue=Q, item_id=item_id)
    again = store.read_item(queue=Q, item_id=item_id)
    assert (again.status, again.attempts, again.claim_token, again.lease_expires_at) == ("pending", 1, None, None)


def test_a_paused_queue_hands_out_nothing(store, config):
    (item_id,) = post(store)
    assert store.claim_items(config=replace(config, paused=True), max_items=5) == []
    assert states_of(store, item_id) == ["pending"]
    assert claim_one(store, config).id == item_id


def test_an_item_is_claimed_by_one_claimant_only(store, tmp_path, clock, config):
    """G2: two stores (as two server processes would) and eight threads race for 300 items."""
    post(store, *range(300))
    other = alongside(store, clock=clock)
    claimed: list[str] = []

    def claim_all(claimant: Store) -> None:
        while items := claimant.claim_items(config=config, max_items=3):
            claimed.extend(i.id for i in items)

    threads = [threading.Thread(target=claim_all, args=(s,)) for s in (store, other) * 4]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(claimed) == 300
    assert len(set(claimed)) == 300
    assert len(files_in(store, "processing")) == 300
    assert all(store.read_item(queue=Q, item_id=i).attempts == 1 for i in claimed)


def test_a_claim_sees_items_posted_by_another_process(store, clock, config):
    other = alongside(store, clock=clock)
    assert store.claim_items(config=config) == []  # the index is built, and empty
    (item_id,) = post(other)
    assert claim_one(store, config).id == item_id


def test_a_small_index_still_hands_out_everything_oldest_first(tmp_path, clock, config):
    """A process keeps only the oldest `index_capacity` pending ids in memory; the rest are
    found by listing again, and posts past the horizon are not lost."""
    store = Store(tmp_path / "small", fsync=False, clock=clock, index_capacity=4)
    posted = []
    for n in range(5):
        posted += post(store, *range(3), queue=Q)
        clock.advance(1)
    other = alongside(store, clock=clock, index_capacity=4)
    claimed = [i.id for i in other.claim_items(config=config, max_items=3)]
    posted += post(store, "late")
    claimed += [i.id for i in store.claim_items(config=config, max_items=100)]
    claimed += [i.id for i in other.claim_items(config=config, max_items=100)]
    assert sorted(claimed) == posted
    assert len(set(claimed)) == len(posted)
    assert claimed[:3] == posted[:3]
    assert files_in(store, "pending") == []


def test_an_item_posted_while_the_directory_is_listed_is_not_missed(store, config, monkeypatch):
    listed = store_module._PendingIndex._oldest_in_directory
    posted_meanwhile = []

    def list_then_post(index):
        found = listed(index)
        if not posted_meanwhile:
            posted_meanwhile.extend(post(store, "meanwhile"))  # too late for this listing
        return found

    monkeypatch.setattr(store_module._PendingIndex, "_oldest_in_directory", list_then_post)
    assert [i.id for i in store.claim_items(config=config, max_items=5)] == posted_meanwhile


def test_a_requeued_item_is_handed_out_before_newer_ones(store, clock, config):
    old, new = post(store, "old"), None
    clock.advance(1)
    new = post(store, "new")
    item = claim_one(store, config)
    assert [item.id] == old
    store.release_item(queue=Q, item_id=item.id)
    assert [i.id for i in store.claim_items(config=config, max_items=2)] == old + new


# ---- results ---------------------------------------------------------------------------------


def test_the_first_result_wins_and_later_ones_are_refused(store, clock, config):
    """G3"""
    (item_id,) = post(store)
    claim_one(store, config)
    clock.advance(2)
    first = store.finish_item(config=config, item_id=item_id, result={"ok": True})
    assert (first.accepted, first.status) == (True, "finished")
    second = store.finish_item(config=config, item_id=item_id, result={"ok": False})
    assert (second.accepted, second.status) == (False, "finished")
    item = store.read_item(queue=Q, item_id=item_id)
    assert item.status == "finished"
    assert item.result == {"ok": True}
    assert item.finished_at == clock.now
    assert item.to_json()["result"] == {"ok": True}
    assert item.to_json()["leaseExpiresAt"] is None
    assert states_of(store, item_id) == ["done"]


def test_a_result_is_accepted_for_an_item_pending_again_after_a_requeue(store, config):
    """G4: the worker whose claim was re-queued may still finish the item."""
    (item_id,) = post(store)
    item = claim_one(store, config)
    store.requeue_item(queue=Q, item_id=item_id, claim_token=item.claim_token)
    assert states_of(store, item_id) == ["pending"]
    outcome = store.finish_item(config=config, item_id=item_id, result="late but fine")
    assert outcome.accepted
    assert states_of(store, item_id) == ["done"]
    assert store.read_item(queue=Q, item_id=item_id).result == "late but fine"
    assert store.claim_items(config=config, max_items=5) == []  # never handed out again


def test_a_late_result_after_a_reclaim_wins_if_first(store, clock, config):
    (item_id,) = post(store)
    claim_one(store, config)
    clock.advance(config.lease_seconds + 1)
    assert store.requeue_lapsed(config=config) == [item_id]
    second_claim = claim_one(store, config)
    assert second_claim.attempts == 2
    assert store.finish_item(config=config, item_id=item_id, result="from the first worker").accepted
    assert not store.finish_item(config=config, item_id=item_id, result="from the second").accepted
    assert store.read_item(queue=Q, item_id=item_id).result == "from the first worker"


def test_a_result_for_an_unknown_item_is_not_found(store, config):
    post(store)
    (never_posted,) = ids.IdMaker().new_ids(1, time.time())
    with pytest.raises(ItemNotFound):
        store.finish_item(config=config, item_id=never_posted, result=1)


def test_an_oversized_result_is_refused_and_changes_nothing(store, config):
    (item_id,) = post(store)
    claim_one(store, config)
    with pytest.raises(PayloadTooLarge):
        store.finish_item(config=config, item_id=item_id, result="x" * 2000)
    assert states_of(store, item_id) == ["processing"]
    assert files_in(store, "tmp") == []


def test_a_batch_of_results_settles_each_item_as_one_result_would(store, clock, config):
    fresh, held, twice, late, too_big = post(store, 1, 2, 3, 4, 5)
    store.claim_items(config=config, max_items=3)
    assert store.finish_item(config=config, item_id=late, result="first").accepted
    never_posted = ids.IdMaker().new_ids(1, clock.now)[0]
    outcomes = store.finish_items(
        config=config,
        results=[
            (held, "a"), (twice, "b"), (twice, "again"), (late, "second"),
            (never_posted, "c"), ("not-an-id", "d"), (too_big, "x" * 2000), (fresh, "e"),
        ],
    )
    assert [(o.accepted, o.status) for o in outcomes[:4]] == [
        (True, "finished"), (True, "finished"), (False, "finished"), (False, "finished")
    ]
    assert [type(o) for o in outcomes[4:7]] == [ItemNotFound, ItemNotFound, PayloadTooLarge]
    assert (outcomes[7].accepted, outcomes[7].id) == (True, fresh)  # pending, never claimed (G4)
    assert [store.read_item(queue=Q, item_id=i).result for i in (held, twice, late, fresh)] == ["a", "b", "first", "e"]
    assert states_of(store, too_big) == ["pending"]
    for item_id in (held, twice, late, fresh):
        assert states_of(store, item_id) == ["done"]


def test_a_batch_of_results_fails_aged_items_instead(store, clock, config):
    old, = post(store, 1)
    clock.advance(config.queue_seconds - 10)
    young, = post(store, 2)
    clock.advance(11)
    aged, fine = store.finish_items(config=config, results=[(old, "r"), (young, "r")])
    assert (aged.accepted, aged.status, fine.accepted) == (False, "failed", True)
    assert store.read_item(queue=Q, item_id=old).error == "timeout"
    assert states_of(store, old) == ["done"]


def test_batches_of_results_racing_over_the_same_items_accept_each_once(tmp_path, clock, config):
    """Two processes (two stores) with two threads each hand in overlapping batches in different
    orders; the batches hold many item locks at once and must neither deadlock nor double-finish."""
    stores = [Store(tmp_path / "shared", fsync=False, clock=clock) for _ in range(2)]
    posted = [i.id for i in stores[0].post_items(queue=Q, payloads=list(range(600)))]
    accepted: list[str] = []
    lock = threading.Lock()

    def hand_in(store: Store, order: list[str]) -> None:
        for start in range(0, len(order), 100):
            batch = order[start : start + 100]
            outcomes = store.finish_items(config=config, results=[(i, i) for i in batch])
            with lock:
                accepted.extend(o.id for o in outcomes if o.accepted)

    orders = [posted, posted[::-1], posted[300:] + posted[:300], posted[::2] + posted[1::2]]
    threads = [threading.Thread(target=hand_in, args=(stores[n % 2], order)) for n, order in enumerate(orders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert sorted(accepted) == posted
    assert len(files_in(stores[0], "done")) == 600 and files_in(stores[0], "pending") == []


def test_a_result_whose_item_was_claimed_again_while_its_batch_was_written_counts_that_claim(
    store, clock, config, monkeypatch
):
    """A batch writes each done file under the item's lock alone; an item that moves on before the
    batch links the files (here: re-queued and claimed again) is settled afresh, not from the
    content read before."""
    (item_id,) = post(store, 1)
    claim_one(store, config)
    real_commit = store._commit_all_done

    def reclaim_then_commit(*args):
        store.release_item(queue=Q, item_id=item_id)  # between the two steps: the item moves on
        claim_one(store, config)
        real_commit(*args)

    monkeypatch.setattr(store, "_commit_all_done", reclaim_then_commit)
    (outcome,) = store.finish_items(config=config, results=[(item_id, "r")])
    assert outcome.accepted
    done = store.read_item(queue=Q, item_id=item_id)
    assert (done.status, done.attempts, done.result) == ("finished", 2, "r")
    assert states_of(store, item_id) == ["done"]
    assert leftovers_in_tmp(store) == []


def test_an_unlocked_read_sees_what_a_locked_one_sees_and_none_for_an_item_mid_move(store, clock, config):
    (item_id,) = post(store, "p")
    assert store.read_item_unlocked(queue=Q, item_id=item_id) == store.read_item(queue=Q, item_id=item_id)
    claimed = claim_one(store, config)
    assert store.read_item_unlocked(queue=Q, item_id=item_id) == claimed
    assert store.finish_item(config=config, item_id=item_id, result=7).accepted
    done = store.read_item_unlocked(queue=Q, item_id=item_id, fetch=True)
    assert (done.status, done.result) == ("finished", 7)
    assert os.stat(queue_dir(store) / "done" / f"{item_id}.json").st_mode & 0o040  # fetched
    # between directories, as a rename in another process would leave it for an instant
    os.rename(queue_dir(store) / "done" / f"{item_id}.json", queue_dir(store) / "tmp" / "moving.json")
    assert store.read_item_unlocked(queue=Q, item_id=item_id) is None
    with pytest.raises(ItemNotFound):
        store.read_item(queue=Q, item_id=item_id)


def test_an_unlocked_read_answers_a_done_item_only_when_nobody_holds_its_lock(store, config, tmp_path):
    """A done file is linked before done/ is synced, under the item's lock: a read that cannot
    take that lock at once must not show the item done (the store's thread asks instead)."""
    (item_id,) = post(store, "p")
    store.finish_item(config=config, item_id=item_id, result=1)
    locks = store._queue_locks(Q)
    with locks.hold(item_id):  # a thread of this process is committing it
        assert store.read_item_unlocked(queue=Q, item_id=item_id, fetch=True) is None
    lock_file = queue_dir(store) / ".lock"
    holder = subprocess.Popen(  # another process is committing it
        [sys.executable, "-c", HOLD_LOCK_BYTE, str(lock_file), str(store_module._stripe(item_id))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert store.read_item_unlocked(queue=Q, item_id=item_id, fetch=True) is None
    finally:
        holder.communicate("", timeout=10)
    assert not os.stat(queue_dir(store) / "done" / f"{item_id}.json").st_mode & 0o040  # not fetched yet
    fresh = alongside(store)  # its locks are not made yet: making them may wait, so it defers
    assert fresh.read_item_unlocked(queue=Q, item_id=item_id) is None
    done = store.read_item_unlocked(queue=Q, item_id=item_id, fetch=True)
    assert (done.status, done.result) == ("finished", 1)
    assert os.stat(queue_dir(store) / "done" / f"{item_id}.json").st_mode & 0o040  # fetched now


HOLD_LOCK_BYTE = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.lockf(fd, fcntl.LOCK_EX, 1, int(sys.argv[2]))
print("held", flush=True)
sys.stdin.read()
"""


def test_a_claim_on_the_event_loop_claims_as_the_store_thread_does(store, clock, config):
    first = post(store, "a")
    clock.advance(1)
    rest = post(store, "b", "c")
    assert store.claim_items_now(config=config, max_items=3) is None  # its locks are not made yet
    assert store.claim_items(config=config, max_items=1)[0].id == first[0]
    store.list_pending(queue=Q)  # as runtime.claim_items makes sure before any claim
    claimed = store.claim_items_now(config=config, max_items=1)
    assert [item.id for item in claimed] == rest[:1]
    assert store.read_item(queue=Q, item_id=rest[0]) == claimed[0]  # the claim is on the disk
    assert (claimed[0].attempts, claimed[0].lease_expires_at) == (1, clock.now + config.lease_seconds)
    assert store.claim_items_now(config=replace(config, paused=True), max_items=3) == []
    assert [item.id for item in store.claim_items_now(config=config, max_items=3)] == rest[1:]
    assert store.claim_items_now(config=config, max_items=3) is None  # nothing in view: the thread lists


def test_a_claim_on_the_event_loop_never_waits_for_a_lock(store, config):
    """It stops at an item whose lock a thread or another process holds, and leaves it pending
    for the store's thread, which waits for the lock."""
    first, second = post(store, "a", "b")
    store.list_pending(queue=Q)
    claim_one(store, config)  # makes the locks
    store.release_item(queue=Q, item_id=first)
    locks = store._queue_locks(Q)
    with locks.hold(first):  # a thread of this process
        assert without_waiting(lambda: store.claim_items_now(config=config, max_items=2)) is None
    assert states_of(store, first) == ["pending"]
    holder = subprocess.Popen(  # another process
        [sys.executable, "-c", HOLD_LOCK_BYTE, str(queue_dir(store) / ".lock"), str(store_module._stripe(second))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        same_stripe = store_module._stripe(first) == store_module._stripe(second)
        claimed = without_waiting(lambda: store.claim_items_now(config=config, max_items=2))
        assert claimed is None if same_stripe else [item.id for item in claimed] == [first]
    finally:
        holder.communicate("", timeout=10)
    assert states_of(store, second) == ["pending"]
    left = [first, second] if same_stripe else [second]
    assert [item.id for item in store.claim_items(config=config, max_items=2)] == left


def without_waiting(call):
    """`call()` in another thread (as the event loop is to the store's thread), failing the test
    if it waits rather than answering at once."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(call).result(timeout=10)
    finally:
        pool.shutdown(wait=False)  # a call stuck on a lock ends once the test lets go of it


def test_a_claim_on_the_event_loop_leaves_an_aged_item_to_the_store_thread(store, clock, config):
    """Failing an aged item syncs the disk, which the event loop must not wait for."""
    (old,) = post(store, "old")
    store.list_pending(queue=Q)
    claim_one(store, config)  # makes the locks
    store.release_item(queue=Q, item_id=old)
    clock.advance(config.queue_seconds + 1)
    (young,) = post(store, "young")
    assert store.claim_items_now(config=config, max_items=2) is None
    assert states_of(store, old) == ["pending"]
    assert claim_one(store, config).id == young
    assert store.read_item(queue=Q, item_id=old).status == "failed"


def test_attempts_count_the_claims(store, clock, config):
    """G5: claim, release, claim, lapse and re-queue, claim: three claims."""
    (item_id,) = post(store)
    assert claim_one(store, config).attempts == 1
    store.release_item(queue=Q, item_id=item_id)
    assert store.read_item(queue=Q, item_id=item_id).attempts == 1
    assert claim_one(store, config).attempts == 2
    clock.advance(config.lease_seconds + 1)
    store.requeue_lapsed(config=config)
    assert claim_one(store, config).attempts == 3
    store.finish_item(config=config, item_id=item_id, result=None)
    done = store.read_item(queue=Q, item_id=item_id)
    assert (done.status, done.attempts, done.result) == ("finished", 3, None)


# ---- queue timeout ---------------------------------------------------------------------------


def test_an_aged_pending_item_fails_with_timeout(store, clock, config):
    """G6 from pending; an item exactly queueSeconds old is not aged yet."""
    (item_id,) = post(store)
    clock.advance(config.queue_seconds)
    assert store.fail_aged(config=config) == []
    clock.advance(0.01)
    assert store.fail_aged(config=config) == [item_id]
    item = store.read_item(queue=Q, item_id=item_id)
    assert (item.status, item.error, item.finished_at) == ("failed", "timeout", clock.now)
    assert item.to_json()["error"] == "timeout"
    assert "result" not in item.to_json()
    assert states_of(store, item_id) == ["done"]
    assert store.count_items(queue=Q).failed == 1


def test_an_aged_processing_item_fails_with_timeout(store, clock, config):
    """G6 from processing, while its lease still runs."""
    long_lease = replace(config, lease_seconds=3600)
    (item_id,) = post(store)
    claim_one(store, long_lease)
    clock.advance(config.queue_seconds + 1)
    assert store.fail_aged(config=long_lease) == [item_id]
    item = store.read_item(queue=Q, item_id=item_id)
    assert (item.status, item.error, item.lease_expires_at) == ("failed", "timeout", None)
    assert states_of(store, item_id) == ["done"]


def test_an_aged_and_lapsed_item_ends_failed_not_requeued(store, clock, config):
    (item_id,) = post(store)
    claim_one(store, config)
    clock.advance(config.queue_seconds + 1)
    # whichever timer looks first, the item fails
    assert store.requeue_lapsed(config=config) == []
    assert store.read_item(queue=Q, item_id=item_id).status == "failed"
    assert states_of(store, item_id) == ["done"]


def test_a_late_result_is_refused_after_timeout(store, clock, config):
    """G6: the verdict is final."""
    (item_id,) = post(store)
    claim_one(store, config)
    clock.advance(config.queue_seconds + 1)
    store.fail_aged(config=config)
    outcome = store.finish_item(config=config, item_id=item_id, result="too late")
    assert (outcome.accepted, outcome.status) == (False, "failed")
    item = store.read_item(queue=Q, item_id=item_id)
    assert (item.status, item.error, item.result) == ("failed", "timeout", None)


def test_a_result_for_an_aged_item_the_sweep_has_not_seen_fails_it(store, clock, config):
    (item_id,) = post(store)
    claim_one(store, config)
    clock.advance(config.queue_seconds + 1)
    outcome = store.finish_item(config=config, item_id=item_id, result="too late")
    assert (outcome.accepted, outcome.status) == (False, "failed")
    assert store.read_item(queue=Q, item_id=item_id).error == "timeout"


def test_a_claim_fails_an_aged_item_and_hands_out_the_next(store, clock, config):
    (old,) = post(store, "old")
    clock.advance(config.queue_seconds)
    (young,) = post(store, "young")
    clock.advance(1)
    assert claim_one(store, config).id == young
    assert store.read_item(queue=Q, item_id=old).status == "failed"


# ---- retention -------------------------------------------------------------------------------


def finished_item(store, config) -> str:
    (item_id,) = post(store)
    claim_one(store, config)
    assert store.finish_item(config=config, item_id=item_id, result="r").accepted
    return item_id


def test_retention_from_finished_deletes_retain_seconds_after_finishing(store, clock, config):
    """G7, retainFrom finished: a fetch does not move the clock."""
    item_id = finished_item(store, config)
    clock.advance(config.retain_seconds - 1)
    store.read_item(queue=Q, item_id=item_id, fetch=True, retain_from="finished")
    assert store.delete_expired(config=config) == []
    clock.advance(1)
    assert store.delete_expired(config=config) == [item_id]
    assert states_of(store, item_id) == []
    with pytest.raises(ItemNotFound):
        store.read_item(queue=Q, item_id=item_id)
    with pytest.raises(ItemNotFound):
        store.finish_item(config=config, item_id=item_id, result="x")


def test_retention_from_fetched_never_deletes_an_unfetched_item(store, clock, config):
    fetched = replace(config, retain_from="fetched")
    item_id = finished_item(store, fetched)
    clock.advance(30 * 86400)
    assert store.delete_expired(config=fetched) == []
    store.read_item(queue=Q, item_id=item_id)  # a read that is not a fetch (the dashboard's)
    clock.advance(30 * 86400)
    assert store.delete_expired(config=fetched) == []
    assert states_of(store, item_id) == ["done"]


def test_retention_from_fetched_counts_from_the_first_fetch_only(store, clock, config):
    fetched = replace(config, retain_from="fetched")
    item_id = finished_item(store, fetched)
    clock.advance(1000)
    store.read_item(queue=Q, item_id=item_id, fetch=True, retain_from="fetched")
    clock.advance(config.retain_seconds - 10)
    store.read_item(queue=Q, item_id=item_id, fetch=True, retain_from="fetched")  # not a new clock
    assert store.delete_expired(config=fetched) == []
    clock.advance(10)
    assert store.delete_expired(config=fetched) == [item_id]


def test_a_fetch_before_the_item_is_terminal_does_not_count(store, clock, config):
    fetched = replace(config, retain_from="fetched")
    (item_id,) = post(store)
    store.read_item(queue=Q, item_id=item_id, fetch=True, retain_from="fetched")
    claim_one(store, fetched)
    store.finish_item(config=fetched, item_id=item_id, result=1)
    clock.advance(config.retain_seconds * 10)
    assert store.delete_expired(config=fetched) == []


def test_failed_items_are_retained_like_finished_ones(store, clock, config):
    fetched = replace(config, retain_from="fetched")
    (item_id,) = post(store)
    clock.advance(config.queue_seconds + 1)
    store.fail_aged(config=fetched)
    clock.advance(config.retain_seconds * 10)
    assert store.delete_expired(config=fetched) == []
    store.read_item(queue=Q, item_id=item_id, fetch=True, retain_from="fetched")
    clock.advance(config.retain_seconds)
    assert store.delete_expired(config=fetched) == [item_id]


def test_zero_retention_deletes_at_the_next_sweep(store, config):
    item_id = finished_item(store, config)
    assert store.delete_expired(config=replace(config, retain_seconds=0)) == [item_id]


def test_retention_never_deletes_pending_or_processing_items(store, clock, config):
    processing_id, pending_id = post(store, 1, 2)
    store.claim_items(config=replace(config, lease_seconds=3600, queue_seconds=86400))
    clock.advance(3000)
    assert store.delete_expired(config=replace(config, retain_seconds=0)) == []
    assert states_of(store, pending_id) == ["pending"]
    assert states_of(store, processing_id) == ["processing"]


# ---- release, extend, re-queue by claim ------------------------------------------------------


def test_release_puts_a_processing_item_back_now(store, config):
    (item_id,) = post(store)
    claim = claim_one(store, config)
    item = store.release_item(queue=Q, item_id=item_id, claim_token=claim.claim_token)
    assert (item.status, item.lease_expires_at, item.claim_token) == ("pending", None, None)
    assert states_of(store, item_id) == ["pending"]
    assert store.read_item(queue=Q, item_id=item_id).to_json()["leaseExpiresAt"] is None


def test_release_of_an_item_not_held_is_refused(store, config):
    pending_id, held_id, done_id = post(store, 1, 2, 3)
    store.claim_items(config=config, max_items=2)
    store.release_item(queue=Q, item_id=pending_id)
    store.finish_item(config=config, item_id=done_id, result=1)
    with pytest.raises(NotHeld):
        store.release_item(queue=Q, item_id=pending_id)
    with pytest.raises(NotHeld):
        store.release_item(queue=Q, item_id=held_id, claim_token="someone else")
    with pytest.raises(NotHeld):
        store.release_item(queue=Q, item_id=done_id)
    assert (states_of(store, pending_id), states_of(store, held_id), states_of(store, done_id)) == (
        ["pending"], ["processing"], ["done"]
    )


def test_extend_moves_the_lease_expiry(store, clock, config):
    (item_id,) = post(store)
    claim = claim_one(store, config)
    clock.advance(20)
    item = store.extend_lease(queue=Q, item_id=item_id, seconds=100, claim_token=claim.claim_token)
    assert item.lease_expires_at == clock.now + 100
    assert store.read_item(queue=Q, item_id=item_id).lease_expires_at == clock.now + 100
    clock.advance(99)
    assert store.requeue_lapsed(config=config) == []  # the old lease has lapsed, the new one not
    clock.advance(2)
    assert store.requeue_lapsed(config=config) == [item_id]


def test_extend_of_an_item_not_processing_is_not_held(store, config):
    pending_id, done_id = post(store, 1, 2)
    with pytest.raises(NotHeld):
        store.extend_lease(queue=Q, item_id=pending_id, seconds=10)
    store.finish_item(config=config, item_id=done_id, result=1)
    with pytest.raises(NotHeld):
        store.extend_lease(queue=Q, item_id=done_id, seconds=10)
    held = claim_one(store, config)
    with pytest.raises(NotHeld):
        store.extend_lease(queue=Q, item_id=held.id, seconds=10, claim_token="stale")
    assert store.read_item(queue=Q, item_id=held.id).lease_expires_at == held.lease_expires_at


def test_requeue_with_a_stale_claim_token_leaves_the_item_alone(store, clock, config):
    """G8 at store level: a closed socket re-queues only what its claims still hold."""
    (item_id,) = post(store)
    first = claim_one(store, config)
    clock.advance(config.lease_seconds + 1)
    store.requeue_lapsed(config=config)
    second = claim_one(store, config)
    assert not store.requeue_item(queue=Q, item_id=item_id, claim_token=first.claim_token)
    current = store.read_item(queue=Q, item_id=item_id)
    assert (current.status, current.claim_token) == ("processing", second.claim_token)
    assert store.requeue_item(queue=Q, item_id=item_id, claim_token=second.claim_token)
    assert states_of(store, item_id) == ["pending"]
    store.finish_item(config=config, item_id=item_id, result=1)
    assert not store.requeue_item(queue=Q, item_id=item_id, claim_token=second.claim_token)
    assert states_of(store, item_id) == ["done"]


def test_requeue_lapsed_leaves_running_leases_alone(store, clock, config):
    early, late = post(store, 1, 2)
    store.claim_items(config=config)
    clock.advance(10)
    store.claim_items(config=config)
    clock.advance(config.lease_seconds - 5)
    assert store.requeue_lapsed(config=config) == [early]
    assert states_of(store, late) == ["processing"]


# ---- reads, counts, listings -----------------------------------------------------------------


def test_read_item_shows_each_state(store, config):
    pending_id, processing_id, finished_id = post(store, 1, 2, 3)
    store.claim_items(config=config, max_items=3)
    store.release_item(queue=Q, item_id=pending_id)
    store.finish_item(config=config, item_id=finished_id, result="r")
    assert store.read_item(queue=Q, item_id=pending_id).status == "pending"
    assert store.read_item(queue=Q, item_id=processing_id).status == "processing"
    assert store.read_item(queue=Q, item_id=finished_id).status == "finished"
    with pytest.raises(ItemNotFound):
        store.read_item(queue="nosuchqueue", item_id=pending_id)
    assert not (store.data_dir / "nosuchqueue").exists()


def test_count_items_counts_each_state(store, clock, config):
    posted = post(store, *range(6))
    clock.advance(5)
    store.claim_items(config=config, max_items=3)  # 0, 1, 2
    store.finish_item(config=config, item_id=posted[0], result=1)
    store.finish_item(config=config, item_id=posted[3], result=1)
    counts = store.count_items(queue=Q)
    assert (counts.pending, counts.processing, counts.finished, counts.failed) == (2, 2, 2, 0)
    assert counts.oldest_pending_posted_at == pytest.approx(clock.now - 5, abs=0.001)
    clock.advance(config.queue_seconds)
    store.fail_aged(config=config)
    # another process counts what it never saw happen
    counts = alongside(store, clock=clock).count_items(queue=Q)
    assert (counts.pending, counts.processing, counts.finished, counts.failed) == (0, 0, 2, 4)
    assert counts.oldest_pending_posted_at is None


def test_count_items_forgets_deleted_items(store, clock, config):
    item_id = finished_item(store, config)
    assert store.count_items(queue=Q).finished == 1
    clock.advance(config.retain_seconds)
    assert store.delete_expired(config=config) == [item_id]
    assert store.count_items(queue=Q).finished == 0


def test_list_items_pages_newest_first(store, clock, config):
    posted = []
    for n in range(7):
        posted += post(store, n)
        clock.advance(1)
    total, page = store.list_items(queue=Q, state="pending", offset=0, limit=3)
    assert total == 7
    assert [i.id for i in page] == posted[::-1][:3]
    total, page = store.list_items(queue=Q, state="pending", offset=6, limit=3)
    assert [i.id for i in page] == posted[:1]
    store.claim_items(config=config, max_items=2)
    total, page = store.list_items(queue=Q, state="processing")
    assert total == 2
    assert [(i.id, i.status) for i in page] == [(posted[1], "processing"), (posted[0], "processing")]
    with pytest.raises(InvalidRequest):
        store.list_items(queue=Q, state="tmp")


def test_throughput_counts_items_ended_per_minute(store, clock, config):
    first, second, third = post(store, 1, 2, 3)
    store.finish_item(config=config, item_id=first, result=1)
    clock.advance(60)
    store.finish_item(config=config, item_id=second, result=1)
    clock.advance(config.queue_seconds)
    store.fail_aged(config=config)
    rows = store.throughput(queue=Q, minutes=15)
    assert len(rows) == 15
    assert sum(r[1] for r in rows) == 2
    assert sum(r[2] for r in rows) == 1
    assert rows[-1][2] == 1


# ---- crash leftovers: repair, quarantine, tmp --------------------------------------------------


def copy_file(store: Store, item_id: str, source: str, target: str) -> None:
    """What a crash between two steps of a transition leaves: the same id in two states."""
    data = (queue_dir(store) / source / f"{item_id}.json").read_bytes()
    (queue_dir(store) / target / f"{item_id}.json").write_bytes(data)


def test_repair_settles_an_id_in_two_states_done_first(store, config):
    a, b, c = post(store, 1, 2, 3)
    store.claim_items(config=config, max_items=3)
    store.finish_item(config=config, item_id=a, result="kept")
    copy_file(store, a, "done", "pending")  # crash after linking into done, before unlinking
    store.finish_item(config=config, item_id=b, result="kept")
    copy_file(store, b, "done", "processing")
    store.release_item(queue=Q, item_id=c)
    copy_file(store, c, "pending", "processing")
    # done wins before any repair too
    assert store.read_item(queue=Q, item_id=a).result == "kept"
    assert not store.finish_item(config=config, item_id=a, result="second").accepted
    assert sorted(store.repair(queue=Q)) == sorted([a, b, c])
    assert states_of(store, a) == ["done"]
    assert states_of(store, b) == ["done"]
    assert states_of(store, c) == ["pending"]
    assert store.read_item(queue=Q, item_id=a).result == "kept"
    assert store.repair(queue=Q) == []


def test_a_claim_never_hands_out_a_stray_copy_of_a_done_item(store, config):
    (item_id,) = post(store)
    store.finish_item(config=config, item_id=item_id, result="kept")
    copy_file(store, item_id, "done", "pending")
    fresh = alongside(store, clock=store.clock)  # its index lists the stray copy
    assert fresh.claim_items(config=config, max_items=5) == []
    assert store.read_item(queue=Q, item_id=item_id).result == "kept"
    assert store.repair(queue=Q) == [item_id]
    assert states_of(store, item_id) == ["done"]


def test_a_claim_is_not_stuck_on_a_file_it_cannot_claim(store, config):
    (queue_dir(store) / "pending").mkdir(parents=True)
    (queue_dir(store) / "pending" / "junk.json").write_text("{}")
    assert store.claim_items(config=config, max_items=5) == []
    (item_id,) = post(store)
    assert claim_one(store, config).id == item_id


def test_requeue_lapsed_never_resurrects_a_stray_copy_of_a_done_item(store, clock, config):
    (item_id,) = post(store)
    claim_one(store, config)
    stray = queue_dir(store) / "processing" / f"{item_id}.json"
    held = stray.read_bytes()
    store.finish_item(config=config, item_id=item_id, result="kept")
    stray.write_bytes(held)  # a crash after linking into done, before unlinking the source
    clock.advance(config.lease_seconds + 1)
    os.utime(stray, (clock.now - 1, clock.now - 1))
    assert store.requeue_lapsed(config=config) == []
    assert states_of(store, item_id) == ["processing", "done"]  # left for the repair
    store.repair(queue=Q)
    assert states_of(store, item_id) == ["done"]


def test_repair_quarantines_names_that_are_not_item_ids(store):
    post(store)
    (queue_dir(store) / "pending" / "notes.txt").write_text("hello")
    store.repair(queue=Q)
    assert files_in(store, "quarantine") == ["pending-notes.txt"]
    assert len(files_in(store, "pending")) == 1


def test_repair_finds_every_kind_of_name_that_is_not_an_item_id(store):
    good = post(store, *range(20))
    first, second = good[0], good[1]
    junk = [
        f"{first.upper()}.json",
        f"{first[:14]}4{first[15:]}.json",  # version 4
        f"{first[:19]}c{first[20:]}.json",  # wrong variant
        f"{first}.jso",  # with the next name, exactly as long as two good names
        f"n{second}.json",
        f"{first}.json.bak",
        f"{first}",
    ]
    for name in junk:
        (queue_dir(store) / "pending" / name).write_text("{}")
    store.repair(queue=Q)
    assert files_in(store, "quarantine") == sorted(f"pending-{name}" for name in junk)
    assert files_in(store, "pending") == sorted(f"{i}.json" for i in good)


def test_a_claim_quarantines_an_unreadable_file_and_hands_out_the_next(store, clock, config):
    broken, good = post(store, 1, 2)
    (queue_dir(store) / "pending" / f"{broken}.json").write_bytes(b'{"id": "trunc')
    assert claim_one(store, config).id == good
    assert files_in(store, "quarantine") == [f"processing-{broken}.json"]
    assert states_of(store, broken) == []


def test_the_sweep_quarantines_an_unreadable_file_and_goes_on(store, clock, config):
    broken, good = post(store, 1, 2)
    store.claim_items(config=config, max_items=2)
    (queue_dir(store) / "processing" / f"{broken}.json").write_bytes(b"\x00\x00garbage")
    os.utime(queue_dir(store) / "processing" / f"{broken}.json", (clock.now, clock.now))
    clock.advance(config.lease_seconds + 1)
    assert store.requeue_lapsed(config=config) == [good]
    assert files_in(store, "quarantine") == [f"processing-{broken}.json"]
    assert states_of(store, good) == ["pending"]


def test_a_file_whose_content_names_another_item_is_quarantined(store, config):
    a, b = post(store, 1, 2)
    copy_file(store, a, "pending", "tmp")
    os.replace(queue_dir(store) / "tmp" / f"{a}.json", queue_dir(store) / "pending" / f"{b}.json")
    with pytest.raises(ItemNotFound):
        store.read_item(queue=Q, item_id=b)
    assert files_in(store, "quarantine") == [f"pending-{b}.json"]


def test_tmp_files_older_than_an_hour_are_removed(store):
    post(store)
    tmp = queue_dir(store) / "tmp"
    stale, fresh = tmp / "stale.json", tmp / "fresh.json"
    stale.write_text("{}")
    fresh.write_text("{}")
    an_hour_ago = time.time() - STALE_TMP_SECONDS - 5
    os.utime(stale, (an_hour_ago, an_hour_ago))
    assert store.remove_stale_tmp(queue=Q) == 1
    assert files_in(store, "tmp") == ["fresh.json"]


# ---- spare files ------------------------------------------------------------------------------


def test_an_old_item_file_is_kept_as_a_spare_and_the_next_file_written_over_it(store, config):
    (first,) = post(store, "x" * 300)
    claim_one(store, config)
    inode = (queue_dir(store) / "processing" / f"{first}.json").stat().st_ino
    assert store.finish_item(config=config, item_id=first, result="r").accepted
    assert states_of(store, first) == ["done"]
    assert [os.stat(queue_dir(store) / "tmp" / name).st_ino for name in spares(store)] == [inode]

    (second,) = post(store, {"small": 1})  # written over the spare: shorter, and never claimed
    path = queue_dir(store) / "pending" / f"{second}.json"
    assert path.stat().st_ino == inode and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_bytes())["payload"] == {"small": 1}
    if store.claim_xattrs:
        assert CLAIM_XATTR not in os.listxattr(path)  # the first item's claim record is gone
    item = store.read_item(queue=Q, item_id=second)
    assert (item.status, item.attempts, item.payload) == ("pending", 0, {"small": 1})
    assert files_in(store, "tmp") == []
    assert claim_one(store, config).attempts == 1


def test_a_spare_kept_too_long_or_a_file_over_a_block_is_deleted_instead(store, config, monkeypatch):
    big, small = post(store, "x" * 900, "y")
    monkeypatch.setattr(store_module, "_SPARE_MAX_BYTES", 500)  # as a file over a block is
    for item in store.claim_items(config=config, max_items=2):
        store.finish_item(config=config, item_id=item.id, result=None)
    assert len(spares(store)) == 1  # the small item's file only
    monkeypatch.setattr(store_module, "SPARE_SECONDS", -1)  # every spare is too old now
    (third,) = post(store, "z")
    assert files_in(store, "tmp") == []
    assert store.read_item(queue=Q, item_id=third).payload == "z"


def test_a_process_keeps_a_bounded_number_of_spares(store, config, monkeypatch):
    monkeypatch.setattr(store_module, "SPARES_PER_QUEUE", 2)
    posted = post(store, 1, 2, 3, 4)
    store.claim_items(config=config, max_items=4)
    store.finish_items(config=config, results=[(i, None) for i in posted])
    assert len(spares(store)) == 2 and all(states_of(store, i) == ["done"] for i in posted)


def test_spares_not_written_over_in_time_are_deleted_by_the_sweep_and_retention_keeps_none(
    store, clock, config, monkeypatch
):
    (item_id,) = post(store)
    claim_one(store, config)
    store.finish_item(config=config, item_id=item_id, result=None)  # its processing file: a spare
    clock.advance(config.retain_seconds + 1)
    store.sweep_queue(config=config)
    assert states_of(store, item_id) == [] and len(spares(store)) == 1  # retention deletes
    monkeypatch.setattr(store_module, "SPARE_SECONDS", -1)
    store.sweep_queue(config=config)
    assert files_in(store, "tmp") == []  # no old payload lingers


def test_a_spare_is_not_removed_as_stale_before_it_is_written_over(store, config):
    (item_id,) = post(store)
    claim_one(store, config)  # its lease, a minute ahead, is its mtime
    store.finish_item(config=config, item_id=item_id, result=None)
    [spare] = spares(store)
    assert os.stat(queue_dir(store) / "tmp" / spare).st_mtime == pytest.approx(time.time(), abs=5)
    assert store.remove_stale_tmp(queue=Q) == 0


# ---- durability ------------------------------------------------------------------------------


def test_a_store_with_fsync_flushes_posts_and_results_but_not_claims(tmp_path, clock, config, monkeypatch):
    """What is flushed, and where each file is when it is: a single post's file once in pending/
    (claimable meanwhile), a batch's files before pending/ shows them, a result's file before
    done/ shows it."""
    store = Store(tmp_path / "synced", fsync=True, clock=clock)
    root = os.fspath(store.data_dir / Q)
    synced: list[str] = []  # what each fsync flushed, relative to the queue's directory
    real_fsync = os.fsync

    def recording_fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        synced.append(os.path.relpath(path, root).removesuffix(".json") if path.startswith(root) else path)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    store.ensure_queue(Q)
    assert synced == [".", os.fspath(store.data_dir)]  # both hold new entries
    synced.clear()
    (a,) = (i.id for i in store.post_items(queue=Q, payloads=[1]))
    assert synced == [f"pending/{a}", "pending"]  # renamed first: claimable while it is flushed
    synced.clear()
    (b, c) = (i.id for i in store.post_items(queue=Q, payloads=[2, 3]))
    assert [path.split("/")[0] for path in synced] == ["tmp", "tmp", "pending"]  # in parallel
    synced.clear()
    store.claim_items(config=config, max_items=3)
    assert synced == []  # a claim need not survive a power cut: the item is pending again then
    store.extend_lease(queue=Q, item_id=b, seconds=100)
    store.release_item(queue=Q, item_id=b)
    synced.clear()
    assert store.finish_item(config=config, item_id=b, result="r").accepted
    assert [path.split("/")[0] for path in synced] == ["tmp", "done"]  # the file before its name
    assert store.read_item(queue=Q, item_id=b).result == "r"
    synced.clear()
    batch = post(store, 1, 2, 3)
    synced.clear()
    assert all(o.accepted for o in store.finish_items(config=config, results=[(i, "r") for i in batch]))
    assert [path.split("/")[0] for path in synced] == ["tmp"] * 3 + ["done"]  # done/ once for the batch
    assert states_of(store, b) == ["done"] and all(states_of(store, i) == ["done"] for i in batch)


@pytest.mark.parametrize(
    "claimed_during, flushed_dirs",
    [
        (None, ["pending"]),
        ("the file's flush", ["processing"]),  # pending/ would record it gone: not worth a flush
        ("pending/'s flush", ["pending", "processing"]),  # pending/ may have recorded it gone
    ],
)
def test_a_single_post_is_claimable_before_it_is_flushed_and_answered_once_its_name_is_on_disk(
    tmp_path, clock, config, monkeypatch, claimed_during, flushed_dirs
):
    """A single post is renamed into pending/ and only then flushed: a claim may take it (and
    is told it may, through `on_claimable`) while the post waits for the disk. The post returns
    once the file and the directory that names it are flushed."""
    store = Store(tmp_path / "synced", fsync=True, clock=clock)
    store.ensure_queue(Q)
    store.list_pending(queue=Q)
    store.post_items(queue=Q, payloads=["first"])
    store.claim_items(config=config)  # makes the locks, as a running server has them
    here = queue_dir(store)
    real_fsync, flushed, claimable = os.fsync, [], []

    def claim_during(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        during = "the file's flush" if path.endswith(".json") else f"{os.path.basename(path)}/'s flush"
        if during == claimed_during:
            assert store.claim_items_now(config=config, max_items=1)  # the event loop was quicker
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))  # where it is as it is flushed
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", claim_during)
    (item,) = store.begin_post(queue=Q, payloads=["x"], on_claimable=lambda: claimable.append(list(flushed)))()
    assert claimable == [[]]  # told before anything was flushed
    file_in = "processing" if claimed_during == "the file's flush" else "pending"
    assert flushed == [os.fspath(here / file_in / f"{item.id}.json")] + [os.fspath(here / d) for d in flushed_dirs]
    assert states_of(store, item.id) == ["pending" if claimed_during is None else "processing"]


def test_a_single_post_whose_flush_fails_is_taken_back_out_even_if_claimed_meanwhile(tmp_path, clock, config, monkeypatch):
    store = Store(tmp_path / "synced", fsync=True, clock=clock)
    store.ensure_queue(Q)
    store.list_pending(queue=Q)
    store.post_items(queue=Q, payloads=["first"])
    store.claim_items(config=config)
    claimed = []

    def failing_fsync(fd):
        claimed.extend(store.claim_items_now(config=config, max_items=1) or [])
        raise OSError(errno.EIO, "the disk failed")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(StorageUnavailable):
        store.post_items(queue=Q, payloads=["x"])
    [item] = claimed
    monkeypatch.undo()
    assert states_of(store, item.id) == []  # answered 503: not posted, in no state
    with pytest.raises(ItemNotFound):
        store.finish_item(config=config, item_id=item.id, result="too late")
    assert leftovers_in_tmp(store) == []


@pytest.fixture
def disk_steps(monkeypatch) -> list[str]:
    """Each flush, deletion and keeping of a spare, in order, as the store makes them."""
    steps: list[str] = []
    real_fsync, real_unlink, real_rename = os.fsync, os.unlink, os.rename

    def fsync(fd):
        steps.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real_fsync(fd)

    def unlink(path, *args, **kwargs):
        steps.append("unlink " + Path(path).parent.name)
        real_unlink(path, *args, **kwargs)

    def rename(source, target, *args, **kwargs):
        if Path(target).name.startswith("spare-"):
            steps.append("kept as a spare: " + Path(source).parent.name)
        real_rename(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(os, "rename", rename)
    return steps


def test_a_batch_removes_old_files_only_after_done_is_synced(tmp_path, clock, config, disk_steps):
    """Were a pending file removed before done/ is on disk, a power cut could lose the item."""
    store = Store(tmp_path / "synced", fsync=True, clock=clock)
    batch = post(store, 1, 2)
    disk_steps.clear()
    store.finish_items(config=config, results=[(i, "r") for i in batch])
    assert disk_steps == [
        "file", "file", "unlink tmp", "unlink tmp", "dir", "kept as a spare: pending", "kept as a spare: pending"
    ]


def test_an_aged_item_leaves_its_old_file_only_after_done_is_synced(tmp_path, clock, config, disk_steps):
    """G6 and G9: the sweep fails an aged item by writing its done file; were the pending file
    removed before done/ is on disk, a power cut could lose the item."""
    store = Store(tmp_path / "synced", fsync=True, clock=clock)
    (item_id,) = post(store, 1)
    clock.advance(config.queue_seconds + 1)
    disk_steps.clear()
    store.sweep_queue(config=config)
    assert disk_steps == ["file", "unlink tmp", "dir", "kept as a spare: pending"]
    assert store.read_item(queue=Q, item_id=item_id).status == "failed"


# ---- unsafe input ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["..", ".", "../etc", "a/b", "/tmp", "Jobs", "x" * 65, "", "-x", "a\x00"])
def test_an_unsafe_queue_name_never_reaches_the_disk(store, name):
    post(store)  # the data directory holds something to lose
    before = sorted(p for p in store.data_dir.rglob("*"))
    for call in (
        lambda: store.count_items(queue=name),
        lambda: store.list_items(queue=name, state="pending"),
        lambda: store.repair(queue=name),
        lambda: store.remove_stale_tmp(queue=name),
        lambda: store.delete_queue(name),
        lambda: store.claim_items(config=QueueConfig(name=name)),
    ):
        with pytest.raises((UnsafePath, InvalidRequest)):
            call()
    with pytest.raises(UnknownQueue):
        store.finish_item(config=QueueConfig(name=name), item_id=ids.IdMaker().new_ids(1, 0)[0], result=1)
    assert sorted(p for p in store.data_dir.rglob("*")) == before


def test_the_path_builder_refuses_unsafe_pieces(store):
    (item_id,) = post(store)
    for queue, state, piece in [
        ("..", "pending", item_id),
        (Q, "../..", item_id),
        (Q, "pending", "../../x"),
        (Q, "pending", item_id.upper()),
        (Q, "lost+found", item_id),
    ]:
        with pytest.raises(UnsafePath):
            store._path(queue, state, piece)


@pytest.fixture
def no_disk(monkeypatch):
    """Fail the test if anything opens, stats, lists or moves a file."""

    def tripwire(*args, **kwargs):
        raise AssertionError(f"touched the disk: {args!r}")

    for name in ("open", "stat", "lstat", "listdir", "scandir", "rename", "replace", "link", "unlink", "mkdir"):
        monkeypatch.setattr(os, name, tripwire)
    monkeypatch.setattr(builtins, "open", tripwire)


@pytest.mark.parametrize(
    "bad_id",
    ["", "nope", "../../../etc/passwd", "0193A4B2-7C1E-7D3A-9F00-2B6C1D0E4F55", "0193a4b2-7c1e-4d3a-9f00-2b6c1d0e4f55",
     "0193a4b2-7c1e-7d3a-9f00-2b6c1d0e4f55/..", None, 7],
)
def test_a_malformed_id_is_not_found_without_touching_the_disk(store, config, bad_id, no_disk):
    for call in (
        lambda: store.read_item(queue=Q, item_id=bad_id, fetch=True),
        lambda: store.finish_item(config=config, item_id=bad_id, result=1),
        lambda: store.release_item(queue=Q, item_id=bad_id),
        lambda: store.extend_lease(queue=Q, item_id=bad_id, seconds=10),
    ):
        with pytest.raises(ItemNotFound):
            call()
    assert store.requeue_item(queue=Q, item_id=bad_id, claim_token="t") is False


def test_delete_queue_removes_its_items_and_only_them(store, config):
    post(store, queue="keep")
    post(store, 1, 2)
    store.delete_queue(Q)
    assert not queue_dir(store).exists()
    assert store.count_items(queue="keep").pending == 1
    # the queue can be made again from scratch
    (item_id,) = post(store)
    assert claim_one(store, config).id == item_id
