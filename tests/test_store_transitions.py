"""Every transition of the store and the guarantees it alone can show (G1-G6, G8 of docs/lifecycle.md,
at store level), with the injected FakeClock instead of sleeps. The timers applied by the sweep are in
test_store_sweep.py; failures of the disk in test_store_faults.py."""

import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest

from conftest import alongside
from serverproc import PROJECT_DIR
from queues import ids
from queues.exceptions import InvalidRequest, ItemNotFound, NotHeld, PayloadTooLarge
from queues.store import NewItem, QueueConfig, Release, Store
from queues.store.items import CLAIM_XATTR
from queues.store.layout import DIRECTORIES
from store_support import Q, claim_one, files_in, first_listing_done, half_written, post, queue_dir, states_of
from storekit import finish, post_batch, release

# ---- posting ---------------------------------------------------------------------------------


def test_a_posted_item_is_pending_with_its_payload(store, clock):
    (item,) = post_batch(store, Q, [{"image": "a.png"}])
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
    items = post_batch(store, Q, list(range(1000)))
    assert [i.payload for i in items] == list(range(1000))
    assert [i.id for i in items] == sorted(i.id for i in items)
    assert len(files_in(store, "pending")) == 1000
    assert half_written(store) == []


def test_a_batch_with_one_oversized_payload_writes_nothing(store):
    with pytest.raises(PayloadTooLarge, match="limit is 1024"):
        post_batch(store, Q, [{"ok": 1}, "x" * 2000, {"ok": 2}])
    assert files_in(store, "pending") == []
    assert half_written(store) == []
    assert store.count_items(queue=Q).pending == 0


@pytest.mark.parametrize("payloads", [[], list(range(1001)), "not a list", [{1, 2}], [float("nan")]])
def test_a_bad_batch_is_refused_and_writes_nothing(store, payloads):
    items = [NewItem(payload) for payload in payloads] if isinstance(payloads, list) else payloads
    with pytest.raises(InvalidRequest):
        store.post_items(config=QueueConfig(name=Q), items=items)
    assert files_in(store, "pending") == []
    assert half_written(store) == []


def test_a_bad_queue_name_is_refused_before_the_disk(store):
    for name in ("..", "a/b", "Jobs", "x" * 65, "", "-a"):
        with pytest.raises(InvalidRequest):
            post_batch(store, name, [1])
    assert not store.data_dir.exists()


def test_a_post_tells_waiting_claims_once_its_items_can_be_claimed(tmp_path, clock, config):
    told = []

    class Events:
        def items_available(self, queue, count):
            told.append((queue, count, files_in(store, "pending")))

        def items_terminal(self, queue, item_ids):
            pass

    store = Store(tmp_path / "data", fsync=False, clock=clock, events=Events())
    store.ensure_queue(Q)
    first_listing_done(store)  # a queue's first listing tells of what it finds, on its own time
    posted = post(store, 1, 2)
    assert told == [(Q, 2, sorted(f"{i}.json" for i in posted))]


def test_those_told_an_item_ended_find_it_in_one_state(tmp_path, clock, config):
    """Waiters for a result are told once its old file is gone too: a count or a listing made
    when they are told never shows the item twice."""
    told = []

    class Events:
        def items_available(self, queue, count):
            pass

        def items_terminal(self, queue, item_ids):
            told.append([states_of(store, item_id) for item_id in item_ids])

        def item_canceled(self, queue, item_id, claim_token):
            pass

    store = Store(tmp_path / "data", fsync=True, clock=clock, events=Events())
    post(store, 1, 2, 3)
    claimed = store.claim_items(config=config, max_items=3)
    store.finish_items(results=[(config, item.id, None) for item in claimed[:2]])
    store.cancel_item(config=config, item_id=claimed[2].id)
    assert told == [[["done"], ["done"]], [["done"]]]


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
    if processing.stat().st_ino == inode:  # claims recorded in an xattr
        assert processing.read_bytes() == posted
        attempts, _, _, claim_token = os.getxattr(processing, CLAIM_XATTR).decode().split(" ")
        assert len(os.getxattr(processing, CLAIM_XATTR)) <= 60  # it fits inside an ext4 inode
    else:  # no xattrs: the file is replaced whole
        record = json.loads(processing.read_bytes())
        attempts, claim_token = record["attempts"], record["claimToken"]
    assert (int(attempts), claim_token) == (1, item.claim_token)
    clock.advance(10)
    extended = store.extend_lease(queue=Q, item_id=item_id, seconds=500)
    assert extended.lease_expires_at == clock.now + 500
    assert store.read_item(queue=Q, item_id=item_id).lease_expires_at == clock.now + 500
    assert processing.stat().st_mtime == pytest.approx(clock.now + 500)
    release(store, Q, item_id)
    again = store.read_item(queue=Q, item_id=item_id)
    assert (again.status, again.attempts, again.claim_token, again.lease_expires_at) == ("pending", 1, None, None)


