"""Transitions on the event loop: each runs in the loop's thread, and while it waits (a flush, a
lock) the loop goes on with other work, other transitions included; the locks that exclude
threads exclude them too, whoever holds them; what a wait raises is raised inside the
transition; and a transition whose caller is cancelled still runs to its end."""

import asyncio
import errno
import os
import threading
from collections import deque
from concurrent.futures import Future

import greenlet
import pytest

from queues.events import Hub
from queues.exceptions import StorageUnavailable
from queues.store import QueueConfig, Release, Store, files, turn
from queues.store.locks import QueueLocks, Stripe
from lock_holder import item_locks_held_elsewhere
from storekit import finish, post_batch

Q = "jobs"
HANG_SECONDS = 60  # far beyond the work: still waiting then is stuck, not slow


@pytest.fixture
def flushed(monkeypatch) -> list[str]:
    """The paths of the files flushed (not directories), each added once its flush returned."""
    paths = []
    flush_file = files._flush_file

    def watched(fd, path):
        flush_file(fd, path)
        paths.append(path)

    monkeypatch.setattr(files, "_flush_file", watched)
    return paths


async def _soon(event: threading.Event) -> bool:
    return await asyncio.to_thread(event.wait, HANG_SECONDS)


async def test_a_transition_waiting_lets_the_loop_run_others():
    go_on = Future()
    order = []

    def first():
        order.append(("first on the loop's thread", threading.current_thread() is threading.main_thread()))
        order.append(turn.wait_for(go_on))
        return "first"

    def second():
        order.append("second")
        return "second"

    waiting = asyncio.ensure_future(turn.on_loop(first))
    await asyncio.sleep(0)
    assert await turn.on_loop(second) == "second"  # while the first waits
    go_on.set_result("first done")
    assert await asyncio.wait_for(waiting, HANG_SECONDS) == "first"
    assert order == [("first on the loop's thread", True), "second", "first done"]


async def test_a_wait_for_the_disk_runs_at_once_and_one_made_together_once_for_all_in_a_turn():
    """On the loop's own thread: a wait out of the turn at once; a wait made together (flushes)
    once every transition started in the same turn of the loop has asked for it, one call for
    all of them, each getting its own outcome."""
    calls = []

    def flush(name):
        calls.append((name, threading.current_thread() is threading.main_thread()))
        return f"{name} flushed"

    def flush_together(names):
        calls.append((tuple(names), threading.current_thread() is threading.main_thread()))
        return [f"{name} flushed together" for name in names]

    def transition(name):
        calls.append(f"{name} asks")
        return turn.outside(flush, name), turn.together(flush_together, f"{name}'s file")

    outcomes = await asyncio.wait_for(
        asyncio.gather(*(turn.on_loop(transition, name=n) for n in ("a", "b"))), HANG_SECONDS
    )

    assert outcomes == [("a flushed", "a's file flushed together"), ("b flushed", "b's file flushed together")]
    assert calls == ["a asks", ("a", True), "b asks", ("b", True), (("a's file", "b's file"), True)]


async def test_a_wait_made_together_answers_each_transition_with_its_own_outcome():
    """One request's error fails its own transition only; a thread's request is called alone."""

    def flush_together(names):
        return [OSError(5, f"{name} failed") if name.startswith("bad") else f"{name} flushed" for name in names]

    def transition(name):
        return turn.together(flush_together, name)

    outcomes = await asyncio.wait_for(asyncio.gather(
        *(turn.on_loop(transition, name=n) for n in ("good", "bad", "fine")), return_exceptions=True
    ), HANG_SECONDS)

    assert outcomes[0] == "good flushed" and outcomes[2] == "fine flushed"
    assert isinstance(outcomes[1], OSError) and str(outcomes[1]) == "[Errno 5] bad failed"
    assert await asyncio.to_thread(transition, "alone") == "alone flushed"
    with pytest.raises(OSError, match="bad alone failed"):
        await asyncio.to_thread(transition, "bad alone")


