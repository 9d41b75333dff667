"""queues/runtime.py: where store calls run. A claim runs on the event loop while that never
waits, and in the store's thread for the rest."""

import asyncio
import threading
from dataclasses import replace

import pytest

from queues import runtime
from queues.runtime import CLAIMS_ON_LOOP, claim_items, get_store
from queues.exceptions import StorageUnavailable
from queues.store import QueueConfig

CONFIG = QueueConfig(name="jobs")


@pytest.fixture
def thread_claims(monkeypatch) -> list[int]:
    """How many items each claim asked of the store's thread."""
    store, asked = get_store(), []
    real = store.claim_items

    def counted(**kwargs):
        asked.append(kwargs["max_items"])
        return real(**kwargs)

    monkeypatch.setattr(store, "claim_items", counted)
    return asked


async def test_a_claim_the_event_loop_can_serve_never_goes_to_the_store_thread(thread_claims):
    store = get_store()
    posted = [item.id for item in store.post_items(queue="jobs", payloads=[1, 2, 3])]
    assert [item.id for item in await claim_items(CONFIG, 1)] == posted[:1]
    asked_first = list(thread_claims)  # a fresh process makes the queue's locks in the thread
    assert [item.id for item in await claim_items(CONFIG, 5)] == posted[1:]
    assert thread_claims == asked_first


async def test_a_big_claim_takes_a_few_items_on_the_event_loop_and_the_rest_in_the_store_thread(thread_claims):
    store = get_store()
    store.post_items(queue="jobs", payloads=[0])
    await claim_items(CONFIG, 1)  # the queue's locks are made
    thread_claims.clear()
    posted = [item.id for item in store.post_items(queue="jobs", payloads=list(range(CLAIMS_ON_LOOP + 5)))]
    claimed = await claim_items(CONFIG, CLAIMS_ON_LOOP + 3)
    assert [item.id for item in claimed] == posted[: CLAIMS_ON_LOOP + 3]  # oldest first, across both
    assert thread_claims == [3]


async def test_a_claim_the_event_loop_cannot_serve_waits_in_the_store_thread(thread_claims):
    store = get_store()
    store.post_items(queue="jobs", payloads=[0])
    await claim_items(CONFIG, 1)
    thread_claims.clear()
    [item_id] = [item.id for item in store.post_items(queue="jobs", payloads=[1])]
    with store._queue_locks("jobs").hold(item_id):  # a transition of it is under way in a thread
        claiming = asyncio.create_task(claim_items(CONFIG, 1))
        await asyncio.sleep(0.05)
        assert not claiming.done()  # it waits, off the event loop (which goes on)
    assert [item.id for item in await claiming] == [item_id]
    assert thread_claims == [1]


async def test_a_single_post_is_flushed_beside_the_store_thread(monkeypatch):
    """With fsync on, a single post is claimable once the store's thread has written it, and is
    flushed in the flush thread: the store's thread takes the next call meanwhile (in a round
    trip, the result for that very item)."""
    store = get_store()
    monkeypatch.setattr(store, "fsync", True)
    release = threading.Event()
    busy = runtime._flush_thread.submit(release.wait, 10)  # the flush thread is still flushing
    try:
        posting = asyncio.create_task(runtime.in_store_threads(store.begin_post, queue="jobs", payloads=[1]))
        assert await asyncio.wait_for(runtime.in_store_thread(lambda: "free"), 5) == "free"
        assert await claim_items(CONFIG, 1)  # claimable already
        assert not posting.done()  # answered only once flushed
    finally:
        release.set()
    busy.result()
    [item] = await asyncio.wait_for(posting, 5)
    assert store.read_item(queue="jobs", item_id=item.id).status == "processing"


async def test_a_claim_on_a_paused_queue_is_answered_on_the_event_loop(thread_claims):
    store = get_store()
    store.post_items(queue="jobs", payloads=[0, 1])
    await claim_items(CONFIG, 1)  # the queue's locks are made
    thread_claims.clear()
    assert await claim_items(replace(CONFIG, paused=True), 5) == []
    assert thread_claims == []


async def test_an_error_in_a_second_half_reaches_the_caller(monkeypatch):
    monkeypatch.setattr(get_store(), "fsync", True)

    def begin():
        def second_half():
            raise StorageUnavailable("the disk went away")

        return second_half

    with pytest.raises(StorageUnavailable):
        await asyncio.wait_for(runtime.in_store_threads(begin), 5)
