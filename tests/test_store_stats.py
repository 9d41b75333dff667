"""Counts, listings and throughput: what the API's figures and the dashboard show."""

from dataclasses import replace

import pytest

from conftest import alongside
from queues import ids
from queues.store import NewItem, stats
from store_support import Q, files_in, post
from storekit import finish


def test_count_items_counts_each_state(store, clock, config):
    posted = post(store, *range(6))
    clock.advance(5)
    store.claim_items(config=config, max_items=3)  # 0, 1, 2
    finish(store, config, posted[0], 1)
    finish(store, config, posted[3], 1)
    counts = store.count_items(queue=Q)
    assert (counts.pending, counts.processing, counts.finished, counts.failed) == (2, 2, 2, 0)
    assert counts.oldest_pending_posted_at == pytest.approx(clock.now - 5, abs=0.001)
    clock.advance(config.queue_seconds)
    store.sweep_queue(config=replace(config, retain_seconds=86400))  # fails the aged, keeps the done
    # another process counts what it never saw happen
    counts = alongside(store, clock=clock).count_items(queue=Q)
    assert (counts.pending, counts.processing, counts.finished, counts.failed) == (0, 0, 2, 4)
    assert counts.oldest_pending_posted_at is None


STATES = ("scheduled", "pending", "processing", "done")


def test_counts_leave_out_names_that_are_not_item_files_in_every_state(store, clock, config):
    (scheduled,) = [p.item.id for p in store.post_items(config=config, items=[NewItem(1, run_at=clock.now + 60)])]
    post(store, 2)
    for state in STATES:
        for stray in ("notes.txt", ".hidden", "a-directory.json.tmp", "notes.json", f"{'0' * 36}.json"):
            (store.data_dir / Q / state / stray).write_text("")
    counts = store.count_items(queue=Q)
    assert (counts.scheduled, counts.pending, counts.processing, counts.finished) == (1, 1, 0, 0)
    assert store.list_items(queue=Q, state="pending")[0] == 1


@pytest.mark.parametrize("content", [b"", b"null", b"[1]", b'{"id": "trunc', b"\x00\xff"])
def test_counts_and_listings_leave_out_files_that_are_not_items_and_quarantine_them(store, clock, config, content):
    """Named as items, but not items: the count that meets them is a reader, and quarantines them."""
    post(store, 1)
    bad = ids.IdMaker().new_ids(4, clock.now)
    for state, item_id in zip(STATES, bad):
        (store.data_dir / Q / state / f"{item_id}.json").write_bytes(content)
    counts = alongside(store, clock=clock).count_items(queue=Q)  # a process that never met them
    assert (counts.scheduled, counts.pending, counts.processing, counts.finished, counts.failed) == (0, 1, 0, 0, 0)
    assert sorted(files_in(store, "quarantine")) == sorted(f"{state}-{i}.json" for state, i in zip(STATES, bad))
    for state in STATES:  # a listing of a state leaves them out of its total too
        (store.data_dir / Q / state / f"{bad[0]}.json").write_bytes(content)
        total, page = store.list_items(queue=Q, state=state)
        assert (total, [item.status for item in page]) == ((1, ["pending"]) if state == "pending" else (0, []))


def test_a_count_reads_each_item_file_once(store, clock, config, faults):
    posted = post(store, *range(4))
    finish(store, config, posted[0], 1)
    clock.advance(config.queue_seconds + 1)
    store.sweep_queue(config=replace(config, retain_seconds=86400))
    faults.clear()
    store.count_items(queue=Q)
    assert {call for call, _ in faults.calls} - {"listdir"}  # it read the files it never met
    faults.clear()
    counts = store.count_items(queue=Q)
    assert (counts.finished, counts.failed) == (1, 3)
    assert {call for call, _ in faults.calls} == {"listdir"}


def test_a_state_with_more_names_than_a_count_reads_is_counted_by_its_names(store, clock, config, faults, monkeypatch):
    monkeypatch.setattr(stats, "MAX_READ_NAMES", 3)
    oldest = post(store, *range(4))[0]
    (store.data_dir / Q / "pending" / f"{ids.IdMaker().new_ids(1, clock.now)[0]}.json").write_bytes(b"null")
    (store.data_dir / Q / "pending" / "000-a-stray.json").write_bytes(b"{}")  # sorts first
    faults.clear()
    counts = store.count_items(queue=Q)
    assert counts.pending == 6 and {call for call, _ in faults.calls} == {"listdir"}
    assert counts.oldest_pending_posted_at == ids.id_millis(oldest) / 1000  # never the stray's


ERROR = {"error": {"type": "ValueError", "message": "no such image", "traceback": "Traceback ..."}}


@pytest.mark.parametrize("result, is_error", [
    (ERROR, True),
    ({"error": {"message": "only a message"}}, True),
    ({"error": "a string is a result like any other"}, False),
    ({"error": {"type": "X"}, "more": 1}, False),
    ({"error": {"code": 3}}, False),
    ([ERROR], False),
])
def test_finished_items_with_an_error_result_are_counted_apart(store, clock, config, result, is_error):
    posted = post(store, 1, 2)
    store.claim_items(config=config, max_items=2)
    finish(store, config, posted[0], result)
    finish(store, config, posted[1], "fine")
    counts = alongside(store, clock=clock).count_items(queue=Q)  # from the marks, as any process
    assert (counts.finished, counts.failed, counts.errors) == (2, 0, int(is_error))
    clock.advance(config.retain_seconds + 1)
    store.sweep_queue(config=config)  # retention takes the mark with its item
    assert store.count_items(queue=Q).errors == 0
    assert not any((store.data_dir / Q / "errors").iterdir())


def test_count_items_forgets_deleted_items(store, clock, config):
    (item_id,) = post(store)
    finish(store, config, item_id, 1)
    assert store.count_items(queue=Q).finished == 1
    clock.advance(config.retain_seconds)
    assert store.sweep_queue(config=config).deleted == [item_id]
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


def test_throughput_counts_items_ended_per_minute(store, clock, config):
    first, second, third = post(store, 1, 2, 3)
    finish(store, config, first, 1)
    clock.advance(60)
    finish(store, config, second, 1)
    clock.advance(config.queue_seconds)
    store.sweep_queue(config=replace(config, retain_seconds=86400))
    rows = store.throughput(queue=Q, minutes=15)
    assert len(rows) == 15
    assert sum(r[1] for r in rows) == 2
    assert sum(r[2] for r in rows) == 1
    assert rows[-1][2] == 1
