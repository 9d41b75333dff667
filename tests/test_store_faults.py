"""The disk fails: every transition, with its k-th file operation made to fail, for every k.

After each failure: nothing acknowledged is lost, no half file is where a reader looks, each item
is readable in exactly one state (G1) and is as it was before the transition (or, where the
transition succeeded in spite of the fault, as it is after it), and the same transition succeeds
once the fault is gone. Faults: an I/O error, a full disk that stays full, a write cut short, a
flush that fails. Run with fsync on, so the flushes are among the operations.
"""

import errno
import os
from dataclasses import replace

import pytest

from faults import Faults
from queues.exceptions import StorageUnavailable, TaskhosterError
from queues.store import NewItem, QueueConfig, Release, Store, files
from store_support import Q, files_in, half_written, queue_dir
from storekit import post_batch

CONFIG = QueueConfig(name=Q, lease_seconds=30, queue_seconds=600, retain_seconds=60)
KINDS = {
    "eio": dict(error=errno.EIO),
    "disk full": dict(error=errno.ENOSPC, persist=True),
    "short write": dict(calls={"write"}, short=7),
    "flush": dict(calls={"fsync"}, error=errno.EIO),
}


class Clock:
    def __init__(self):
        self.now = 1_796_000_000.0

    def __call__(self):
        return self.now


def picture(store: Store, item_ids) -> dict:
    """Each item as a reader sees it (its state directories and its record); None if gone."""
    seen = {}
    for item_id in item_ids:
        where = [s for s in ("scheduled", "pending", "processing", "done") if (queue_dir(store) / s / f"{item_id}.json").exists()]
        try:
            item = store.read_item(queue=Q, item_id=item_id)
        except TaskhosterError:
            seen[item_id] = None
            continue
        record = item.to_json(payload=True)
        seen[item_id] = (where, record)
    return seen


def assert_whole(store: Store, plan: Faults) -> None:
    """No half file anywhere a reader looks, and nothing left in tmp/ but a file whose removal
    was the operation that failed (the sweep removes it in an hour)."""
    assert files_in(store, "quarantine") == [], "a reader found a half-written file"
    unremoved = {os.path.basename(path) for call, path in plan.struck if call == "unlink"}
    assert set(half_written(store)) <= unremoved


class Walk:
    """One transition from a state set up afresh for every fault."""

    def __init__(self, tmp_path, setup, act):
        self.tmp_path, self.setup, self.act = tmp_path, setup, act
        self.runs = 0

    def fresh(self):
        self.runs += 1
        clock = Clock()
        store = Store(self.tmp_path / f"run{self.runs}", fsync=True, clock=clock)
        ids = self.setup(store, clock)
        return store, clock, ids

    def operations(self) -> int:
        store, clock, ids = self.fresh()
        counting = Faults()
        files.fault = counting
        try:
            self.act(store, clock, ids)
        finally:
            files.fault = None
        return counting.count()

    def each_fault(self, kind: str):
        """(store, clock, ids, before, outcome or the error raised) for each k."""
        for k in range(1, self.operations() + 1):
            store, clock, ids = self.fresh()
            before = picture(store, ids)
            plan = Faults()
            plan.fail(at=k, **KINDS[kind])
            files.fault = plan
            try:
                outcome = self.act(store, clock, ids)
            except StorageUnavailable as error:
                outcome = error
            finally:
                files.fault = None
            assert_whole(store, plan)
            yield store, clock, ids, before, outcome


@pytest.fixture(autouse=True)
def _no_fault_left(monkeypatch):
    monkeypatch.setattr(files, "fault", None)


def posted(store, clock, count=3) -> list[str]:
    return [item.id for item in post_batch(store, Q, [{"n": n} for n in range(count)])]


# ---- posts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("count", [1, 3])
def test_a_post_that_fails_leaves_no_item_and_the_next_try_posts(tmp_path, kind, count):
    walk = Walk(tmp_path, lambda store, clock: [], lambda store, clock, ids: post_batch(store, Q, [{"n": n} for n in range(count)]))
    for store, clock, _, _, outcome in walk.each_fault(kind):
        pending = files_in(store, "pending")
        if isinstance(outcome, StorageUnavailable):
            assert pending == [] and files_in(store, "processing") == []
            outcome = post_batch(store, Q, [{"n": n} for n in range(count)])
        assert sorted(f"{item.id}.json" for item in outcome) == files_in(store, "pending")
        for item in outcome:
            assert store.read_item(queue=Q, item_id=item.id).payload == item.payload