def test_a_paused_queue_hands_out_nothing(store, config):
    (item_id,) = post(store)
    assert store.claim_items(config=replace(config, paused=True), max_items=5) == []
    assert states_of(store, item_id) == ["pending"]
    assert claim_one(store, config).id == item_id


def test_an_item_is_claimed_by_one_claimant_only(store, clock, config):
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
    for _ in range(5):
        posted += post(store, *range(3))
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
    from queues.store.pending import PendingIndex

    listed = PendingIndex._oldest_in_directory
    posted_meanwhile = []

    def list_then_post(index):
        found = listed(index)
        if not posted_meanwhile:
            posted_meanwhile.extend(post(store, "meanwhile"))  # too late for this listing
        return found

    monkeypatch.setattr(PendingIndex, "_oldest_in_directory", list_then_post)
    assert [i.id for i in store.claim_items(config=config, max_items=5)] == posted_meanwhile


def test_a_requeued_item_is_handed_out_before_newer_ones(store, clock, config):
    old = post(store, "old")
    clock.advance(1)
    new = post(store, "new")
    item = claim_one(store, config)
    assert [item.id] == old
    release(store, Q, item.id)
    assert [i.id for i in store.claim_items(config=config, max_items=2)] == old + new


def test_a_claim_passes_over_an_aged_item_and_the_sweep_fails_it(store, clock, config):
    (old,) = post(store, "old")
    clock.advance(config.queue_seconds)
    (young,) = post(store, "young")
    clock.advance(1)
    assert claim_one(store, config).id == young
    assert store.claim_items(config=config) == []
    assert store.sweep_queue(config=config).failed == [old]
    assert store.read_item(queue=Q, item_id=old).status == "failed"


def test_a_claim_never_hands_out_a_stray_copy_of_a_done_item(store, config):
    from store_support import copy_file

    (item_id,) = post(store)
    finish(store, config, item_id, "kept")
    copy_file(store, item_id, "done", "pending")  # a crash after linking into done, before unlinking
    fresh = alongside(store, clock=store.clock)  # its index lists the stray copy
    assert fresh.claim_items(config=config, max_items=5) == []
    assert store.read_item(queue=Q, item_id=item_id).result == "kept"


def test_a_claim_is_not_stuck_on_a_file_it_cannot_claim(store, config):
    (queue_dir(store) / "pending").mkdir(parents=True)
    (queue_dir(store) / "pending" / "junk.json").write_text("{}")
    assert store.claim_items(config=config, max_items=5) == []
    (item_id,) = post(store)
    assert claim_one(store, config).id == item_id


def test_attempts_count_the_claims(store, clock, config):
    """G5: claim, release, claim, lapse and re-queue, claim: three claims."""
    (item_id,) = post(store)
    assert claim_one(store, config).attempts == 1
    release(store, Q, item_id)
    assert store.read_item(queue=Q, item_id=item_id).attempts == 1
    assert claim_one(store, config).attempts == 2
    clock.advance(config.lease_seconds + 1)
    store.sweep_queue(config=config)
    assert claim_one(store, config).attempts == 3
    finish(store, config, item_id, None)
    done = store.read_item(queue=Q, item_id=item_id)
    assert (done.status, done.attempts, done.result) == ("finished", 3, None)


# ---- results ---------------------------------------------------------------------------------


def test_the_first_result_wins_and_later_ones_are_refused(store, clock, config):
    """G3"""
    (item_id,) = post(store)
    claim_one(store, config)
    clock.advance(2)
    first = finish(store, config, item_id, {"ok": True})
    assert (first.accepted, first.status) == (True, "finished")
    second = finish(store, config, item_id, {"ok": False})
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
    release(store, Q, item_id, item.claim_token)
    assert states_of(store, item_id) == ["pending"]
    outcome = finish(store, config, item_id, "late but fine")
    assert outcome.accepted
    assert states_of(store, item_id) == ["done"]
    assert store.read_item(queue=Q, item_id=item_id).result == "late but fine"
    assert store.claim_items(config=config, max_items=5) == []  # never handed out again


