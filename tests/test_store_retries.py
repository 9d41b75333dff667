"""Beyond the seed, in the store: scheduled items and their promotion, releases with a delay and
an error, maxAttempts on every re-queue path, retries and cancels, with the injected clock."""

import errno
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from queues import ids
from queues.exceptions import InvalidRequest, ItemNotFound, NotEnded, NotHeld, TaskhosterError
from queues.store import ABSENT, NewItem, QueueConfig, Release, Store, files
from queues.store.items import NoEvents
from queues.store.promote import promote
from queues.store import transitions as transitions_module
from queues.store.layout import SLOT_SECONDS, STALE_SECONDS
from conftest import FakeClock, alongside
from store_support import Q, claim_one, files_in, first_listing_done, queue_dir, states_of
from serverproc import PROJECT_DIR
from storekit import finish, release


def schedule(store, config, *run_ats, payload="p") -> list[str]:
    return [posted.item.id for posted in store.post_items(config=config, items=[NewItem(payload, run_at=t) for t in run_ats])]


def due_marks(store) -> list[str]:
    schedule_dir = queue_dir(store, Q) / "schedule"
    return sorted(mark.name for mark in schedule_dir.glob("*/*"))


# ---- scheduled items ---------------------------------------------------------------------------


def test_a_post_for_later_is_scheduled_and_comes_due_at_its_run_at(store, clock, config):
    (item_id,) = schedule(store, config, clock.now + 30)
    item = store.read_item(queue=Q, item_id=item_id)
    assert (item.status, item.run_at, states_of(store, item_id)) == ("scheduled", clock.now + 30, ["scheduled"])
    assert item.to_json()["runAt"] == ids.iso(clock.now + 30)
    assert store.claim_items(config=config, max_items=5) == []  # a claim never returns a scheduled item
    assert store.count_items(queue=Q).scheduled == 1
    clock.advance(29.9)
    assert store.promote_due(config=config) == []  # never before its runAt
    clock.advance(0.1)
    assert store.promote_due(config=config) == [item_id]
    assert states_of(store, item_id) == ["pending"]
    assert claim_one(store, config).id == item_id
    clock.advance(SLOT_SECONDS)
    store.promote_due(config=config)
    assert files_in(store, "schedule") == []  # its slot is gone once it passed


def test_a_run_at_in_the_past_or_now_posts_a_pending_item(store, clock, config):
    past, now = schedule(store, config, clock.now - 5, clock.now)
    assert states_of(store, past) == states_of(store, now) == ["pending"]
    assert "runAt" not in store.read_item(queue=Q, item_id=past).to_json()


def test_a_run_at_past_the_queue_timeout_is_refused_and_nothing_is_stored(store, clock, config):
    with pytest.raises(InvalidRequest, match="queueSeconds"):
        schedule(store, config, clock.now + 1, clock.now + config.queue_seconds)
    assert files_in(store, "scheduled") == files_in(store, "pending") == [] and files_in(store, "schedule") == []


def test_a_run_at_at_the_posted_at_plus_queue_seconds_is_refused_to_the_millisecond(store, clock, config):
    """postedAt is the id's millisecond: a runAt within the millisecond after `now` plus
    queueSeconds would age the item out before it came due."""
    clock.now = 1_796_000_000.0006
    with pytest.raises(InvalidRequest, match="queueSeconds"):
        schedule(store, config, clock.now + config.queue_seconds - 0.0003)
    (item_id,) = schedule(store, config, 1_796_000_000.0 + config.queue_seconds - 0.001)
    item = store.read_item(queue=Q, item_id=item_id)
    assert item.run_at < item.posted_at + config.queue_seconds


def test_an_item_due_within_a_millisecond_never_comes_due_before_its_run_at(store, clock, config):
    run_at = clock.now + 10.0009
    (item_id,) = schedule(store, config, run_at)
    clock.now = run_at - 0.0008  # past the millisecond below the runAt
    assert store.promote_due(config=config) == []
    clock.now = run_at + 0.0001
    assert store.promote_due(config=config) == [item_id]


def test_due_items_come_out_oldest_first_and_a_batch_may_mix(store, clock, config):
    later, now_, sooner = schedule(store, config, clock.now + 20, None, clock.now + 10)
    assert states_of(store, now_) == ["pending"]
    clock.advance(25)
    assert store.promote_due(config=config) == [sooner, later]
    assert [item.id for item in store.claim_items(config=config, max_items=5)] == [later, now_, sooner]  # by id


def test_another_process_and_a_restarted_one_promote_what_this_one_scheduled(store, clock, config):
    (item_id,) = schedule(store, config, clock.now + 3 * SLOT_SECONDS)
    clock.advance(3 * SLOT_SECONDS + 1)
    restarted = Store(store.data_dir, fsync=False, clock=clock)  # knows nothing but the disk
    assert restarted.promote_due(config=config) == [item_id]
    assert store.promote_due(config=config) == []  # promoted once