def with_a_spare(store, clock) -> list[str]:
    """An item ended, so the next file made takes its old one over."""
    [item_id] = posted(store, clock, count=1)
    store.claim_items(config=CONFIG)
    store.finish_items(results=[(CONFIG, item_id, "r")])
    return []


@pytest.mark.parametrize("kind", KINDS)
def test_a_post_into_a_spare_file_that_fails_leaves_no_item_and_no_stray_file(tmp_path, kind):
    walk = Walk(tmp_path, with_a_spare, lambda store, clock, ids: post_batch(store, Q, [{"n": 1}]))
    for store, clock, _, _, outcome in walk.each_fault(kind):
        if isinstance(outcome, StorageUnavailable):
            assert files_in(store, "pending") == []
            outcome = post_batch(store, Q, [{"n": 1}])
        assert files_in(store, "pending") == [f"{outcome[0].id}.json"]
        assert store.read_item(queue=Q, item_id=outcome[0].id).payload == {"n": 1}
        # what tmp/ holds is a spare this process still takes over: posting as many leaves none
        spares = [name for name in files_in(store, "tmp") if name.endswith(".spare")]
        if spares:
            post_batch(store, Q, [{"n": n} for n in range(len(spares))])
        assert [name for name in files_in(store, "tmp") if name.endswith(".spare")] == []


# ---- claims ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_claim_that_fails_leaves_the_item_pending_as_it_was(tmp_path, kind):
    walk = Walk(tmp_path, posted, lambda store, clock, ids: store.claim_items(config=CONFIG, max_items=2))
    for store, clock, ids, before, outcome in walk.each_fault(kind):
        claimed = [] if isinstance(outcome, StorageUnavailable) else [item.id for item in outcome]
        now = picture(store, ids)
        for item_id in ids:
            if item_id in claimed:
                where, record = now[item_id]
                assert (where, record["status"], record["attempts"]) == (["processing"], "processing", 1)
            else:
                assert now[item_id] == before[item_id], f"{item_id} changed though not claimed"
        # the next claims hand out the rest, oldest first, each once
        rest = [item.id for item in store.claim_items(config=CONFIG, max_items=3)]
        assert sorted(claimed + rest) == sorted(ids) and not set(claimed) & set(rest)


# ---- results ---------------------------------------------------------------------------------


def claimed(store, clock) -> list[str]:
    ids = posted(store, clock)
    store.claim_items(config=CONFIG, max_items=2)  # the third stays pending (G4: it may finish too)
    return ids


def hand_in_all(store, clock, ids):
    return store.finish_items(results=[(CONFIG, item_id, {"r": item_id}) for item_id in ids])