async def test_what_a_wait_raises_is_raised_inside_the_transition():
    def failing_flush():
        raise OSError(5, "the disk failed")

    failed_lock = Future()
    failed_lock.set_exception(OSError(5, "the lock file failed"))
    cleaned_up = []

    def transition(wait):
        try:
            wait()
        finally:
            cleaned_up.append(True)

    with pytest.raises(OSError, match="the disk failed"):
        await turn.on_loop(transition, wait=lambda: turn.outside(failing_flush))
    with pytest.raises(OSError, match="the disk failed"):
        await turn.on_loop(transition, wait=lambda: turn.together(lambda requests: failing_flush(), "a file"))
    with pytest.raises(OSError, match="the lock file failed"):
        await turn.on_loop(transition, wait=lambda: turn.wait_for(failed_lock))
    assert cleaned_up == [True, True, True]


async def test_a_transition_whose_caller_is_cancelled_runs_to_its_end_and_a_stop_waits_for_it():
    go_on = Future()
    ended = []

    def transition():
        turn.wait_for(go_on)
        ended.append(True)

    caller = asyncio.ensure_future(turn.on_loop(transition))
    await asyncio.sleep(0)
    caller.cancel()  # as a stop cancels what is left
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, HANG_SECONDS)
    assert not await turn.transitions_ended(0.05) and ended == []
    asyncio.get_running_loop().call_later(0.05, go_on.set_result, None)
    assert await turn.transitions_ended(HANG_SECONDS)
    assert ended == [True]


async def test_transitions_on_the_loop_take_an_items_lock_one_at_a_time(tmp_path):
    """A holds an item's lock while it waits; B, on the same loop thread, asks for it: B waits
    (without blocking the loop) until A lets go, rather than taking it as the same thread."""
    Store(tmp_path / "data", fsync=False).ensure_queue(Q)
    locks = QueueLocks.for_file(str(tmp_path / "data" / Q / "locks" / "items"))
    go_on = Future()
    order = []

    def a():
        with locks.hold("ab"):
            order.append("a holds")
            turn.wait_for(go_on)  # as for another lock
            order.append("a lets go")

    def b():
        with locks.hold("ab"):
            order.append("b holds")

    holding = asyncio.ensure_future(turn.on_loop(a))
    await asyncio.sleep(0)
    asking = asyncio.ensure_future(turn.on_loop(b))
    for _ in range(5):
        await asyncio.sleep(0.01)  # the loop runs on meanwhile
    assert order == ["a holds"]
    go_on.set_result(None)
    await asyncio.wait_for(asyncio.gather(holding, asking), HANG_SECONDS)
    assert order == ["a holds", "a lets go", "b holds"]


async def test_a_thread_and_a_transition_on_the_loop_exclude_each_other():
    stripe = Stripe()
    stripe.take()  # held by this, the loop's thread, outside any transition
    taken = []

    def transition():
        stripe.take()
        taken.append("transition")
        stripe.release()

    on_the_loop = asyncio.ensure_future(turn.on_loop(transition))
    await asyncio.sleep(0.05)
    assert taken == [] and not on_the_loop.done()
    stripe.release()
    await asyncio.wait_for(on_the_loop, HANG_SECONDS)

    in_transition, go_on = threading.Event(), Future()

    def holder():
        stripe.take()
        in_transition.set()
        turn.wait_for(go_on)
        stripe.release()

    def thread():
        stripe.take()
        taken.append("thread")
        stripe.release()

    holding = asyncio.ensure_future(turn.on_loop(holder))
    assert await _soon(in_transition)
    waiting_thread = asyncio.ensure_future(asyncio.to_thread(thread))
    for _ in range(HANG_SECONDS * 100):
        if stripe._waiters:  # the thread waits now
            break
        await asyncio.sleep(0.01)
    assert taken == ["transition"] and stripe._waiters
    go_on.set_result(None)
    await asyncio.wait_for(asyncio.gather(holding, waiting_thread), HANG_SECONDS)
    assert taken == ["transition", "thread"]


async def test_a_holder_takes_its_stripe_again():
    stripe = Stripe()

    def transition():
        outermost = [stripe.take(), stripe.take()]  # the second as a retry making a new item under its old one's lock
        stripe.release()
        stripe.release()
        return outermost

    # only the outermost hold takes (and drops) the other processes' record lock
    assert await asyncio.wait_for(turn.on_loop(transition), HANG_SECONDS) == [True, False]


