"""Wake-ups inside one server process: claims waiting for items, reads waiting for an item to
turn terminal, and sockets holding an item that was canceled.

Transitions made in this process (from the event loop or from any thread, such as the sweep's)
call `items_available` / `items_terminal`; waiters await `wait_available` / `wait_terminal`.

A waiter looks at the disk first and waits after, so an event can land in between. It takes a
mark (`available_mark` / `terminal_mark`) before it looks, and passes it to the wait: if an event
came since the mark, the wait returns at once instead of sleeping through it.
A bridge (set by the channel-layer code) may forward each notification to other processes and
feed theirs back in with `local_only=True`.
"""

import asyncio
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from typing import Protocol


MOST_UNHELD_CANCELS = 1024


class Bridge(Protocol):
    def publish(self, kind: str, queue: str, payload: object) -> None: ...


def _wake(future: asyncio.Future, woken: bool = True) -> None:
    """A waiter's future settles with whether it was woken (False: its time ran out)."""
    if not future.done():
        future.set_result(woken)


def _wake_soon(future: asyncio.Future) -> None:
    """Wake a waiter from any thread; from its own loop's thread at once (no trip through the
    loop's self-pipe, which costs an extra turn of the loop)."""
    loop = future.get_loop()
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if here is loop:
        _wake(future)
    else:
        loop.call_soon_threadsafe(_wake, future)


class Hub:
    def __init__(self):
        self._lock = threading.Lock()
        self._claim_waiters: dict[str, deque[asyncio.Future]] = defaultdict(deque)
        self._item_waiters: dict[tuple[str, str], deque[asyncio.Future]] = defaultdict(deque)
        self._available_events: dict[str, int] = defaultdict(int)  # queue -> events so far
        self._terminal_events: dict[str, int] = defaultdict(int)
        self._holders: dict[tuple[str, str], tuple[str, Callable[[str, str], None]]] = {}  # held item -> (claim, told)
        # claims canceled before anyone held their item: a socket's claim still under way
        self._canceled_unheld: dict[tuple[str, str, str], None] = {}  # (queue, item, claim), oldest first
        self.bridge: Bridge | None = None

    def items_available(self, queue: str, count: int = 1, *, local_only: bool = False) -> int:
        """Items were posted or re-queued: wake at most `count` waiting claims, oldest first
        (no thundering herd: the rest keep waiting). How many of this process's it woke."""
        with self._lock:
            self._available_events[queue] += 1
            waiters = self._claim_waiters.get(queue)
            woken = []
            while waiters and len(woken) < count:
                future = waiters.popleft()
                if not future.done():  # timed out or cancelled: leaving anyway
                    woken.append(future)
        for future in woken:
            _wake_soon(future)
        if self.bridge is not None and not local_only:
            self.bridge.publish("available", queue, count)
        return len(woken)

    def items_terminal(self, queue: str, item_ids: Iterable[str], *, local_only: bool = False) -> None:
        """Items finished or failed: wake every read waiting on them."""
        item_ids = list(item_ids)
        with self._lock:
            self._terminal_events[queue] += 1
            woken = [f for i in item_ids for f in self._item_waiters.pop((queue, i), ())]
        for future in woken:
            _wake_soon(future)
        if self.bridge is not None and not local_only and item_ids:
            self.bridge.publish("terminal", queue, item_ids)

    def item_canceled(self, queue: str, item_id: str, claim_token: str | None, *, local_only: bool = False) -> None:
        """A processing item was canceled under this claim: tell the socket holding it by that
        claim, in this process or (through the bridge) in another. A socket here that held the
        item by an older claim (it lapsed, or staff re-queued it) is not the one."""
        with self._lock:
            holder = self._holders.get((queue, item_id))
            if holder is not None and holder[0] == claim_token:
                del self._holders[(queue, item_id)]
            else:
                holder = None
                if claim_token is not None:
                    self._remember_unheld_cancel((queue, item_id, claim_token))
        if holder is not None:
            holder[1](queue, item_id)
        elif self.bridge is not None and not local_only:
            self.bridge.publish("canceled", queue, [[item_id, claim_token]])

    def hold(self, queue: str, item_id: str, claim_token: str, told: Callable[[str, str], None]) -> bool:
        """`told(queue, item_id)` is called (from any thread) if the item is canceled while held
        under this claim. False, and nothing held, if it was canceled under this claim already
        (between the claim and this call)."""
        with self._lock:
            if (queue, item_id, claim_token) in self._canceled_unheld:
                del self._canceled_unheld[(queue, item_id, claim_token)]
                return False
            self._holders[(queue, item_id)] = (claim_token, told)
            return True

    def _remember_unheld_cancel(self, canceled: tuple[str, str, str]) -> None:
        """Call holding the lock. Most are never asked for (a claim over HTTP holds nothing):
        only the latest are kept, as a claim under way asks within moments."""
        self._canceled_unheld[canceled] = None
        if len(self._canceled_unheld) > MOST_UNHELD_CANCELS:
            del self._canceled_unheld[next(iter(self._canceled_unheld))]

    def let_go(self, queue: str, item_id: str, claim_token: str) -> None:
        """Only this claim's hold goes: a socket that lost the item (re-queued by staff or the
        sweep) lets go after another claimed it, whose socket must still be told of a cancel."""
        with self._lock:
            if self._holders.get((queue, item_id), (None,))[0] == claim_token:
                del self._holders[(queue, item_id)]

    def available_mark(self, queue: str) -> int:
        """Take before looking for items; give to `wait_available`."""
        return self._available_events.get(queue, 0)

    def terminal_mark(self, queue: str) -> int:
        """Take before reading an item; give to `wait_terminal`."""
        return self._terminal_events.get(queue, 0)

    async def wait_available(self, queue: str, timeout: float, *, since: int | None = None) -> bool:
        """Wait until woken for `queue` or `timeout` passes; True if woken. With `since` (a mark),
        True at once if items became available after the mark was taken."""
        return await self._wait(self._claim_waiters, queue, timeout, self._available_events, queue, since)

    async def wait_terminal(self, queue: str, item_id: str, timeout: float, *, since: int | None = None) -> bool:
        """Wait until the item is reported terminal or `timeout` passes; True if reported. With
        `since` (a mark), True at once if any item of the queue ended after the mark was taken."""
        return await self._wait(self._item_waiters, (queue, item_id), timeout, self._terminal_events, queue, since)

    async def _wait(self, waiting: dict, key, timeout: float, events: dict, queue: str, since: int | None) -> bool:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if since is not None and events.get(queue, 0) != since:
                return True
            waiting[key].append(future)
        # a timer, not asyncio.wait_for: a wake-up then resumes the waiter in the loop's next
        # turn, not the one after it (a woken claim runs before a post's gathered flush)
        timer = loop.call_later(timeout, _wake, future, False)
        try:
            return await future
        finally:
            timer.cancel()
            with self._lock:
                waiters = waiting.get(key)
                if waiters is not None and future in waiters:
                    waiters.remove(future)
                    if not waiters:
                        del waiting[key]


hub = Hub()
