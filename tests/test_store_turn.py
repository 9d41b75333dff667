"""The store's turn: one thread at a time runs store code in it, another runs while it waits (a
flush, an item lock), and threads racing in it on the same items never deadlock, with another
process holding item locks too."""

import errno
import os
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

from queues.store import QueueConfig, Release, Store, files, turn
from queues.store.locks import QueueLocks
from lock_holder import item_locks_held_elsewhere
from storekit import finish, post_batch

Q = "jobs"
HANG_SECONDS = 120  # far beyond the work: a thread still running then is stuck, not slow


def _guard(target, errors: list) -> None:
    try:
        target()
    except BaseException as exc:  # reported by the test
        errors.append(exc)


def _run_threads(targets, names=()) -> list[BaseException]:
    """Run each target in a thread of its own (named from `names`, if given) until all end; what
    they raised. A thread still running after HANG_SECONDS fails the test."""
    errors: list[BaseException] = []
    names = list(names) or [None] * len(targets)
    threads = [
        threading.Thread(target=_guard, args=(target, errors), name=name, daemon=True)
        for target, name in zip(targets, names)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_SECONDS)
    assert not any(t.is_alive() for t in threads), "a thread is stuck: the turn deadlocked"
    return errors


def test_one_thread_at_a_time_runs_in_the_turn():
    running, most = [], []
    lock = threading.Lock()

    def work():
        with lock:
            running.append(1)
            most.append(len(running))
        time.sleep(0.002)  # not a wait in the turn's sense: the turn is kept
        with lock:
            running.pop()

    assert _run_threads([lambda: [turn.taking(work) for _ in range(20)] for _ in range(4)]) == []
    assert max(most) == 1


def test_a_thread_waiting_lets_another_run():
    waiting, ran_meanwhile = threading.Event(), threading.Event()
    seen_while_waiting = []

    def wait():
        waiting.set()
        seen_while_waiting.append(ran_meanwhile.wait(HANG_SECONDS))

    def waits():
        turn.outside(wait)

    def runs():
        assert waiting.wait(HANG_SECONDS)
        turn.taking(ran_meanwhile.set)

    assert _run_threads([lambda: turn.taking(waits), runs]) == []
    assert seen_while_waiting == [True]


def test_waiting_outside_the_turn_changes_nothing():
    assert turn.outside(lambda x: x + 1, 6) == 7
    assert turn.taking(lambda: 7) == 7  # the turn is free: nothing took it, nothing released it twice


def test_a_thread_waiting_for_an_item_lock_lets_the_holder_go_on(tmp_path):
    """B holds an item's lock while it waits (as for a flush); A, in the turn, asks for the same
    lock: A must let go of the turn, or B could never take it back and neither would end."""
    Store(tmp_path / "data", fsync=False).ensure_queue(Q)
    locks = QueueLocks.for_file(str(tmp_path / "data" / Q / "locks" / "items"))
    b_holds, a_asks, go_on = threading.Event(), threading.Event(), threading.Event()
    order = []

    def b():
        with locks.hold("ab"):
            b_holds.set()
            turn.outside(go_on.wait, HANG_SECONDS)
            order.append("b done")

    def a():
        a_asks.set()
        with locks.hold("ab"):
            order.append("a holds")

    def main():
        assert a_asks.wait(HANG_SECONDS)
        turn.taking(go_on.set)  # needs the turn, which A has unless it let go while it waits

    # A asks once B holds the lock (so A, not B, waits in the turn)
    assert _run_threads([lambda: turn.taking(b), lambda: b_holds.wait(HANG_SECONDS) and turn.taking(a), main]) == []
    assert order == ["b done", "a holds"]


def test_a_thread_waiting_for_another_threads_directory_flush_lets_it_end(tmp_path, monkeypatch):
    """Two threads in the turn flush the same directory: the second waits for the first's flush
    out of the turn, so the first, back from the disk, can take the turn again and end."""
    directory = tmp_path / "dir"
    directory.mkdir()
    first_flushing, second_asks = threading.Event(), threading.Event()
    fsync = os.fsync

    def slow_fsync(fd):
        if threading.current_thread().name == "first":
            first_flushing.set()
            assert second_asks.wait(HANG_SECONDS)
            time.sleep(0.05)  # the second is then waiting on the flush, not merely about to
        fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)

    def second():
        assert first_flushing.wait(HANG_SECONDS)
        second_asks.set()
        turn.taking(partial(files.flush_directory, str(directory)))

    first = partial(turn.taking, partial(files.flush_directory, str(directory)))
    assert _run_threads([first, second], names=["first", "second"]) == []


def test_a_batch_of_files_is_flushed_in_one_wait_out_of_the_turn(tmp_path, monkeypatch):
    """Once a thread flushing several files has let go of the turn, it flushes them all before it
    takes the turn back: another thread taking the turn meanwhile does not hold up the rest of
    the batch (taken back between files, a batch waited for the turn once a file)."""
    paths = _small_files(tmp_path)
    first_flush, turn_taken = threading.Event(), threading.Event()
    flushed: list[int] = []
    all_flushed = threading.Event()
    fsync = os.fsync

    def counting_fsync(fd):
        if threading.current_thread().name == "flusher":
            if not flushed:
                first_flush.set()
                assert turn_taken.wait(HANG_SECONDS)
            fsync(fd)
            flushed.append(fd)
            if len(flushed) == len(paths):
                all_flushed.set()
        else:
            fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    seen_in_the_turn = []

    def other():
        assert first_flush.wait(HANG_SECONDS)

        def hold_the_turn():
            turn_taken.set()
            seen_in_the_turn.append(all_flushed.wait(10))  # False if the flusher needed the turn back

        turn.taking(hold_the_turn)

    flusher = partial(turn.taking, partial(files.flush_files, paths))
    assert _run_threads([flusher, other], names=["flusher", "other"]) == []
    assert seen_in_the_turn == [True]
    assert len(flushed) == len(paths)


