"""One sweep pass over a queue (the store's part of the Sweeper): G6's timeout, lapsed leases,
G7's retention, and what crashes leave behind, with the injected clock."""

import errno
import os
import time
from dataclasses import replace

import pytest

from queues.exceptions import ItemNotFound, StorageUnavailable
from queues.store import Store, files
from queues.store.sweep import STALE_SECONDS
from store_support import Q, claim_one, copy_file, files_in, post, queue_dir, states_of
from storekit import finish, release

# ---- queue timeout (G6) ----------------------------------------------------------------------


def test_an_aged_pending_item_fails_with_timeout(store, clock, config):
    """G6 from pending; an item exactly queueSeconds old is not aged yet."""
    (item_id,) = post(store)
    clock.advance(config.queue_seconds)
    assert store.sweep_queue(config=config).failed == []
    clock.advance(0.01)
    assert store.sweep_queue(config=config).failed == [item_id]
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
    assert store.sweep_queue(config=long_lease).failed == [item_id]
    item = store.read_item(queue=Q, item_id=item_id)
    assert (item.status, item.error, item.lease_expires_at, item.attempts) == ("failed", "timeout", None, 1)
    assert states_of(store, item_id) == ["done"]


def test_an_aged_and_lapsed_item_ends_failed_not_requeued(store, clock, config):
    (item_id,) = post(store)
    claim_one(store, config)
    clock.advance(config.queue_seconds + 1)
    changes = store.sweep_queue(config=config)
    assert (changes.failed, changes.requeued) == ([item_id], [])
    assert store.read_item(queue=Q, item_id=item_id).status == "failed"
    assert states_of(store, item_id) == ["done"]


# ---- lapsed leases ---------------------------------------------------------------------------


def test_lapsed_leases_go_back_and_running_ones_stay(store, clock, config):
    early, late = post(store, 1, 2)
    store.claim_items(config=config)
    clock.advance(10)
    store.claim_items(config=config)
    clock.advance(config.lease_seconds - 5)
    assert store.sweep_queue(config=config).requeued == [early]
    assert states_of(store, late) == ["processing"]
    assert store.read_item(queue=Q, item_id=early).attempts == 1


def test_a_lapsed_lease_on_the_last_try_ends_the_item_and_the_pass_says_so(store, clock, config):
    once = replace(config, max_attempts=1)
    (item_id,) = post(store, 1)
    store.claim_items(config=once)
    clock.advance(config.lease_seconds + 1)
    changes = store.sweep_queue(config=once)
    assert (changes.failed, changes.requeued) == ([item_id], [])
    assert store.read_item(queue=Q, item_id=item_id).error == "max_attempts"


# ---- retention (G7) --------------------------------------------------------------------------


def finished_item(store, config) -> str:
    (item_id,) = post(store)
    claim_one(store, config)
    assert finish(store, config, item_id, "r").accepted
    return item_id


def test_retention_from_finished_deletes_retain_seconds_after_finishing(store, clock, config):
    """G7, retainFrom finished: a fetch does not move the clock."""
    item_id = finished_item(store, config)
    clock.advance(config.retain_seconds - 1)
    store.read_item(queue=Q, item_id=item_id, fetch=True)
    assert store.sweep_queue(config=config).deleted == []
    clock.advance(1)
    assert store.sweep_queue(config=config).deleted == [item_id]
    assert states_of(store, item_id) == []
    assert files_in(store, "fetched") == []  # the mark goes with the item
    with pytest.raises(ItemNotFound):
        store.read_item(queue=Q, item_id=item_id)
    with pytest.raises(ItemNotFound):
        finish(store, config, item_id, "x")


def test_retention_from_fetched_never_deletes_an_unfetched_item(store, clock, config):
    fetched = replace(config, retain_from="fetched")
    item_id = finished_item(store, fetched)
    clock.advance(30 * 86400)
    assert store.sweep_queue(config=fetched).deleted == []
    store.read_item(queue=Q, item_id=item_id)  # a read that is not a fetch (the dashboard's)
    clock.advance(30 * 86400)
    assert store.sweep_queue(config=fetched).deleted == []
    assert states_of(store, item_id) == ["done"]


def test_retention_from_fetched_counts_from_the_first_fetch_only(store, clock, config):
    fetched = replace(config, retain_from="fetched")
    item_id = finished_item(store, fetched)
    clock.advance(1000)
    store.read_item(queue=Q, item_id=item_id, fetch=True)
    clock.advance(config.retain_seconds - 10)
    store.read_item(queue=Q, item_id=item_id, fetch=True)  # not a new clock
    assert store.sweep_queue(config=fetched).deleted == []
    clock.advance(10)
    assert store.sweep_queue(config=fetched).deleted == [item_id]
    assert files_in(store, "fetched") == []