async def test_posts_on_the_loop_at_once_share_one_directory_flush(tmp_path, monkeypatch):
    store = Store(tmp_path / "data", fsync=True)
    store.ensure_queue(Q)
    pending = str(tmp_path / "data" / Q / "pending")
    flushed = []
    fsync = files._fsync

    def watched_fsync(path):
        flushed.append(path)
        fsync(path)

    monkeypatch.setattr(files, "_fsync", watched_fsync)
    posts = [turn.on_loop(post_batch, store=store, queue=Q, payloads=[n]) for n in range(6)]
    await asyncio.wait_for(asyncio.gather(*posts), HANG_SECONDS)
    assert flushed.count(pending) == 1  # the six at once, one for all

    for n in range(6, 9):  # one after another: a flush each
        await turn.on_loop(post_batch, store=store, queue=Q, payloads=[n])
    assert flushed.count(pending) == 4
    claimed = store.claim_items(config=QueueConfig(name=Q), max_items=20)
    assert sorted(item.payload for item in claimed) == list(range(9))


async def test_posts_on_the_loop_at_once_flush_their_files_together(tmp_path, monkeypatch):
    store = Store(tmp_path / "data", fsync=True)
    store.ensure_queue(Q)
    calls = []
    flush_files, start_writeback = files._flush_files, files._start_writeback

    def watched_flush_files(requests):
        calls.append(len(requests))
        return flush_files(requests)

    def watched_start_writeback(fd, path):
        calls.append(("sent on its way", fd is not None))
        start_writeback(fd, path)

    def watched_flush_file(fd, path):
        calls.append(("flushed", fd is not None))
        flush_file(fd, path)

    flush_file = files._flush_file
    monkeypatch.setattr(files, "_flush_files", watched_flush_files)
    monkeypatch.setattr(files, "_start_writeback", watched_start_writeback)
    monkeypatch.setattr(files, "_flush_file", watched_flush_file)
    posts = [turn.on_loop(post_batch, store=store, queue=Q, payloads=[n]) for n in range(6)]
    await asyncio.wait_for(asyncio.gather(*posts), HANG_SECONDS)

    # one call, each file sent on its way through its own descriptor, then each flushed
    assert calls == [6] + [("sent on its way", True)] * 6 + [("flushed", True)] * 6
    assert store.count_items(queue=Q).pending == 6


async def test_a_file_whose_writeback_cannot_be_started_is_still_flushed_and_its_post_stands(tmp_path, monkeypatch, flushed):
    """Sending files on their way is only a hint: when it fails, each file's own flush decides."""
    store = Store(tmp_path / "data", fsync=True)
    store.ensure_queue(Q)

    def refused(fd, offset, length, advice):
        raise OSError(errno.EINVAL, "no such hint here")

    monkeypatch.setattr(os, "posix_fadvise", refused)
    posts = [turn.on_loop(post_batch, store=store, queue=Q, payloads=[n]) for n in range(3)]
    outcomes = await asyncio.wait_for(asyncio.gather(*posts), HANG_SECONDS)

    assert sorted(path.rsplit("/", 1)[1] for path in flushed) == sorted(f"{item.id}.json" for (item,) in outcomes)
    assert store.count_items(queue=Q).pending == 3


async def test_of_posts_flushing_their_files_together_only_the_one_whose_file_fails_fails(tmp_path, faults, monkeypatch,
                                                                                          flushed):
    store = Store(tmp_path / "data", fsync=True)
    store.ensure_queue(Q)
    pending = tmp_path / "data" / Q / "pending"
    faults.fail(at=2, calls={"fsync"})  # the second post's file
    together = []
    flush_files = files._flush_files

    def watched_flush_files(requests):
        together.append(len(requests))
        return flush_files(requests)

    monkeypatch.setattr(files, "_flush_files", watched_flush_files)
    posts = [turn.on_loop(post_batch, store=store, queue=Q, payloads=[n]) for n in range(3)]
    outcomes = await asyncio.wait_for(asyncio.gather(*posts, return_exceptions=True), HANG_SECONDS)

    assert together == [3]  # the three in one call: the failure was the second's alone
    (struck_call, struck_path), = faults.struck
    assert struck_call == "fsync" and struck_path.startswith(str(pending)) and struck_path not in flushed
    assert [path.rsplit("/", 1)[1] for path in flushed] == [
        f"{item.id}.json" for outcome in (outcomes[0], outcomes[2]) for item in outcome]  # the others flushed
    assert isinstance(outcomes[1], StorageUnavailable)
    assert [item.payload for outcome in (outcomes[0], outcomes[2]) for item in outcome] == [0, 2]
    assert sorted(item.payload for item in store.claim_items(config=QueueConfig(name=Q), max_items=10)) == [0, 2]