def test_a_failed_flush_in_a_batch_is_raised_with_the_turn_taken_back(tmp_path, faults):
    """A file of the batch the disk fails to flush fails the call, in the turn again as it was
    entered, with no descriptor left open; the turn is free for the next caller."""
    paths = _small_files(tmp_path)
    faults.fail(at=2, calls={"fsync"})
    open_before = len(os.listdir("/proc/self/fd"))
    raised = []

    def flush():
        try:
            files.flush_files(paths)
        except OSError as exc:
            raised.append(exc.errno)

    # taking() lets go of the turn as it ends: had the flush not taken it back, that would raise
    assert _run_threads([partial(turn.taking, flush)]) == []
    assert raised == [errno.EIO]
    assert faults.struck == [("fsync", paths[1])]
    assert len(os.listdir("/proc/self/fd")) == open_before
    assert _run_threads([partial(turn.taking, lambda: None)]) == []  # the turn is free


def _small_files(directory: Path, count: int = 3) -> list[str]:
    paths = [directory / f"file-{n}" for n in range(count)]
    for path in paths:
        path.write_bytes(b"x")
    return [str(path) for path in paths]


def test_threads_racing_in_the_turn_on_the_same_items_finish_every_one(tmp_path):
    """Threads hand in results for the same items in the same order, with fsync on: each waits for
    its flushes holding an item's lock, and for the item locks the others hold, while the rest
    take turns; one result is accepted for each item, and none of them is stuck."""
    store = Store(tmp_path / "data", fsync=True)
    config = QueueConfig(name=Q)
    post_batch(store, Q, list(range(60)))
    claimed = store.claim_items(config=config, max_items=60)
    some_released = claimed[::6]
    accepted: list[tuple[str, int]] = []

    def hand_in(number: int):
        for item in claimed:
            if item in some_released and number == 0:
                turn.taking(store.release_items, releases=[Release(config, item.id, item.claim_token)])
            outcome = turn.taking(partial(finish, store, config, item.id, number))
            if outcome.accepted:
                accepted.append((item.id, number))

    def poster():
        for n in range(20):
            turn.taking(partial(post_batch, store, Q, [n]))

    assert _run_threads([partial(hand_in, n) for n in range(4)] + [poster]) == []
    assert sorted({item_id for item_id, _ in accepted}) == sorted(item.id for item in claimed)
    assert len(accepted) == len(claimed)  # one accepted result each
    for item_id, number in accepted:
        assert store.read_item(queue=Q, item_id=item_id).result == number
    assert store.count_items(queue=Q).pending == 20


def test_a_thread_waiting_for_another_process_lock_lets_the_others_run(tmp_path, monkeypatch):
    """While another process holds the item locks, a finish in the turn waits for them out of the
    turn: a post, which needs no item lock, runs meanwhile; then the finish goes on."""
    store = Store(tmp_path / "data", fsync=False)
    config = QueueConfig(name=Q)
    post_batch(store, Q, ["first"])
    (item,) = store.claim_items(config=config, max_items=1)
    waits = threading.Event()
    real_aside = turn.aside

    def telling_aside(call, *args):
        waits.set()
        return real_aside(call, *args)

    monkeypatch.setattr(turn, "aside", telling_aside)
    with item_locks_held_elsewhere(tmp_path / "data", Q) as let_go:
        finished, posted = [], []
        finishing = threading.Thread(
            target=lambda: finished.append(turn.taking(partial(finish, store, config, item.id, "late"))), daemon=True
        )
        finishing.start()
        assert waits.wait(HANG_SECONDS)  # the finish waits for the other process's lock
        assert _run_threads([lambda: posted.extend(turn.taking(partial(post_batch, store, Q, ["meanwhile"])))]) == []
        assert len(posted) == 1 and not finished
        let_go()
        finishing.join(HANG_SECONDS)
        assert finished and finished[0].accepted


def _taken_elsewhere(path: str, stripe: int) -> bool:
    """Whether another process finds the stripe's byte of the lock file `path` locked."""
    probe = (
        "import fcntl, os, sys\n"
        f"fd = os.open({path!r}, os.O_RDWR)\n"
        "try:\n"
        f"    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, {stripe})\n"
        "except OSError:\n"
        "    sys.exit(1)\n"
    )
    return subprocess.run([sys.executable, "-c", probe], timeout=HANG_SECONDS).returncode == 1


def test_an_item_held_again_stays_locked_for_other_processes_until_its_outermost_hold_ends(tmp_path):
    """A transition that makes an item under another's lock (a retry) takes the same stripe twice:
    the inner hold ending must not let another process in."""
    Store(tmp_path / "data", fsync=False).ensure_queue(Q)
    path = str(tmp_path / "data" / Q / "locks" / "items")
    locks = QueueLocks.for_file(path)
    stripe = locks.stripe_of("ab")
    with locks.hold("ab"):
        with locks.hold("ab"):
            assert _taken_elsewhere(path, stripe)
        assert _taken_elsewhere(path, stripe)
    assert not _taken_elsewhere(path, stripe)