def test_a_fetch_before_the_item_is_terminal_does_not_count(store, clock, config):
    fetched = replace(config, retain_from="fetched")
    (item_id,) = post(store)
    store.read_item(queue=Q, item_id=item_id, fetch=True)
    claim_one(store, fetched)
    finish(store, fetched, item_id, 1)
    clock.advance(config.retain_seconds * 10)
    assert store.sweep_queue(config=fetched).deleted == []


def test_a_fetch_of_a_result_whose_flush_then_failed_never_starts_the_items_retention(tmp_path, clock, config,
                                                                                      monkeypatch):
    """A reader may see a done file before done/ is flushed; when that flush fails the item goes
    back to processing, and the fetch's mark must not make retention delete the live item."""
    store = Store(tmp_path / "flushed", fsync=True, clock=clock)
    fetched = replace(config, retain_from="fetched", retain_seconds=0)
    (item_id,) = post(store)
    claim_one(store, fetched)
    seen = []

    def fetch_then_fail(call, path):
        if call == "fsync" and path.endswith(f"/{Q}/done") and not seen:
            seen.append(store.read_item(queue=Q, item_id=item_id, fetch=True).status)
            raise OSError(errno.EIO, "injected", path)

    monkeypatch.setattr(files, "fault", fetch_then_fail)
    [outcome] = store.finish_items(results=[(fetched, item_id, "r")])
    monkeypatch.setattr(files, "fault", None)

    assert seen == ["finished"] and isinstance(outcome, StorageUnavailable)
    assert files_in(store, "fetched") == []
    clock.advance(1)
    assert store.sweep_queue(config=fetched).deleted == []
    assert states_of(store, item_id) == ["processing"]


def stale_fetched_mark(store, clock, config):
    """A processing item with a fetched mark of an end that was undone (the reader wrote it
    after the end was taken back)."""
    (item_id,) = post(store)
    claim_one(store, config)
    mark = queue_dir(store) / "fetched" / item_id
    mark.touch()
    os.utime(mark, (clock.now, clock.now))
    return item_id


def test_retention_from_fetched_never_deletes_an_item_whose_fetched_mark_outlived_its_end(store, clock, config):
    fetched = replace(config, retain_from="fetched", retain_seconds=60, lease_seconds=3600)
    item_id = stale_fetched_mark(store, clock, fetched)
    clock.advance(61)
    assert store.sweep_queue(config=fetched).deleted == []
    assert states_of(store, item_id) == ["processing"]
    assert finish(store, fetched, item_id, "r").accepted


def test_a_fetched_mark_that_outlived_an_end_never_starts_the_retention_of_the_next_end(store, clock, config):
    fetched = replace(config, retain_from="fetched", retain_seconds=60, lease_seconds=3600)
    item_id = stale_fetched_mark(store, clock, fetched)
    clock.advance(61)
    assert finish(store, fetched, item_id, "r").accepted
    assert store.sweep_queue(config=fetched).deleted == []  # not fetched since it ended
    store.read_item(queue=Q, item_id=item_id, fetch=True)
    clock.advance(61)
    assert store.sweep_queue(config=fetched).deleted == [item_id]


def test_a_stray_file_among_the_fetched_marks_never_stops_the_sweep(store, clock, config):
    fetched = replace(config, retain_from="fetched", retain_seconds=0)
    aged = post(store)
    (queue_dir(store) / "fetched" / ".DS_Store").touch()
    clock.advance(config.queue_seconds + 1)
    assert store.sweep_queue(config=fetched).failed == aged
    assert files_in(store, "fetched") == [".DS_Store"]


def test_a_mark_left_by_an_end_a_crash_cut_short_goes_when_the_item_ends_otherwise(store, config):
    """A cancel killed between its failed/ mark and its done link leaves the item pending with a
    mark; when a worker's result then wins, the item counts and lists as finished."""
    (item_id,) = post(store)
    (queue_dir(store) / "failed" / item_id).touch()
    claim_one(store, config)
    assert finish(store, config, item_id, "r").accepted
    counts = store.count_items(queue=Q)
    assert (counts.finished, counts.failed) == (1, 0)
    assert files_in(store, "failed") == []