async def test_after_a_wait_nobody_else_joined_the_next_run_at_once_then_one_is_gathered():
    """Gathering costs a lone caller a turn of the loop: after a gathering nobody joined, the
    next AT_ONCE_AFTER_ALONE waits made together run at once (two transitions flush twice),
    then one is gathered again and others join it."""
    flushes = []

    def flush(requests):
        flushes.append(requests)
        return [None] * len(requests)

    def transition():
        turn.together(flush, "directory")

    await turn.on_loop(transition)  # gathered, alone
    assert len(flushes) == 1
    for _ in range(turn.AT_ONCE_AFTER_ALONE // 2):
        await asyncio.wait_for(asyncio.gather(turn.on_loop(transition), turn.on_loop(transition)), HANG_SECONDS)
    assert len(flushes) == 1 + turn.AT_ONCE_AFTER_ALONE
    await asyncio.wait_for(asyncio.gather(turn.on_loop(transition), turn.on_loop(transition)), HANG_SECONDS)
    assert len(flushes) == 2 + turn.AT_ONCE_AFTER_ALONE  # gathered again, and shared
    await asyncio.wait_for(asyncio.gather(turn.on_loop(transition), turn.on_loop(transition)), HANG_SECONDS)
    assert len(flushes) == 3 + turn.AT_ONCE_AFTER_ALONE  # others came: gathered still


async def test_a_transition_runs_from_the_moment_it_is_asked_not_once_awaited():
    ran = []
    ended = turn.on_loop(lambda: ran.append("ran") or "done")
    assert ran == ["ran"] and ended.done()
    assert await ended == "done"


async def test_a_transition_that_woke_others_lets_them_run_before_its_next_wait_for_the_disk():
    """Even when waits run at once (after one nobody joined), one after a wake-up is gathered:
    what was woken (a claim) goes first, so its worker works while the disk flushes."""
    order = []

    def flush(requests):
        order.append("flush")
        return [None] * len(requests)

    def transition(*, wakes: bool, flushes: bool = True):
        asyncio.get_running_loop().call_soon(order.append, "woken")  # as a woken claim's task
        if wakes:
            turn.let_woken_go_first()
        if flushes:
            turn.together(flush, "directory")

    await turn.on_loop(transition, wakes=False)  # gathered, alone: the next ones run at once
    order.clear()
    await asyncio.wait_for(turn.on_loop(transition, wakes=True), HANG_SECONDS)
    assert order == ["woken", "flush"]
    order.clear()
    await asyncio.wait_for(turn.on_loop(transition, wakes=False), HANG_SECONDS)
    await asyncio.sleep(0)
    assert order == ["flush", "woken"]
    # the wake-up is the waking transition's own: one that made no flush leaves others as they were
    await turn.on_loop(transition, wakes=True, flushes=False)
    await asyncio.sleep(0)
    order.clear()
    await asyncio.wait_for(turn.on_loop(transition, wakes=False), HANG_SECONDS)
    await asyncio.sleep(0)
    assert order == ["flush", "woken"]


async def test_where_claims_replace_files_a_post_left_where_it_landed_flushes_its_file_once(tmp_path, monkeypatch,
                                                                                          flushed):
    monkeypatch.setattr(files, "set_xattr", lambda path, name, value: False)
    store = Store(tmp_path / "data", fsync=True)
    store.ensure_queue(Q)
    store._items.claim_xattrs = False  # as a first refused xattr leaves it
    [posted] = await turn.on_loop(post_batch, store=store, queue=Q, payloads=["x"])
    assert flushed == [str(tmp_path / "data" / Q / "pending" / f"{posted.id}.json")]


async def test_a_posts_item_hidden_by_a_move_under_way_is_looked_for_again_and_its_directory_flushed(
        tmp_path, monkeypatch):
    store = Store(tmp_path / "data", fsync=True)
    store.ensure_queue(Q)
    data = tmp_path / "data" / Q
    flushed_directories = []
    flush_directory, exists = files.flush_directory, files.exists
    looks = []

    def hidden_at_first(path):  # the first look, in every state, comes while a move is under way
        if os.path.basename(os.path.dirname(path)) in ("done", "pending", "scheduled", "processing"):
            looks.append(path)
            if len(looks) <= 4:
                return False
        return exists(path)

    monkeypatch.setattr(files, "flush_directory", lambda path: (flush_directory(path), flushed_directories.append(path)))
    monkeypatch.setattr(files, "exists", hidden_at_first)
    await turn.on_loop(post_batch, store=store, queue=Q, payloads=["x"])
    assert len(looks) > 4  # looked again
    assert str(data / "pending") in flushed_directories


@pytest.mark.parametrize("xattrs", [True, False], ids=["claims-in-xattrs", "claims-replace-the-file"])
async def test_a_posts_item_claimed_and_requeued_before_its_directory_flush_is_flushed_as_it_is_then(
        tmp_path, monkeypatch, xattrs):
    """Where a claim replaced the file whole and a re-queue brought the new one back to
    pending/, that new file is flushed too, not only the directory naming it."""
    if not xattrs:
        monkeypatch.setattr(files, "set_xattr", lambda path, name, value: False)
    store = Store(tmp_path / "data", fsync=True)
    store.ensure_queue(Q)
    config = QueueConfig(name=Q)
    data = tmp_path / "data" / Q
    flushed_files = []  # the inode of each file flushed
    flush_file, flush_directory = files._flush_file, files.flush_directory

    def watched_flush_file(fd, path):
        flush_file(fd, path)
        flushed_files.append(os.fstat(fd).st_ino if fd is not None else os.stat(path).st_ino)

    def watched_flush_directory(path):
        if path == str(data / "pending") and "requeued" not in moved:
            [claimed] = store.claim_items(config=config, max_items=1)
            moved["requeued"] = store.release_items(releases=[Release(config, claimed.id, claimed.claim_token)])
        flush_directory(path)

    moved = {}
    monkeypatch.setattr(files, "_flush_file", watched_flush_file)
    monkeypatch.setattr(files, "flush_directory", watched_flush_directory)
    [posted] = await turn.on_loop(post_batch, store=store, queue=Q, payloads=["x"])
    as_it_is = os.stat(data / "pending" / f"{posted.id}.json").st_ino
    assert as_it_is in flushed_files
    assert store.read_item(queue=Q, item_id=posted.id).status == "pending"


async def test_an_item_moved_while_its_posts_directory_flush_ran_is_flushed_where_it_went(tmp_path, monkeypatch):
    """A claim takes the post's item before pending/ is flushed, and a re-queue brings it back
    while processing/ is flushed: pending/ is flushed after that (on ext4 without a journal the
    rename would otherwise never reach the disk)."""
    store = Store(tmp_path / "data", fsync=True)
    store.ensure_queue(Q)
    config = QueueConfig(name=Q)
    data = tmp_path / "data" / Q
    flushed_directories = []
    flush_directory = files.flush_directory
    moves = {}

    def watched(path):
        if path == str(data / "pending") and not flushed_directories:
            [moves["claimed"]] = store.claim_items(config=config, max_items=1)  # before pending/ is flushed
        flush_directory(path)
        flushed_directories.append(path)
        if path == str(data / "processing") and "requeued" not in moves:
            claimed = moves["claimed"]
            moves["requeued"] = store.release_items(releases=[Release(config, claimed.id, claimed.claim_token)])

    monkeypatch.setattr(files, "flush_directory", watched)
    [posted] = await turn.on_loop(post_batch, store=store, queue=Q, payloads=["x"])
    assert flushed_directories[-2:] == [str(data / "processing"), str(data / "pending")]
    assert store.read_item(queue=Q, item_id=posted.id).status == "pending"


async def test_a_transition_cannot_start_another_from_inside():
    def inner():
        return "inner"

    def outer():
        try:
            turn.on_loop(inner)
        except RuntimeError as error:
            return str(error)

    assert "cannot start another" in await turn.on_loop(outer)


@pytest.mark.parametrize("xattrs", [True, False], ids=["claims-in-xattrs", "claims-replace-the-file"])
async def test_a_claim_woken_by_a_post_takes_the_item_before_the_post_is_flushed_and_the_post_stays_durable(
        tmp_path, monkeypatch, flushed, xattrs):
    hub = Hub()
    store = Store(tmp_path / "data", fsync=True, events=hub)
    store.ensure_queue(Q)
    if not xattrs:  # as on a file system without them (see conftest's store)
        monkeypatch.setattr(files, "set_xattr", lambda path, name, value: False)
    config = QueueConfig(name=Q)
    directories = []
    fsync = files._fsync
    monkeypatch.setattr(files, "_fsync", lambda path: (directories.append(path), fsync(path))[1])
    await turn.on_loop(post_batch, store=store, queue=Q, payloads=["first"])  # flushed alone
    [first] = store.claim_items(config=config, max_items=1)
    order = []

    async def claim_when_woken():
        await hub.wait_available(Q, HANG_SECONDS)
        items = await turn.on_loop(store.claim_items, config=config, max_items=1)
        order.append(("claimed", [item.payload for item in items], len(flushed)))

    claiming = asyncio.ensure_future(claim_when_woken())
    await asyncio.sleep(0)
    flushed.clear()
    directories.clear()
    [posted] = await asyncio.wait_for(turn.on_loop(post_batch, store=store, queue=Q, payloads=["second"]), HANG_SECONDS)
    await asyncio.wait_for(claiming, HANG_SECONDS)

    assert order == [("claimed", ["second"], 0)]  # before any file was flushed
    as_posted = str(tmp_path / "data" / Q / "pending" / f"{posted.id}.json")
    as_claimed = str(tmp_path / "data" / Q / "processing" / f"{posted.id}.json")
    # then its own file, and the claim's new one where the claim replaced it
    assert flushed == ([as_posted] if xattrs else [as_posted, as_claimed])
    assert str(tmp_path / "data" / Q / "processing") in directories  # and the directory naming it now
    assert store.read_item(queue=Q, item_id=posted.id).status == "processing"
    assert first.payload == "first"


async def test_a_wait_on_the_loops_thread_outside_a_transition_is_refused_not_a_hang():
    stripe = Stripe()
    held = asyncio.ensure_future(turn.on_loop(stripe.take))  # a transition holds it, and ends
    await held
    with pytest.raises(RuntimeError, match="on_loop"):
        stripe.take()
    assert stripe._waiters == deque()  # its wait was taken back


async def test_a_call_that_answers_too_few_requests_fails_each_transition_and_leaves_none_asleep():
    def answers_one(requests):
        return ["one"]

    def answers_three(requests):
        return ["one", "two", "three"]

    def answers_each(requests):
        return [f"{request} done" for request in requests]

    def transition(call, request):
        return turn.together(call, request)

    outcomes = await asyncio.wait_for(asyncio.gather(
        turn.on_loop(transition, call=answers_one, request="a"), turn.on_loop(transition, call=answers_one, request="b"),
        turn.on_loop(transition, call=answers_each, request="c"),
        turn.on_loop(transition, call=answers_three, request="d"), return_exceptions=True,
    ), HANG_SECONDS)

    assert [type(outcome) for outcome in outcomes[:2]] == [RuntimeError, RuntimeError]
    assert "answered 1 of 2 requests" in str(outcomes[0])
    assert outcomes[2] == "c done"  # another call of the same turn is answered all the same
    assert isinstance(outcomes[3], RuntimeError) and "answered 3 of 1 requests" in str(outcomes[3])
    with pytest.raises(RuntimeError, match="answered 3 of 1"):  # from a thread as well
        await asyncio.to_thread(transition, answers_three, "e")


async def test_flushes_of_two_directories_in_one_turn_count_as_nobody_joining(tmp_path, monkeypatch):
    """Each directory is a gathering of its own: two transitions flushing different directories
    share nothing, so the flushes after them run at once, inside their transitions."""
    pending, done = tmp_path / "pending", tmp_path / "done"
    pending.mkdir()
    done.mkdir()
    at_once = []
    flush = files._DirectoryFlush.flush

    def watched_flush(self):
        at_once.append((self.path, isinstance(greenlet.getcurrent(), turn._OnLoop)))
        flush(self)

    monkeypatch.setattr(files._DirectoryFlush, "flush", watched_flush)
    await asyncio.wait_for(asyncio.gather(
        turn.on_loop(files.flush_directory, path=str(pending)), turn.on_loop(files.flush_directory, path=str(done)),
    ), HANG_SECONDS)
    await turn.on_loop(files.flush_directory, path=str(pending))

    assert at_once == [(str(pending), False), (str(done), False), (str(pending), True)]  # gathered, then at once


async def test_a_flush_made_together_that_fails_fails_every_transition_that_asked_each_with_its_own_error():
    flushes = []

    def failing_flush(requests):
        flushes.append(1)
        raise OSError(5, "the disk failed")

    def transition():
        turn.together(failing_flush, "directory")

    outcomes = await asyncio.wait_for(
        asyncio.gather(*(turn.on_loop(transition) for _ in range(3)), return_exceptions=True), HANG_SECONDS
    )

    assert flushes == [1]
    assert all(isinstance(outcome, OSError) and outcome.errno == 5 for outcome in outcomes)
    assert len({id(outcome) for outcome in outcomes}) == 3


async def test_a_stripe_goes_to_its_waiters_in_the_order_they_asked():
    stripe = Stripe()
    go_on = Future()
    order = []

    def holder():
        stripe.take()
        turn.wait_for(go_on)
        stripe.release()

    def waiter(name):
        stripe.take()
        order.append(name)
        stripe.release()

    holding = asyncio.ensure_future(turn.on_loop(holder))
    await asyncio.sleep(0)
    in_thread = asyncio.ensure_future(asyncio.to_thread(waiter, "thread"))
    for _ in range(HANG_SECONDS * 100):
        if stripe._waiters:  # the thread waits now
            break
        await asyncio.sleep(0.01)
    on_the_loop = asyncio.ensure_future(turn.on_loop(waiter, name="transition"))
    await asyncio.sleep(0)
    assert len(stripe._waiters) == 2 and order == []
    go_on.set_result(None)
    await asyncio.wait_for(asyncio.gather(holding, in_thread, on_the_loop), HANG_SECONDS)
    assert order == ["thread", "transition"]


async def test_a_transition_waiting_for_another_process_lock_lets_the_loop_run_others(tmp_path):
    """Another process holds every item lock: a result on the loop waits for its item's in a
    thread of its own, while the loop runs a post (which takes no item lock); then it goes on."""
    store = Store(tmp_path / "data", fsync=False)
    config = QueueConfig(name=Q)
    post_batch(store, Q, ["first"])
    (item,) = store.claim_items(config=config, max_items=1)
    with item_locks_held_elsewhere(tmp_path / "data", Q) as let_go:
        finishing = asyncio.ensure_future(turn.on_loop(finish, store=store, config=config, item_id=item.id, result="late"))
        await asyncio.sleep(0.05)
        posted = await asyncio.wait_for(turn.on_loop(post_batch, store=store, queue=Q, payloads=["meanwhile"]), HANG_SECONDS)
        assert len(posted) == 1 and not finishing.done()
        let_go()
        assert (await asyncio.wait_for(finishing, HANG_SECONDS)).accepted


async def test_posts_whose_shared_directory_flush_fails_all_fail_and_none_is_left(tmp_path, faults):
    """Posts gathered on one flush of pending/ that the disk fails: every one of them fails (none
    would be answered 201), and none of their items is left in any state."""
    store = Store(tmp_path / "data", fsync=True)
    store.ensure_queue(Q)
    pending = str(tmp_path / "data" / Q / "pending")
    faults.fail(at=7, calls={"fsync"})  # each post flushes its own file, then pending/ once for all

    posts = [turn.on_loop(post_batch, store=store, queue=Q, payloads=[n]) for n in range(6)]
    outcomes = await asyncio.wait_for(asyncio.gather(*posts, return_exceptions=True), HANG_SECONDS)

    assert faults.struck == [("fsync", pending)]
    assert all(isinstance(outcome, StorageUnavailable) for outcome in outcomes), outcomes
    counts = store.count_items(queue=Q)
    assert (counts.pending, counts.processing, counts.finished, counts.failed) == (0, 0, 0, 0)