@pytest.mark.parametrize("kind", KINDS)
def test_a_result_that_fails_leaves_the_item_as_it_was_and_the_next_try_is_accepted(tmp_path, kind):
    walk = Walk(tmp_path, claimed, hand_in_all)
    for store, clock, ids, before, outcome in walk.each_fault(kind):
        outcomes = [outcome] * len(ids) if isinstance(outcome, StorageUnavailable) else outcome
        now = picture(store, ids)
        for item_id, result in zip(ids, outcomes):
            if isinstance(result, TaskhosterError):
                assert isinstance(result, StorageUnavailable)
                assert now[item_id] == before[item_id], f"{item_id} changed though its result was refused"
                (again,) = store.finish_items(results=[(CONFIG, item_id, {"r": item_id})])
                assert again.accepted
            else:
                assert result.accepted
            done = store.read_item(queue=Q, item_id=item_id)  # nothing accepted is lost
            assert (done.status, done.result) == ("finished", {"r": item_id})
        store.sweep_queue(config=replace(CONFIG, retain_seconds=86400))  # a copy a failed unlink left
        for item_id in ids:
            assert picture(store, [item_id])[item_id][0] == ["done"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_error_result_leaves_no_error_mark_and_the_next_try_is_counted_once(tmp_path, kind):
    """An error-shaped result is marked in errors/ with its done file: a failed hand-in takes the
    mark back with it, so counts never say an error the items do not have."""
    def error_of(item_id):
        return {"error": {"type": "ValueError", "message": item_id}}

    def act(store, clock, ids):
        return store.finish_items(results=[(CONFIG, item_id, error_of(item_id)) for item_id in ids])

    walk = Walk(tmp_path, claimed, act)
    for store, clock, ids, before, outcome in walk.each_fault(kind):
        outcomes = [outcome] * len(ids) if isinstance(outcome, StorageUnavailable) else outcome
        ended = [item_id for item_id, result in zip(ids, outcomes) if not isinstance(result, TaskhosterError)]
        assert files_in(store, "errors") == sorted(ended)
        assert store.count_items(queue=Q).errors == len(ended)
        refused = [item_id for item_id in ids if item_id not in ended]
        if refused:
            store.finish_items(results=[(CONFIG, item_id, error_of(item_id)) for item_id in refused])
        assert store.count_items(queue=Q).errors == len(ids)


# ---- release, extend, fetch ------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_release_or_extension_that_fails_changes_nothing(tmp_path, kind):
    def setup(store, clock):
        ids = posted(store, clock, 2)
        for item in store.claim_items(config=CONFIG, max_items=2):
            store.extend_lease(queue=Q, item_id=item.id, seconds=40)  # the claims hold them
        return ids

    def act(store, clock, ids):
        clock.now += 5
        store.extend_lease(queue=Q, item_id=ids[0], seconds=100)
        return store.release_items(releases=[Release(CONFIG, ids[1])])

    walk = Walk(tmp_path, setup, act)
    for store, clock, ids, before, outcome in walk.each_fault(kind):
        now = picture(store, ids)
        if isinstance(outcome, StorageUnavailable):  # the extension failed: nothing else was tried
            assert now == before
            continue
        (released,) = outcome
        if isinstance(released, StorageUnavailable):
            assert now[ids[1]] == before[ids[1]]
        else:
            assert now[ids[1]][0] == ["pending"]
        assert store.read_item(queue=Q, item_id=ids[0]).lease_expires_at == clock.now + 100

    # past the lease the setup gave, short of the extension's: the sweep puts the item back only
    # if the extension failed (a failed one must not hide the lapsed lease from it)
    for store, clock, ids, before, outcome in walk.each_fault(kind):
        clock.now += 41
        extended = not isinstance(outcome, StorageUnavailable)
        assert (ids[0] in store.sweep_queue(config=CONFIG).requeued) != extended


@pytest.mark.parametrize("kind", KINDS)
def test_a_fetch_that_cannot_mark_the_item_still_answers_it(tmp_path, kind):
    def setup(store, clock):
        ids = posted(store, clock, 1)
        store.finish_items(results=[(CONFIG, ids[0], "r")])
        return ids

    walk = Walk(tmp_path, setup, lambda store, clock, ids: store.read_item(queue=Q, item_id=ids[0], fetch=True))
    for store, clock, ids, before, outcome in walk.each_fault(kind):
        if isinstance(outcome, StorageUnavailable):  # the file itself could not be read
            outcome = store.read_item(queue=Q, item_id=ids[0], fetch=True)
        assert (outcome.status, outcome.result) == ("finished", "r")


# ---- the sweep -------------------------------------------------------------------------------


def due(store, clock) -> list[str]:
    """An item to fail (aged), one whose lease lapsed, one past retention, and a crash's copy."""
    aged = posted(store, clock, 1)
    clock.now += 550
    lapsed, retained, doubled = posted(store, clock, 3)
    store.claim_items(config=CONFIG, max_items=5)
    store.finish_items(results=[(CONFIG, retained, "r"), (CONFIG, doubled, "r")])
    done = queue_dir(store) / "done" / f"{doubled}.json"
    (queue_dir(store) / "processing" / f"{doubled}.json").write_bytes(done.read_bytes())
    clock.now += 100  # aged is past queueSeconds, every lease lapsed, retained past retention
    return aged + [lapsed, retained, doubled]


@pytest.mark.parametrize("kind", KINDS)
def test_a_sweep_pass_that_fails_leaves_every_item_in_one_state_and_the_next_pass_finishes(tmp_path, kind):
    keep = replace(CONFIG, retain_seconds=86400)
    walk = Walk(tmp_path, due, lambda store, clock, ids: store.sweep_queue(config=CONFIG))
    for store, clock, ids, before, outcome in walk.each_fault(kind):
        aged, lapsed, retained, doubled = ids
        now = picture(store, ids)
        for item_id in (aged, lapsed):  # as it was, or as the pass leaves it (done may have a
            # stray copy beside it, if removing the old file was what failed: done wins)
            assert now[item_id] == before[item_id] or now[item_id][1]["status"] in ("failed", "pending")
        for item_id in (retained, doubled):  # done wins throughout, till retention deletes it
            assert now[item_id] is None or now[item_id][1] == before[item_id][1]
        store.sweep_queue(config=CONFIG)  # the fault is gone: the next pass does the rest
        after = picture(store, ids)
        assert after[aged][1]["error"] == "timeout" and after[aged][0] == ["done"]
        assert after[lapsed][0] == ["pending"] and after[lapsed][1]["attempts"] == 1
        assert after[retained] is None and after[doubled] is None
        assert store.sweep_queue(config=keep).repaired == []


# ---- beyond the seed: scheduled and keyed posts, release for later, maxAttempts, cancel, retry --


def counted_right(store: Store, ids) -> None:
    """The counts agree with the items: a failed mark only beside a failed done item."""
    ended = {item_id: picture(store, [item_id])[item_id] for item_id in ids}
    failed = sum(1 for seen in ended.values() if seen and seen[1]["status"] == "failed")
    assert store.count_items(queue=Q).failed == failed
    assert len(files_in(store, "failed")) == failed


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("keyed", [False, True])
def test_a_scheduled_or_keyed_post_that_fails_leaves_nothing_and_the_next_try_posts_once(tmp_path, kind, keyed):
    def act(store, clock, ids):
        new = [NewItem({"n": n}, run_at=clock.now + 60 * n or None, key=f"k{n}" if keyed else None) for n in range(3)]
        return store.post_items(config=CONFIG, items=new)

    walk = Walk(tmp_path, lambda store, clock: [], act)
    for store, clock, ids, _, outcome in walk.each_fault(kind):
        if isinstance(outcome, StorageUnavailable):
            assert files_in(store, "pending") == files_in(store, "scheduled") == []
            assert not keyed or files_in(store, "keys") == []
            outcome = act(store, clock, ids)
        assert not any(posted.duplicate for posted in outcome)
        assert [posted.item.status for posted in outcome] == ["pending", "scheduled", "scheduled"]
        assert files_in(store, "pending") + files_in(store, "scheduled") == sorted(
            f"{posted.item.id}.json" for posted in outcome)
        again = act(store, clock, ids)  # a key holds its item; without keys it is three more
        assert [posted.duplicate for posted in again] == [keyed] * 3
        clock.now += 121
        store.promote_due(config=CONFIG)
        assert len(files_in(store, "pending")) == (3 if keyed else 6)


def held(store, clock) -> list[str]:
    ids = posted(store, clock, 2)
    store.claim_items(config=CONFIG, max_items=2)
    return ids


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("limit", [None, 1])
def test_a_release_for_later_with_an_error_that_fails_changes_nothing(tmp_path, kind, limit):
    config = replace(CONFIG, max_attempts=limit)

    def act(store, clock, ids):
        return store.release_items(releases=[Release(config, ids[0], delay=30, error={"why": "busy"}),
                                             Release(config, ids[1], error="flaky")])

    walk = Walk(tmp_path, held, act)
    for store, clock, ids, before, outcome in walk.each_fault(kind):
        outcomes = [outcome] * 2 if isinstance(outcome, StorageUnavailable) else outcome
        now = picture(store, ids)
        for item_id, released in zip(ids, outcomes):
            if isinstance(released, TaskhosterError):
                assert now[item_id] == before[item_id], f"{item_id} changed though its release failed"
            else:  # given back (beside its old copy if removing that was what failed: the sweep's)
                assert set(now[item_id][0]) - {"processing"}
        counted_right(store, ids)
        retried = [Release(config, item_id, error="again") for item_id, out in zip(ids, outcomes)
                   if isinstance(out, TaskhosterError)]
        if retried:
            assert not any(isinstance(out, TaskhosterError) for out in store.release_items(releases=retried))
        after = picture(store, ids)
        for item_id in ids:
            where, record = after[item_id]
            assert "lastError" in record and set(where) - {"processing"}  # what a reader sees wins
            assert record["status"] == ("failed" if limit else record["status"])
        clock.now += CONFIG.lease_seconds + 1
        store.sweep_queue(config=replace(CONFIG, retain_seconds=86400))  # the old copy a failed unlink left
        assert all(len(picture(store, [item_id])[item_id][0]) == 1 for item_id in ids)
        counted_right(store, ids)


@pytest.mark.parametrize("kind", KINDS)
def test_a_cancel_that_fails_leaves_the_item_as_it_was_and_counts_right(tmp_path, kind):
    def setup(store, clock):
        ids = posted(store, clock, 2)
        store.claim_items(config=CONFIG, max_items=1)
        return ids

    def act(store, clock, ids):
        return [store.cancel_item(config=CONFIG, item_id=item_id) for item_id in ids]

    walk = Walk(tmp_path, setup, act)
    for store, clock, ids, before, outcome in walk.each_fault(kind):
        now = picture(store, ids)
        for item_id in ids:
            assert now[item_id] == before[item_id] or now[item_id][1]["error"] == "canceled"
        counted_right(store, ids)
        for item_id in ids:
            store.cancel_item(config=CONFIG, item_id=item_id)
        # a result after the cancel is refused, and the counts still agree
        (late,) = store.finish_items(results=[(CONFIG, ids[0], "late")])
        assert not late.accepted
        store.sweep_queue(config=replace(CONFIG, retain_seconds=86400))
        assert [picture(store, [i])[i][1]["error"] for i in ids] == ["canceled", "canceled"]
        counted_right(store, ids)


@pytest.mark.parametrize("kind", KINDS)
def test_a_retry_that_fails_makes_at_most_one_new_item_and_the_next_try_finds_it(tmp_path, kind):
    def setup(store, clock):
        ids = posted(store, clock, 1)
        store.claim_items(config=CONFIG)
        store.finish_items(results=[(CONFIG, ids[0], "r")])
        return ids

    walk = Walk(tmp_path, setup, lambda store, clock, ids: store.retry_item(config=CONFIG, item_id=ids[0]))
    for store, clock, ids, before, outcome in walk.each_fault(kind):
        old = store.read_item(queue=Q, item_id=ids[0])
        assert (old.status, old.result) == ("finished", "r")  # the old item stays as it is
        new, _ = store.retry_item(config=CONFIG, item_id=ids[0])
        if not isinstance(outcome, StorageUnavailable):
            assert outcome[0].id == new.id
        assert store.read_item(queue=Q, item_id=ids[0]).retried_as == new.id
        assert files_in(store, "pending") == [f"{new.id}.json"]
        assert store.retry_item(config=CONFIG, item_id=ids[0]) [0].id == new.id


@pytest.mark.parametrize("kind", KINDS)
def test_due_items_that_fail_to_move_stay_scheduled_and_the_next_look_moves_them(tmp_path, kind):
    def setup(store, clock):
        new = [NewItem({"n": n}, run_at=clock.now + 10) for n in range(3)]
        ids = [entry.item.id for entry in store.post_items(config=CONFIG, items=new)]
        clock.now += 11
        return ids

    walk = Walk(tmp_path, setup, lambda store, clock, ids: store.promote_due(config=CONFIG))
    for store, clock, ids, before, outcome in walk.each_fault(kind):
        now = picture(store, ids)
        assert all(now[item_id][0] in (["scheduled"], ["pending"]) for item_id in ids)
        clock.now += 2
        store.promote_due(config=CONFIG)
        assert files_in(store, "pending") == sorted(f"{item_id}.json" for item_id in ids)
        assert files_in(store, "scheduled") == []


# ---- a real full disk --------------------------------------------------------------------------