def test_on_a_full_disk_retention_still_runs_though_an_aged_item_cannot_end(store, clock, config, faults,
                                                                             caplog):
    """Ending an aged item writes its done file, which a full disk refuses; deleting what is past
    retention, which frees space, runs in the same pass all the same, and the aged item ends in
    the first pass after space came back."""
    done_id = finished_item(store, config)
    (aged_id,) = post(store)
    clock.advance(config.queue_seconds + 1)
    faults.fail(where=f"/{Q}/tmp/", error=errno.ENOSPC, persist=True)
    changes = store.sweep_queue(config=config)
    assert (changes.deleted, changes.failed) == ([done_id], [])
    assert states_of(store, done_id) == [] and states_of(store, aged_id) == ["pending"]
    assert "fail_aged failed" in caplog.text
    faults.clear()
    assert store.sweep_queue(config=config).failed == [aged_id]


def test_on_a_full_disk_an_item_that_cannot_end_holds_back_no_other_lapsed_lease(store, clock, config, faults,
                                                                                 caplog, monkeypatch):
    """An item on its last try ends when its lease lapses, which writes its done file and a full
    disk refuses; the lapsed items listed after it go back all the same (a rename each), and it
    ends in the first pass after space came back."""
    twice = replace(config, max_attempts=2)
    last_try, *others = post(store, 1, 2, 3)
    claim_one(store, twice)
    release(store, twice, last_try)
    store.claim_items(config=twice, max_items=3)
    assert store.read_item(queue=Q, item_id=last_try).attempts == 2
    listed = files.names
    monkeypatch.setattr(files, "names", lambda directory: sorted(listed(directory), key=lambda name: last_try not in name))
    clock.advance(config.lease_seconds + 1)
    faults.fail(where=f"/{Q}/tmp/", error=errno.ENOSPC, persist=True)
    changes = store.sweep_queue(config=twice)
    assert (sorted(changes.requeued), changes.failed) == (sorted(others), [])
    assert [states_of(store, item_id) for item_id in (last_try, *others)] == [["processing"], ["pending"], ["pending"]]
    assert "requeue_lapsed failed on " + last_try in caplog.text
    faults.clear()
    assert store.sweep_queue(config=twice).failed == [last_try]
    assert store.read_item(queue=Q, item_id=last_try).error == "max_attempts"


def test_failed_items_are_retained_like_finished_ones(store, clock, config):
    fetched = replace(config, retain_from="fetched")
    (item_id,) = post(store)
    clock.advance(config.queue_seconds + 1)
    store.sweep_queue(config=fetched)
    clock.advance(config.retain_seconds * 10)
    assert store.sweep_queue(config=fetched).deleted == []
    store.read_item(queue=Q, item_id=item_id, fetch=True)
    clock.advance(config.retain_seconds)
    assert store.sweep_queue(config=fetched).deleted == [item_id]
    assert files_in(store, "failed") == files_in(store, "fetched") == []


def test_zero_retention_deletes_at_the_next_sweep(store, config):
    item_id = finished_item(store, config)
    assert store.sweep_queue(config=replace(config, retain_seconds=0)).deleted == [item_id]


def test_retention_never_deletes_pending_or_processing_items(store, clock, config):
    processing_id, pending_id = post(store, 1, 2)
    store.claim_items(config=replace(config, lease_seconds=3600, queue_seconds=86400))
    clock.advance(3000)
    store.sweep_queue(config=replace(config, retain_seconds=0, lease_seconds=3600, queue_seconds=86400))
    assert states_of(store, pending_id) == ["pending"]
    assert states_of(store, processing_id) == ["processing"]


def test_retention_deletes_a_stray_copy_with_the_done_item(store, clock, config):
    """A crash leftover must never bring a deleted item back."""
    item_id = finished_item(store, config)
    copy_file(store, item_id, "done", "processing")
    clock.advance(config.retain_seconds)
    store.sweep_queue(config=config)
    assert states_of(store, item_id) == []


# ---- crash leftovers: repair, quarantine, tmp --------------------------------------------------


def test_repair_settles_an_id_in_two_states_done_first(store, config):
    a, b, c = post(store, 1, 2, 3)
    store.claim_items(config=config, max_items=3)
    finish(store, config, a, "kept")
    copy_file(store, a, "done", "pending")  # crash after linking into done, before unlinking
    finish(store, config, b, "kept")
    copy_file(store, b, "done", "processing")
    release(store, Q, c)
    copy_file(store, c, "pending", "processing")
    # done wins before any repair too
    assert store.read_item(queue=Q, item_id=a).result == "kept"
    assert not finish(store, config, a, "second").accepted
    assert sorted(store.sweep_queue(config=config).repaired) == sorted([a, b, c])
    assert states_of(store, a) == ["done"]
    assert states_of(store, b) == ["done"]
    assert states_of(store, c) == ["pending"]
    assert store.read_item(queue=Q, item_id=a).result == "kept"
    assert store.sweep_queue(config=config).repaired == []


