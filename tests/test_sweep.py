"""The Sweeper, driven directly with the injected clock."""

import os
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest

from queues.bench.servers import Deployment
from queues.store import NewItem, QueueConfig, Store
from queues.store.sweep import ID_CLOCK_MARGIN_SECONDS, STALE_SECONDS
from queues.sweep import Sweeper
from store_support import first_listing_done
from serverproc import PROJECT_DIR, postgres_database
from storekit import finish, post_batch, release

QUIET = {"promoted": 0, "repaired": 0, "failed": 0, "requeued": 0, "deleted": 0, "tmpRemoved": 0}


def state_dir(store: Store, queue: str, state: str):
    return store.data_dir / queue / state


def states_of(store: Store, queue: str, item_id: str) -> list[str]:
    return [s for s in ("pending", "processing", "done") if (state_dir(store, queue, s) / f"{item_id}.json").exists()]


def test_one_pass_applies_every_timer_and_repairs_crash_leftovers(store, clock, config):
    start = clock.now
    (aged,) = (i.id for i in post_batch(store, "jobs", [0]))
    clock.advance(200)
    lapsed, retained, doubled = (i.id for i in post_batch(store, "jobs", [1, 2, 3]))
    store.claim_items(config=config, max_items=4)
    release(store, "jobs", aged)
    clock.advance(20)
    finish(store, config, retained, "r")
    finish(store, config, doubled, "r")
    # a crash between linking into done and unlinking the source leaves a second copy
    (state_dir(store, "jobs", "pending") / f"{doubled}.json").write_bytes(b"{}")
    stale = state_dir(store, "jobs", "tmp") / "left.json"
    stale.write_text("{}")
    os.utime(stale, (time.time() - STALE_SECONDS - 1,) * 2)
    fresh_pending = post_batch(store, "jobs", ["young"])[0].id
    clock.now = start + config.queue_seconds + 1  # only `aged` is too old

    sweeper = Sweeper(store, lambda: [config])
    assert sweeper.sweep_once() == {
        "jobs": {"promoted": 0, "repaired": 1, "failed": 1, "requeued": 1, "deleted": 2, "tmpRemoved": 1}
    }
    assert store.read_item(queue="jobs", item_id=aged).error == "timeout"
    assert states_of(store, "jobs", lapsed) == ["pending"]
    assert states_of(store, "jobs", retained) == []
    assert states_of(store, "jobs", doubled) == []
    assert states_of(store, "jobs", fresh_pending) == ["pending"]
    assert [n for n in os.listdir(state_dir(store, "jobs", "tmp")) if not n.endswith(".spare")] == []  # spares stay
    assert sweeper.sweep_once() == {}


def test_an_aged_and_lapsed_item_ends_failed_in_one_pass(store, clock, config):
    (item,) = post_batch(store, "jobs", [1])
    store.claim_items(config=config)
    clock.advance(config.queue_seconds + 1)
    assert Sweeper(store, lambda: [config]).sweep_once() == {"jobs": {**QUIET, "failed": 1}}
    done = store.read_item(queue="jobs", item_id=item.id)
    assert (done.status, done.error, done.attempts) == ("failed", "timeout", 1)


def test_only_queues_that_changed_are_reported(store, clock, config):
    quiet = QueueConfig(name="quiet")
    post_batch(store, "quiet", [1])
    post_batch(store, "jobs", [1])
    store.claim_items(config=config)
    clock.advance(config.lease_seconds + 1)
    assert Sweeper(store, lambda: [quiet, config]).sweep_once() == {"jobs": {**QUIET, "requeued": 1}}


class Heard:
    """The store's events, as the hub would hear them."""

    def __init__(self):
        self.heard = []

    def items_available(self, queue, count):
        self.heard.append(("available", queue, count))

    def items_terminal(self, queue, item_ids):
        self.heard.append(("terminal", queue, sorted(item_ids)))


