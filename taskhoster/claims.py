"""Claiming: only as many items as there are free slots, from queues that may have items first,
in turn; when every queue is known to be empty, one waiting claim per idle queue."""

import asyncio
import logging
from collections import deque
from functools import partial
from typing import TYPE_CHECKING

from .errors import ApiError
from .jobs import Job
from .leases import release
from .link import ANSWER_SECONDS, Link, LinkClosed, answer_of

if TYPE_CHECKING:
    from .run import Run

log = logging.getLogger("taskhoster.worker")

CLAIM_WAIT_SECONDS = 20  # how long one waiting claim lasts before it is asked again
CLAIM_MAX = 100  # the server's limit of items per claim
CLAIM_RETRY_SECONDS = 1.0  # after a claim the server refused for a passing reason
FILL_DELAY_SECONDS = 0.001  # fewer than half the slots free: wait this long for more to free up
# claim errors no retry can mend: the worker stops and raises them
FATAL_CLAIM_ERRORS = {"unauthorized", "forbidden", "unknown_queue", "invalid_request", "invalid_json"}
RESTING = object()  # a claim the server refused for now (a full disk, say)


def split_slots(free: int, queues: int) -> list[int]:
    """How many items each waiting claim may bring when `queues` queues are idle: one queue gets
    the most, each other one slot, never more than `free` in all."""
    count = min(free, queues)
    return [free - (count - 1)] + [1] * (count - 1) if count else []