def test_the_next_sweep_settles_an_item_given_back_for_later_whose_old_copy_stayed(store, clock, config):
    """G1: a release for later whose removal of the processing copy failed (or was cut short)
    leaves two copies; the next sweep keeps the scheduled one, long before the lease lapses."""
    long_lease = replace(config, lease_seconds=3600)
    (item_id,) = post(store)
    claim = claim_one(store, long_lease)
    held = (queue_dir(store) / "processing" / f"{item_id}.json").read_bytes()
    release(store, long_lease, item_id, claim.claim_token, delay=60)
    (queue_dir(store) / "processing" / f"{item_id}.json").write_bytes(held)  # the removal that failed
    assert states_of(store, item_id) == ["scheduled", "processing"]
    assert store.sweep_queue(config=long_lease).repaired == [item_id]
    assert states_of(store, item_id) == ["scheduled"]
    assert store.read_item(queue=Q, item_id=item_id).status == "scheduled"


def test_a_lapsed_lease_never_resurrects_a_stray_copy_of_a_done_item(store, clock, config):
    (item_id,) = post(store)
    claim_one(store, config)
    stray = queue_dir(store) / "processing" / f"{item_id}.json"
    held = stray.read_bytes()
    finish(store, config, item_id, "kept")
    stray.write_bytes(held)  # a crash after linking into done, before unlinking the source
    clock.advance(config.lease_seconds + 1)
    os.utime(stray, (clock.now - 1, clock.now - 1))
    changes = store.sweep_queue(config=config)
    assert (changes.requeued, changes.repaired) == ([], [item_id])
    assert states_of(store, item_id) == ["done"]


def test_names_that_are_not_item_ids_are_quarantined(store, config):
    post(store)
    (queue_dir(store) / "pending" / "notes.txt").write_text("hello")
    store.sweep_queue(config=config)
    assert files_in(store, "quarantine") == ["pending-notes.txt"]
    assert len(files_in(store, "pending")) == 1


def test_every_kind_of_name_that_is_not_an_item_id_is_found(store, config):
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
    store.sweep_queue(config=config)
    assert files_in(store, "quarantine") == sorted(f"pending-{name}" for name in junk)
    assert files_in(store, "pending") == sorted(f"{i}.json" for i in good)


def test_the_sweep_quarantines_an_unreadable_file_and_goes_on(store, clock, config):
    broken, good = post(store, 1, 2)
    store.claim_items(config=config, max_items=2)
    (queue_dir(store) / "processing" / f"{broken}.json").write_bytes(b"\x00\x00garbage")
    os.utime(queue_dir(store) / "processing" / f"{broken}.json", (clock.now, clock.now))
    clock.advance(config.lease_seconds + 1)
    assert store.sweep_queue(config=config).requeued == [good]
    assert files_in(store, "quarantine") == [f"processing-{broken}.json"]
    assert states_of(store, good) == ["pending"]


def test_a_leftover_the_disk_will_not_remove_leaves_the_others_to_go(store, config, faults, caplog):
    post(store)  # the queue's directories are made
    an_hour_ago = time.time() - STALE_SECONDS - 5
    tmp = queue_dir(store) / "tmp"
    for name in ("a.json", "b.json", "c.json"):
        (tmp / name).write_text("")
        os.utime(tmp / name, (an_hour_ago, an_hour_ago))
    faults.fail(calls={"unlink"}, where="/tmp/b.json")
    assert store.sweep_queue(config=config).tmp_removed == 2
    assert files_in(store, "tmp") == ["b.json"]
    assert "remove_leftovers in tmp/ failed on b.json" in caplog.text


def test_leftovers_older_than_an_hour_are_removed(store, config):
    (item_id,) = post(store)
    an_hour_ago = time.time() - STALE_SECONDS - 5
    tmp = queue_dir(store) / "tmp"
    stale, fresh = tmp / "stale.json", tmp / "fresh.json"
    stray_mark = queue_dir(store) / "failed" / item_id  # the mark of a failure undone
    for path in (stale, fresh, stray_mark):
        path.write_text("")
    for path in (stale, stray_mark):
        os.utime(path, (an_hour_ago, an_hour_ago))
    assert store.sweep_queue(config=config).tmp_removed == 1
    assert files_in(store, "tmp") == ["fresh.json"]
    assert files_in(store, "failed") == []
    assert store.count_items(queue=Q).pending == 1