def test_what_the_sweep_requeues_and_fails_is_told_so_waiters_wake(tmp_path, clock, config):
    events = Heard()
    store = Store(tmp_path / "data", fsync=False, clock=clock, events=events)
    first, second = (i.id for i in post_batch(store, "jobs", [1, 2]))
    store.claim_items(config=config)
    first_listing_done(store, "jobs")  # its wake-up, if any, is not the sweep's
    clock.advance(config.lease_seconds + 1)
    sweeper = Sweeper(store, lambda: [config])
    events.heard.clear()
    sweeper.sweep_once()
    assert events.heard == [("available", "jobs", 1)]
    events.heard.clear()
    clock.advance(config.queue_seconds)
    sweeper.sweep_once()
    assert sorted(events.heard) == [("terminal", "jobs", [first]), ("terminal", "jobs", [second])]


def test_a_sweep_that_sees_the_queue_timeout_lowered_marks_what_was_scheduled_under_the_old(store, clock, config):
    """Posted by this process after the change was saved, before it heard of it."""
    current = [config]
    sweeper = Sweeper(store, lambda: current)
    sweeper.sweep_once()
    (item,) = store.post_items(config=config, items=[NewItem(1, run_at=clock.now + 500)])
    current[:] = [replace(config, queue_seconds=100)]
    sweeper.sweep_once()
    clock.advance(101)
    sweeper.sweep_once()
    assert (store.read_item(queue="jobs", item_id=item.item.id).error) == "timeout"


def test_one_queue_failing_does_not_stop_the_others(store, clock, config, monkeypatch, caplog):
    broken = QueueConfig(name="broken")
    post_batch(store, "jobs", [1])
    store.claim_items(config=config)
    clock.advance(config.lease_seconds + 1)
    real_sweep = store.sweep_queue

    def sweep_queue(*, config):
        if config.name == "broken":
            raise OSError("disk on fire")
        return real_sweep(config=config)

    monkeypatch.setattr(store, "sweep_queue", sweep_queue)
    assert Sweeper(store, lambda: [broken, config]).sweep_once() == {"jobs": {**QUIET, "requeued": 1}}
    assert "sweep of queue broken failed" in caplog.text


def test_run_passes_until_stopped_and_survives_a_failing_pass(store, clock, config):
    post_batch(store, "jobs", [1])
    store.claim_items(config=config)
    clock.advance(config.lease_seconds + 1)
    calls, reports = [], []
    stop = threading.Event()

    def configs():
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("the database is down for a moment")
        return [config]

    def report(changes):
        reports.append(changes)
        stop.set()

    Sweeper(store, configs).run(interval=0.01, stop=stop, report=report)
    assert reports == [{"jobs": {**QUIET, "requeued": 1}}]
    assert len(calls) == 2


def test_run_goes_on_sweeping_when_its_report_cannot_be_written(store, clock, config):
    """`manage.py sweep` prints each pass's changes: a closed stdout must not end the sweeping."""
    post_batch(store, "jobs", [1])
    store.claim_items(config=config)
    clock.advance(config.lease_seconds + 1)
    reports = []
    stop = threading.Event()

    def report(changes):
        reports.append(changes)
        if len(reports) == 1:
            store.claim_items(config=config)  # lapses again by the next pass
            clock.advance(config.lease_seconds + 1)
            raise BrokenPipeError(32, "Broken pipe")
        stop.set()

    Sweeper(store, lambda: [config]).run(interval=0.01, stop=stop, report=report)
    assert reports == [{"jobs": {**QUIET, "requeued": 1}}] * 2