def test_a_post_never_touches_its_scheduled_file_once_it_is_in(store, clock, config, monkeypatch):
    """Its mark is on disk before: another process may promote the item the moment it shows, and
    the post is answered all the same."""
    shown = []

    def hook(call, path):
        if shown and "/scheduled/" in path:
            raise FileNotFoundError(errno.ENOENT, "promoted meanwhile", path)
        if call == "rename" and "/scheduled/" in path:
            shown.append(path)

    monkeypatch.setattr(files, "fault", hook)
    (item_id,) = schedule(store, config, clock.now + 10)
    assert shown and states_of(store, item_id) == ["scheduled"]


def test_a_look_that_lags_never_moves_an_item_scheduled_again_since_it_listed_the_mark(store, clock, config,
                                                                                       faults):
    """Two looks list a post's mark (the promoter's and the sweep's, or two processes'): one
    moves the item (unread: it is as it was posted), a worker takes it and gives it back for
    later, and only then does the other go on with the mark it listed. The item stays scheduled
    until its new runAt. (The store's clock runs a year ahead of the machine's: file times must
    come from the one that times the marks.)"""
    clock.now = float(int(time.time()) + 365 * 86400)
    (item_id,) = schedule(store, config, clock.now + 10)
    clock.advance(10)
    lagging = alongside(store, clock=clock)
    listed = lagging._items.schedule.due(Q, clock.now).marks
    faults.clear()
    assert store.promote_due(config=config) == [item_id]
    assert not [path for call, path in faults.calls if call == "open" and "/scheduled/" in path]
    release(store, config, claim_one(store, config).id, delay=300)
    assert promote(lagging._items, config, listed, clock.now) == []
    assert states_of(store, item_id) == ["scheduled"]
    clock.advance(300)
    assert store.promote_due(config=config) == [item_id]


def test_on_a_full_disk_an_aged_item_that_cannot_end_holds_back_no_other_due_item(store, clock, config, faults):
    """A scheduled item that aged out ends failed, which writes its done file; a full disk
    refuses that, and the items due after it are moved to pending all the same."""
    (aged,) = schedule(store, config, clock.now + 10)
    clock.advance(config.queue_seconds - 5)
    (due,) = schedule(store, config, clock.now + 1)
    clock.advance(10)
    faults.fail(where=f"/{Q}/tmp/", error=errno.ENOSPC, persist=True)
    assert store.promote_due(config=config) == [due]
    assert states_of(store, aged) == ["scheduled"]
    faults.clear()
    # its mark stays, for the next look that lists every slot (a process's first, and one a minute)
    assert alongside(store, clock=clock).promote_due(config=config) == []
    assert store.read_item(queue=Q, item_id=aged).error == "timeout"


def test_a_quiet_look_for_due_items_lists_no_more_than_a_slot_or_two(store, clock, config, faults):
    """A million items scheduled for later cost a look nothing: it lists what came due only."""
    schedule(store, config, *(clock.now + 50 + n for n in range(200)))
    store.promote_due(config=config)  # the first look at a queue lists its slots
    clock.advance(1)
    faults.clear()
    store.promote_due(config=config)
    listed = [path for call, path in faults.calls if call == "listdir"]
    assert len(listed) <= 2 and not any(path.endswith("/scheduled") for path in listed)


def test_claims_posts_and_a_quiet_sweep_never_look_at_items_scheduled_for_later(store, clock, config, faults):
    """What they cost does not grow with the items waiting for later: none of them lists
    scheduled/ or reads a scheduled item, or lists a slot that is not due."""
    later = schedule(store, config, *(clock.now + 100 + n for n in range(50)))
    schedule(store, config, None, None)
    store.sweep_queue(config=config)  # a process's first look at the queue lists its slots
    clock.advance(1)
    faults.clear()
    store.post_items(config=config, items=[NewItem("one more")])
    claim_one(store, config)
    changes = store.sweep_queue(config=config)
    assert not changes.promoted and not changes.requeued and not changes.failed
    later_slots = {f"/schedule/{int(clock.now + 100 + n) // SLOT_SECONDS}" for n in range(50)}
    touched = [path for _, path in faults.calls]
    assert touched and not [path for path in touched if "/scheduled" in path or any(
        path.endswith(slot) or slot + "/" in path for slot in later_slots)]
    assert all(states_of(store, item_id) == ["scheduled"] for item_id in later)


def test_the_sweep_promotes_too(store, clock, config):
    (item_id,) = schedule(store, config, clock.now + 5)
    clock.advance(6)
    assert store.sweep_queue(config=config).promoted == [item_id]