class Claims:
    """The claims out over the open socket. It gives each item it brings to the run, which says
    how many handlers are busy."""

    def __init__(self, run: "Run", queues: list[str], concurrency: int, server: str):
        self._run = run
        self._concurrency = concurrency
        # claims wait for a moment when only a few slots are free: half of them is enough at once
        self._enough_slots = max(1, min(concurrency, CLAIM_MAX) // 2)
        self._rotation = deque(queues)  # the next claim starts with the queue at the front
        self._announcement: tuple[str, str] | None = (", ".join(queues), server)  # until said once
        self._link: Link | None = None
        self._claiming: dict[str, int] = {}  # queue -> slots its outstanding claim may fill
        self._known_empty: set[str] = set()  # queues whose last claim brought fewer items than asked
        self._refusals: dict[str, asyncio.TimerHandle] = {}  # queue -> its refused claim's pause
        self._fill_timer: asyncio.TimerHandle | None = None
        self._stopped = False

    def socket_opened(self, link: Link) -> None:
        """A new socket: nothing is claimed over it yet, and every queue may have items."""
        self._link = link
        self._claiming.clear()
        self._known_empty.clear()

    def socket_closed(self) -> None:
        """The socket closed: its claims end with it (the server re-queues what they claimed)."""
        self._link = None
        for timer in self._refusals.values():
            timer.cancel()
        self._refusals.clear()
        if self._fill_timer is not None:
            self._fill_timer.cancel()
            self._fill_timer = None

    def stop(self) -> None:
        """No more claims: the worker is stopping. What a claim still out brings runs while the
        stop waits for running handlers, else goes back (see _claimed)."""
        self._stopped = True

    def items_likely_waiting(self) -> bool:
        return any(queue not in self._known_empty for queue in self._rotation)

    def _free_slots(self) -> int:
        return self._concurrency - self._run.busy() - sum(self._claiming.values())

    def fill(self, *, waited: bool = False) -> None:
        """Claim for the free slots: first from queues that may have items (answered at once),
        then, when all are known empty, one waiting claim per idle queue. Fewer than
        `_enough_slots` free wait FILL_DELAY_SECONDS for more, so a claim brings a batch."""
        if self._link is None or self._stopped:
            return
        free = min(self._free_slots(), CLAIM_MAX)
        idle = [q for q in self._rotation if q not in self._claiming]
        if free <= 0 or not idle:
            return
        if free < self._enough_slots and not waited:
            if self._fill_timer is None:
                self._fill_timer = asyncio.get_running_loop().call_later(FILL_DELAY_SECONDS, self._fill_after_delay)
            return
        if self._fill_timer is not None:
            self._fill_timer.cancel()
            self._fill_timer = None
        ready = [q for q in idle if q not in self._known_empty]
        if ready:
            self._claim(ready[0], free, wait=self._first_claim_wait())
            return
        for queue, slots in zip(idle, split_slots(free, len(idle))):
            self._claim(queue, slots, wait=CLAIM_WAIT_SECONDS)

    def _fill_after_delay(self) -> None:
        self._fill_timer = None
        self.fill(waited=True)

    def _first_claim_wait(self) -> int:
        """How long a claim on a queue that may have items waits. With one queue nothing else
        could use the slots meanwhile, so it waits (and saves the empty answer and the claim
        after it); but not before the server has answered on this socket, so a server that
        takes frames and never answers is noticed within ANSWER_SECONDS."""
        return CLAIM_WAIT_SECONDS if len(self._rotation) == 1 and self._link.answered else 0

    def _claim(self, queue: str, slots: int, wait: int) -> None:
        self._claiming[queue] = slots
        self._rotation.remove(queue)
        self._rotation.append(queue)  # the next claim starts with another queue
        link = self._link
        try:
            link.ask({"op": "claim", "queue": queue, "max": slots, "wait": wait},
                     partial(self._answered, link, queue, slots), timeout=wait + ANSWER_SECONDS)
        except LinkClosed:
            self._claiming.pop(queue, None)  # the socket is closing: socket_closed() comes next

    def _answered(self, link: Link, queue: str, slots: int, reply: dict | None) -> None:
        """A claim's answer, taken the moment the socket reads it: no task in between."""
        try:
            items = self._items_of(link, queue, slots, reply)
            if items is not RESTING:
                self._claimed(link, queue, slots, items)
        except Exception as exc:  # a bug: the run stops and raises it
            self._run.fail(exc)

    def _items_of(self, link: Link, queue: str, slots: int, reply: dict | None) -> list[dict] | None:
        """The items one claim brought; None if the socket closed or the claim can never work;
        RESTING if the server refused it for a passing reason (it is asked again later)."""
        try:
            answer = answer_of(reply)
        except LinkClosed:
            return None
        except ApiError as exc:
            if exc.code in FATAL_CLAIM_ERRORS:
                self._run.fail(exc)
                return None
            log.warning("the server refused a claim on %s (%s); trying again in %g s", queue, exc, CLAIM_RETRY_SECONDS)
            # a full disk, say: the claim stays counted until then, so it is not asked again at once
            self._refusals[queue] = self._run.loop.call_later(CLAIM_RETRY_SECONDS, self._rested, link, queue,
                                                              slots)
            return RESTING
        if self._announcement is not None:  # said once the server has taken a claim: token and queue are good
            log.info("working %s at %s", *self._announcement)
            self._announcement = None
        return answer.get("items") or []

    def _rested(self, link: Link, queue: str, slots: int) -> None:
        del self._refusals[queue]
        try:
            self._claimed(link, queue, slots, [])  # as a claim that found the queue empty
        except Exception as exc:
            self._run.fail(exc)

    def _claimed(self, link: Link, queue: str, slots: int, items: list[dict] | None) -> None:
        if self._link is link:
            self._claiming.pop(queue, None)
        if items is None or self._link is not link:
            return  # if the socket closed meanwhile, the server has re-queued what it claimed
        jobs = [Job.from_item(item) for item in items]
        # a claim that was waiting when the stop came: its items run beside the handlers the stop
        # waits for (giving one back would spend a try, or end it on its last), else go back
        if self._stopped and not self._run.letting_handlers_finish:
            if jobs:
                self._run.spawn(_release_all(link, jobs))
            return
        if len(jobs) < slots:  # the server had no more: the next claim on it may wait
            self._known_empty.add(queue)
        else:
            self._known_empty.discard(queue)
        for job in jobs:
            self._run.take(job, link)
        if self._free_slots() > 0:
            # only then: a turn due now would come before these handlers and split their results
            self._run.nudge()


async def _release_all(link: Link, jobs: list[Job]) -> None:
    await asyncio.gather(*(release(link, job) for job in jobs))
