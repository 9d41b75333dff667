"""The in-process wake-up hub: claims and reads wake when told, and no more of them than asked."""

import asyncio
import threading

from queues.events import Hub


async def test_items_available_wakes_only_as_many_claims_as_items_oldest_first():
    hub = Hub()
    waiters = [asyncio.create_task(hub.wait_available("jobs", timeout=5)) for _ in range(5)]
    await asyncio.sleep(0)  # let every waiter register
    assert hub.items_available("jobs", 2) == 2
    done, pending = await asyncio.wait(waiters, timeout=0.5)
    assert [waiters.index(task) for task in sorted(done, key=waiters.index)] == [0, 1]
    assert all(task.result() is True for task in done)
    assert hub.items_available("jobs", 10) == 3  # as many as were waiting
    assert await asyncio.gather(*pending) == [True, True, True]
    assert hub.items_available("jobs", 1) == 0


async def test_a_wake_up_goes_to_a_claim_still_waiting_not_to_one_that_timed_out_but_has_not_left():
    hub = Hub()
    left = asyncio.get_running_loop().create_future()
    left.set_result(False)  # timed out: its task removes it from the queue when it next runs
    hub._claim_waiters["jobs"].append(left)
    waiting = asyncio.create_task(hub.wait_available("jobs", timeout=30))
    await asyncio.sleep(0)
    assert hub.items_available("jobs", 1) == 1
    assert await asyncio.wait_for(waiting, 5) is True


async def test_a_woken_claim_goes_on_in_the_loops_next_turn():
    """Not a turn later: a post's flush, gathered in the next turn, comes after the claim."""
    hub = Hub()
    waiter = asyncio.create_task(hub.wait_available("jobs", timeout=30))
    await asyncio.sleep(0)
    hub.items_available("jobs", 1)
    await asyncio.sleep(0)  # one turn of the loop
    assert waiter.done() and waiter.result() is True


async def test_a_claim_on_another_queue_is_not_woken():
    hub = Hub()
    waiter = asyncio.create_task(hub.wait_available("jobs", timeout=0.2))
    await asyncio.sleep(0)
    hub.items_available("other", 5)
    assert await waiter is False


async def test_items_terminal_wakes_every_read_of_that_item_from_another_thread():
    hub = Hub()
    reads = [asyncio.create_task(hub.wait_terminal("jobs", "a", timeout=5)) for _ in range(3)]
    other = asyncio.create_task(hub.wait_terminal("jobs", "b", timeout=0.2))
    await asyncio.sleep(0)
    thread = threading.Thread(target=hub.items_terminal, args=("jobs", ["a"]))  # as the sweep does
    thread.start()
    thread.join()
    assert await asyncio.gather(*reads) == [True, True, True]
    assert await other is False


async def test_an_event_after_the_mark_ends_a_wait_at_once_and_none_lets_it_wait():
    """A waiter marks, looks at the disk, then waits: what came while it looked is not missed."""
    hub = Hub()
    posted, ended = hub.available_mark("jobs"), hub.terminal_mark("jobs")
    hub.items_available("jobs", 1)  # no claim is waiting yet: nobody to wake
    hub.items_terminal("jobs", ["a"])
    assert await hub.wait_available("jobs", timeout=30, since=posted) is True
    assert await hub.wait_terminal("jobs", "a", timeout=30, since=ended) is True
    assert await hub.wait_available("jobs", timeout=0.05, since=hub.available_mark("jobs")) is False
    assert await hub.wait_terminal("jobs", "a", timeout=0.05, since=hub.terminal_mark("jobs")) is False
    assert await hub.wait_available("other", timeout=0.05, since=hub.available_mark("other")) is False


async def test_a_wait_that_times_out_leaves_nothing_behind():
    hub = Hub()
    assert await hub.wait_available("jobs", timeout=0.01) is False
    assert await hub.wait_terminal("jobs", "a", timeout=0.01) is False
    assert not hub._claim_waiters and not hub._item_waiters


class RecordingBridge:
    def __init__(self):
        self.published = []

    def publish(self, kind, queue, payload):
        self.published.append((kind, queue, payload))


def test_notifications_reach_the_bridge_unless_they_came_from_it():
    hub = Hub()
    hub.bridge = RecordingBridge()
    hub.items_available("jobs", 3)
    hub.items_terminal("jobs", ["a"])
    hub.items_available("jobs", 1, local_only=True)
    hub.items_terminal("jobs", ["b"], local_only=True)
    assert hub.bridge.published == [("available", "jobs", 3), ("terminal", "jobs", ["a"])]