def test_a_scheduled_item_ages_out_like_any_other(store, clock, config):
    (held,) = schedule(store, config, None)
    claim = claim_one(store, config)
    # a release may reach past the queue timeout: the item fails when it ages out, scheduled
    release(store, config, held, claim.claim_token, delay=config.queue_seconds * 2)
    clock.advance(config.queue_seconds - 1)
    assert store.promote_due(config=config) == []
    assert store.read_item(queue=Q, item_id=held).status == "scheduled"
    clock.advance(2)
    assert store.promote_due(config=config) == []
    aged = store.read_item(queue=Q, item_id=held)
    assert (aged.status, aged.error) == ("failed", "timeout")


def test_an_item_marked_for_its_timeout_waits_for_its_run_at_once_the_timeout_is_raised(store, clock, config):
    (held,) = schedule(store, config, None)
    claim = claim_one(store, config)
    release(store, config, held, claim.claim_token, delay=config.queue_seconds * 2)
    (mark,) = due_marks(store)
    assert mark.endswith(".read")  # due when it ages out, not at its runAt: read to see which
    raised = replace(config, queue_seconds=config.queue_seconds * 3)
    clock.advance(config.queue_seconds + 1)
    assert store.promote_due(config=raised) == []  # not aged out under the new timeout, not due either
    assert states_of(store, held) == ["scheduled"]
    (again,) = due_marks(store)
    assert not again.endswith(".read")  # marked for its runAt now
    clock.advance(config.queue_seconds)
    assert store.promote_due(config=raised) == [held]


def test_an_item_due_at_its_run_at_that_aged_out_meanwhile_fails_instead(store, clock, config):
    (item_id,) = schedule(store, config, clock.now + 100)
    lowered = replace(config, queue_seconds=50)
    clock.advance(100)
    assert store.promote_due(config=lowered) == []
    aged = store.read_item(queue=Q, item_id=item_id)
    assert (aged.status, aged.error) == ("failed", "timeout")


def test_a_lowered_queue_timeout_reaches_the_items_scheduled_under_the_old_one(store, clock, config):
    """G6 for scheduled items: each is marked when it is scheduled, under the limit of then."""
    (far,) = schedule(store, config, clock.now + 500)
    clock.advance(100)
    aged, near = schedule(store, config, clock.now + 400, clock.now + 20)
    clock.advance(100)  # far is 200 s old, aged and near 100 s; near is due
    lowered = replace(config, queue_seconds=150)
    store.mark_timeouts(config=lowered)
    assert store.read_item(queue=Q, item_id=far).error == "timeout"  # older than the new limit already
    marks = due_marks(store)
    assert [mark for mark in marks if near in mark] == [f"{int((clock.now - 80) * 1000)}.{near}"]  # no more
    assert f"{ids.id_millis(aged) + 150_000}.{aged}.read" in marks
    assert store.promote_due(config=lowered) == [near]
    clock.advance(49)
    assert store.promote_due(config=lowered) == [] and states_of(store, aged) == ["scheduled"]
    clock.advance(2)  # aged is 151 s old, its runAt 249 s off
    assert store.promote_due(config=lowered) == []
    assert store.read_item(queue=Q, item_id=aged).error == "timeout"


@pytest.mark.parametrize("claims", ["xattr", "rewrite"])
def test_many_items_due_at_once_are_promoted_in_chunks_each_claimable_at_once(tmp_path, clock, config, monkeypatch, claims):
    import queues.store.transitions as transitions

    pushed = []

    class Events(NoEvents):
        def items_available(self, queue, count):
            pushed.append(count)

    monkeypatch.setattr(transitions, "PROMOTE_CHUNK", 3)
    if claims == "rewrite":  # as on a file system without xattrs, like the store fixture's second kind
        monkeypatch.setattr(files, "set_xattr", lambda path, name, value: False)
    store = Store(tmp_path / "data", fsync=False, clock=clock, events=Events())
    scheduled = schedule(store, config, *[clock.now + 5] * 8)
    first_listing_done(store)
    pushed.clear()
    clock.advance(5)
    assert store.promote_due(config=config) == scheduled
    assert pushed == [3, 3, 2]
    assert [item.id for item in store.claim_items(config=config, max_items=10)] == scheduled
    assert due_marks(store) == []


def test_a_late_result_is_accepted_while_the_item_is_scheduled(store, clock, config):
    (item_id,) = schedule(store, config, None)
    claim = claim_one(store, config)
    release(store, config, item_id, claim.claim_token, delay=60)
    assert finish(store, config, item_id, "late").accepted  # G4
    clock.advance(61)
    assert store.promote_due(config=config) == []  # its mark only remained
    assert (store.read_item(queue=Q, item_id=item_id).result, states_of(store, item_id)) == ("late", ["done"])