def test_a_late_result_after_a_reclaim_wins_if_first(store, clock, config):
    (item_id,) = post(store)
    claim_one(store, config)
    clock.advance(config.lease_seconds + 1)
    assert store.sweep_queue(config=config).requeued == [item_id]
    second_claim = claim_one(store, config)
    assert second_claim.attempts == 2
    assert finish(store, config, item_id, "from the first worker").accepted
    assert not finish(store, config, item_id, "from the second").accepted
    assert store.read_item(queue=Q, item_id=item_id).result == "from the first worker"


def test_a_result_for_an_unknown_item_is_not_found(store, config):
    post(store)
    (never_posted,) = ids.IdMaker().new_ids(1, time.time())
    with pytest.raises(ItemNotFound):
        finish(store, config, never_posted, 1)


def test_an_oversized_result_is_refused_and_changes_nothing(store, config):
    (item_id,) = post(store)
    claim_one(store, config)
    with pytest.raises(PayloadTooLarge):
        finish(store, config, item_id, "x" * 2000)
    assert states_of(store, item_id) == ["processing"]
    assert half_written(store) == []


def test_a_batch_of_results_settles_each_item_as_one_result_would(store, clock, config):
    fresh, held, twice, late, too_big = post(store, 1, 2, 3, 4, 5)
    store.claim_items(config=config, max_items=3)
    assert finish(store, config, late, "first").accepted
    never_posted = ids.IdMaker().new_ids(1, clock.now)[0]
    outcomes = store.finish_items(
        results=[
            (config, held, "a"), (config, twice, "b"), (config, twice, "again"), (config, late, "second"),
            (config, never_posted, "c"), (config, "not-an-id", "d"), (config, too_big, "x" * 2000), (config, fresh, "e"),
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
    assert half_written(store) == []


def test_a_batch_of_results_may_span_queues(store, config):
    other = replace(config, name="other")
    (mine,) = post(store, 1)
    (theirs,) = post(store, 2, queue="other")
    outcomes = store.finish_items(results=[(config, mine, "m"), (other, theirs, "t")])
    assert [(o.id, o.accepted) for o in outcomes] == [(mine, True), (theirs, True)]
    assert store.read_item(queue="other", item_id=theirs).result == "t"


def test_a_batch_of_results_fails_aged_items_instead(store, clock, config):
    (old,) = post(store, 1)
    clock.advance(config.queue_seconds - 10)
    (young,) = post(store, 2)
    clock.advance(11)
    aged, fine = store.finish_items(results=[(config, old, "r"), (config, young, "r")])
    assert (aged.accepted, aged.status, fine.accepted) == (False, "failed", True)
    assert store.read_item(queue=Q, item_id=old).error == "timeout"
    assert states_of(store, old) == ["done"]


def test_batches_of_results_racing_over_the_same_items_accept_each_once(tmp_path, clock, config):
    """Two processes (two stores) with two threads each hand in overlapping batches in different
    orders: none may deadlock or finish an item twice."""
    stores = [Store(tmp_path / "shared", fsync=False, clock=clock) for _ in range(2)]
    posted = [i.id for i in post_batch(stores[0], Q, list(range(600)))]
    accepted: list[str] = []
    lock = threading.Lock()

    def hand_in(store: Store, order: list[str]) -> None:
        for start in range(0, len(order), 100):
            batch = order[start : start + 100]
            outcomes = store.finish_items(results=[(config, i, i) for i in batch])
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


@pytest.mark.parametrize("meanwhile", ["claimed again", "extended", "finished by another"])
def test_a_result_whose_item_moved_on_while_its_batch_was_flushed_is_settled_afresh(
    tmp_path, clock, config, monkeypatch, meanwhile
):
    """A batch writes each done file under the item's lock alone, then flushes them all; an item
    that moves on meanwhile is settled from what it is then, not from what was read."""
    from queues.store import files

    store = Store(tmp_path / "data", fsync=True, clock=clock)
    other = alongside(store, clock=clock)  # another process
    (item_id,) = post(store, 1)
    claim = claim_one(store, config)

    def move_on_once(call, path):  # before the batch's done file is flushed
        if call == "fsync" and "/tmp/" in path:
            monkeypatch.setattr(files, "fault", None)
            if meanwhile == "claimed again":
                release(other, Q, item_id)
                claim_one(other, config)
            elif meanwhile == "extended":
                clock.advance(3)
                other.extend_lease(queue=Q, item_id=item_id, seconds=99, claim_token=claim.claim_token)
            else:
                assert finish(other, config, item_id, "theirs").accepted

    monkeypatch.setattr(files, "fault", move_on_once)
    (outcome,) = store.finish_items(results=[(config, item_id, "r")])
    done = store.read_item(queue=Q, item_id=item_id)
    if meanwhile == "finished by another":
        assert (outcome.accepted, done.result) == (False, "theirs")
    else:
        assert outcome.accepted
        assert (done.status, done.attempts, done.result) == ("finished", 2 if meanwhile == "claimed again" else 1, "r")
    assert states_of(store, item_id) == ["done"]
    assert half_written(store) == []


def test_a_late_result_is_refused_after_timeout(store, clock, config):
    """G6: the verdict is final."""
    (item_id,) = post(store)
    claim_one(store, config)
    clock.advance(config.queue_seconds + 1)
    store.sweep_queue(config=config)
    outcome = finish(store, config, item_id, "too late")
    assert (outcome.accepted, outcome.status) == (False, "failed")
    item = store.read_item(queue=Q, item_id=item_id)
    assert (item.status, item.error, item.result) == ("failed", "timeout", None)


def test_a_result_for_an_aged_item_the_sweep_has_not_seen_fails_it(store, clock, config):
    (item_id,) = post(store)
    claim_one(store, config)
    clock.advance(config.queue_seconds + 1)
    outcome = finish(store, config, item_id, "too late")
    assert (outcome.accepted, outcome.status) == (False, "failed")
    assert store.read_item(queue=Q, item_id=item_id).error == "timeout"
    assert store.count_items(queue=Q).failed == 1


# ---- release, extend -------------------------------------------------------------------------


def test_release_puts_a_processing_item_back_now(store, config):
    (item_id,) = post(store)
    claim = claim_one(store, config)
    item = release(store, Q, item_id, claim.claim_token)
    assert (item.status, item.lease_expires_at, item.claim_token) == ("pending", None, None)
    assert states_of(store, item_id) == ["pending"]
    assert store.read_item(queue=Q, item_id=item_id).to_json()["leaseExpiresAt"] is None


def test_release_of_an_item_not_held_is_refused(store, config):
    pending_id, held_id, done_id = post(store, 1, 2, 3)
    store.claim_items(config=config, max_items=2)
    release(store, Q, pending_id)
    finish(store, config, done_id, 1)
    for item_id, token in ((pending_id, None), (held_id, "someone else"), (done_id, None)):
        with pytest.raises(NotHeld):
            release(store, Q, item_id, token)
    assert (states_of(store, pending_id), states_of(store, held_id), states_of(store, done_id)) == (
        ["pending"], ["processing"], ["done"]
    )


def test_releasing_many_gives_each_claim_its_own_outcome(store, config):
    """What a closed socket re-queues: only what its claims still hold (G8)."""
    a, b, c = post(store, 1, 2, 3)
    claimed = {item.id: item for item in store.claim_items(config=config, max_items=3)}
    finish(store, config, c, 1)
    outcomes = store.release_items(releases=[
        Release(config, a, claimed[a].claim_token), Release(config, b, "stale"),
        Release(config, c, claimed[c].claim_token), Release(config, ids.IdMaker().new_ids(1, 0)[0], "t"),
    ])
    assert outcomes[0].status == "pending"
    assert [type(o) for o in outcomes[1:]] == [NotHeld, NotHeld, ItemNotFound]
    assert [states_of(store, i) for i in (a, b, c)] == [["pending"], ["processing"], ["done"]]


def test_extend_moves_the_lease_expiry(store, clock, config):
    (item_id,) = post(store)
    claim = claim_one(store, config)
    clock.advance(20)
    item = store.extend_lease(queue=Q, item_id=item_id, seconds=100, claim_token=claim.claim_token)
    assert item.lease_expires_at == clock.now + 100
    assert store.read_item(queue=Q, item_id=item_id).lease_expires_at == clock.now + 100
    clock.advance(99)
    assert store.sweep_queue(config=config).requeued == []  # the old lease has lapsed, the new one not
    clock.advance(2)
    assert store.sweep_queue(config=config).requeued == [item_id]


def test_a_claim_and_an_extension_answer_the_times_a_read_shows(store, clock, config):
    """Kept as the API shows them, to the millisecond: a claim made at an instant just short of
    a half millisecond must not read back one millisecond later than its worker was told."""
    (item_id,) = post(store)
    clock.now = 1_796_000_001.0084999  # rounded to microseconds, then milliseconds: .009, not .008
    claim = claim_one(store, config)
    read = store.read_item(queue=Q, item_id=item_id).to_json()
    assert (read["claimedAt"], read["leaseExpiresAt"]) == (claim.to_json()["claimedAt"], claim.to_json()["leaseExpiresAt"])
    extended = store.extend_lease(queue=Q, item_id=item_id, seconds=60, claim_token=claim.claim_token)
    assert store.read_item(queue=Q, item_id=item_id).to_json()["leaseExpiresAt"] == extended.to_json()["leaseExpiresAt"]


def test_extend_of_an_item_not_processing_is_not_held(store, config):
    pending_id, done_id = post(store, 1, 2)
    with pytest.raises(NotHeld):
        store.extend_lease(queue=Q, item_id=pending_id, seconds=10)
    finish(store, config, done_id, 1)
    with pytest.raises(NotHeld):
        store.extend_lease(queue=Q, item_id=done_id, seconds=10)
    held = claim_one(store, config)
    with pytest.raises(NotHeld):
        store.extend_lease(queue=Q, item_id=held.id, seconds=10, claim_token="stale")
    assert store.read_item(queue=Q, item_id=held.id).lease_expires_at == held.lease_expires_at


def test_extend_of_an_item_whose_claim_died_before_its_record_is_not_held(store, config):
    """A claim killed between its rename and its record leaves a processing file nobody holds
    (the sweep puts it back): an extension of it is refused, not a server error."""
    (item_id,) = post(store)
    os.rename(queue_dir(store) / "pending" / f"{item_id}.json", queue_dir(store) / "processing" / f"{item_id}.json")
    with pytest.raises(NotHeld):
        store.extend_lease(queue=Q, item_id=item_id, seconds=100)
    assert store.read_item(queue=Q, item_id=item_id).lease_expires_at is None


def test_a_stale_claim_leaves_the_item_to_the_claim_that_holds_it(store, clock, config):
    """G8 at store level: a closed socket re-queues only what its claims still hold."""
    (item_id,) = post(store)
    first = claim_one(store, config)
    clock.advance(config.lease_seconds + 1)
    store.sweep_queue(config=config)
    second = claim_one(store, config)
    with pytest.raises(NotHeld):
        release(store, Q, item_id, first.claim_token)
    current = store.read_item(queue=Q, item_id=item_id)
    assert (current.status, current.claim_token) == ("processing", second.claim_token)
    release(store, Q, item_id, second.claim_token)
    assert states_of(store, item_id) == ["pending"]


# ---- reads -----------------------------------------------------------------------------------


def test_read_item_shows_each_state(store, config):
    pending_id, processing_id, finished_id = post(store, 1, 2, 3)
    store.claim_items(config=config, max_items=3)
    release(store, Q, pending_id)
    finish(store, config, finished_id, "r")
    assert store.read_item(queue=Q, item_id=pending_id).status == "pending"
    assert store.read_item(queue=Q, item_id=processing_id).status == "processing"
    assert store.read_item(queue=Q, item_id=finished_id).status == "finished"
    with pytest.raises(ItemNotFound):
        store.read_item(queue="nosuchqueue", item_id=pending_id)
    assert not (store.data_dir / "nosuchqueue").exists()


def test_a_read_finds_an_item_a_move_hides_for_an_instant(store, config, monkeypatch):
    """Without the lock, a move between the looks into each state may hide an item; the read
    then looks again under the item's lock, where no move is under way."""
    from queues.store import files

    (item_id,) = post(store, 1)
    claim_one(store, config)  # the queue's locks exist, as on a running server
    real_read, hidden = files.read, []

    def hidden_twice(path, **kwargs):
        if f"/{item_id}.json" in path and len(hidden) < 2 * 3:  # every state, twice
            hidden.append(path)
            raise FileNotFoundError(path)
        return real_read(path, **kwargs)

    monkeypatch.setattr(files, "read", hidden_twice)
    assert store.read_item(queue=Q, item_id=item_id).status == "processing"
    missing = ids.IdMaker().new_ids(1, 0)[0]
    with pytest.raises(ItemNotFound):
        store.read_item(queue=Q, item_id=missing)


def test_a_fetch_marks_a_done_item_once(store, clock, config):
    (item_id,) = post(store, 1)
    store.read_item(queue=Q, item_id=item_id, fetch=True)  # not terminal: no mark
    assert files_in(store, "fetched") == []
    finish(store, config, item_id, 1)
    store.read_item(queue=Q, item_id=item_id)  # not a fetch (the dashboard's)
    assert files_in(store, "fetched") == []
    store.read_item(queue=Q, item_id=item_id, fetch=True)
    first = os.stat(queue_dir(store) / "fetched" / item_id).st_mtime
    clock.advance(100)
    store.read_item(queue=Q, item_id=item_id, fetch=True)
    assert os.stat(queue_dir(store) / "fetched" / item_id).st_mtime == first == pytest.approx(clock.now - 100)
    assert not os.stat(queue_dir(store) / "done" / f"{item_id}.json").st_mode & 0o077  # not a permission


# ---- queues ----------------------------------------------------------------------------------


def test_delete_queue_removes_its_items_and_only_them(store, config):
    post(store, queue="keep")
    post(store, 1, 2)
    store.delete_queue(Q)
    assert sorted(os.listdir(queue_dir(store))) == ["deleted", "locks"]  # locks: kept for the other processes, see below
    assert store.count_items(queue="keep").pending == 1
    # the queue can be made again from scratch
    (item_id,) = post(store)
    assert claim_one(store, config).id == item_id


def test_what_a_post_racing_a_queue_s_deletion_left_goes_when_the_queue_is_made_again(store, config):
    """Another process, not told of the deletion yet (its settings are up to a second old),
    posts to the queue after its directories went: a queue made again under the name starts
    empty all the same."""
    elsewhere = alongside(store)
    post(elsewhere)  # it knows the queue
    store.delete_queue(Q)
    post(elsewhere)  # answered 201 there: the file is made again
    assert store.count_items(queue=Q).pending == 1
    store.create_queue(Q)
    assert store.count_items(queue=Q).pending == 0
    assert sorted(os.listdir(queue_dir(store))) == sorted(DIRECTORIES)
    (item_id,) = post(store)
    assert claim_one(store, config).id == item_id


def test_a_queue_made_over_a_directory_no_deletion_marked_keeps_its_items(store):
    """The queue's database row is gone but no deletion made that (a database lost and made
    again): its items are still the queue's."""
    post(store, 1, 2)
    store.create_queue(Q)
    assert store.count_items(queue=Q).pending == 2


OPEN_THEN_HOLD = """
import sys, time
from pathlib import Path
from contextlib import ExitStack
from queues.store.locks import ITEM_STRIPES, QueueLocks
lock_file, opened, hold, held = sys.argv[1:]
locks = QueueLocks.for_file(lock_file)
Path(opened).write_text("")
while not Path(hold).exists():
    time.sleep(0.01)
with ExitStack() as stack:
    for stripe in range(ITEM_STRIPES):
        stack.enter_context(locks.hold(f"{stripe:02x}"))
    Path(held).write_text("")
    time.sleep(60)
"""


def test_a_queue_deleted_and_made_again_still_locks_against_a_process_that_knew_it_before(tmp_path, config):
    """Another server process opened the queue's lock file before the queue was deleted here and
    made again: its item locks must still exclude this process's."""
    store = Store(tmp_path / "data", fsync=False)
    store.ensure_queue(Q)
    signals = {name: tmp_path / name for name in ("opened", "hold", "held")}
    other = subprocess.Popen([sys.executable, "-c", OPEN_THEN_HOLD, f"{queue_dir(store)}/locks/items",
                              *map(str, signals.values())], cwd=PROJECT_DIR)
    try:
        wait_for_file(signals["opened"], other)
        store.delete_queue(Q)
        store.ensure_queue(Q)
        signals["hold"].write_text("")
        wait_for_file(signals["held"], other)
        fd = os.open(f"{queue_dir(store)}/locks/items", os.O_RDWR)
        try:
            with pytest.raises(OSError):
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
        finally:
            os.close(fd)
    finally:
        other.kill()
        other.wait()


def wait_for_file(path, process) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.parametrize("claimed", ["just after it is moved in", "while pending/ is flushed"])
def test_a_single_post_claimed_before_its_flush_ended_is_answered_and_on_disk(tmp_path, clock, config, monkeypatch, claimed):
    """A single post is in pending/ before its flush ends: a claim (here another process's) may
    take it meanwhile; the post still succeeds, and the directory that names the item then
    (processing/) is flushed too."""
    from queues.store import files

    store = Store(tmp_path / "data", fsync=True, clock=clock)
    other = alongside(store, clock=clock)
    store.ensure_queue(Q)
    seen, taken, flushed = [], [], []
    poster = threading.get_ident()

    def claim_once_due(call, path):
        if threading.get_ident() != poster:
            return  # the pending view's listing in the background: not a step of the post
        due = seen and seen[-1][0] == "rename" if claimed == "just after it is moved in" else path.endswith("/pending")
        if due and call in ("open", "fsync") and not taken:
            monkeypatch.setattr(files, "fault", None)
            taken.extend(other.claim_items(config=config, max_items=1))
            monkeypatch.setattr(files, "fault", claim_once_due)
        seen.append((call, path))
        if call == "fsync":
            flushed.append(path.rsplit("/", 1)[-1])

    monkeypatch.setattr(files, "fault", claim_once_due)
    (item,) = post_batch(store, Q, ["x"])
    assert [c.id for c in taken] == [item.id]
    assert flushed[-1] == "processing"  # where the item is named now
    assert states_of(store, item.id) == ["processing"]


def test_a_single_post_may_be_claimed_while_it_is_flushed(tmp_path, clock, config, monkeypatch):
    """A worker's part of a round trip overlaps the post's wait for the disk: the item is in view
    of this process's claims, and waiting claims are told, before the post's flush ends."""
    from queues.store import files

    told = []

    class Events:
        def items_available(self, queue, count):
            told.append(count)

        def items_terminal(self, queue, item_ids):
            pass

        def item_canceled(self, queue, item_id, claim_token):
            pass

    store = Store(tmp_path / "data", fsync=True, clock=clock, events=Events())
    store.ensure_queue(Q)
    first_listing_done(store)
    claimed = []

    def claim_during_the_flush(call, path):
        if call == "fsync" and "/pending/" in path and not claimed:
            assert told == [1]
            claimed.extend(store.claim_items(config=config))

    monkeypatch.setattr(files, "fault", claim_during_the_flush)
    (item,) = post_batch(store, Q, ["x"])
    assert [c.id for c in claimed] == [item.id]
    assert states_of(store, item.id) == ["processing"]


def test_a_claim_never_waits_for_a_large_directory_to_be_listed(tmp_path, clock, config, monkeypatch):
    """A fresh process over a large pending directory lists it in the background: its claims find
    nothing meanwhile (they may run on the event loop), and waiting claims are told once the
    listing is in."""
    from queues.store.pending import PendingIndex

    builder = Store(tmp_path / "data", fsync=False, clock=clock)
    posted = [item.id for start in range(0, 3000, 1000) for item in post_batch(builder, Q, list(range(start, start + 1000)))]
    assert os.stat(queue_dir(builder) / "pending").st_size > 64 << 10  # a large directory
    listed, told = threading.Event(), threading.Event()
    real_listing = PendingIndex._oldest_in_directory

    def slow_listing(index):
        listed.wait(10)
        return real_listing(index)

    class Events:
        def items_available(self, queue, count):
            told.set()

        def items_terminal(self, queue, item_ids):
            pass

        def item_canceled(self, queue, item_id, claim_token):
            pass

    monkeypatch.setattr(PendingIndex, "_oldest_in_directory", slow_listing)
    fresh = Store(tmp_path / "data", fsync=False, clock=clock, events=Events())
    assert fresh.claim_items(config=config, max_items=5) == []  # did not wait for the listing
    listed.set()
    assert told.wait(10)
    assert [item.id for item in fresh.claim_items(config=config, max_items=5)] == posted[:5]