def test_several_sweepers_at_once_change_each_item_once(tmp_path, clock, config):
    """Two sweepers per process (threads), as if from two processes (two stores), race over the
    same lapsed items: each item is re-queued exactly once."""
    stores = [Store(tmp_path / "shared", fsync=False, clock=clock) for _ in range(2)]
    posted = [i.id for i in post_batch(stores[0], "jobs", list(range(300)))]
    assert len(stores[0].claim_items(config=config, max_items=300)) == 300
    clock.advance(config.lease_seconds + 1)
    changes = []
    threads = [threading.Thread(target=lambda s=s: changes.extend(s.sweep_queue(config=config).requeued)) for s in stores * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(changes) == posted
    for item_id in posted:
        assert states_of(stores[0], "jobs", item_id) == ["pending"]
        assert stores[1].read_item(queue="jobs", item_id=item_id).attempts == 1


def test_retention_deletes_a_stray_copy_with_the_done_item(store, clock, config):
    """A crash leftover must never bring a deleted item back."""
    (item,) = post_batch(store, "jobs", [1])
    store.claim_items(config=config)
    held = (state_dir(store, "jobs", "processing") / f"{item.id}.json").read_bytes()
    finish(store, config, item.id, "r")
    (state_dir(store, "jobs", "processing") / f"{item.id}.json").write_bytes(held)
    clock.advance(config.retain_seconds)
    assert store.sweep_queue(config=config).deleted == [item.id]
    assert states_of(store, "jobs", item.id) == []


@pytest.mark.parametrize("retain_from", ["finished", "fetched"])
def test_the_sweep_honours_retain_from(store, clock, config, retain_from):
    config = replace(config, retain_from=retain_from)
    (item,) = post_batch(store, "jobs", [1])
    finish(store, config, item.id, "r")
    sweeper = Sweeper(store, lambda: [config])
    clock.advance(config.retain_seconds)
    expected = {"jobs": {**QUIET, "deleted": 1}} if retain_from == "finished" else {}
    assert sweeper.sweep_once() == expected
    if retain_from == "fetched":
        store.read_item(queue="jobs", item_id=item.id, fetch=True)
        assert sweeper.sweep_once() == {}
        clock.advance(config.retain_seconds)
        assert sweeper.sweep_once() == {"jobs": {**QUIET, "deleted": 1}}


def test_a_quiet_pass_never_stats_done_items_too_young_to_be_due(store, clock, config, monkeypatch):
    """A done item's retention starts no earlier than its posting time (in its name), so a pass
    does not stat the done files of items posted within the retention period."""
    config = replace(config, retain_seconds=3600)
    posted = [i.id for i in post_batch(store, "jobs", list(range(50)))]
    for item_id in posted:
        finish(store, config, item_id, "r")
    clock.advance(config.retain_seconds - ID_CLOCK_MARGIN_SECONDS - 1)
    statted = []
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        statted.append(str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    assert Sweeper(store, lambda: [config]).sweep_once() == {}
    assert not [path for path in statted if "/done/" in path]
    clock.advance(ID_CLOCK_MARGIN_SECONDS + 1)
    assert Sweeper(store, lambda: [config]).sweep_once() == {"jobs": {**QUIET, "deleted": 50}}


def test_retention_is_on_time_for_an_item_whose_id_ran_ahead_of_the_clock(store, clock, config):
    """Ids never go backwards, so after the clock steps back an id can claim a later posting
    time than the item's finishing time; retention still counts from finishing."""
    clock.advance(30)
    (item,) = post_batch(store, "jobs", [1])
    clock.advance(-30)  # the clock is stepped back
    finish(store, config, item.id, "r")
    sweeper = Sweeper(store, lambda: [config])
    clock.advance(config.retain_seconds - 1)
    assert sweeper.sweep_once() == {}
    clock.advance(1)
    assert sweeper.sweep_once() == {"jobs": {**QUIET, "deleted": 1}}


def test_the_sweep_loop_carries_on_once_the_database_dropped_its_connection(tmp_path):
    """A database restart ends the standalone sweeper's connection: the next passes must open a
    new one, and fail an aged item as before."""
    import psycopg

    with postgres_database() as database_url:
        deployment = Deployment(tmp_path, database_url=database_url, extra_env={"TASKHOSTER_SWEEP_INTERVAL": "0.2"})
        deployment.migrate()
        deployment.create_queue("aging", "--queue-seconds", "1")
        sweeper = subprocess.Popen([sys.executable, str(PROJECT_DIR / "manage.py"), "sweep"], cwd=PROJECT_DIR,
                                   env=deployment.environ(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            time.sleep(1.5)  # a few passes, on its connection
            with psycopg.connect(database_url, autocommit=True) as admin:  # every connection but this one
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                              "WHERE datname = current_database() AND pid <> pg_backend_pid()")
            store = Store(deployment.data_dir, fsync=False)
            [item] = post_batch(store, "aging", ["old soon"])
            deadline = time.monotonic() + 30
            while store.read_item(queue="aging", item_id=item.id).status != "failed":
                assert sweeper.poll() is None and time.monotonic() < deadline, "the sweep never came back"
                time.sleep(0.1)
        finally:
            sweeper.terminate()
            sweeper.communicate(timeout=30)