def test_a_release_for_later_whose_move_failed_never_brings_a_later_release_forward(store, clock, config, faults):
    """The failed release's mark stays; the item, released again for much later, waits for that."""
    config = replace(config, queue_seconds=86400)
    (item_id,) = schedule(store, config, None)
    claim = claim_one(store, config)
    faults.fail(calls={"create"}, where=f"/{Q}/tmp/")  # the rewrite of the item, after its mark
    with pytest.raises(TaskhosterError):
        release(store, config, item_id, claim.claim_token, delay=60)
    faults.clear()
    assert states_of(store, item_id) == ["processing"]

    release(store, config, item_id, claim.claim_token, delay=3600)
    clock.advance(61)
    assert store.promote_due(config=config) == []
    assert states_of(store, item_id) == ["scheduled"]
    clock.advance(3600)
    assert store.promote_due(config=config) == [item_id]


# ---- a mark due by the time its item shows -----------------------------------------------------


def _once_before(where: str, action):
    """For files.fault: `action` runs before the first file operation on a path holding `where`."""
    armed = [True]

    def hook(call, path):
        if armed[0] and where in path:
            armed[0] = False
            action()

    return hook


def _looks_pass_the_slot_of(run_at, lookers, clock, config):
    """Every process's look, once its clock is past the end of `run_at`'s slot: none finds the
    mark, which is not made yet, and each passes that slot for good."""

    def look():
        clock.now = (int(run_at) // SLOT_SECONDS + 1) * SLOT_SECONDS + 0.5
        assert [looker.promote_due(config=config) for looker in lookers] == [[]] * len(lookers)

    return look


def test_a_post_whose_run_at_and_slot_pass_before_its_mark_is_made_makes_its_item_pending(store, clock, config, monkeypatch):
    other = alongside(store, clock=clock)
    for looker in (store, other):
        looker.promote_due(config=config)  # it listed the queue's slots: from now on the new ones only
    run_at = (int(clock.now) // SLOT_SECONDS + 1) * SLOT_SECONDS - 0.001  # its slot ends a moment after it
    monkeypatch.setattr(files, "fault", _once_before("/schedule/", _looks_pass_the_slot_of(run_at, [store, other], clock, config)))
    (posted,) = store.post_items(config=config, items=[NewItem("p", run_at=run_at)])
    item_id = posted.item.id
    assert posted.item.status == "pending"  # answered as it is now
    assert states_of(store, item_id) == ["pending"] and due_marks(store) == []
    assert claim_one(store, config).id == item_id


def test_a_post_whose_mark_a_look_found_before_its_item_showed_makes_its_item_pending(store, clock, config, monkeypatch):
    other = alongside(store, clock=clock)
    run_at = clock.now + 1

    def look():
        clock.now = run_at
        assert other.promote_due(config=config) == []  # the mark came due without its item: left for it
        assert len(due_marks(store)) == 1

    monkeypatch.setattr(files, "fault", _once_before("/scheduled/", look))
    (item_id,) = schedule(store, config, run_at)
    assert states_of(store, item_id) == ["pending"]
    assert claim_one(store, config).id == item_id


def test_a_post_whose_mark_a_look_ahead_of_its_clock_found_keeps_it(store, clock, config, monkeypatch):
    """Hosts sharing a data directory: the look's clock is ahead of the post's, so the mark is
    due for the look before the item shows, and not yet due for the post."""
    ahead = FakeClock(clock.now + 5)
    other = alongside(store, clock=ahead)
    run_at = clock.now + 1

    def look():
        assert other.promote_due(config=config) == [] and len(due_marks(store)) == 1  # left for its item

    monkeypatch.setattr(files, "fault", _once_before("/scheduled/", look))
    (item_id,) = schedule(store, config, run_at)
    assert states_of(store, item_id) == ["scheduled"] and len(due_marks(store)) == 1
    clock.advance(1)
    assert store.promote_due(config=config) == [item_id]


class Killed(BaseException):
    """The process is killed here."""


def test_a_post_killed_after_a_look_found_its_mark_before_its_item_leaves_the_item_to_a_later_look(
        store, clock, config, monkeypatch):
    """Its maker writes the mark, then moves the item in, then checks the mark: killed before
    that check, the item has only its mark to bring it to pending."""
    other = alongside(store, clock=clock)
    run_at = clock.now + 1

    def look():
        clock.now = run_at
        assert other.promote_due(config=config) == []

    def killed(*args):
        raise Killed

    monkeypatch.setattr(files, "fault", _once_before("/scheduled/", look))
    monkeypatch.setattr(transitions_module, "promote_if_due", killed)
    with pytest.raises(Killed):
        schedule(store, config, run_at)
    monkeypatch.undo()
    (item_id,) = [p.name.removesuffix(".json") for p in (queue_dir(store, Q) / "scheduled").iterdir()]
    clock.advance(1)
    assert alongside(store, clock=clock).promote_due(config=config) == [item_id]
    assert states_of(store, item_id) == ["pending"] and due_marks(store) == []


@pytest.mark.parametrize("at_run_at", [True, False], ids=["moved unread", "read first"])
def test_a_mark_whose_item_never_came_is_a_leftover_after_an_hour(store, clock, config, at_run_at):
    """Its maker was killed after it wrote the mark and before it moved the item in."""
    store.ensure_queue(Q)
    (item_id,) = ids.IdMaker().new_ids(1, clock.now)
    run_at = clock.now + 1
    store._items.schedule.mark(Q, item_id, run_at, at_run_at=at_run_at)
    clock.now = run_at
    assert store.promote_due(config=config) == [] and len(due_marks(store)) == 1  # it may yet come
    clock.now = run_at + STALE_SECONDS
    assert store.promote_due(config=config) == [] and due_marks(store) == []


def test_a_post_whose_mark_a_look_found_early_and_that_could_not_be_promoted_keeps_its_mark(store, clock, config, monkeypatch, caplog):
    other = alongside(store, clock=clock)
    run_at = clock.now + 1
    looked = []

    def hook(call, path):
        if "/scheduled/" in path and not looked:
            clock.now = run_at
            assert other.promote_due(config=config) == []  # the mark came due without its item: kept
            looked.append(True)
        if looked and call == "rename" and "/pending/" in path:  # the post's own promotion fails
            raise OSError(errno.EIO, "injected", path)

    monkeypatch.setattr(files, "fault", hook)
    (item_id,) = schedule(store, config, run_at)
    monkeypatch.setattr(files, "fault", None)
    assert states_of(store, item_id) == ["scheduled"] and len(due_marks(store)) == 1
    assert "could not promote item" in caplog.text
    assert alongside(store, clock=clock).promote_due(config=config) == [item_id]


def test_a_release_for_later_whose_slot_passes_before_its_mark_is_made_makes_its_item_pending(store, clock, config, monkeypatch):
    (item_id,) = schedule(store, config, None)
    claim = claim_one(store, config)
    other = alongside(store, clock=clock)
    for looker in (store, other):
        looker.promote_due(config=config)
    run_at = (int(clock.now) // SLOT_SECONDS + 1) * SLOT_SECONDS - 0.001
    monkeypatch.setattr(files, "fault", _once_before("/schedule/", _looks_pass_the_slot_of(run_at, [store, other], clock, config)))
    assert release(store, config, item_id, claim.claim_token, delay=run_at - clock.now).status == "pending"
    assert states_of(store, item_id) == ["pending"] and due_marks(store) == []
    assert (claim_one(store, config).id, store.read_item(queue=Q, item_id=item_id).attempts) == (item_id, 2)


def test_an_item_marked_again_for_its_run_at_that_comes_due_meanwhile_is_promoted_by_that_look(store, clock, config, monkeypatch):
    (held,) = schedule(store, config, None)
    claim = claim_one(store, config)
    release(store, config, held, claim.claim_token, delay=config.queue_seconds + 3 * SLOT_SECONDS)
    (mark,) = due_marks(store)
    assert mark.endswith(".read")  # due when it ages out, before its runAt
    raised = replace(config, queue_seconds=config.queue_seconds * 3)
    clock.advance(config.queue_seconds + SLOT_SECONDS + 1)  # the queue timeout's slot has ended
    run_at = store.read_item(queue=Q, item_id=held).run_at
    # this process's next look, while the mark for its runAt is being made
    monkeypatch.setattr(files, "fault", _once_before(f"/schedule/{int(run_at) // SLOT_SECONDS}",
                                                     _looks_pass_the_slot_of(run_at, [store], clock, raised)))
    assert store.promote_due(config=raised) == [held]
    assert states_of(store, held) == ["pending"] and due_marks(store) == []


def test_a_release_promoted_at_once_tells_waiting_claims_once(tmp_path, clock, config):
    told = []

    class Events(NoEvents):
        def items_available(self, queue, count):
            told.append(count)

    store = Store(tmp_path / "data", fsync=False, clock=clock, events=Events())
    (item_id,) = schedule(store, config, None)
    claim = claim_one(store, config)
    first_listing_done(store)
    told.clear()
    run_at = (int(clock.now) // SLOT_SECONDS + 1) * SLOT_SECONDS - 0.001

    def late():
        clock.now = run_at + 1  # due by the time the item shows in scheduled/

    files.fault = _once_before("/schedule/", late)
    try:
        assert release(store, config, item_id, claim.claim_token, delay=run_at - clock.now).status == "pending"
    finally:
        files.fault = None
    assert told == [1]


def test_a_post_whose_item_came_due_but_could_not_be_promoted_stands_and_a_later_look_promotes_it(store, clock, config, monkeypatch, caplog):
    run_at = clock.now + 1

    def hook(call, path):
        if "/schedule/" in path:
            clock.now = run_at  # due by the time the item shows
        if call == "rename" and "/pending/" in path:
            raise OSError(errno.EIO, "injected", path)

    monkeypatch.setattr(files, "fault", hook)
    (item_id,) = schedule(store, config, run_at)  # answered: the item is on disk, scheduled
    monkeypatch.setattr(files, "fault", None)
    assert states_of(store, item_id) == ["scheduled"] and len(due_marks(store)) == 1
    assert "could not promote item" in caplog.text
    assert alongside(store, clock=clock).promote_due(config=config) == [item_id]


# ---- release with delay and error --------------------------------------------------------------


def test_a_release_with_an_error_keeps_it_as_last_error_and_the_next_one_replaces_it(store, clock, config):
    (item_id,) = schedule(store, config, None)
    first = claim_one(store, config)
    back = release(store, config, item_id, first.claim_token, error={"why": "flaky"})
    assert (back.status, back.last_error, back.attempts) == ("pending", {"why": "flaky"}, 1)
    assert store.read_item(queue=Q, item_id=item_id).to_json()["lastError"] == {"why": "flaky"}
    second = claim_one(store, config)
    assert (second.attempts, second.last_error) == (2, {"why": "flaky"})  # claims show it too
    release(store, config, item_id, second.claim_token, error=None)
    assert store.read_item(queue=Q, item_id=item_id).last_error is None
    third = claim_one(store, config)
    finish(store, config, item_id, "done at last")
    done = store.read_item(queue=Q, item_id=item_id)
    assert (done.status, done.attempts, done.last_error, third.attempts) == ("finished", 3, None, 3)


def test_a_release_with_a_delay_schedules_the_item(store, clock, config):
    (item_id,) = schedule(store, config, None)
    claim = claim_one(store, config)
    back = release(store, config, item_id, claim.claim_token, delay=30, error="busy")
    assert (back.status, back.run_at, states_of(store, item_id)) == ("scheduled", clock.now + 30, ["scheduled"])
    clock.advance(30)
    assert store.promote_due(config=config) == [item_id]
    again = claim_one(store, config)
    assert (again.attempts, again.last_error) == (2, "busy")


def test_a_release_without_an_error_keeps_the_last_one(store, config):
    (item_id,) = schedule(store, config, None)
    release(store, config, item_id, claim_one(store, config).claim_token, error="first")
    release(store, config, item_id, claim_one(store, config).claim_token)
    assert store.read_item(queue=Q, item_id=item_id).last_error == "first"


# ---- maxAttempts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["release", "lease", "socket", "staff"])
def test_an_item_that_had_its_max_attempts_ends_instead_of_going_back(store, clock, config, path):
    limited = replace(config, max_attempts=2)
    (item_id,) = schedule(store, limited, None)
    for attempt in (1, 2):
        claim = claim_one(store, limited)
        assert claim.attempts == attempt
        if path == "lease":
            clock.advance(limited.lease_seconds + 1)
            store.sweep_queue(config=limited)
        else:
            token = None if path == "staff" else claim.claim_token
            release(store, limited, item_id, token, reason=path, error=f"try {attempt}")
    item = store.read_item(queue=Q, item_id=item_id)
    assert (item.status, item.error, item.attempts) == ("failed", "max_attempts", 2)
    if path != "lease":
        assert item.last_error == "try 2"  # kept after the item ends
    assert store.count_items(queue=Q).failed == 1


@pytest.mark.parametrize("path", ["release", "delayed release", "lease", "socket", "staff", "shutdown"])
@pytest.mark.parametrize("max_attempts", [None, 1])
def test_an_item_older_than_its_queue_allows_ends_timeout_instead_of_going_back(store, clock, config, path, max_attempts):
    """G6, on every path back, before maxAttempts: the sweep's own pass may not have come yet."""
    limited = replace(config, max_attempts=max_attempts)
    (item_id,) = schedule(store, limited, None)
    claim = claim_one(store, limited)
    clock.advance(limited.queue_seconds + 1)
    if path == "lease":
        assert store.sweep_queue(config=limited).requeued == []
    else:
        token = None if path == "staff" else claim.claim_token
        reason = "release" if path == "delayed release" else path
        back = release(store, limited, item_id, token, reason=reason, error="late", delay=5 if path == "delayed release" else 0)
        assert (back.status, back.error) == ("failed", "timeout")
    item = store.read_item(queue=Q, item_id=item_id)
    assert (item.status, item.error, states_of(store, item_id)) == ("failed", "timeout", ["done"])
    if path != "lease":
        assert item.last_error == "late"


def test_a_stopping_server_gives_items_back_without_counting_their_tries(store, config):
    limited = replace(config, max_attempts=1)
    (item_id,) = schedule(store, limited, None)
    back = release(store, limited, item_id, claim_one(store, limited).claim_token, reason="shutdown")
    assert back.status == "pending"


# ---- retry -----------------------------------------------------------------------------------------


def test_a_retry_posts_the_ended_item_again_once(store, clock, config):
    (old,) = schedule(store, config, None, payload={"image": 1})
    finish(store, config, old, "r")
    new, made = store.retry_item(config=config, item_id=old)
    assert made and (new.status, new.payload, new.retry_of) == ("pending", {"image": 1}, old)
    assert store.read_item(queue=Q, item_id=old).retried_as == new.id
    assert store.read_item(queue=Q, item_id=old).result == "r"  # the old item stays as it was
    again, made_again = store.retry_item(config=config, item_id=old)
    assert (again.id, made_again) == (new.id, False)
    assert claim_one(store, config).id == new.id


def test_a_retry_of_an_item_that_ended_long_ago_is_no_leftover_to_a_sweep_meanwhile(store, clock, config, monkeypatch):
    """The old item is rewritten through tmp/, which sweeps clear of files older than an hour:
    it takes the old finishedAt as its time only once in place."""
    long_retained = replace(config, retain_seconds=86400)
    clock.now = time.time() - 2 * STALE_SECONDS
    (old,) = schedule(store, long_retained, None)
    finish(store, long_retained, old, "r")
    clock.now = time.time()
    sweeper = alongside(store, clock=clock)
    swept = []

    def sweep_before_the_move(call, path):
        if call == "rename" and path.endswith(f"/done/{old}.json") and not swept:
            swept.append(sweeper.sweep_queue(config=long_retained).tmp_removed)

    monkeypatch.setattr(files, "fault", sweep_before_the_move)
    new, made = store.retry_item(config=long_retained, item_id=old)
    assert made and store.read_item(queue=Q, item_id=old).retried_as == new.id
    assert swept == [0]
    done = queue_dir(store, Q) / "done" / f"{old}.json"
    assert done.stat().st_mtime == pytest.approx(store.read_item(queue=Q, item_id=old).finished_at, abs=0.01)


def test_a_retry_asked_again_once_its_new_item_was_deleted_retries_anew(store, clock, config):
    fetched = replace(config, retain_from="fetched")  # kept until fetched: the old one is not
    (old,) = schedule(store, fetched, None)
    finish(store, fetched, old, "r")
    first, _ = store.retry_item(config=fetched, item_id=old)
    finish(store, fetched, first.id, "again")
    store.read_item(queue=Q, item_id=first.id, fetch=True)
    clock.advance(fetched.retain_seconds + 1)
    assert store.sweep_queue(config=fetched).deleted == [first.id]
    second, made = store.retry_item(config=fetched, item_id=old)
    assert made and second.id != first.id and (second.status, second.retry_of) == ("pending", old)
    assert store.read_item(queue=Q, item_id=old).retried_as == second.id
    with pytest.raises(ItemNotFound):  # the deleted item's id is never used again
        store.read_item(queue=Q, item_id=first.id)


def test_a_retry_of_an_item_that_has_not_ended_is_refused(store, clock, config):
    (item_id,) = schedule(store, config, None)
    with pytest.raises(NotEnded):
        store.retry_item(config=config, item_id=item_id)
    posted = store.post_items(config=config, items=[NewItem(1)])[0].item.id
    never_posted = posted[:-1] + ("1" if posted.endswith("0") else "0")
    with pytest.raises(ItemNotFound):
        store.retry_item(config=config, item_id=never_posted)


def test_a_retry_made_again_after_a_crash_between_its_two_steps_makes_one_new_item(store, config):
    (old,) = schedule(store, config, None)
    finish(store, config, old, "r")
    new, _ = store.retry_item(config=config, item_id=old)
    os.remove(queue_dir(store) / "pending" / f"{new.id}.json")  # the crash came before the new item was in
    again, made = store.retry_item(config=config, item_id=old)  # nobody was told of the lost one
    assert made and store.read_item(queue=Q, item_id=old).retried_as == again.id
    assert files_in(store, "pending") == [f"{again.id}.json"]


def test_a_retry_whose_new_item_the_disk_refused_leaves_the_old_item_naming_none(store, config, faults):
    (old,) = schedule(store, config, None)
    finish(store, config, old, "r")
    faults.fail(calls={"rename"}, where="/pending/")  # the new item's move in
    with pytest.raises(TaskhosterError):
        store.retry_item(config=config, item_id=old)
    faults.clear()
    assert store.read_item(queue=Q, item_id=old).retried_as is None
    assert files_in(store, "pending") == []
    new, made = store.retry_item(config=config, item_id=old)
    assert made and store.read_item(queue=Q, item_id=old).retried_as == new.id


def test_a_retry_whose_flush_failed_after_a_worker_ended_its_new_item_still_names_it(store, config, monkeypatch):
    """The new item is claimable while it is flushed: ended meanwhile, it lives on though its
    post failed, and the old item keeps naming it (a retry asked again finds it)."""
    (old,) = schedule(store, config, None)
    finish(store, config, old, "r")
    publish = store._items.publish

    def ended_then_the_flush_failed(queue, items):
        publish(queue, items)
        (new,) = store.claim_items(config=config, max_items=1)
        assert finish(store, config, new.id, "done anyway").accepted
        raise OSError(errno.EIO, "injected: the flush failed")

    monkeypatch.setattr(store._items, "publish", ended_then_the_flush_failed)
    with pytest.raises(TaskhosterError):
        store.retry_item(config=config, item_id=old)
    monkeypatch.setattr(store._items, "publish", publish)
    again, made = store.retry_item(config=config, item_id=old)
    assert (made, again.status, again.result) == (False, "finished", "done anyway")


def _elsewhere(data_dir, code: str, *, within: float = 2.0) -> bool:
    """Run `code` (with `store`, a Store over `data_dir`) in another process, as a transition of
    another server would be; whether it ended within `within` seconds of its start (else it is
    stopped: it was waiting for a lock). Its start-up is not counted."""
    script = f"from queues.store import *\nstore = Store({str(data_dir)!r}, fsync=False)\nprint('ready', flush=True)\n{code}"
    process = subprocess.Popen([sys.executable, "-c", script], cwd=PROJECT_DIR, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "ready\n", "the other process did not start"
        process.wait(within)
        assert process.returncode == 0
        return True
    except subprocess.TimeoutExpired:
        return False
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        process.stdout.close()


def test_a_retry_asked_again_finds_its_new_item_though_another_process_moves_it_meanwhile(store, clock, config, monkeypatch):
    """Another process gives the new item back (to pending/), then finishes it (to done/), each
    just after a look passed the state the item moves to (a look goes done/, pending/, scheduled/,
    processing/). Looked for twice without the new item's lock, it was missed twice, and a second
    new item made."""
    lasting = replace(config, queue_seconds=30 * 86400)  # the other process's clock is the real one
    (old,) = schedule(store, lasting, None)
    finish(store, lasting, old, "r")
    new, _ = store.retry_item(config=lasting, item_id=old)
    claim = claim_one(store, lasting)
    setting = f"QueueConfig({Q!r}, queue_seconds={lasting.queue_seconds})"
    moves = [  # as a look is about to read there, in turn: a move into a state it passed already
        (f"/scheduled/{new.id}", f"store.release_items(releases=[Release({setting}, {new.id!r}, {claim.claim_token!r})])"),
        (f"/pending/{new.id}", f"store.finish_items(results=[({setting}, {new.id!r}, 'meanwhile')])"),
    ]
    moved = []

    def hook(call, path):
        if call == "open" and moves and moves[0][0] in path:
            moved.append(_elsewhere(store.data_dir, moves.pop(0)[1]))

    monkeypatch.setattr(files, "fault", hook)
    again, made = store.retry_item(config=lasting, item_id=old)
    monkeypatch.setattr(files, "fault", None)
    assert (again.id, made) == (new.id, False)
    assert moved == [False]  # the give-back waited for the look's lock, and then was stopped
    assert store.read_item(queue=Q, item_id=old).retried_as == new.id
    assert (files_in(store, "pending"), states_of(store, new.id)) == ([], ["processing"])


def test_retries_racing_from_two_processes_make_one_item(tmp_path, clock, config):
    import threading

    stores = [Store(tmp_path / "shared", fsync=False, clock=clock) for _ in range(2)]
    (old,) = schedule(stores[0], config, None)
    finish(stores[0], config, old, "r")
    answers = []
    threads = [threading.Thread(target=lambda s=s: answers.append(s.retry_item(config=config, item_id=old)))
               for s in stores * 4]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({item.id for item, _ in answers}) == 1
    assert sorted(made for _, made in answers) == [False] * 7 + [True]
    assert len(files_in(stores[0], "pending")) == 1


# ---- cancel ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["scheduled", "pending", "processing"])
def test_a_cancel_ends_an_item_that_has_not_ended_and_refuses_later_results(tmp_path, clock, config, state):
    told = []

    class Events:
        def items_available(self, queue, count):
            pass

        def items_terminal(self, queue, item_ids):
            pass

        def item_canceled(self, queue, item_id, claim_token):
            told.append(item_id)

    store = Store(tmp_path / "data", fsync=False, clock=clock, events=Events())
    (item_id,) = schedule(store, config, clock.now + 60 if state == "scheduled" else None)
    if state == "processing":
        claim_one(store, config)
    item, canceled = store.cancel_item(config=config, item_id=item_id)
    assert canceled and (item.status, item.error) == ("failed", "canceled")
    assert states_of(store, item_id) == ["done"]
    assert not finish(store, config, item_id, "too late").accepted
    assert told == ([item_id] if state == "processing" else [])
    again, canceled_again = store.cancel_item(config=config, item_id=item_id)
    assert (canceled_again, again.error) == (False, "canceled")
    with pytest.raises(NotHeld):
        store.extend_lease(queue=Q, item_id=item_id, seconds=5)
