"""Where store calls run: a call of a few items on the event loop, a bigger one in the store's
threads; a claim takes its first items on the loop and the rest in the store's threads, and the
caller sees one claim."""

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from queues import runtime
from queues.exceptions import StorageUnavailable
from queues.runtime import run
from queues.store import QueueConfig, Store, turn
from queues.threads import in_thread
from storekit import post_batch

Q = "jobs"


def _store_with_items(tmp_path, count: int) -> Store:
    store = Store(tmp_path / "data", fsync=False)
    post_batch(store, Q, list(range(count)))
    return store


def _watched_claims(store: Store):
    """The store's claim_items, and where each call of it ran: (on the loop's thread, max_items)."""
    where = []

    def claim_items(**kwargs):
        where.append((threading.current_thread() is threading.main_thread(), kwargs["max_items"]))
        return store.claim_items(**kwargs)

    return claim_items, where


async def test_a_big_claim_is_one_claim_of_the_oldest_items(tmp_path):
    claim_items, where = _watched_claims(_store_with_items(tmp_path, 30))

    claimed = await run(claim_items, config=QueueConfig(name=Q), max_items=20)

    assert [item.payload for item in claimed] == list(range(20))
    assert len({item.claim_token for item in claimed}) == 20
    assert where == [(True, runtime.ITEMS_ON_LOOP), (False, 20 - runtime.ITEMS_ON_LOOP)]


async def test_a_big_claim_ends_with_its_items_though_a_stopping_server_cancels_every_task(tmp_path):
    """A stopping server cancels the tasks it leaves (finish_leftover_tasks): a claim cut there
    would have taken items for nobody, holding them till their lease lapsed."""
    claim_items, where = _watched_claims(_store_with_items(tmp_path, 30))

    claiming = run(claim_items, config=QueueConfig(name=Q), max_items=20)
    for task in asyncio.all_tasks():
        if task is not asyncio.current_task():
            task.cancel()
    claimed = await claiming

    assert [item.payload for item in claimed] == list(range(20))


async def test_a_big_claim_whose_rest_cannot_start_ends_with_its_first_items(tmp_path, monkeypatch):
    claim_items, _ = _watched_claims(_store_with_items(tmp_path, 30))

    def shut_down(*args, **kwargs):
        raise RuntimeError("cannot schedule new futures after shutdown")

    monkeypatch.setattr(runtime, "_in_store_thread", shut_down)
    claimed = await asyncio.wait_for(run(claim_items, config=QueueConfig(name=Q), max_items=20), 5)
    assert [item.payload for item in claimed] == list(range(runtime.ITEMS_ON_LOOP))


async def test_a_claim_that_finds_few_items_never_leaves_the_loop(tmp_path):
    claim_items, where = _watched_claims(_store_with_items(tmp_path, 3))

    claimed = await run(claim_items, config=QueueConfig(name=Q), max_items=100)

    assert len(claimed) == 3 and where == [(True, runtime.ITEMS_ON_LOOP)]


async def test_a_claim_of_no_more_than_the_loop_takes_never_leaves_it(tmp_path):
    claim_items, where = _watched_claims(_store_with_items(tmp_path, 30))

    claimed = await run(claim_items, config=QueueConfig(name=Q), max_items=runtime.ITEMS_ON_LOOP)

    assert len(claimed) == runtime.ITEMS_ON_LOOP and where == [(True, runtime.ITEMS_ON_LOOP)]


async def test_a_claim_that_fails_after_its_first_items_ends_with_them(tmp_path):
    """As within one claim: items taken before the disk failed are handed out, not stranded."""
    store = _store_with_items(tmp_path, 30)
    calls = []

    def claim_items(**kwargs):
        calls.append(kwargs["max_items"])
        if len(calls) == 2:
            raise StorageUnavailable("the disk failed")
        return store.claim_items(**kwargs)

    claimed = await run(claim_items, config=QueueConfig(name=Q), max_items=20)

    assert [item.payload for item in claimed] == list(range(runtime.ITEMS_ON_LOOP))
    assert store.count_items(queue=Q).processing == runtime.ITEMS_ON_LOOP


async def test_a_claim_that_fails_at_once_raises(tmp_path):
    def claim_items(**kwargs):
        raise StorageUnavailable("the disk failed")

    with pytest.raises(StorageUnavailable):
        await run(claim_items, config=QueueConfig(name=Q), max_items=20)


# ---- calls in the store's threads ---------------------------------------------------------------


def _many() -> list:
    return [None] * (runtime.ITEMS_ON_LOOP + 1)


@pytest.mark.parametrize("items, on_the_loop", [([None] * runtime.ITEMS_ON_LOOP, True), (_many(), False)])
async def test_a_call_runs_on_the_loop_or_in_the_store_threads_by_its_items(items, on_the_loop):
    def post_items(*, items, value):
        if value is None:
            raise StorageUnavailable("the disk is full")
        return (value, threading.current_thread() is threading.main_thread())

    assert await run(post_items, items=items, value=7) == (7, on_the_loop)
    with pytest.raises(StorageUnavailable, match="the disk is full"):
        await run(post_items, items=items, value=None)


@pytest.mark.parametrize("kwargs, on_the_loop", [({}, True), ({"results": _many()}, False), ({"releases": _many()}, False)])
async def test_a_call_of_no_item_list_runs_on_the_loop_and_big_batches_of_results_in_threads(kwargs, on_the_loop):
    def finish_items(**kwargs):
        return threading.current_thread() is threading.main_thread()

    assert await run(finish_items, **kwargs) is on_the_loop


@pytest.mark.parametrize("name, kwargs", [("post_items", {}), ("post_items", {"items": _many()}), ("count_items", {})])
async def test_a_call_that_raises_stopiteration_fails_its_caller_rather_than_leave_it_waiting(name, kwargs):
    # on the loop, in the store's threads, in a scan's
    def call(**kwargs):
        return next(iter(()))

    call.__name__ = name
    with pytest.raises(RuntimeError, match="StopIteration") as raised:
        await asyncio.wait_for(run(call, **kwargs), 10)
    assert isinstance(raised.value.__cause__, StopIteration)  # its traceback kept


@pytest.mark.parametrize("kwargs", [{}, {"items": _many()}])  # on the loop, in the store's threads
async def test_a_started_call_runs_to_its_end_though_its_caller_is_cancelled(kwargs):
    started, go_on, ended = threading.Event(), Future(), threading.Event()

    def post_items(**kwargs):
        started.set()
        turn.wait_for(go_on)  # as for a lock another holds
        ended.set()

    loop = asyncio.get_running_loop()
    troubles = []  # the outcome handed back to a caller that is gone must raise nothing on the loop
    loop.set_exception_handler(lambda loop, context: troubles.append(context))
    try:
        caller = asyncio.ensure_future(run(post_items, **kwargs))
        await asyncio.to_thread(started.wait, 10)
        caller.cancel()
        go_on.set_result(None)
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert await asyncio.to_thread(ended.wait, 10)
        await run(lambda items: None, items=_many())  # after the cancelled call's outcome reached the loop
        for _ in range(10):
            await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert troubles == []


async def test_cancelling_a_calls_future_takes_its_work_back_at_once_if_no_thread_has_it():
    """Not a turn of the loop later: by then a thread that freed up could have started it."""
    pool = ThreadPoolExecutor(max_workers=1)
    busy = threading.Event()
    pool.submit(busy.wait, 10)  # the one thread is busy: the call waits in the queue
    ran = []
    answer = in_thread(pool, ran.append, "ran")
    answer.cancel()
    busy.set()
    pool.shutdown(wait=True)  # the thread takes whatever is left in the queue, then ends
    assert ran == [] and answer.cancelled()


async def test_a_call_whose_caller_is_cancelled_before_it_starts_never_runs():
    # as many blocking calls as there are store threads go first: the next call waits behind them
    started, go_on = threading.Event(), threading.Event()
    ran = []

    def finish_items(**kwargs):
        started.set()
        go_on.wait(10)

    def post_items(**kwargs):
        ran.append(True)

    holders = [asyncio.ensure_future(run(finish_items, results=_many())) for _ in range(runtime.STORE_THREADS)]
    try:
        await asyncio.to_thread(started.wait, 10)
        waiting = asyncio.ensure_future(run(post_items, items=_many()))
        await asyncio.sleep(0.05)  # it is in the store threads' queue now
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    finally:
        go_on.set()  # even if the test fails: the store threads are the next test's too
    await asyncio.gather(*holders)
    assert await run(post_items, items=_many()) is None
    # every store thread waiting at once on a barrier: a call that had started would have ended
    barrier = threading.Barrier(runtime.STORE_THREADS, timeout=10)

    def save_items(**kwargs):
        turn.outside(barrier.wait)  # out of the turn, which the other threads must take to get here

    await asyncio.gather(*(run(save_items, items=_many()) for _ in range(runtime.STORE_THREADS)))
    assert ran == [True]  # only the later call ran
